//! Bytes read from a client before the protocol that serves it was chosen (the HTTP/2
//! preface check of `h2c`, the first request head of `http`), given back in front of the
//! socket's own: `Prefixed`; and `Recording`, which keeps what a reader took, to give it
//! back later.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A client stream with bytes already read from it in front.
pub struct Prefixed<IO> {
    prefix: Vec<u8>,
    at: usize,
    inner: IO,
}

impl<IO> Prefixed<IO> {
    pub fn new(prefix: Vec<u8>, inner: IO) -> Prefixed<IO> {
        Prefixed {
            prefix,
            at: 0,
            inner,
        }
    }

    /// Puts bytes a reader took but did not use back in front of the rest.
    pub fn unread(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let mut prefix = bytes.to_vec();
        prefix.extend_from_slice(&self.prefix[self.at..]);
        self.prefix = prefix;
        self.at = 0;
    }

    /// Whether bytes are waiting in front of the stream's own.
    pub fn has_prefix(&self) -> bool {
        self.at < self.prefix.len()
    }

    pub fn get_ref(&self) -> &IO {
        &self.inner
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            if self.at == self.prefix.len() {
                self.prefix = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Prefixed<IO> {
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

/// A client stream that keeps a copy of every byte read from it (when `on`).
pub struct Recording<'a, IO: ?Sized> {
    inner: &'a mut IO,
    on: bool,
    pub seen: Vec<u8>,
}

impl<'a, IO: ?Sized> Recording<'a, IO> {
    pub fn new(inner: &'a mut IO, on: bool) -> Recording<'a, IO> {
        Recording {
            inner,
            on,
            seen: Vec::new(),
        }
    }
}

impl<IO: AsyncRead + Unpin + ?Sized> AsyncRead for Recording<'_, IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut *self.inner).poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), true) = (&polled, self.on) {
            let new = buf.filled()[before..].to_vec();
            self.seen.extend_from_slice(&new);
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin + ?Sized> AsyncWrite for Recording<'_, IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.inner).poll_shutdown(cx)
    }
}
