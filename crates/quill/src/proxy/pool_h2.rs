//! HTTP/2 connections to servers (`upstream_h2`) for `proxy::gateway`: each one carries
//! the requests of many client connections at once, as streams (`proxy::h2_client`).
//!
//! One table per event loop (a thread-local, as `proxy::pool`: no lock), keyed by the same
//! `Target`. Invariants: a connection is handed out only while it runs (a request that
//! finds it can take no new stream, after a GOAWAY, retires it), to the server's current
//! address, before `upstream_max_requests` and while it carries fewer streams than the
//! server's `SETTINGS_MAX_CONCURRENT_STREAMS`. A request that finds every connection to
//! its server full opens another one rather than queue behind streams it cannot see the
//! end of, so a loop holds as many connections to a server as its concurrency needs
//! (usually one). While a connection to a target is being opened, requests that find no
//! room wait for it instead of opening their own: a burst of requests makes one
//! connection, not one each. A connection without streams for `upstream_idle_timeout`
//! leaves the table; one out of the table ends once its last stream has (the h2 crate
//! closes a connection when its last handle goes). A new connection is handed out only
//! once the server's SETTINGS have been read ([`Preface`]): before, its stream limit is
//! unknown, and it may not be HTTP/2 at all.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use super::h2_client::Connected;
use super::pool::{ByTarget, Limits, Target};

/// One multiplexed connection.
struct Shared {
    sender: SendRequest<Bytes>,
    addr: SocketAddr,
    /// Set once the connection has ended.
    closed: Rc<Cell<bool>>,
    /// Requests whose response has not ended yet.
    streams: Cell<usize>,
    /// Reads the server's current `SETTINGS_MAX_CONCURRENT_STREAMS` from the connection.
    max_streams: Box<dyn Fn() -> usize>,
    /// Requests sent over it so far.
    uses: Cell<u64>,
    /// Since when it carries no stream.
    idle_since: Cell<Instant>,
    idle_timeout: Duration,
    /// A request found it unusable: never handed out again.
    retired: Cell<bool>,
}

impl Shared {
    fn usable(&self, addr: SocketAddr, max_requests: u64) -> bool {
        !self.retired.get()
            && !self.closed.get()
            && self.addr == addr
            && (max_requests == 0 || self.uses.get() < max_requests)
    }

    fn has_room(&self) -> bool {
        // A server announcing 0 streams would otherwise make every request open a connection.
        self.streams.get() < (self.max_streams)().max(1)
    }
}

#[derive(Default)]
struct Table {
    conns: ByTarget<Vec<Rc<Shared>>>,
    /// Targets a connection is being opened to, and how its waiters are woken.
    opening: ByTarget<Rc<Notify>>,
    /// A sweeper task is running on this loop.
    sweeping: bool,
}

thread_local! {
    static TABLE: RefCell<Table> = RefCell::default();
}

/// A request's stream on a connection: counts among the connection's streams until
/// dropped (when the response has ended).
pub struct Stream {
    pub sender: SendRequest<Bytes>,
    conn: Rc<Shared>,
}

impl Stream {
    /// Takes the connection out of use: it failed a request before sending any of it.
    pub fn retire(&self) {
        self.conn.retired.set(true);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let left = self.conn.streams.get().saturating_sub(1);
        self.conn.streams.set(left);
        if left == 0 {
            self.conn.idle_since.set(Instant::now());
        }
    }
}

/// What [`take`] found.
pub enum Take {
    /// A stream on an open connection with room.
    Stream(Stream),
    /// None has room, but one is being opened: wait, then take again.
    Wait(Rc<Notify>),
    /// None has room: open one (under [`opening`]).
    Open,
}

/// A stream on a usable connection to `target` at `addr`, if one has room.
pub fn take(target: Target, addr: SocketAddr, limits: Limits) -> Take {
    TABLE.with(|table| {
        let mut table = table.borrow_mut();
        if let Some(list) = table.conns.get_mut(&target) {
            list.retain(|c| c.usable(addr, limits.max_requests));
            // The first with room: load goes to few connections, and the others idle out.
            if let Some(conn) = list.iter().find(|c| c.has_room()) {
                conn.streams.set(conn.streams.get() + 1);
                conn.uses.set(conn.uses.get() + 1);
                return Take::Stream(Stream {
                    sender: conn.sender.clone(),
                    conn: Rc::clone(conn),
                });
            }
        }
        match table.opening.get(&target) {
            Some(notify) => Take::Wait(Rc::clone(notify)),
            None => Take::Open,
        }
    })
}

/// Marks a connection to `target` as being opened until the guard drops (then its waiters
/// take again: from the new connection, or they open their own if it failed).
pub fn opening(target: Target) -> Opening {
    let notify = Rc::new(Notify::new());
    TABLE.with(|table| {
        table
            .borrow_mut()
            .opening
            .insert(target, Rc::clone(&notify))
    });
    Opening { target, notify }
}

pub struct Opening {
    target: Target,
    notify: Rc<Notify>,
}

impl Drop for Opening {
    fn drop(&mut self) {
        TABLE.with(|table| {
            let mut table = table.borrow_mut();
            if table
                .opening
                .get(&self.target)
                .is_some_and(|n| Rc::ptr_eq(n, &self.notify))
            {
                table.opening.remove(&self.target);
            }
        });
        self.notify.notify_waiters();
    }
}

/// A new connection's first stream; the connection joins the table for later requests
/// unless `upstream_keepalive` is 0 (then it ends with this stream).
pub fn add(target: Target, connected: Connected, addr: SocketAddr, limits: Limits) -> Stream {
    let Connected {
        sender,
        max_streams,
        closed,
    } = connected;
    let conn = Rc::new(Shared {
        sender: sender.clone(),
        addr,
        closed,
        streams: Cell::new(1),
        max_streams,
        uses: Cell::new(1),
        idle_since: Cell::new(Instant::now()),
        idle_timeout: limits.idle_timeout,
        retired: Cell::new(false),
    });
    if limits.keepalive > 0 {
        let start_sweeper = TABLE.with(|table| {
            let mut table = table.borrow_mut();
            table
                .conns
                .entry(target)
                .or_default()
                .push(Rc::clone(&conn));
            !std::mem::replace(&mut table.sweeping, true)
        });
        if start_sweeper {
            tokio::task::spawn_local(sweep());
        }
    }
    Stream { sender, conn }
}

/// Drops connections idle past their timeout, closed or retired, every second, until this
/// loop's table is empty.
async fn sweep() {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = Instant::now();
        let empty = TABLE.with(|table| {
            let mut table = table.borrow_mut();
            table.conns.retain(|_, list| {
                list.retain(|c| {
                    let idle_out = c.streams.get() == 0
                        && now.duration_since(c.idle_since.get()) >= c.idle_timeout;
                    !idle_out && !c.retired.get() && !c.closed.get()
                });
                !list.is_empty()
            });
            let empty = table.conns.is_empty();
            if empty {
                table.sweeping = false;
            }
            empty
        });
        if empty {
            return;
        }
    }
}

/// Why a new connection is not HTTP/2 after all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotH2 {
    #[error("the server does not speak HTTP/2 (its first bytes are no SETTINGS frame)")]
    Garbled,
    #[error("the server closed the connection before its HTTP/2 SETTINGS")]
    Closed,
    #[error("no HTTP/2 SETTINGS from the server in time")]
    Silent,
}

/// The server's side of the HTTP/2 preface, as the bytes of a new connection arrive: a
/// SETTINGS frame (RFC 9113 §3.4). Until it has been read, the server's limit of
/// concurrent streams is unknown (streams opened beyond it would be refused), and a server
/// that does not speak HTTP/2 (prior knowledge to an HTTP/1.1 server) is found out here,
/// before a request is sent to it.
#[derive(Default)]
pub struct Preface {
    head: Cell<[u8; 9]>,
    /// Bytes of the server's first frame read so far.
    read: Cell<usize>,
    verdict: Cell<Option<Result<(), NotH2>>>,
    notify: Notify,
}

impl Preface {
    /// Takes the next bytes read from the server (public for the fuzz target).
    pub fn feed(&self, bytes: &[u8]) {
        if self.verdict.get().is_some() {
            return;
        }
        let mut read = self.read.get();
        let mut rest = bytes;
        if read < 9 {
            let mut head = self.head.get();
            let n = rest.len().min(9 - read);
            head[read..read + n].copy_from_slice(&rest[..n]);
            self.head.set(head);
            read += n;
            rest = &rest[n..];
        }
        read = read.saturating_add(rest.len());
        self.read.set(read);
        if read < 9 {
            return;
        }
        let head = self.head.get();
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        // SETTINGS (type 4), not an ACK, on stream 0, whole settings of 6 bytes, no larger
        // than the default frame size.
        let settings = head[3] == 4 && head[4] & 1 == 0 && stream == 0 && len % 6 == 0;
        if !settings || len > 16_384 {
            self.decide(Err(NotH2::Garbled));
        } else if read >= 9 + len {
            self.decide(Ok(()));
        }
    }

    /// What the bytes fed so far say: `None` while the first frame is incomplete.
    pub fn verdict(&self) -> Option<Result<(), NotH2>> {
        self.verdict.get()
    }

    fn decide(&self, verdict: Result<(), NotH2>) {
        if self.verdict.get().is_none() {
            self.verdict.set(Some(verdict));
            self.notify.notify_waiters();
        }
    }

    /// Waits at most `limit` for the server's SETTINGS frame to have been read (the
    /// connection's task handles it in the same poll, before this task runs again).
    pub async fn settled(&self, limit: Duration) -> Result<(), NotH2> {
        let wait = async {
            loop {
                let woken = self.notify.notified();
                if let Some(v) = self.verdict.get() {
                    return v;
                }
                woken.await;
            }
        };
        tokio::time::timeout(limit, wait)
            .await
            .unwrap_or(Err(NotH2::Silent))
    }
}

/// A new server connection, telling `preface` what it reads until the server's first frame
/// is complete.
pub struct Watched<IO> {
    pub io: IO,
    pub preface: Rc<Preface>,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        match &polled {
            Poll::Ready(Ok(())) => match buf.filled().get(before..) {
                Some(new) if !new.is_empty() => this.preface.feed(new),
                _ => this.preface.decide(Err(NotH2::Closed)),
            },
            Poll::Ready(Err(_)) => this.preface.decide(Err(NotH2::Closed)),
            Poll::Pending => {}
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: [u8; 15] = [0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 128];

    #[test]
    fn a_settings_frame_read_in_pieces_settles_the_preface() {
        let p = Preface::default();
        for b in SETTINGS.chunks(2) {
            assert_eq!(p.verdict.get(), None);
            p.feed(b);
        }
        assert_eq!(p.verdict.get(), Some(Ok(())));
    }

    #[test]
    fn an_http11_answer_or_another_frame_is_not_http2() {
        for first in [
            &b"HTTP/1.1 400 Bad Request\r\n"[..],
            &[0, 0, 0, 4, 1, 0, 0, 0, 0][..],    // a SETTINGS ACK
            &[0, 0, 8, 6, 0, 0, 0, 0, 0][..],    // a PING
            &[0, 0, 6, 4, 0, 0, 0, 0, 1][..],    // SETTINGS on a stream
            &[0, 0x40, 2, 4, 0, 0, 0, 0, 0][..], // larger than a frame may be
        ] {
            let p = Preface::default();
            p.feed(first);
            assert_eq!(p.verdict.get(), Some(Err(NotH2::Garbled)), "{first:?}");
        }
    }

    #[test]
    fn the_first_verdict_stays() {
        let p = Preface::default();
        p.feed(&SETTINGS);
        p.decide(Err(NotH2::Closed));
        p.feed(b"HTTP/1.1");
        assert_eq!(p.verdict.get(), Some(Ok(())));
    }
}
