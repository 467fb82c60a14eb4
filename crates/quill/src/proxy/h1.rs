//! HTTP/1.x clients served request by request through hyper (`http` with
//! `upstream_keepalive` above 0, and `upstream_h2`, which needs each request as a message;
//! otherwise `proxy::h1_pump` relays them as bytes): after the byte pump's
//! checks of the first head (`pump::first_head`: 400, 431, 408, no
//! server before a whole head), hyper serves the connection and every request goes to
//! `proxy::gateway`, which may send each to another server over pooled connections.
//! A connection idle for `idle_park` is taken off hyper (its buffers freed) and waits on
//! its socket alone until the client sends again: keep-alive clients cost little memory
//! between their requests.

use std::future::poll_fn;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::gateway::{self, Activity, Ended, Graceful, HeadTimeout, Peer, Timers};
use super::http::Refusal;
use crate::state::State;

/// A client connection that can be served without hyper for a while: its socket waited on
/// alone, and bytes hyper had read but not used given back.
pub(super) trait Parkable: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Ready when the client's socket has something to read: bytes, EOF or an error.
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>>;
    /// Puts bytes read but not used back in front of the stream.
    fn unread(&mut self, bytes: &[u8]);
    /// Whether bytes wait to be read without the socket (given back, or decrypted), or
    /// to be written (TLS records): then the connection is not idle.
    fn busy(&self) -> bool;
    /// Whether the client sent something not read yet: bytes given back or decrypted, or
    /// anything in the socket (asked of the socket: the event loop may not have seen it).
    fn sent(&self) -> bool;
}

impl<I, S> Graceful for hyper::server::conn::http1::UpgradeableConnection<I, S>
where
    Self: std::future::Future,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    fn shut(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }

    fn recycle(self: Pin<&mut Self>, activity: &Activity) -> bool {
        activity.close_next.set(true);
        false
    }
}

/// Serves one HTTP/1.x client connection until it ends (`io` starts with the first
/// request head, already checked). Later heads must come whole within
/// `http_request_timeout` of the previous answer; a body or tunnel that moves no byte for
/// `idle_timeout` ends the connection.
pub(super) async fn serve<IO: Parkable>(state: &'static State, io: IO, peer: Peer) {
    let settings = state.settings();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // Also bounds what hyper buffers of a response for a slow client: it polls the
        // body only while its write buffer is under this, so a server's answer (an HTTP/2
        // stream's data, released to its window as it is polled) waits at the server.
        // Hence no `pipeline_flush`: with it hyper buffers without limit (its
        // `can_buffer` is then always true), the whole answer for a client that does
        // not read.
        .max_buf_size(settings.http_header_max.max(8192))
        .preserve_header_case(true)
        // Names without a case of their own (an HTTP/2 server's, quill's) as servers write
        // them.
        .title_case_headers(true)
        // A client that half-closes after its request still gets the answer.
        .half_close(true)
        // quill's own watchdog bounds later heads: it answers a partial one 408.
        .header_read_timeout(None);
    let activity = Rc::new(Activity::default());
    let mut service = gateway::service(state, peer, &activity);
    let read = Arc::new(Reads::default());
    let mut io = Watched {
        inner: io,
        reads: Arc::clone(&read),
    };
    // Between requests, the next head is due within `http_request_timeout`, and an idle
    // keep-alive connection ends at `idle_timeout`, whichever comes first.
    let head = gateway::secs(settings.http_request_timeout);
    let idle = gateway::secs(settings.idle_timeout);
    let between = match (head, idle) {
        (Some(h), Some(i)) => Some(h.min(i)),
        (h, i) => h.or(i),
    };
    let timers = Timers {
        first: head,
        between,
        between_is_head: true,
        stalled: gateway::secs(settings.idle_timeout),
        park: gateway::secs(settings.idle_park),
    };
    let late_head = |answered: Instant| read.late_head(answered);
    let parkable = |answered: Instant| read.idle_since(answered);
    loop {
        let mut conn = builder
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades();
        // After `conn`: dropped first when the task is aborted.
        let quill_ends = gateway::QuillEnds::new(&activity);
        let ended = gateway::supervise(
            state,
            Pin::new(&mut conn),
            &activity,
            timers,
            &late_head,
            &parkable,
        )
        .await;
        quill_ends.disarm();
        if let Ended::Closed(timed_out) = ended {
            if let Some(t) = timed_out {
                t.count(state);
            }
            // hyper has shut the write side, maybe with a request body left unread (an
            // upload its server answered early, a 413): dropping the socket now would
            // reset the connection under a client still sending, which may then never
            // read the answer. A client that went silent has nothing more to send.
            if timed_out != Some(HeadTimeout::Silent) {
                if let Some(parts) = conn.into_parts() {
                    let mut io = parts.io.into_inner();
                    super::pump::close_lingering(&mut io.inner, b"").await;
                }
            }
            return;
        }
        // Idle: hyper is dropped with its buffers; what it had read goes back in front.
        let Some(parts) = conn.into_parts() else {
            return; // upgraded: never idle
        };
        io = parts.io.into_inner();
        service = parts.service;
        io.inner.unread(&parts.read_buf);
        drop(parts.read_buf); // hyper's read buffer: not to be held while parked
        if io.inner.busy() {
            continue;
        }
        if let Some(end) = park(state, &io.inner, &activity, timers).await {
            if let Some(t) = end {
                t.count(state);
            }
            // As hyper ends an idle connection: the write side closed (TLS: close_notify).
            let _ = tokio::time::timeout(Duration::from_secs(1), io.inner.shutdown()).await;
            return;
        }
    }
}

/// Waits, without hyper, until an idle client sends again (or its socket ends or fails):
/// then `None`, to be served on. Ends the connection (`Some`, with how it timed out, if it
/// did) when the next head is overdue (`timers.between` after the last answer) or quill
/// stops. A reload or drain meanwhile makes the next response say `Connection: close`, as
/// for a connection under hyper. Counted in `State::parked` meanwhile.
async fn park<IO: Parkable>(
    state: &State,
    io: &IO,
    activity: &Activity,
    timers: Timers,
) -> Option<Option<HeadTimeout>> {
    let mut asked = super::signals::Watcher::new(state);
    if asked.seen().stopping() {
        return Some(None);
    }
    state.parked.fetch_add(1, Relaxed);
    // Also when the task is aborted meanwhile (`close N`).
    let _parked = super::tcp::Held(&state.parked);
    crate::memory::release_when_quiet();
    let overdue = async {
        match (timers.between, activity.last()) {
            (Some(limit), Some(last)) => tokio::time::sleep_until((last + limit).into()).await,
            _ => std::future::pending().await,
        }
    };
    tokio::pin!(overdue);
    loop {
        tokio::select! {
            _ = poll_fn(|cx| io.poll_read_ready(cx)) => return None,
            () = &mut overdue => return Some(Some(HeadTimeout::Silent)),
            now = asked.changed() => {
                if now.stopping() {
                    return Some(None);
                }
                activity.close_next.set(true);
            }
        }
    }
}

/// What the watchdog knows of the client's reads, and how it ends a late head. (Shared
/// with hyper's I/O, which must be `Send` for upgrades: atomics and a mutex that only this
/// connection's one thread ever takes.)
#[derive(Default)]
struct Reads {
    /// When bytes last came from the client, and the reader waiting for more (woken to
    /// see `timed_out`).
    read: Mutex<(Option<Instant>, Option<Waker>)>,
    /// Set by the watchdog: answer 408 and end the read side.
    timed_out: AtomicBool,
    /// hyper has written (or tried to) since its last successful flush: bytes may still
    /// be in its buffer.
    unflushed: AtomicBool,
}

/// The `408` quill answers to a head that did not come whole in time, as the byte pump
/// does.
const REQUEST_TIMEOUT: &[u8] = Refusal::Timeout.response();

impl Reads {
    /// Whether the client sent bytes (part of a head) after the answer that ended at
    /// `answered`: then it is answered 408 (the next read does it) and `true`; a client
    /// that sent nothing is closed without a word.
    fn late_head(&self, answered: Instant) -> bool {
        let mut read = self.read.lock().unwrap_or_else(|p| p.into_inner());
        if !read.0.is_some_and(|at| at > answered) {
            return false;
        }
        self.timed_out.store(true, Relaxed);
        if let Some(w) = read.1.take() {
            w.wake();
        }
        true
    }

    /// Whether hyper holds nothing of the client's since the answer that ended at
    /// `answered`: no byte read since (part of a next head), everything written flushed.
    fn idle_since(&self, answered: Instant) -> bool {
        let read = self.read.lock().unwrap_or_else(|p| p.into_inner());
        !read.0.is_some_and(|at| at > answered) && !self.unflushed.load(Relaxed)
    }
}

/// The client connection under hyper, watched: records when bytes arrive; once a head is
/// late, writes the 408 (best effort: the socket has room for 70 bytes) and reports the
/// end of the stream, so that hyper drops the partial head and closes.
struct Watched<IO> {
    inner: IO,
    reads: Arc<Reads>,
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.reads.timed_out.load(Relaxed) {
            let _ = Pin::new(&mut self.inner).poll_write(cx, REQUEST_TIMEOUT);
            let _ = Pin::new(&mut self.inner).poll_flush(cx);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let mut read = self.reads.read.lock().unwrap_or_else(|p| p.into_inner());
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => read.0 = Some(Instant::now()),
            Poll::Pending => read.1 = Some(cx.waker().clone()),
            _ => {}
        }
        drop(read);
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        // Whatever this returns, hyper holds or has sent bytes that only a flush settles.
        self.reads.unflushed.store(true, Relaxed);
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        if matches!(flushed, Poll::Ready(Ok(()))) {
            self.reads.unflushed.store(false, Relaxed);
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
