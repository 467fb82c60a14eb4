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

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::io::{self, ErrorKind};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use super::http::{Exchange, Fed};
use super::relay::{
    fast_close, turn_end, End, IdleTimer, Outcome, RelayOptions, BUDGET, SCRATCH_SIZE,
};

/// After a refusal (400/431), how long the client's remaining bytes are read and dropped
/// so that closing does not reset the connection before the client has read the answer.
const LINGER: Duration = Duration::from_secs(2);
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
    /// The EOF has been passed on; this direction is finished.
    done: bool,
    /// The start of the first read, when asked for (connection log).
    first: Option<Vec<u8>>,
    bytes: u64,
}

/// State shared by both directions during one poll.
struct Shared<'a> {
    exchange: Option<&'a mut Exchange>,
    /// Something moved (for the idle timer).
    active: bool,
    /// The refusal has been queued for the client; the server is not read any more.
    refusing: bool,
}

impl Shared<'_> {
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
                let n = ready!(Pin::new(&mut *dst).poll_write(cx, &self.out[self.written..]))?;
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
                ready!(Pin::new(&mut *dst).poll_flush(cx))?;
                self.unflushed = false;
            }
            if dir == Dir::Down && !shared.refusing {
                if let Some(refusal) = shared.exchange.as_mut().and_then(|ex| ex.take_refusal()) {
                    // The answers to earlier requests are out: now the refusal, then close.
                    self.out.extend_from_slice(refusal);
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
            if !shared.accepts(dir) {
                // Woken again when the other direction changes what the exchange accepts.
                return Poll::Pending;
            }
            if budget == 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            budget -= 1;
            let step =
                SCRATCH.with(|scratch| {
                    let mut scratch = scratch.borrow_mut();
                    let mut buf = ReadBuf::new(&mut scratch[..]);
                    match Pin::new(&mut *src).poll_read(cx, &mut buf) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Ready(Ok(())) => {}
                    }
                    let input = buf.filled();
                    if input.is_empty() {
                        self.eof = true;
                        if dir == Dir::Down {
                            if let Some(ex) = shared.exchange.as_mut() {
                                // Forwarded before the EOF is passed on.
                                ex.server_closed(&mut self.out);
                            }
                        }
                        return Poll::Ready(Ok(()));
                    }
                    self.bytes += input.len() as u64;
                    shared.active = true;
                    if let Some(first) = self.first.as_mut().filter(|f| f.is_empty()) {
                        first.extend_from_slice(
                            &input[..input.len().min(crate::connlog::REQUEST_BYTES)],
                        );
                    }
                    Poll::Ready(OUT.with(|out| {
                        self.forward(dir, cx, input, &mut out.borrow_mut(), dst, shared)
                    }))
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
                Dir::Up => ex.client_bytes(input, out),
                Dir::Down => ex.server_bytes(input, out),
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
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => break,
            }
        }
        if written < data.len() {
            self.out.extend_from_slice(&data[written..]);
        }
        Ok(())
    }
}

/// Relays between `client` and `server` until the connection ends, through `exchange`
/// when given (HTTP rewriting), verbatim otherwise.
pub async fn relay<C, S>(
    client: &mut C,
    server: &mut S,
    mut exchange: Option<Exchange>,
    opts: RelayOptions,
) -> Outcome
where
    C: AsyncRead + AsyncWrite + Unpin + ?Sized,
    S: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let mut up = Flow {
        first: opts.capture.then(Vec::new),
        ..Flow::default()
    };
    let mut down = Flow::default();
    let mut active = false;
    let mut refusing = false;
    let mut idle = IdleTimer::new(opts.idle_timeout, None);
    let mut linger: Option<(Pin<Box<Sleep>>, usize)> = None;
    let end = poll_fn(|cx| {
        if let Some((timer, drained)) = linger.as_mut() {
            return poll_linger(cx, client, timer.as_mut(), drained);
        }
        let mut shared = Shared {
            exchange: exchange.as_mut(),
            active,
            refusing,
        };
        let blocked_before = !shared.accepts(Dir::Up);
        if !up.done {
            if let Poll::Ready(Err(e)) =
                up.poll(Dir::Up, cx, client, server, down.done, &mut shared)
            {
                return Poll::Ready(End::Error(e));
            }
        }
        if !down.done {
            if let Poll::Ready(Err(e)) =
                down.poll(Dir::Down, cx, server, client, up.done, &mut shared)
            {
                return Poll::Ready(End::Error(e));
            }
        }
        if blocked_before && shared.accepts(Dir::Up) && !up.done {
            // The server's answer released the client (an `Upgrade` was declined or
            // accepted): let the client direction run again.
            cx.waker().wake_by_ref();
        }
        active = shared.active;
        refusing = shared.refusing;
        let refused = shared
            .exchange
            .as_ref()
            .is_some_and(|ex| ex.refusal().is_some());
        if refused && down.done {
            if refusing {
                // The refusal is out and the client's write side shut: drain, then close.
                let mut timer = Box::pin(tokio::time::sleep(LINGER));
                let mut drained = 0;
                let r = poll_linger(cx, client, timer.as_mut(), &mut drained);
                linger = Some((timer, drained));
                return r;
            }
            // The server went away with answers due: the refusal can never be sent.
            return Poll::Ready(End::Refused);
        }
        // A refusal being delivered is not cut short by fastclose.
        let fast = fast_close(opts.fastclose, up.eof, down.eof) && !refusing;
        turn_end(fast, up.done && down.done, &mut idle, cx, &mut active)
    })
    .await;
    Outcome {
        up: up.bytes,
        down: down.bytes,
        end,
        first: up.first.unwrap_or_default(),
    }
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
