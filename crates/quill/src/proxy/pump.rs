//! The byte pump for streams known only as `AsyncRead + AsyncWrite` (TLS sessions, any
//! socket), optionally through an HTTP [`Exchange`] that rewrites what passes (`http`).
//!
//! Same contract as [`super::relay`], whose readiness-based fast path serves plain sockets
//! without rewriting: bytes are forwarded in order and never dropped; an EOF is passed on
//! (`poll_shutdown`) only after everything before it was written; `tcp_fastclose` and
//! `idle_timeout` apply. Reads go to a per-thread scratch buffer and rewrites to a
//! per-thread output buffer; a connection owns bytes only while its receiver is slow, or
//! while the exchange holds the client back (an `Upgrade` waiting for its answer), so an
//! idle keep-alive connection holds no buffer.
//!
//! With `http`, [`first_head`] runs before any server is chosen: the client's first
//! request head must arrive whole, within `http_request_timeout`, before a backend
//! connection exists (a slowloris client never reaches a server). The relay then bounds
//! every later head the same way ([`HeadTimer`]).

use std::cell::{Cell, RefCell};
use std::future::{poll_fn, Future};
use std::io::{self, ErrorKind};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::http::{Exchange, Fed, Logged, Refusal};
use super::quickack::Acknowledge;
use super::relay::{
    fast_close, turn_end, End, IdleTimer, Outcome, RelayOptions, BUDGET, SCRATCH_SIZE,
};
use super::signals::NEXT_REQUEST_AT_STOP;
use crate::accesslog::{AccessLog, Arrival, Record};
use crate::balance::servers::Answers;

/// After a refusal (400/431), how long the client's remaining bytes are read and dropped
/// so that closing does not reset the connection before the client has read the answer.
pub(super) const LINGER: Duration = Duration::from_secs(2);
/// ... and at most how many of them.
const LINGER_BYTES: usize = 1 << 20;

thread_local! {
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH_SIZE].into_boxed_slice());
    static OUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Which way bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

/// One direction.
#[derive(Default)]
struct Flow {
    /// Bytes for the receiver that it has not taken yet (only while it is slow).
    out: Vec<u8>,
    written: usize,
    /// Something was written since the last flush (TLS sessions buffer records).
    unflushed: bool,
    /// Bytes read that the exchange cannot take yet.
    held: Vec<u8>,
    /// The source reached EOF (or, after a refusal, will not be read again).
    eof: bool,
    /// The source itself closed (its EOF was read), as opposed to `eof` set by quill.
    closed: bool,
    /// The EOF has been passed on; this direction is finished.
    done: bool,
    /// The start of the first read, when asked for (connection log).
    first: Option<Vec<u8>>,
    bytes: u64,
}

/// State shared by both directions during one poll.
struct Shared<'a> {
    exchange: Option<&'a mut Exchange>,
    /// Where the exchange's requests are logged as their answers end.
    lines: Option<&'a Lines>,
    /// Where the server's answers are counted as they are forwarded.
    answers: Option<&'a Answers>,
    /// The server's last bytes brought an answer's head and not all of its body: their
    /// acknowledgement is sent at once, so that a server whose rest waits for it (Nagle's
    /// algorithm) does not wait for the kernel's delayed one.
    acknowledge: bool,
    /// Something moved (for the idle timer).
    active: bool,
    /// The refusal has been queued for the client; the server is not read any more.
    refusing: bool,
    /// Request by request (`Exchange::request_by_request`): the server connection carries
    /// one request, and its end is not the client's.
    one_request: bool,
    /// The error being returned came from the server's stream.
    server_failed: bool,
    /// Request by request: the server closed its connection between requests.
    server_left: bool,
    /// Request by request: the client closed its side while its request's answer was
    /// awaited. Its EOF went on to the server, which may answer or give up. (A client's
    /// failure ends the relay at once: the server's connection is dropped.)
    client_left: bool,
}

impl Shared<'_> {
    /// Request by request, the error being returned came from the server's stream after
    /// it had answered whole every request it was given (it closed without TLS's
    /// close_notify, or would not take the rest of a body it had answered early, as a
    /// 413 does): the server's connection is of no further use, but the server did its
    /// part, and the client has its answer.
    fn failed_after_answering(&self, answer_bytes: u64) -> bool {
        self.one_request
            && self.server_failed
            && answer_bytes > 0
            && self.exchange.as_ref().is_some_and(|ex| ex.answered())
    }

    /// Request by request, whether the client, its side done (`client_done`), closed it
    /// before its request was whole (an upload given up) or while its answer was awaited
    /// (a client that left: curl stopped, a tab closed). Its EOF went on to the server. A
    /// server that then ends without an answer, or fails, is not at fault: it was left with
    /// half a request, or told its client had gone.
    fn given_up(&self, client_done: bool) -> bool {
        self.one_request
            && client_done
            && (self.client_left || !self.exchange.as_ref().is_some_and(|ex| ex.request_whole()))
    }

    /// Request by request, the client is read while its answer comes (unless its request
    /// was refused: what follows a refused request is never read).
    fn reads_ahead(&self) -> bool {
        self.one_request
            && self
                .exchange
                .as_ref()
                .is_some_and(|ex| ex.refusal().is_none())
    }

    fn accepts(&self, dir: Dir) -> bool {
        match (&self.exchange, dir) {
            (Some(ex), Dir::Up) => ex.accepts_client_bytes(),
            (_, Dir::Down) => !self.refusing,
            (None, Dir::Up) => true,
        }
    }
}

impl Flow {
    fn poll<R, W>(
        &mut self,
        dir: Dir,
        cx: &mut Context<'_>,
        src: &mut R,
        dst: &mut W,
        other_done: bool,
        shared: &mut Shared<'_>,
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut budget = BUDGET;
        loop {
            while self.written < self.out.len() {
                let n = ready!(Pin::new(&mut *dst).poll_write(cx, &self.out[self.written..]))
                    .inspect_err(|_| shared.server_failed = dir == Dir::Up)?;
                if n == 0 {
                    return Poll::Ready(Err(ErrorKind::WriteZero.into()));
                }
                self.written += n;
                self.unflushed = true;
                shared.active = true;
            }
            if !self.out.is_empty() {
                // Flushed: give the memory back rather than keep it for an idle connection.
                self.out = Vec::new();
                self.written = 0;
            }
            if self.unflushed {
                ready!(Pin::new(&mut *dst).poll_flush(cx))
                    .inspect_err(|_| shared.server_failed = dir == Dir::Up)?;
                self.unflushed = false;
            }
            if dir == Dir::Down && !shared.refusing {
                if let Some(refusal) = shared.exchange.as_mut().and_then(|ex| ex.take_refusal()) {
                    // The answers to earlier requests are out: now the refusal, then close.
                    self.out.extend_from_slice(&refusal);
                    self.eof = true;
                    shared.refusing = true;
                    continue;
                }
            }
            if !self.held.is_empty() {
                if !shared.accepts(dir) {
                    return Poll::Pending;
                }
                let held = std::mem::take(&mut self.held);
                OUT.with(|out| self.forward(dir, cx, &held, &mut out.borrow_mut(), dst, shared))?;
                continue;
            }
            if self.eof {
                // When the other direction is finished too, dropping both streams follows at
                // once and closes the connection: the shutdown would be wasted.
                if !self.done && !other_done {
                    match ready!(Pin::new(&mut *dst).poll_shutdown(cx)) {
                        Ok(()) => {}
                        // The peer is already gone; the other direction will notice.
                        Err(e) if e.kind() == ErrorKind::NotConnected => {}
                        Err(e) => return Poll::Ready(Err(e)),
                    }
                }
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            // Request by request the client is read while its answer comes, its bytes
            // held for the next request, so that its leaving is seen (and passed on to
            // the server, as without quill) rather than found only at the next write.
            let ahead = !shared.accepts(dir);
            if ahead && !(dir == Dir::Up && shared.reads_ahead()) {
                // Woken again when the other direction changes what the exchange accepts.
                return Poll::Pending;
            }
            if budget == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            budget -= 1;
            let step = SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                let mut buf = ReadBuf::new(&mut scratch[..]);
                match Pin::new(&mut *src).poll_read(cx, &mut buf) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(e)) => {
                        shared.server_failed = dir == Dir::Down;
                        return Poll::Ready(Err(e));
                    }
                    Poll::Ready(Ok(())) => {}
                }
                let input = buf.filled();
                if ahead {
                    if input.is_empty() {
                        self.eof = true;
                        self.closed = true;
                        shared.client_left = true;
                        if let Some(ex) = shared.exchange.as_mut() {
                            ex.client_closed();
                        }
                    } else {
                        self.bytes += input.len() as u64;
                        shared.active = true;
                        self.held.extend_from_slice(input);
                    }
                    return Poll::Ready(Ok(()));
                }
                if input.is_empty() && dir == Dir::Down && shared.one_request {
                    if shared.exchange.as_ref().is_some_and(|ex| ex.between()) {
                        // Between requests: the connection is of no further use, but
                        // the client's goes on.
                        shared.server_left = true;
                        return Poll::Pending;
                    }
                    let given_up = shared.given_up(other_done);
                    if self.bytes == 0 && !given_up {
                        // Gone before answering: the request may go elsewhere.
                        shared.server_failed = true;
                        return Poll::Ready(Err(io::Error::new(
                            ErrorKind::UnexpectedEof,
                            "the server closed the connection before answering",
                        )));
                    }
                    if !given_up && shared.exchange.as_ref().is_some_and(|ex| ex.cut_by_close()) {
                        // The answer cut: the client's connection ends here, so that the
                        // client sees it cut rather than wait for the rest.
                        shared.server_failed = true;
                        return Poll::Ready(Err(io::Error::new(
                            ErrorKind::UnexpectedEof,
                            "the server closed the connection in the middle of its answer",
                        )));
                    }
                }
                if input.is_empty() {
                    self.eof = true;
                    self.closed = true;
                    if let Some(ex) = shared.exchange.as_mut() {
                        match dir {
                            // Forwarded before the EOF is passed on.
                            Dir::Down => ex.server_closed(&mut self.out),
                            Dir::Up => ex.client_closed(),
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
                self.bytes += input.len() as u64;
                super::polling::moved(input.len() as u64);
                shared.active = true;
                if let Some(first) = self.first.as_mut().filter(|f| f.is_empty()) {
                    first.extend_from_slice(
                        &input[..input.len().min(crate::connlog::REQUEST_BYTES)],
                    );
                }
                Poll::Ready(
                    OUT.with(|out| {
                        self.forward(dir, cx, input, &mut out.borrow_mut(), dst, shared)
                    }),
                )
            });
            ready!(step)?;
        }
    }

    /// Passes `input` through the exchange (if any) and writes the result, keeping what
    /// the receiver does not take now in `out` and what the exchange does not take in
    /// `held`.
    fn forward<W: AsyncWrite + Unpin + ?Sized>(
        &mut self,
        dir: Dir,
        cx: &mut Context<'_>,
        input: &[u8],
        out: &mut Vec<u8>,
        dst: &mut W,
        shared: &mut Shared<'_>,
    ) -> io::Result<()> {
        out.clear();
        let fed = match shared.exchange.as_mut() {
            None => Fed::Verbatim,
            Some(ex) => match dir {
                Dir::Up => {
                    let fed = ex.client_bytes(input, out);
                    ex.stamp_arrivals(Arrival::now);
                    fed
                }
                Dir::Down => {
                    let fed = ex.server_bytes(input, out);
                    shared.acknowledge = ex.head_awaits_body();
                    fed
                }
            },
        };
        let data: &[u8] = match fed {
            Fed::Verbatim => input,
            Fed::Consumed(n) => {
                if n < input.len() {
                    if dir == Dir::Up
                        && shared
                            .exchange
                            .as_ref()
                            .is_some_and(|ex| ex.refusal().is_some())
                    {
                        // A refused request: what follows it is never forwarded.
                    } else {
                        self.held.extend_from_slice(&input[n..]);
                    }
                }
                out
            }
        };
        let mut written = 0;
        while written < data.len() {
            match Pin::new(&mut *dst).poll_write(cx, &data[written..]) {
                Poll::Ready(Ok(0)) => return Err(ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    written += n;
                    self.unflushed = true;
                }
                Poll::Ready(Err(e)) => {
                    shared.server_failed = dir == Dir::Up;
                    return Err(e);
                }
                Poll::Pending => break,
            }
        }
        if written < data.len() {
            self.out.extend_from_slice(&data[written..]);
        }
        if let (Some(ex), Dir::Down) = (shared.exchange.as_mut(), dir) {
            if let Some(answers) = shared.answers {
                count_answers(ex, answers);
            }
            if let Some(lines) = shared.lines {
                lines.write(ex, false);
            }
        }
        Ok(())
    }
}

/// What quill asks of an `http` connection while it relays (its caller sets it; the relay
/// looks at every turn).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Ask {
    #[default]
    Nothing,
    /// A reload or a drain: the client should move on to a new connection without losing
    /// a request. The next answer that leaves none pending says `Connection: close`, and
    /// the connection ends after it.
    MoveOn,
    /// quill stops: as `MoveOn`, and a connection between requests ends at once.
    Stop,
}

/// Where a relay reads what quill asks of its connection, at every turn.
pub trait Asks {
    fn ask(&self) -> Ask;
}

/// Set by a watcher beside the relay (`tcp::telling`).
impl Asks for Cell<Ask> {
    fn ask(&self) -> Ask {
        self.get()
    }
}

/// An `http` connection before its relay: its exchange, what [`first_head`] read, and the
/// bound on request heads.
pub struct Http {
    pub exchange: Exchange,
    pub preread: Preread,
    /// `http_request_timeout` (`None`: no bound).
    pub head_limit: Option<Duration>,
    /// The access log, when the relay writes its lines (one server connection for the
    /// client's; request by request `h1_pump` writes them).
    pub lines: Option<Lines>,
    /// The answers of the server being relayed to, where its answers are counted (set by
    /// the driver as it chooses the server).
    pub answers: Option<&'static Answers>,
}

impl Http {
    pub fn new(exchange: Exchange, head_limit: Option<Duration>) -> Http {
        Http {
            exchange,
            preread: Preread::default(),
            head_limit,
            lines: None,
            answers: None,
        }
    }

    /// Writes the access log's lines of every request left (the connection ended: those
    /// still unanswered have status 0).
    pub fn log_the_rest(&mut self) {
        if let Some(lines) = &self.lines {
            lines.write(&mut self.exchange, true);
        }
    }

    /// Keeps bytes read from the client before the relay (they go after the request's).
    pub fn hold(&mut self, bytes: &[u8]) {
        self.preread.held.extend_from_slice(bytes);
        self.preread.bytes += bytes.len() as u64;
    }

    /// How many bytes of the client's are held for the relay.
    pub fn held_len(&self) -> usize {
        self.preread.held.len()
    }

    /// Whether bytes of the client's were read and not taken by the exchange yet.
    pub fn has_held(&self) -> bool {
        !self.preread.held.is_empty()
    }

    /// What goes to the server first: the request head (rewritten), with what followed it.
    pub fn request_bytes(&self) -> Vec<u8> {
        self.preread.out.clone()
    }

    /// Puts a request's bytes back to be sent again (they went to a server connection that
    /// turned out closed).
    pub fn unsend(&mut self, bytes: Vec<u8>) {
        self.preread.out = bytes;
    }

    /// The start of the client's first read, when `first_head` was asked to keep it.
    pub fn first_bytes(&mut self) -> Vec<u8> {
        self.preread.first.take().unwrap_or_default()
    }

    /// [`Http::first_bytes`], left in place.
    pub fn first_bytes_kept(&self) -> &[u8] {
        self.preread.first.as_deref().unwrap_or_default()
    }
}

/// The access log of a connection relayed whole to one server (`upstream_keepalive 0`):
/// a line per request, written as its answer ends.
pub struct Lines {
    pub log: Arc<AccessLog>,
    pub client: IpAddr,
    /// `None`: no server took the connection.
    pub server: Option<SocketAddr>,
}

impl Lines {
    /// Writes the lines of the requests whose answers ended (`all`: of every request kept).
    fn write(&self, ex: &mut Exchange, all: bool) {
        while let Some(mut l) = if all {
            ex.take_logged()
        } else {
            ex.take_answered()
        } {
            let r = record(Arc::clone(&self.log), self.client, &mut l);
            tally(&r, &l);
            r.server.set(self.server);
        }
    }
}

/// Adds the statuses of the answers the exchange forwarded to their server's count.
fn count_answers(ex: &mut Exchange, answers: &Answers) {
    let statuses = ex.take_statuses();
    if !statuses.is_empty() {
        answers.add(&statuses);
    }
}

/// The access log record of a request the exchange kept, its text taken from `l`.
pub fn record(log: Arc<AccessLog>, client: IpAddr, l: &mut Logged) -> Record {
    Record::from_owned(
        log,
        client,
        l.arrived.unwrap_or_else(Arrival::now),
        std::mem::take(&mut l.method),
        l.authority.take(),
        std::mem::take(&mut l.target),
        if l.http10 { "HTTP/1.0" } else { "HTTP/1.1" },
    )
}

/// Fills in what the exchange counted of the request: its status (unless quill answered
/// it itself) and its body bytes each way.
pub fn tally(r: &Record, l: &Logged) {
    if r.status.get() == 0 {
        r.status.set(l.status);
    }
    r.bytes_in.set(l.body_in);
    r.bytes_out.set(l.body_out);
}

/// What was read from the client before a server was chosen: its first request head,
/// complete, and whatever came with it.
#[derive(Default)]
pub struct Preread {
    /// For the server: the rewritten head and the bytes that followed it in the same reads.
    out: Vec<u8>,
    /// Read but not taken by the exchange yet (what follows an `Upgrade` head).
    held: Vec<u8>,
    /// Bytes read from the client.
    bytes: u64,
    /// The start of the first read (connection log), when asked for.
    first: Option<Vec<u8>>,
}

/// How waiting for the first head ended, when it did not end with the head.
enum Unfinished {
    /// The client closed (or failed) before its head was complete.
    Gone(End),
    /// Refused (400, 431): the answer is due.
    Refused,
    /// `http_request_timeout` passed.
    TimedOut,
}

/// Reads the client's first request head into `http` (through its exchange, with the
/// per-thread scratch buffer; a head in pieces is held by the exchange, bounded by
/// `http_header_max`) within `limit` (`http_request_timeout` for a connection's first
/// request; request by request, what is left of the wait for the next), before any
/// server is chosen. `None`:
/// the head is complete and the relay can start. Otherwise the connection is over and
/// answered: a client that sent part of a head gets 408 when time runs out, a bad or
/// oversized head 400 or 431, and one that sent nothing is closed without a word (as
/// NGINX does); the outcome is for the books (`down` = bytes of the answer).
pub async fn first_head<C>(
    client: &mut C,
    http: &mut Http,
    capture: bool,
    limit: Option<Duration>,
) -> Option<Outcome>
where
    C: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    if capture {
        http.preread.first = Some(Vec::new());
    }
    let read = poll_fn(|cx| poll_first_head(cx, client, http));
    let unfinished = match limit {
        None => read.await,
        Some(limit) => match tokio::time::timeout(limit, read).await {
            Ok(r) => r,
            Err(_) => Err(Unfinished::TimedOut),
        },
    };
    let end = match unfinished {
        Ok(()) => return None,
        Err(Unfinished::Gone(end)) => end,
        Err(Unfinished::TimedOut) if !http.exchange.head_started() => {
            End::RequestTimeout { answered: false }
        }
        Err(Unfinished::TimedOut) => {
            http.exchange.head_timed_out();
            End::RequestTimeout { answered: true }
        }
        Err(Unfinished::Refused) => End::Refused,
    };
    let mut down = 0;
    if let Some(answer) = http.exchange.take_refusal() {
        down = answer.len() as u64;
        close_lingering(client, &answer).await;
    }
    let preread = std::mem::take(&mut http.preread);
    Some(Outcome {
        up: preread.bytes,
        down,
        end,
        first: preread.first.unwrap_or_default(),
    })
}

/// Reads until the exchange has a complete first head (`Ok`), or refuses it, or the
/// client is gone. Bytes read earlier and held (request by request: what came after the
/// previous request) go first.
fn poll_first_head<C>(
    cx: &mut Context<'_>,
    client: &mut C,
    http: &mut Http,
) -> Poll<Result<(), Unfinished>>
where
    C: AsyncRead + Unpin + ?Sized,
{
    if !http.preread.held.is_empty() {
        let held = std::mem::take(&mut http.preread.held);
        if let Some(done) = take_head_bytes(http, &held) {
            return Poll::Ready(done);
        }
    }
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        loop {
            let mut buf = ReadBuf::new(&mut scratch[..]);
            match Pin::new(&mut *client).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Unfinished::Gone(End::Error(e)))),
                Poll::Ready(Ok(())) => {}
            }
            let input = buf.filled();
            if input.is_empty() {
                return Poll::Ready(Err(Unfinished::Gone(End::Closed)));
            }
            let pre = &mut http.preread;
            pre.bytes += input.len() as u64;
            if let Some(first) = pre.first.as_mut().filter(|f| f.is_empty()) {
                first.extend_from_slice(&input[..input.len().min(crate::connlog::REQUEST_BYTES)]);
            }
            if let Some(done) = take_head_bytes(http, input) {
                return Poll::Ready(done);
            }
        }
    })
}

/// Feeds the client's bytes to the exchange while it waits for a head: `Some` once the
/// head is complete (`Ok`) or refused.
fn take_head_bytes(http: &mut Http, input: &[u8]) -> Option<Result<(), Unfinished>> {
    let pre = &mut http.preread;
    match http.exchange.client_bytes(input, &mut pre.out) {
        Fed::Verbatim => pre.out.extend_from_slice(input),
        // What follows a refused request is never forwarded.
        Fed::Consumed(n) if n < input.len() && http.exchange.refusal().is_none() => {
            pre.held.extend_from_slice(&input[n..]);
        }
        Fed::Consumed(_) => {}
    }
    http.exchange.stamp_arrivals(Arrival::now);
    // A complete head is the first thing the exchange writes out. A refusal after it (a
    // bad second request in the same read) is the relay's to send, after the answer to
    // the first.
    if !pre.out.is_empty() {
        return Some(Ok(()));
    }
    if http.exchange.refusal().is_some() {
        return Some(Err(Unfinished::Refused));
    }
    None
}

/// `http_request_timeout` for the heads that follow the first on a keep-alive
/// connection: from the end of the previous answer (or the first byte of a pipelined
/// head) until the head is complete ([`Exchange::awaiting_head`]). Cheap when heads come
/// whole: the timer is created at the first wait and then only moved forward when it
/// fires before the current wait's deadline, so a wait that ends in time costs no timer
/// operation, only a clock read when it begins.
struct HeadTimer {
    limit: Duration,
    /// When the current wait began; `None` while quill is not waiting for a head.
    since: Option<Instant>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl HeadTimer {
    /// True when the current wait passed the limit.
    fn expired(&mut self, cx: &mut Context<'_>, waiting: bool) -> bool {
        if !waiting {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        let deadline = since + self.limit;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        while sleep.as_mut().poll(cx).is_ready() {
            if sleep.deadline() >= deadline {
                return true;
            }
            sleep.as_mut().reset(deadline);
        }
        false
    }
}

/// Relays between `client` and `server` until the connection ends, through the exchange
/// of `http` when given (HTTP rewriting; the bytes [`first_head`] read go first),
/// verbatim otherwise. With `http`, what `ask` says ends the connection gracefully: after
/// an answer that says `Connection: close`, or between requests when quill stops (once
/// the client has been silent for `NEXT_REQUEST_AT_STOP` since its last answer);
/// the client's side is shut and what it still sends drained for a while (`End::Closed`).
///
/// Request by request (`Exchange::request_by_request`), the relay carries one request
/// and ends at `End::Boundary` once it is answered (the client's bytes read beyond it go
/// back into `http.preread`); an error of the server's stream is `End::ServerError`, and
/// a server that closes before a byte of answer is one.
pub async fn relay<C, S, A>(
    client: &mut C,
    server: &mut S,
    mut http: Option<&mut Http>,
    opts: RelayOptions,
    ask: &A,
) -> Outcome
where
    C: AsyncRead + AsyncWrite + Unpin + ?Sized,
    S: AsyncRead + AsyncWrite + Acknowledge + Unpin + ?Sized,
    A: Asks + ?Sized,
{
    let (preread, mut head) = match http.as_deref_mut() {
        Some(h) => {
            let timer = h.head_limit.map(|limit| HeadTimer {
                limit,
                since: None,
                sleep: None,
            });
            (std::mem::take(&mut h.preread), timer)
        }
        None => (Preread::default(), None),
    };
    let mut no_held = Vec::new();
    let (mut exchange, preread_held, lines, answers) = match http {
        Some(h) => (
            Some(&mut h.exchange),
            &mut h.preread.held,
            h.lines.as_ref(),
            h.answers,
        ),
        None => (None, &mut no_held, None, None),
    };
    let one_request = exchange
        .as_ref()
        .is_some_and(|ex| ex.is_request_by_request());
    let mut up = Flow {
        out: preread.out,
        held: preread.held,
        bytes: preread.bytes,
        first: opts.capture.then(|| preread.first.unwrap_or_default()),
        ..Flow::default()
    };
    let mut down = Flow::default();
    let mut active = false;
    let mut refusing = false;
    // The connection ends as asked: the client's side is being shut, then drained.
    let mut ending = false;
    let mut idle = IdleTimer::new(opts.idle_timeout, None);
    let mut linger: Option<(Pin<Box<Sleep>>, usize)> = None;
    // Since when quill has been waiting on the client alone for its next request.
    let mut waiting_since: Option<Instant> = None;
    // Stopping between requests: the client's time to send one more.
    let mut stop_wait: Option<Pin<Box<Sleep>>> = None;
    // Request by request: writing the request to the server failed; its answer may come.
    let mut server_refused: Option<io::Error> = None;
    // The client's direction was stopped because the server took no more, not because the
    // client finished: its side is still to be shut after the answer.
    let mut up_stopped = false;
    let mut client_left = false;
    // The client's side ended (closed, or its socket failed) while the server's had not:
    // the answers still due then were abandoned by the client.
    let mut client_first = false;
    let end = poll_fn(|cx| {
        if let Some((timer, drained)) = linger.as_mut() {
            return poll_linger(cx, client, timer.as_mut(), drained);
        }
        let mut shared = Shared {
            exchange: exchange.as_deref_mut(),
            lines,
            answers,
            acknowledge: false,
            active,
            refusing,
            one_request,
            server_failed: false,
            server_left: false,
            client_left,
        };
        let blocked_before = !shared.accepts(Dir::Up);
        let failed = |e, shared: &Shared<'_>, client_done: bool| {
            if shared.one_request && shared.server_failed && !shared.given_up(client_done) {
                End::ServerError(e)
            } else {
                End::Error(e)
            }
        };
        let mut server_gone = false;
        if !up.done {
            if let Poll::Ready(Err(e)) =
                up.poll(Dir::Up, cx, client, server, down.done, &mut shared)
            {
                if shared.failed_after_answering(down.bytes) {
                    server_gone = true;
                } else if shared.one_request && shared.server_failed {
                    // The server would not take the rest of the request: it may have
                    // answered (and closed) before reading it. Its answer, or its end
                    // without one, decides.
                    up.done = true;
                    up_stopped = true;
                    up.out = Vec::new();
                    up.unflushed = false;
                    server_refused = Some(e);
                } else {
                    client_first |= !shared.server_failed && !down.closed;
                    return Poll::Ready(failed(e, &shared, up.done && !up_stopped));
                }
            }
        }
        client_first |= up.closed && !down.closed;
        if !down.done && !server_gone {
            if let Poll::Ready(Err(e)) = down.poll(
                Dir::Down,
                cx,
                server,
                client,
                up.done && !up_stopped,
                &mut shared,
            ) {
                if !shared.failed_after_answering(down.bytes) {
                    client_first |= !shared.server_failed && !down.closed;
                    return Poll::Ready(failed(e, &shared, up.done && !up_stopped));
                }
                server_gone = true;
            }
            if shared.acknowledge {
                server.acknowledge();
            }
        }
        if one_request
            && down.done
            && !up.done
            && !ending
            && shared
                .exchange
                .as_ref()
                .is_some_and(|ex| ex.ended_by_close())
        {
            // The answer ended with the server's connection (a body delimited by the close,
            // or no HTTP quill can frame): the client's connection cannot carry another
            // request, its close is what tells the client the body ended, and it ends
            // too, as an asked-for end does.
            ending = true;
            up.done = true;
            up_stopped = true;
            up.out = Vec::new();
            up.held = Vec::new();
            cx.waker().wake_by_ref();
        }
        if server_refused.is_some() && !server_gone {
            if down.bytes > 0 && shared.exchange.as_ref().is_some_and(|ex| ex.answered()) {
                server_gone = true;
            } else if down.done {
                // Gone without an answer: the request's failure is the server's.
                return Poll::Ready(End::ServerError(server_refused.take().unwrap_or_else(
                    || io::Error::new(ErrorKind::UnexpectedEof, "the server closed"),
                )));
            }
        }
        if server_gone {
            // Nothing more goes to the server. Its request complete, the client's
            // connection goes on (the boundary below); with some of the request's body
            // still to come, the connection ends as an asked-for end does: the answer
            // written, the client's side shut, what it still sends drained.
            up.out = Vec::new();
            up.unflushed = false;
            shared.server_left = true;
            if !shared.exchange.as_ref().is_some_and(|ex| ex.between()) {
                ending = true;
                up.done = true;
                up_stopped = true;
                up.held = Vec::new();
                down.eof = true;
            }
            cx.waker().wake_by_ref();
        }
        let server_left = shared.server_left;
        if blocked_before && shared.accepts(Dir::Up) && !up.done {
            // The server's answer released the client (an `Upgrade` was declined or
            // accepted): let the client direction run again.
            cx.waker().wake_by_ref();
        }
        active = shared.active;
        refusing = shared.refusing;
        client_left = shared.client_left;
        let refused = shared
            .exchange
            .as_ref()
            .is_some_and(|ex| ex.refusal().is_some());
        // Waiting on the client alone: nothing of its own is still being written.
        let waiting = !one_request
            && !refusing
            && !up.eof
            && up.out.is_empty()
            && up.held.is_empty()
            && down.out.is_empty()
            && exchange.as_deref().is_some_and(Exchange::awaiting_head);
        if !waiting {
            waiting_since = None;
        } else if waiting_since.is_none() {
            waiting_since = Some(Instant::now());
        }
        if let Some(timer) = head.as_mut().filter(|_| !one_request) {
            if timer.expired(cx, waiting) {
                match exchange.as_deref_mut() {
                    Some(ex) if ex.head_started() => {
                        // 408 once the earlier answers are out: the next turn queues it.
                        ex.head_timed_out();
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    _ => return Poll::Ready(End::RequestTimeout { answered: false }),
                }
            }
        }
        if let Some(ex) = exchange.as_deref_mut().filter(|_| !refusing && !ending) {
            match ask.ask() {
                Ask::Nothing => {}
                Ask::MoveOn => ex.close_after_answer(),
                Ask::Stop => {
                    ex.close_after_answer();
                    // Between requests the connection ends once the client has had
                    // `NEXT_REQUEST_AT_STOP` since its last answer to send the request it
                    // may be sending already (which is then answered with `Connection:
                    // close`). Request by request, the relay ends at the answer's boundary
                    // as usual, and `h1_pump` gives the client that moment.
                    let until = waiting_since.map(|since| since + NEXT_REQUEST_AT_STOP);
                    if up.held.is_empty() && !one_request {
                        match until.filter(|&until| until > Instant::now()) {
                            Some(until) => {
                                let sleep = stop_wait.get_or_insert_with(|| {
                                    Box::pin(tokio::time::sleep_until(until))
                                });
                                sleep.as_mut().reset(until);
                                if sleep.as_mut().poll(cx).is_ready() {
                                    ex.close_now();
                                }
                            }
                            None => ex.close_now(),
                        }
                    }
                }
            }
            // Request by request, bytes held are the client's next requests: it sends them
            // again on a new connection, as `Connection: close` tells it to.
            if ex.finished() && up.out.is_empty() && (up.held.is_empty() || one_request) {
                // The last answer is out (or none was due): the down direction writes what
                // it still holds, then shuts the client's side.
                ending = true;
                down.eof = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let written = up.out.is_empty() && !up.unflushed && down.out.is_empty();
            let boundary = (server_left && ex.between()) || (ex.at_boundary() && !down.unflushed);
            if boundary && written {
                if server_left || up.eof {
                    // Closed by the server, or half-closed by the client (its EOF went on
                    // to the server): of no use for another request.
                    ex.server_left();
                }
                return Poll::Ready(End::Boundary);
            }
        }
        if down.done && (ending || (refused && refusing)) {
            // The last answer (or the refusal) is out and the client's write side shut:
            // drain what it still sends, so that closing does not reset what it has not
            // read yet, then close.
            let mut timer = Box::pin(tokio::time::sleep(LINGER));
            let mut drained = 0;
            let r = poll_linger(cx, client, timer.as_mut(), &mut drained);
            linger = Some((timer, drained));
            return r;
        }
        if refused && down.done {
            // The server went away with answers due: the refusal can never be sent.
            return Poll::Ready(End::Refused);
        }
        // A refusal being delivered, or an end asked for, is not cut short by fastclose.
        let fast = fast_close(opts.fastclose, up.eof, down.eof) && !refusing && !ending;
        turn_end(fast, up.done && down.done, &mut idle, cx, &mut active)
    })
    .await;
    // The client left with answers due (not when quill ended the connection: its idle
    // timeout, a refusal, an answer that was the last).
    let left_first = client_first && matches!(end, End::Closed | End::FastClose | End::Error(_));
    if let Some(ex) = exchange.as_deref_mut() {
        if left_first {
            ex.client_left();
        }
        let abandoned = ex.take_abandoned();
        if let Some(answers) = answers {
            // An answer whose bytes could not all be written (the client failed) was
            // counted by the exchange all the same: the server gave it.
            count_answers(ex, answers);
            answers.abandon(abandoned);
        }
    }
    let end = match end {
        // The linger after an asked-for end reports as a refusal's does.
        End::Refused if ending => End::Closed,
        End::Refused if exchange.and_then(|ex| ex.refusal()) == Some(Refusal::Timeout) => {
            End::RequestTimeout { answered: true }
        }
        end => end,
    };
    // What the client sent beyond the request is the next request's.
    *preread_held = up.held;
    Outcome {
        up: up.bytes,
        down: down.bytes,
        end,
        first: up.first.unwrap_or_default(),
    }
}

/// Ends a client connection without resetting it: writes `last` (the connection's last
/// answer, if quill writes one now), shuts the write side, then reads and drops what the
/// client still sends (the rest of an upload answered early) until it closes or
/// `LINGER_BYTES` were dropped. Closing a socket with unread bytes resets the connection,
/// and a client still sending may then lose the answer it had not read yet. All of it
/// within `LINGER`: a client that does not read or never closes cannot hold the
/// connection.
pub(super) async fn close_lingering<C>(client: &mut C, last: &[u8])
where
    C: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let _ = tokio::time::timeout(LINGER, async {
        client.write_all(last).await?;
        client.shutdown().await?;
        let mut drained = 0;
        poll_fn(|cx| poll_linger_bytes(cx, client, &mut drained)).await;
        io::Result::Ok(())
    })
    .await;
}

/// Reads and drops what the refused client still sends, until it closes, `LINGER` passes
/// or `LINGER_BYTES` were dropped.
fn poll_linger<C: AsyncRead + Unpin + ?Sized>(
    cx: &mut Context<'_>,
    client: &mut C,
    mut timer: Pin<&mut Sleep>,
    drained: &mut usize,
) -> Poll<End> {
    if timer.as_mut().poll(cx).is_ready() {
        return Poll::Ready(End::Refused);
    }
    poll_linger_bytes(cx, client, drained)
}

/// Reads and drops the client's bytes until it closes (or fails) or `LINGER_BYTES` were
/// dropped: then `Ready`.
fn poll_linger_bytes<C: AsyncRead + Unpin + ?Sized>(
    cx: &mut Context<'_>,
    client: &mut C,
    drained: &mut usize,
) -> Poll<End> {
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        loop {
            let mut buf = ReadBuf::new(&mut scratch[..]);
            match Pin::new(&mut *client).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    *drained += buf.filled().len();
                    if *drained > LINGER_BYTES {
                        return Poll::Ready(End::Refused);
                    }
                }
                Poll::Ready(_) => return Poll::Ready(End::Refused),
            }
        }
    })
}
