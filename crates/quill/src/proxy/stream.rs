//! The byte pump for connections where at least one side is not a raw socket (a TLS
//! stream): the same contract as [`super::relay`], over `AsyncRead + AsyncWrite`.
//!
//! Reads go to a per-thread scratch buffer of one TLS record's worth and are written on at
//! once; a connection owns a buffer only while the receiving side is slower than the
//! sending one, and that direction stops reading until it has been flushed (backpressure).
//! Writes into a TLS stream are flushed before the next read, so no byte waits in a TLS
//! buffer while the relay waits for input. Invariants: bytes are forwarded in order and
//! never dropped; an EOF (or a TLS close_notify) is passed on with `poll_shutdown` (which
//! sends close_notify, then FIN) only after everything read before it was written; the
//! relay ends when both directions are done, on an error, on `tcp_fastclose`, or when idle.

use std::cell::RefCell;
use std::future::poll_fn;
use std::io::{self, ErrorKind};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::quickack::{self, Acknowledge};
use super::relay::{fast_close, turn_end, End, IdleTimer, Outcome, RelayOptions};
use crate::connlog::Capture;

/// Bytes read per call: the largest TLS record's plaintext, so one read is one record.
pub const SCRATCH_SIZE: usize = 16 * 1024;

/// Reads in one direction before yielding to other connections of the same event loop.
const BUDGET: usize = 32;

thread_local! {
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0; SCRATCH_SIZE].into_boxed_slice());
}

/// One direction of the relay.
#[derive(Default)]
struct Pipe {
    /// Bytes read but not yet accepted by the receiver (only while it is slow).
    pending: Vec<u8>,
    written: usize,
    /// Bytes were written that may sit in the receiver's (TLS) buffer.
    unflushed: bool,
    eof: bool,
    done: bool,
    first: Option<Capture>,
    bytes: u64,
}

/// A clean end of the sender: EOF, or a TLS peer that closed the TCP connection without
/// close_notify (most HTTPS clients do; the relay passes the close on either way).
fn is_eof(e: &io::Error) -> bool {
    e.kind() == ErrorKind::UnexpectedEof
}

impl Pipe {
    fn poll<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        src: &mut R,
        dst: &mut W,
        active: &mut bool,
    ) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        let mut budget = BUDGET;
        loop {
            while self.written < self.pending.len() {
                match ready!(Pin::new(&mut *dst).poll_write(cx, &self.pending[self.written..])) {
                    Ok(0) => return Poll::Ready(Err(ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        self.written += n;
                        self.unflushed = true;
                        *active = true;
                    }
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
            if !self.pending.is_empty() {
                // Flushed: give the memory back rather than keep it for an idle connection.
                self.pending = Vec::new();
                self.written = 0;
            }
            if self.unflushed {
                ready!(Pin::new(&mut *dst).poll_flush(cx))?;
                self.unflushed = false;
            }
            if self.eof {
                match ready!(Pin::new(&mut *dst).poll_shutdown(cx)) {
                    Ok(()) => {}
                    // The peer is already gone; the other direction will notice.
                    Err(e) if e.kind() == ErrorKind::NotConnected => {}
                    Err(e) => return Poll::Ready(Err(e)),
                }
                self.done = true;
                return Poll::Ready(Ok(()));
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
                    Poll::Ready(Err(e)) if is_eof(&e) => {
                        self.eof = true;
                        return Poll::Ready(Ok(()));
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) => {}
                }
                let data = buf.filled();
                let n = data.len();
                if n == 0 {
                    self.eof = true;
                    return Poll::Ready(Ok(()));
                }
                self.bytes += n as u64;
                super::polling::moved(n as u64);
                *active = true;
                if let Some(first) = self.first.as_mut() {
                    first.first_read(data);
                }
                match Pin::new(&mut *dst).poll_write(cx, data) {
                    Poll::Ready(Ok(w)) => {
                        self.unflushed = true;
                        if w < n {
                            self.pending = data[w..].to_vec();
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => self.pending = data.to_vec(),
                }
                Poll::Ready(Ok(()))
            });
            ready!(step)?;
        }
    }
}

/// Relays between `client` and `server` until the connection ends, keeping the client's
/// first bytes in `first` (for the connection log).
pub async fn relay<C, S>(
    client: &mut C,
    server: &mut S,
    opts: RelayOptions,
    first: Option<Capture>,
) -> Outcome
where
    C: AsyncRead + AsyncWrite + Unpin + ?Sized,
    S: AsyncRead + AsyncWrite + Acknowledge + Unpin + ?Sized,
{
    let mut up = Pipe {
        first,
        ..Pipe::default()
    };
    let mut down = Pipe::default();
    // Acknowledges at once the server's reads once it was seen to wait for that.
    let server = &mut quickack::WatchedServer::new(server);
    let mut active = false;
    let mut idle = IdleTimer::new(opts.idle_timeout, None);
    let end = poll_fn(|cx| {
        if !up.done {
            if let Poll::Ready(Err(e)) = up.poll(cx, client, server, &mut active) {
                return Poll::Ready(End::Error(e));
            }
        }
        if !down.done {
            if let Poll::Ready(Err(e)) = down.poll(cx, server, client, &mut active) {
                return Poll::Ready(End::Error(e));
            }
        }
        let fast = fast_close(opts.fastclose, up.eof, down.eof);
        turn_end(fast, up.done && down.done, &mut idle, cx, &mut active)
    })
    .await;
    Outcome {
        up: up.bytes,
        down: down.bytes,
        end,
        first: up.first.map(Capture::into_bytes).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::FastClose;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An in-memory stream has no acknowledgements to send.
    impl Acknowledge for tokio::io::DuplexStream {
        fn acknowledge(&self) {}
    }

    fn opts() -> RelayOptions {
        RelayOptions {
            fastclose: FastClose::Off,
            idle_timeout: None,
            park_after: None,
            capture: true,
        }
    }

    /// Bytes go through in order in both directions, half-close is passed on, and the
    /// counters and the captured first bytes are right, also when the receiver is slow.
    #[tokio::test]
    async fn relays_both_ways_with_half_close() {
        let (mut client_far, mut client) = tokio::io::duplex(1024);
        let (mut server, mut server_far) = tokio::io::duplex(1024);
        let pump = tokio::spawn(async move {
            relay(&mut client, &mut server, opts(), Some(Capture::default())).await
        });
        let up: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let down: Vec<u8> = (0..50_000u32).map(|i| (i % 13) as u8).collect();
        let (up2, down2) = (up.clone(), down.clone());
        let far_server = tokio::spawn(async move {
            let mut got = Vec::new();
            server_far.read_to_end(&mut got).await.map(|_| ())?;
            server_far.write_all(&down2).await?;
            server_far.shutdown().await?;
            Ok::<_, io::Error>(got)
        });
        client_far
            .write_all(&up2)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        client_far
            .shutdown()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut got_down = Vec::new();
        client_far
            .read_to_end(&mut got_down)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let got_up = far_server
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got_up, up);
        assert_eq!(got_down, down);
        let outcome = pump.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
        assert_eq!((outcome.up, outcome.down), (200_000, 50_000));
        assert_eq!(outcome.first[..4], up[..4]);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_end() {
        let (_client_far, mut client) = tokio::io::duplex(64);
        let (mut server, _server_far) = tokio::io::duplex(64);
        let o = RelayOptions {
            idle_timeout: Some(Duration::from_secs(5)),
            park_after: None,
            ..opts()
        };
        let outcome = relay(&mut client, &mut server, o, Some(Capture::default())).await;
        assert!(matches!(outcome.end, End::Idle));
    }
}
