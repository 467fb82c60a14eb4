//! The byte pump between a client and a server socket.
//!
//! No buffer belongs to an idle connection: data is read into a per-thread scratch buffer
//! when a socket is readable and written straight on to the other socket. Only when the
//! receiving peer is slow does the unwritten rest get copied into a buffer owned by the
//! connection, which is freed again as soon as it has been flushed. While that buffer is
//! non-empty, the direction stops reading (backpressure), so memory per connection is bounded
//! by one scratch-sized read.
//!
//! A direction that reads a full scratch buffer is moving bulk data: it switches to
//! splice(2) through a pooled kernel pipe (see [`super::splice`]) until its source runs dry,
//! so bulk bytes are not copied through user space at all.
//!
//! A direction whose sender was seen to wait for quill's delayed acknowledgement (Nagle's
//! algorithm: [`super::quickack::Watch`]) acknowledges each read that empties its queue.
//!
//! A connection silent for `idle_park` seconds with nothing in flight stops relaying
//! ([`Stop::Quiet`]) so that its caller can park it outside the event loop's tasks (see
//! [`super::park`]); relaying resumes from the same [`Totals`] when a socket wakes.
//!
//! Invariants: bytes are forwarded in order and never dropped; an EOF is passed on with
//! `shutdown(SHUT_WR)` only after everything read before it was written; the relay ends when
//! both directions are done, on an error, on `tcp_fastclose`, or when idle too long; it only
//! stops quiet with both directions open and no byte held in user space or in a kernel pipe.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::io::{self, ErrorKind};
use std::net::Shutdown;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::{TcpStream, UnixStream};
use tokio::time::{Instant, Sleep};

use super::quickack::{self, Acknowledge};
use super::splice::{KernelPipe, PIPE_SIZE};
use crate::command::FastClose;
use crate::connlog::Capture;

/// Bytes read per system call; also the most a slow peer can make a connection buffer.
pub const SCRATCH_SIZE: usize = 64 * 1024;

/// Reads in one direction before yielding to other connections of the same event loop.
pub(crate) const BUDGET: usize = 32;

thread_local! {
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH_SIZE].into_boxed_slice());
}

/// What the relay needs from a socket: readiness, non-blocking reads and writes, and
/// half-close, and acknowledging what was read at once. Implemented for TCP and
/// Unix-domain streams.
pub trait Stream: Acknowledge {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Reads without consulting the event loop's readiness: used once, speculatively, when
    /// a parked connection resumes (either socket may hold what woke it), and to take bytes
    /// known to be there (a peeked PROXY header). A short read, or one that finds nothing,
    /// clears the readiness the event loop may have cached, as [`Stream::try_read`] does.
    fn read_now(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Clears the readiness for reading the event loop may have cached, without a system
    /// call: the next wait for readability waits for an event it has not yet taken. Safe
    /// only where no await separates it from the last look at the socket (tokio keeps a
    /// readiness that arrived with a newer tick).
    fn forget_readable(&self);
    /// Whether something waits to be read (bytes, EOF or an error), asked of the socket
    /// itself (a peek) rather than of the event loop, which may not have taken the event
    /// that announces it yet.
    fn readable_now(&self) -> bool;
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
    fn shutdown_write(&self) -> io::Result<()>;
    /// Copies received bytes without consuming them. When `more(peeked)` says more bytes
    /// are needed, the cached readiness is cleared, so that the next wait for readiness
    /// waits for new bytes instead of returning at once.
    fn try_peek(&self, buf: &mut [u8], more: &mut dyn FnMut(&[u8]) -> bool) -> io::Result<usize>;
    /// Moves up to `len` bytes from this socket into `pipe` (splice); 0 means EOF.
    fn try_splice_out(&self, pipe: &KernelPipe, len: usize) -> io::Result<usize>;
    /// Moves up to `len` bytes from `pipe` into this socket (splice).
    fn try_splice_in(&self, pipe: &KernelPipe, len: usize) -> io::Result<usize>;
}

macro_rules! impl_stream {
    ($t:ty) => {
        impl Stream for $t {
            fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                <$t>::poll_read_ready(self, cx)
            }
            fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                <$t>::poll_write_ready(self, cx)
            }
            fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
                // A short read means the receive queue is empty right now. Reporting
                // WouldBlock to tokio from inside `try_io` clears the readiness it cached,
                // which saves the extra read() that would otherwise only return EAGAIN.
                // tokio only clears it if no new readiness event arrived meanwhile.
                let len = buf.len();
                let mut got = None;
                let result = self.try_io(Interest::READABLE, || {
                    let n = rustix::io::read(self, &mut *buf).map_err(io::Error::from)?;
                    got = Some(n);
                    if n > 0 && n < len {
                        Err(ErrorKind::WouldBlock.into())
                    } else {
                        Ok(n)
                    }
                });
                match (result, got) {
                    (Err(e), Some(n)) if e.kind() == ErrorKind::WouldBlock => Ok(n),
                    (result, _) => result,
                }
            }
            fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
                let read = rustix::io::read(self, &mut *buf).map_err(io::Error::from);
                let drained = match &read {
                    Ok(n) => *n > 0 && *n < buf.len(),
                    Err(e) => e.kind() == ErrorKind::WouldBlock,
                };
                if drained {
                    // The queue is empty now, but a readiness may still be cached (the
                    // event that announced these bytes, or an older one): without this,
                    // the next read would only return EAGAIN, as it did once a connection
                    // while tokio's assumed readiness of accepted sockets was kept (the
                    // accept loop now drops it). No await separates the read from this,
                    // so no later event is lost: tokio keeps a readiness that arrived
                    // with a newer tick.
                    Stream::forget_readable(self);
                }
                read
            }
            fn readable_now(&self) -> bool {
                let mut byte = [0u8; 1];
                let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
                !matches!(rustix::net::recv(self, &mut byte, flags), Err(e) if e == rustix::io::Errno::AGAIN)
            }
            fn forget_readable(&self) {
                // Saying "would block" from inside `try_io` is how tokio is told.
                let _ = self.try_io(Interest::READABLE, || {
                    Err::<(), _>(io::Error::from(ErrorKind::WouldBlock))
                });
            }
            fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
                <$t>::try_write(self, buf)
            }
            fn shutdown_write(&self) -> io::Result<()> {
                socket2::SockRef::from(self).shutdown(Shutdown::Write)
            }
            fn try_peek(
                &self,
                buf: &mut [u8],
                more: &mut dyn FnMut(&[u8]) -> bool,
            ) -> io::Result<usize> {
                let mut got = None;
                let result = self.try_io(Interest::READABLE, || {
                    let n = rustix::net::recv(self, &mut *buf, rustix::net::RecvFlags::PEEK)
                        .map_err(io::Error::from)?;
                    got = Some(n);
                    if n > 0 && more(&buf[..n]) {
                        Err(ErrorKind::WouldBlock.into())
                    } else {
                        Ok(n)
                    }
                });
                match (result, got) {
                    (Err(e), Some(n)) if e.kind() == ErrorKind::WouldBlock => Ok(n),
                    (result, _) => result,
                }
            }
            fn try_splice_out(&self, pipe: &KernelPipe, len: usize) -> io::Result<usize> {
                self.try_io(Interest::READABLE, || pipe.fill_from(self, len))
            }
            fn try_splice_in(&self, pipe: &KernelPipe, len: usize) -> io::Result<usize> {
                self.try_io(Interest::WRITABLE, || pipe.drain_into(self, len))
            }
        }
    };
}

impl_stream!(TcpStream);
impl_stream!(UnixStream);

/// Per-connection relay settings, copied from the settings snapshot.
#[derive(Debug, Clone, Copy)]
pub struct RelayOptions {
    pub fastclose: FastClose,
    /// Close after this much silence in both directions.
    pub idle_timeout: Option<Duration>,
    /// Stop quiet (to be parked) after this much silence in both directions. Only the raw
    /// relay parks; the TLS and HTTP relays ignore it.
    pub park_after: Option<Duration>,
    /// Keep the first bytes the client sends (for the connection log), in the `http` pump;
    /// the raw and TLS relays are given a `connlog::Capture` instead.
    pub capture: bool,
}

/// Why a relay ended.
#[derive(Debug)]
pub enum End {
    /// Both sides closed (their EOFs were passed on).
    Closed,
    /// One side closed and `tcp_fastclose` closed the other.
    FastClose,
    /// Nothing moved for `idle_timeout`.
    Idle,
    /// A socket error (reset, broken pipe...) that says nothing against the server: on
    /// the client's side, or on the server's after it had closed its side cleanly.
    Error(io::Error),
    /// The server's socket failed before the server closed its side (it reset the
    /// connection, or died mid-transfer): the caller blacklists the server, as for a
    /// failed connect.
    ServerError(io::Error),
    /// An HTTP request was refused (400, 408 or 431) and the connection closed (`http`).
    Refused,
    /// `http` request by request: the request was answered whole; the client's connection
    /// goes on, and the server's is free for another request.
    Boundary,
    /// `http`: a request head did not come whole within `http_request_timeout`. After
    /// part of one the client was `answered` 408; a client that sent nothing (since it
    /// connected, or since the answer to its previous request) was closed without a word.
    RequestTimeout { answered: bool },
}

/// Which socket of a pipe an error came from.
enum Failed {
    /// Reading from the source.
    Source(io::Error),
    /// Writing to the destination.
    Destination(io::Error),
}

/// How far a relay got before it stopped quiet: what the next relay of the same connection
/// continues from.
#[derive(Debug, Default)]
pub struct Totals {
    /// Bytes from the client to the server so far.
    pub up: u64,
    /// Bytes from the server to the client so far.
    pub down: u64,
    /// The capture of the client's first bytes (for the connection log).
    pub first: Option<Capture>,
    /// How long both directions had been silent when the relay stopped.
    pub silent: Duration,
    /// The relay stopped quiet before (it was parked) and resumes now: either socket may
    /// be the one that woke it.
    pub resumed: bool,
    /// Whether each direction's sender (the client's, the server's) was seen to wait for
    /// acknowledgements ([`quickack::Watch`]): a parked connection keeps what its relay
    /// learnt, so that it does not wait out one more delayed ACK each time it wakes.
    pub acking: (bool, bool),
}

impl Totals {
    /// Where a new connection starts: nothing relayed, capturing the first bytes when the
    /// connection log wants them.
    pub fn new(first: Option<Capture>) -> Totals {
        Totals {
            first,
            ..Totals::default()
        }
    }

    /// The outcome of a connection that ended, for `end`, where its relay had stopped.
    pub fn ended(self, end: End) -> Outcome {
        Outcome {
            up: self.up,
            down: self.down,
            end,
            first: self.first.map(Capture::into_bytes).unwrap_or_default(),
        }
    }
}

/// Why a raw relay returned.
#[derive(Debug)]
pub enum Stop {
    /// The connection is over.
    Ended(Outcome),
    /// Silent for `park_after`, nothing in flight, both directions open.
    Quiet(Totals),
}

/// Totals of one relay.
#[derive(Debug)]
pub struct Outcome {
    /// Bytes from the client to the server.
    pub up: u64,
    /// Bytes from the server to the client.
    pub down: u64,
    pub end: End,
    /// The start of the client's first read, when `capture` was asked for.
    pub first: Vec<u8>,
}

/// One direction of the relay.
#[derive(Default)]
struct Pipe {
    /// Bytes read but not yet written (only while the receiver is slow).
    pending: Vec<u8>,
    /// How much of `pending` has been written.
    written: usize,
    /// The source reached EOF.
    eof: bool,
    /// The EOF has been passed on; this direction is finished.
    done: bool,
    /// The first read has been tried without waiting for readiness.
    speculated: bool,
    /// Capture the start of the first read here (only while empty and asked for).
    first: Option<Capture>,
    bytes: u64,
    /// The kernel pipe of bulk mode, held only while bulk data flows.
    bulk: Option<KernelPipe>,
    /// Bytes in `bulk` not yet written on.
    in_bulk: usize,
    /// The last read filled the scratch buffer: the next goes through a kernel pipe.
    go_bulk: bool,
    /// splice(2) failed on these sockets: copy only.
    no_splice: bool,
    /// Whether the source waits for acknowledgements before it writes on.
    acks: quickack::Watch,
}

impl Drop for Pipe {
    fn drop(&mut self) {
        if let Some(pipe) = self.bulk.take() {
            if self.in_bulk == 0 {
                pipe.give_back();
            }
        }
    }
}

impl Pipe {
    /// A direction that can be parked: open, and holding no byte anywhere.
    fn quiet(&self) -> bool {
        !self.eof && self.pending.is_empty() && self.in_bulk == 0
    }

    /// Moves bytes from `src` to `dst` until both would block, the budget is spent, or the
    /// direction is finished. `Ready(Ok)` means finished. `other_done` says the opposite
    /// direction is finished, so both sockets are about to be closed; `other_bytes`: the
    /// bytes it moved so far.
    fn poll<S: Stream + ?Sized, D: Stream + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        src: &S,
        dst: &D,
        (other_done, other_bytes): (bool, u64),
        active: &mut bool,
    ) -> Poll<Result<(), Failed>> {
        let mut budget = BUDGET;
        loop {
            while self.written < self.pending.len() {
                ready!(dst.poll_write_ready(cx)).map_err(Failed::Destination)?;
                match dst.try_write(&self.pending[self.written..]) {
                    Ok(n) => {
                        self.written += n;
                        *active = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
                    Err(e) => return Poll::Ready(Err(Failed::Destination(e))),
                }
            }
            if !self.pending.is_empty() {
                // Flushed: give the memory back rather than keep it for an idle connection.
                self.pending = Vec::new();
                self.written = 0;
            }
            while self.in_bulk > 0 {
                let Some(pipe) = self.bulk.as_ref() else {
                    break;
                };
                ready!(dst.poll_write_ready(cx)).map_err(Failed::Destination)?;
                match dst.try_splice_in(pipe, self.in_bulk) {
                    Ok(0) => {
                        return Poll::Ready(Err(Failed::Destination(ErrorKind::WriteZero.into())))
                    }
                    Ok(n) => {
                        self.in_bulk -= n;
                        *active = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
                    Err(e) => return Poll::Ready(Err(Failed::Destination(e))),
                }
            }
            if self.eof {
                // When the other direction is finished too, close() follows at once and
                // sends the FIN itself: the shutdown would be a wasted system call.
                if !self.done && !other_done {
                    match dst.shutdown_write() {
                        Ok(()) => {}
                        // The peer is already gone; the other direction will notice.
                        Err(e) if e.kind() == ErrorKind::NotConnected => {}
                        Err(e) => return Poll::Ready(Err(Failed::Destination(e))),
                    }
                }
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            if budget == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            budget -= 1;
            if self.go_bulk && self.bulk.is_none() {
                self.bulk = KernelPipe::take();
                self.go_bulk = self.bulk.is_some();
            }
            if let Some(pipe) = self.bulk.as_ref() {
                ready!(src.poll_read_ready(cx)).map_err(Failed::Source)?;
                // The pipe is empty here, so WouldBlock can only mean that the source is.
                match src.try_splice_out(pipe, PIPE_SIZE) {
                    Ok(0) => self.eof = true,
                    Ok(n) => {
                        self.bytes += n as u64;
                        super::polling::moved(n as u64);
                        self.in_bulk = n;
                        *active = true;
                    }
                    Err(e) => {
                        let dry = e.kind() == ErrorKind::WouldBlock;
                        let unsupported =
                            matches!(e.kind(), ErrorKind::InvalidInput | ErrorKind::Unsupported);
                        if !dry && !unsupported {
                            return Poll::Ready(Err(Failed::Source(e)));
                        }
                        // Bulk transfer over (or impossible): back to plain reads, and the
                        // empty pipe back to the pool.
                        self.no_splice |= unsupported;
                        self.go_bulk = false;
                        if let Some(pipe) = self.bulk.take() {
                            pipe.give_back();
                        }
                    }
                }
                continue;
            }
            // A resumed relay's first read skips the wait for readiness: either socket may
            // hold what woke it, and this saves an event-loop round.
            let speculate = !self.speculated;
            if speculate {
                self.speculated = true;
            } else {
                ready!(src.poll_read_ready(cx)).map_err(Failed::Source)?;
            }
            let step = SCRATCH.with(|scratch| {
                let mut buf = scratch.borrow_mut();
                let read = if speculate {
                    src.read_now(&mut buf)
                } else {
                    src.try_read(&mut buf)
                };
                let n = match read {
                    Ok(0) => {
                        self.eof = true;
                        return Ok(());
                    }
                    Ok(n) => n,
                    Err(e) => return Err(Failed::Source(e)),
                };
                self.bytes += n as u64;
                super::polling::moved(n as u64);
                *active = true;
                self.go_bulk = n == buf.len() && !self.no_splice;
                if let Some(first) = self.first.as_mut() {
                    first.first_read(&buf[..n]);
                }
                let written = match dst.try_write(&buf[..n]) {
                    Ok(w) => w,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
                    Err(e) => return Err(Failed::Destination(e)),
                };
                if written < n {
                    self.pending = buf[written..n].to_vec();
                }
                // A read short of the buffer emptied the source's queue: a sender waiting
                // for its acknowledgement to write on is given it now.
                if n < buf.len() && self.acks.drained(other_bytes) {
                    src.acknowledge();
                }
                Ok(())
            });
            match step {
                Ok(()) => {}
                Err(Failed::Source(e)) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Whether `tcp_fastclose` ends the connection, given which directions reached EOF
/// (`up`: the client's, `down`: the server's). Shared by every relay.
pub(crate) fn fast_close(mode: FastClose, up_eof: bool, down_eof: bool) -> bool {
    match mode {
        FastClose::Off => false,
        FastClose::Up => down_eof,
        FastClose::Down => up_eof,
        FastClose::Both => up_eof || down_eof,
    }
}

/// The end of one turn of a relay, after both directions were polled, shared by every
/// relay: `tcp_fastclose` first (`fast`: whether its rule ends the connection now), then
/// both directions done, then `idle_timeout`; otherwise the relay waits.
pub(crate) fn turn_end(
    fast: bool,
    both_done: bool,
    idle: &mut Option<IdleTimer>,
    cx: &mut Context<'_>,
    active: &mut bool,
) -> Poll<End> {
    if fast {
        return Poll::Ready(End::FastClose);
    }
    if both_done {
        return Poll::Ready(End::Closed);
    }
    if idle.as_mut().is_some_and(|t| t.expired(cx, active)) {
        return Poll::Ready(End::Idle);
    }
    Poll::Pending
}

/// The silence of one connection, shared by every relay: it ends the connection after
/// `idle_timeout`, and tells the raw relay when `idle_park` has come. The timer exists only
/// when one of them is configured, and it is not reset on every read: it fires once per
/// period (the shorter of the two), and a period without activity adds to the silence. So
/// silence is detected between one and two periods after the last byte, at the cost of one
/// timer wake-up per period.
pub(crate) struct IdleTimer {
    period: Duration,
    sleep: Pin<Box<Sleep>>,
    /// Silence so far, in whole periods.
    silent: Duration,
    /// `idle_timeout`.
    limit: Option<Duration>,
    /// The timer was polled since it was last set, so it will wake the task: until it
    /// fires, a turn need not poll it again (a poll costs more than the check).
    armed: bool,
}

impl IdleTimer {
    /// `limit`: `idle_timeout`; `park_after`: `idle_park` (raw relay only).
    pub(crate) fn new(limit: Option<Duration>, park_after: Option<Duration>) -> Option<IdleTimer> {
        let period = match (limit, park_after) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        Some(IdleTimer {
            period,
            sleep: Box::pin(tokio::time::sleep(period)),
            silent: Duration::ZERO,
            limit,
            armed: false,
        })
    }

    /// True when the silence reached `idle_timeout`. Each period that had activity clears
    /// `active` and the silence; each one without adds a period to the silence.
    pub(crate) fn expired(&mut self, cx: &mut Context<'_>, active: &mut bool) -> bool {
        if self.armed && !self.sleep.is_elapsed() {
            return false;
        }
        self.armed = true;
        while self.sleep.as_mut().poll(cx).is_ready() {
            if *active {
                *active = false;
                self.silent = Duration::ZERO;
            } else {
                self.silent += self.period;
                if self.limit.is_some_and(|limit| self.silent >= limit) {
                    return true;
                }
            }
            self.sleep.as_mut().reset(Instant::now() + self.period);
        }
        false
    }

    /// How long both directions have been silent, in whole periods.
    pub(crate) fn silent(&self) -> Duration {
        self.silent
    }
}

/// Relays between `client` and `server`, continuing from `from`, until the connection ends
/// or stops quiet (`park_after`).
pub async fn relay<C: Stream + ?Sized, S: Stream + ?Sized>(
    client: &C,
    server: &S,
    opts: RelayOptions,
    from: Totals,
) -> Stop {
    let mut up = Pipe::default();
    up.bytes = from.up;
    up.first = from.first;
    let mut down = Pipe::default();
    down.bytes = from.down;
    up.acks = quickack::Watch::resumed(from.acking.0);
    down.acks = quickack::Watch::resumed(from.acking.1);
    // A server just connected to has had no time to answer a request sent in the same
    // turn (nor, on a LAN, to greet): reading it before the event loop says so finds
    // nothing (one wasted system call per connection: 0.74–0.86 measured). Nor has a new
    // client mostly sent its request when the relay starts (one EAGAIN a connection under
    // wrk's connection-per-request load; the accept loop drops tokio's assumption that an
    // accepted socket is readable, so an earlier event is not missed). A resumed relay
    // reads both at once: either socket may hold what woke it.
    up.speculated = !from.resumed;
    down.speculated = !from.resumed;
    let mut active = false;
    let mut idle = IdleTimer::new(opts.idle_timeout, opts.park_after);
    // `None`: stopped quiet; `Some`: ended.
    let stop = poll_fn(|cx| {
        if !up.done {
            match up.poll(cx, client, server, (down.done, down.bytes), &mut active) {
                Poll::Ready(Err(Failed::Source(e))) => return Poll::Ready(Some(End::Error(e))),
                // A server that closed cleanly first and then resets what the client
                // still sends (an HTTP keep-alive timeout racing a new request) has not
                // failed: only one that resets without having closed is.
                Poll::Ready(Err(Failed::Destination(e))) if down.eof => {
                    return Poll::Ready(Some(End::Error(e)))
                }
                Poll::Ready(Err(Failed::Destination(e))) => {
                    return Poll::Ready(Some(End::ServerError(e)))
                }
                _ => {}
            }
        }
        if !down.done {
            match down.poll(cx, server, client, (up.done, up.bytes), &mut active) {
                Poll::Ready(Err(Failed::Source(e))) => {
                    return Poll::Ready(Some(End::ServerError(e)))
                }
                Poll::Ready(Err(Failed::Destination(e))) => {
                    return Poll::Ready(Some(End::Error(e)))
                }
                _ => {}
            }
        }
        let fast = fast_close(opts.fastclose, up.eof, down.eof);
        if let Poll::Ready(end) = turn_end(fast, up.done && down.done, &mut idle, cx, &mut active) {
            return Poll::Ready(Some(end));
        }
        // `active`: bytes moved since the timer last fired, e.g. a slow receiver's backlog
        // that only now drained; the connection has not been silent since.
        let parks = !active
            && opts
                .park_after
                .zip(idle.as_ref())
                .is_some_and(|(after, timer)| {
                    timer.silent() >= after && up.quiet() && down.quiet()
                });
        if parks {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    })
    .await;
    match stop {
        Some(end) => Stop::Ended(Outcome {
            up: up.bytes,
            down: down.bytes,
            end,
            first: up.first.take().map(Capture::into_bytes).unwrap_or_default(),
        }),
        None => Stop::Quiet(Totals {
            up: up.bytes,
            down: down.bytes,
            first: up.first.take(),
            silent: idle.as_ref().map_or(Duration::ZERO, IdleTimer::silent),
            resumed: true,
            acking: (up.acks.acking(), down.acks.acking()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A socket of the relay that counts its reads made without asking the event loop, and
    /// the reads that found nothing.
    struct Counted {
        socket: TcpStream,
        unasked: Cell<u32>,
        empty: Cell<u32>,
    }

    impl Counted {
        fn count_empty(&self, read: io::Result<usize>) -> io::Result<usize> {
            if read
                .as_ref()
                .is_err_and(|e| e.kind() == ErrorKind::WouldBlock)
            {
                self.empty.set(self.empty.get() + 1);
            }
            read
        }
    }

    impl Stream for Counted {
        fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Stream::poll_read_ready(&self.socket, cx)
        }
        fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Stream::poll_write_ready(&self.socket, cx)
        }
        fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
            // The relay asks only after the event loop said readable: this is a read(2).
            self.count_empty(Stream::try_read(&self.socket, buf))
        }
        fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
            self.unasked.set(self.unasked.get() + 1);
            self.count_empty(self.socket.read_now(buf))
        }
        fn forget_readable(&self) {
            Stream::forget_readable(&self.socket);
        }
        fn readable_now(&self) -> bool {
            self.socket.readable_now()
        }
        fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
            Stream::try_write(&self.socket, buf)
        }
        fn shutdown_write(&self) -> io::Result<()> {
            self.socket.shutdown_write()
        }
        fn try_peek(
            &self,
            buf: &mut [u8],
            more: &mut dyn FnMut(&[u8]) -> bool,
        ) -> io::Result<usize> {
            self.socket.try_peek(buf, more)
        }
        fn try_splice_out(&self, pipe: &KernelPipe, len: usize) -> io::Result<usize> {
            self.socket.try_splice_out(pipe, len)
        }
        fn try_splice_in(&self, pipe: &KernelPipe, len: usize) -> io::Result<usize> {
            self.socket.try_splice_in(pipe, len)
        }
    }

    impl Acknowledge for Counted {
        fn acknowledge(&self) {
            self.socket.acknowledge();
        }
    }

    /// Two connected sockets: the far end (a client or a server) and quill's end.
    async fn pair() -> (TcpStream, Counted) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let far = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (near, _) = listener.accept().await.unwrap();
        let near = Counted {
            socket: near,
            unasked: Cell::new(0),
            empty: Cell::new(0),
        };
        (far, near)
    }

    const OPTIONS: RelayOptions = RelayOptions {
        fastclose: FastClose::Off,
        idle_timeout: None,
        park_after: None,
        capture: false,
    };

    /// Relays one request and its answer from `from`; returns how many reads of the client
    /// and of the server were made without the event loop saying they were readable.
    async fn first_reads(from: Totals) -> (u32, u32) {
        let (mut client, quill_client) = pair().await;
        let (mut server, quill_server) = pair().await;
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let serve = async {
            let mut request = Vec::new();
            server.read_to_end(&mut request).await.unwrap();
            assert_eq!(request, b"request");
            server.write_all(b"answer").await.unwrap();
            server.shutdown().await.unwrap();
            // Not to its end: once both sides have closed the relay ends, and the EOF
            // reaches the client when quill's sockets close, after it.
            let mut answer = [0; 6];
            client.read_exact(&mut answer).await.unwrap();
            assert_eq!(&answer, b"answer");
        };
        let (stop, ()) = tokio::join!(relay(&quill_client, &quill_server, OPTIONS, from), serve);
        assert!(matches!(stop, Stop::Ended(Outcome { up: 7, down: 6, .. })));
        (quill_client.unasked.get(), quill_server.unasked.get())
    }

    #[tokio::test]
    async fn a_speculative_read_that_finds_nothing_is_not_made_twice() {
        // A readiness the event loop cached though the queue is empty (tokio assumes one
        // for every accepted socket; here: the byte it announced was taken behind its
        // back). A resumed relay's speculative read finds nothing, and the relay then
        // waits for the next event instead of reading again at once.
        let (mut client, quill_client) = pair().await;
        let (mut server, quill_server) = pair().await;
        client.write_all(b"x").await.unwrap();
        quill_client.socket.readable().await.unwrap();
        assert_eq!(
            rustix::io::read(&quill_client.socket, &mut [0; 1]).unwrap(),
            1
        );
        let talk = async {
            // Polled after the relay's first turn.
            client.write_all(b"request").await.unwrap();
            client.shutdown().await.unwrap();
            let mut request = [0; 7];
            server.read_exact(&mut request).await.unwrap();
            assert_eq!(&request, b"request");
            server.shutdown().await.unwrap();
        };
        let resumed = Totals {
            resumed: true,
            ..Totals::new(None)
        };
        let (stop, ()) = tokio::join!(relay(&quill_client, &quill_server, OPTIONS, resumed), talk);
        assert!(matches!(stop, Stop::Ended(Outcome { up: 7, down: 0, .. })));
        assert_eq!(
            quill_client.empty.get(),
            1,
            "reads of the client that found nothing"
        );
    }

    #[tokio::test]
    async fn a_new_relay_reads_each_side_when_the_event_loop_says_so() {
        // A server sent the request in the same turn has not answered yet, and a new
        // client has mostly not sent its request when its connection is accepted.
        assert_eq!(first_reads(Totals::new(None)).await, (0, 0));
    }

    #[tokio::test]
    async fn a_resumed_relay_reads_both_sides_at_once() {
        // Either socket may hold what woke a parked connection.
        let resumed = Totals {
            resumed: true,
            ..Totals::new(None)
        };
        assert_eq!(first_reads(resumed).await, (1, 1));
    }
}
