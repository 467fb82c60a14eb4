//! Acknowledging at once what a peer sent, for peers whose next write waits for it.
//!
//! A sender with Nagle's algorithm on (no TCP_NODELAY: Python's and many older application
//! servers) holds a small write while an earlier one is unacknowledged, and the reader's
//! kernel delays that acknowledgement (40 ms on Linux) hoping to carry it on data of its
//! own. A server that writes an answer's head and body apart then delivers every answer
//! 40 ms late, through any relay and to a client of its own alike. quill sends the held
//! acknowledgement at once (`TCP_QUICKACK`) where it knows more is to come: the HTTP paths
//! after a head whose body is awaited, and a raw relay once a [`Watch`] has seen its
//! sender stall like this.
//!
//! Invariant: acknowledging is never needed for correctness, only for latency, so a watch
//! that guesses wrong costs one `setsockopt` a read on that connection, nothing more.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use rustix::time::{clock_gettime, ClockId};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A socket whose received bytes quill can acknowledge at once.
pub trait Acknowledge {
    /// Sends the acknowledgement the kernel is holding back for what was read, if any
    /// (`TCP_QUICKACK`: the kernel delays one for up to 40 ms, hoping to carry it on data
    /// of quill's, which an answer's reader has none of).
    fn acknowledge(&self);
}

impl Acknowledge for tokio::net::TcpStream {
    fn acknowledge(&self) {
        if let Err(e) = socket2::SockRef::from(self).set_quickack(true) {
            tracing::debug!("TCP_QUICKACK: {e}");
        }
    }
}

impl<T: Acknowledge + ?Sized> Acknowledge for Box<T> {
    fn acknowledge(&self) {
        (**self).acknowledge();
    }
}

impl<T: Acknowledge + ?Sized> Acknowledge for &mut T {
    fn acknowledge(&self) {
        (**self).acknowledge();
    }
}

/// A Unix-domain stream has no acknowledgements: nothing to send.
impl Acknowledge for tokio::net::UnixStream {
    fn acknowledge(&self) {}
}

impl Acknowledge for crate::tls::ClientTlsStream<tokio::net::TcpStream> {
    fn acknowledge(&self) {
        self.get_ref().0.acknowledge();
    }
}

/// The gap in milliseconds between two reads of a sender that waited for quill's delayed
/// acknowledgement: Linux delays one by 40 ms at least and 200 ms at most
/// (`TCP_DELACK_MIN`, `_MAX`); the bounds leave room for the event loop's lateness in
/// taking the first read and for the coarse clock's tick (up to 10 ms).
const HELD_MS: Range<u64> = 30..250;

/// Milliseconds of the coarse monotonic clock: the last scheduler tick's time, read
/// without a system call for a fraction of a precise clock's cost (two reads a relayed
/// request; [`HELD_MS`] needs no better).
fn coarse_ms() -> u64 {
    let t = clock_gettime(ClockId::MonotonicCoarse);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let millis = u64::try_from(t.tv_nsec / 1_000_000).unwrap_or(0);
    secs.saturating_mul(1000).saturating_add(millis)
}

/// One direction of a relay that knows no HTTP (both of a plain raw relay; the server's of
/// a TLS-terminating one and of hyper's client, through [`WatchedServer`]), watched for a sender
/// that waits for acknowledgements.
///
/// The sign: a read that emptied the receive queue, then nothing the other way, then the
/// sender's next bytes a delayed acknowledgement's time later. From then on the direction
/// acknowledges after every read that empties the queue. A sender that is merely slow by
/// that much (a stream of updates every 50 ms) is taken for one too: it then costs a
/// system call a read, and its updates are acknowledged sooner.
#[derive(Debug, Default)]
pub struct Watch {
    /// The last read that emptied the queue: when (coarse milliseconds), and the bytes
    /// moved the other way by then.
    last: Option<(u64, u64)>,
    /// The sender was seen to wait: acknowledge every read that empties the queue.
    acking: bool,
}

impl Watch {
    /// The watch of a relay that resumes after parking: `acking` as its sender was seen.
    pub fn resumed(acking: bool) -> Watch {
        Watch { last: None, acking }
    }

    /// A read emptied the sender's queue; `other`: the bytes moved the other way so far.
    /// True when what was read should be acknowledged now.
    pub fn drained(&mut self, other: u64) -> bool {
        self.drained_at(coarse_ms(), other)
    }

    fn drained_at(&mut self, now: u64, other: u64) -> bool {
        if self.acking {
            return true;
        }
        let last = self.last.replace((now, other));
        self.acking = last
            .is_some_and(|(at, then)| then == other && HELD_MS.contains(&now.saturating_sub(at)));
        self.acking
    }

    /// Whether the sender was seen to wait for acknowledgements.
    pub fn acking(&self) -> bool {
        self.acking
    }
}

/// A server stream read through `AsyncRead` by a reader that does not acknowledge on its
/// own (the TLS-terminating relay, and hyper's HTTP/1.1 client for `upstream_h2` servers
/// that decline HTTP/2): its reads are watched as the plain relay's are, a read counting
/// as having emptied the queue when the next one finds nothing. Everything else passes
/// through.
pub struct WatchedServer<S> {
    inner: S,
    watch: Watch,
    /// Bytes written to the server so far: its sign of an answered request.
    written: u64,
    /// Bytes were read since the last read that found nothing.
    read: bool,
}

impl<S> WatchedServer<S> {
    pub fn new(inner: S) -> WatchedServer<S> {
        WatchedServer {
            inner,
            watch: Watch::default(),
            written: 0,
            read: false,
        }
    }
}

impl<S: AsyncRead + Acknowledge + Unpin> AsyncRead for WatchedServer<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.inner).poll_read(cx, buf);
        match poll {
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.read = true,
            Poll::Pending if this.read => {
                this.read = false;
                if this.watch.drained(this.written) {
                    this.inner.acknowledge();
                }
            }
            _ => {}
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WatchedServer<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.count(&poll);
        poll
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.count(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S> WatchedServer<S> {
    fn count(&mut self, written: &Poll<io::Result<usize>>) {
        if let Poll::Ready(Ok(n)) = written {
            self.written = self.written.saturating_add(*n as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_silent_for_a_delayed_acknowledgement_is_acknowledged_from_then_on() {
        let t = coarse_ms();
        let mut w = Watch::default();
        assert!(!w.drained_at(t, 100), "the head of an answer");
        assert!(w.drained_at(t + 41, 100), "its body, 41 ms later");
        assert!(w.drained_at(t + 5041, 200), "every read after");
    }

    #[test]
    fn a_relay_resumed_after_parking_keeps_what_it_saw() {
        let t = coarse_ms();
        assert!(
            Watch::resumed(true).drained_at(t, 0),
            "no stall to see again"
        );
        assert!(!Watch::resumed(false).drained_at(t, 0));
    }

    #[test]
    fn quick_or_answering_senders_are_left_to_the_kernel() {
        let t = coarse_ms();
        let mut w = Watch::default();
        // Head and body a millisecond apart: nothing held them.
        assert!(!w.drained_at(t, 100));
        assert!(!w.drained_at(t + 1, 100));
        // The next answer 41 ms later, after a new request: the gap was the client's.
        assert!(!w.drained_at(t + 42, 180));
        // A second later, with nothing the other way: a sender that took its time.
        assert!(!w.drained_at(t + 1042, 180));
        assert!(!w.acking());
    }
}
