//! HTTP/1.x clients served request by request (`http` with `upstream_keepalive` above 0):
//! after the byte pump's checks of the first head (`pump::first_head`: 400, 431, 408, no
//! server before a whole head), hyper serves the connection and every request goes to
//! `proxy::gateway`, which may send each to another server over pooled connections.

use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::gateway::{self, Activity, Graceful, Peer, Timers};
use crate::state::State;

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
pub(super) async fn serve<IO>(state: &'static State, io: IO, peer: Peer)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let settings = state.settings();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .max_buf_size(settings.http_header_max.max(8192))
        .pipeline_flush(true)
        .preserve_header_case(true)
        // A client that half-closes after its request still gets the answer.
        .half_close(true)
        // quill's own watchdog bounds later heads: it answers a partial one 408.
        .header_read_timeout(None);
    let activity = Rc::new(Activity::default());
    let service = gateway::service(state, peer, &activity);
    let read = Arc::new(Reads::default());
    let io = Watched {
        inner: io,
        reads: Arc::clone(&read),
    };
    let conn = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
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
    };
    let late_head = |answered: Instant| read.late_head(answered);
    if let Some(t) = gateway::supervise(state, conn, &activity, timers, &late_head).await {
        t.count(state);
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
}

/// The `408` quill answers to a head that did not come whole in time, as the byte pump
/// does.
const REQUEST_TIMEOUT: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";

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
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
