//! The writes of one turn of an HTTP/2 connection, sent together. h2 flushes its socket
//! after every DATA frame it chains (any body of 256 bytes or more), so ten responses that
//! are ready in one turn of the event loop would leave as ten TLS records, ten system calls
//! and ten TCP segments. [`gather`] splits a socket in two: the [`Gathered`] end that hyper
//! writes to collects what it is given (up to [`LIMIT`]), and [`Flushing`], around the
//! connection's future, writes it out after each poll of the connection.
//!
//! Invariant: when [`Flushing`] returns `Pending`, nothing is left gathered or unflushed
//! (a TLS stream keeps what the socket refused until it is flushed) unless the socket
//! refused it, and then the socket's write readiness wakes the task: no byte waits for an
//! event that is not coming. An idle connection holds no buffer (it is freed each
//! time it empties).

use std::cell::RefCell;
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::gateway::{Activity, Graceful};

/// The most bytes gathered before they are written: one TLS record's worth. A write at
/// least this big is not copied: what was gathered goes first, then the write itself.
pub const LIMIT: usize = 16 * 1024;

/// The socket and the bytes gathered for it, shared by both ends.
struct Shared<IO> {
    io: IO,
    /// Gathered bytes; `buf[sent..]` are still to be written.
    buf: Vec<u8>,
    sent: usize,
    /// Bytes went to `io` since its last flush: a TLS stream may hold some of them
    /// (encrypted, the socket being full) until it is flushed.
    unflushed: bool,
    /// A failed write of gathered bytes, told to the connection at its next write.
    failed: Option<io::ErrorKind>,
}

impl<IO: AsyncWrite + Unpin> Shared<IO> {
    fn pending(&self) -> usize {
        self.buf.len() - self.sent
    }

    /// Writes out what was gathered and flushes `io`; `Pending` (with the waker
    /// registered by the socket) while the socket takes no more.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(kind) = self.failed {
            return Poll::Ready(Err(kind.into()));
        }
        while self.sent < self.buf.len() {
            match ready!(Pin::new(&mut self.io).poll_write(cx, &self.buf[self.sent..])) {
                Ok(0) => return Poll::Ready(Err(self.fail(io::ErrorKind::WriteZero))),
                Ok(n) => {
                    self.sent += n;
                    self.unflushed = true;
                }
                Err(e) => return Poll::Ready(Err(self.fail(e.kind()))),
            }
        }
        self.buf = Vec::new();
        self.sent = 0;
        if self.unflushed {
            if let Err(e) = ready!(Pin::new(&mut self.io).poll_flush(cx)) {
                return Poll::Ready(Err(self.fail(e.kind())));
            }
            self.unflushed = false;
        }
        Poll::Ready(Ok(()))
    }

    /// A write too big to gather, straight to `io`.
    fn poll_write_through(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, bufs))?;
        self.unflushed = true;
        Poll::Ready(Ok(n))
    }

    fn fail(&mut self, kind: io::ErrorKind) -> io::Error {
        self.failed = Some(kind);
        self.buf = Vec::new();
        self.sent = 0;
        kind.into()
    }

    /// Makes room for `len` more bytes: `Ready(true)` when they are to be gathered,
    /// `Ready(false)` when they are too many and go to the socket themselves (after
    /// everything gathered before them).
    fn poll_room(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<io::Result<bool>> {
        if self.pending() + len > LIMIT {
            ready!(self.poll_drain(cx))?;
        } else if let Some(kind) = self.failed {
            return Poll::Ready(Err(kind.into()));
        }
        if len >= LIMIT {
            return Poll::Ready(Ok(false));
        }
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(LIMIT);
        }
        Poll::Ready(Ok(true))
    }
}

/// Splits `io` into the end a connection reads and writes, and the [`Drain`] that writes
/// out what it gathered.
pub fn gather<IO>(io: IO) -> (Gathered<IO>, Drain<IO>) {
    let shared = Rc::new(RefCell::new(Shared {
        io,
        buf: Vec::new(),
        sent: 0,
        unflushed: false,
        failed: None,
    }));
    (Gathered(Rc::clone(&shared)), Drain(shared))
}

/// The end of the socket given to the connection: reads go straight through, writes are
/// gathered, and a flush waits for the [`Drain`] (a shutdown writes everything first).
pub struct Gathered<IO>(Rc<RefCell<Shared<IO>>>);

/// Writes out what a [`Gathered`] collected; used by [`Flushing`].
pub struct Drain<IO>(Rc<RefCell<Shared<IO>>>);

impl<IO: AsyncRead + Unpin> AsyncRead for Gathered<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0.borrow_mut().io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Gathered<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len = bufs.iter().map(|b| b.len()).sum();
        let mut shared = self.0.borrow_mut();
        if ready!(shared.poll_room(cx, len))? {
            for b in bufs {
                shared.buf.extend_from_slice(b);
            }
            Poll::Ready(Ok(len))
        } else {
            shared.poll_write_through(cx, bufs)
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// h2 flushes after every chained frame; the bytes go when [`Flushing`] drains them,
    /// once the connection's turn is over.
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.0.borrow().failed {
            Some(kind) => Poll::Ready(Err(kind.into())),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut shared = self.0.borrow_mut();
        ready!(shared.poll_drain(cx))?;
        Pin::new(&mut shared.io).poll_shutdown(cx)
    }
}

/// A connection's future that writes out what its socket gathered after each poll.
pub struct Flushing<C: Future, IO> {
    conn: Pin<Box<C>>,
    drain: Drain<IO>,
    /// The connection's result, kept while its last bytes are still being written.
    done: Option<C::Output>,
}

impl<C: Future, IO> Flushing<C, IO> {
    pub fn new(conn: C, drain: Drain<IO>) -> Self {
        Flushing {
            conn: Box::pin(conn),
            drain,
            done: None,
        }
    }
}

impl<C: Future, IO: AsyncWrite + Unpin> Future for Flushing<C, IO>
where
    C::Output: Unpin,
{
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        if this.done.is_none() {
            if let Poll::Ready(out) = this.conn.as_mut().poll(cx) {
                this.done = Some(out);
            }
        }
        let drained = {
            let mut shared = this.drain.0.borrow_mut();
            if shared.failed.is_some() {
                Poll::Ready(Ok(()))
            } else {
                shared.poll_drain(cx)
            }
        };
        match (this.done.take(), drained) {
            // A failed write ends nothing here: the connection meets the error at its next
            // write or flush, or reads the socket's end; woken once, it looks now.
            (None, Poll::Ready(Err(_))) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            (None, _) => Poll::Pending,
            (Some(out), Poll::Pending) => {
                this.done = Some(out);
                Poll::Pending
            }
            (Some(out), Poll::Ready(_)) => Poll::Ready(out),
        }
    }
}

impl<C: Graceful, IO: AsyncWrite + Unpin> Graceful for Flushing<C, IO>
where
    C::Output: Unpin,
{
    fn shut(mut self: Pin<&mut Self>) {
        self.conn.as_mut().shut();
    }

    fn recycle(mut self: Pin<&mut Self>, activity: &Activity) -> bool {
        self.conn.as_mut().recycle(activity)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::future::poll_fn;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use super::*;

    /// What a socket was given, and how much more it takes.
    struct Wire {
        writes: Vec<Vec<u8>>,
        room: usize,
        broken: bool,
        shut: bool,
        /// Like a TLS stream over a full socket: writes are taken but held until a flush.
        holds: bool,
        held: Vec<u8>,
        flushes: usize,
    }

    #[derive(Clone)]
    struct Socket(Rc<RefCell<Wire>>);

    fn socket(room: usize) -> Socket {
        Socket(Rc::new(RefCell::new(Wire {
            writes: Vec::new(),
            room,
            broken: false,
            shut: false,
            holds: false,
            held: Vec::new(),
            flushes: 0,
        })))
    }

    impl Socket {
        fn writes(&self) -> Vec<usize> {
            self.0.borrow().writes.iter().map(Vec::len).collect()
        }

        fn bytes(&self) -> Vec<u8> {
            self.0.borrow().writes.concat()
        }
    }

    impl AsyncRead for Socket {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let mut wire = self.0.borrow_mut();
            if wire.broken {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            }
            if wire.holds {
                wire.held.extend_from_slice(buf);
                return Poll::Ready(Ok(buf.len()));
            }
            let n = buf.len().min(wire.room);
            if n == 0 {
                return Poll::Pending;
            }
            wire.room -= n;
            wire.writes.push(buf[..n].to_vec());
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            let mut wire = self.0.borrow_mut();
            wire.flushes += 1;
            if !wire.held.is_empty() {
                let held = std::mem::take(&mut wire.held);
                wire.writes.push(held);
            }
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.0.borrow_mut().shut = true;
            Poll::Ready(Ok(()))
        }
    }

    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Polls `fut` once with a waker that counts its wake-ups.
    fn poll_once<F: Future + Unpin>(fut: &mut F, wakes: &Arc<Wakes>) -> Poll<F::Output> {
        let waker = Waker::from(Arc::clone(wakes));
        Pin::new(fut).poll(&mut Context::from_waker(&waker))
    }

    /// A frame of `len` bytes, each its index in the turn (to check the order).
    fn frame(i: u8, len: usize) -> Vec<u8> {
        vec![i; len]
    }

    /// Writes `frames` as h2 does (a head and a payload in one vectored write, then a
    /// flush), then waits or ends.
    fn write_frames(io: &mut Gathered<Socket>, cx: &mut Context<'_>, frames: &[Vec<u8>]) {
        for f in frames {
            let (head, payload) = f.split_at(9.min(f.len()));
            let bufs = [IoSlice::new(head), IoSlice::new(payload)];
            assert_eq!(
                Pin::new(&mut *io)
                    .poll_write_vectored(cx, &bufs)
                    .map_err(|e| e.kind()),
                Poll::Ready(Ok(f.len()))
            );
            assert!(Pin::new(&mut *io).poll_flush(cx).is_ready());
        }
    }

    #[test]
    fn the_responses_of_one_turn_leave_in_one_write() {
        let wire = socket(usize::MAX);
        let (mut io, drain) = gather(wire.clone());
        let frames: Vec<_> = (0..10).map(|i| frame(i, 1055)).collect();
        let mut turns = 0;
        let mut conn = Flushing::new(
            poll_fn(move |cx| {
                turns += 1;
                if turns == 1 {
                    write_frames(&mut io, cx, &frames);
                }
                Poll::<()>::Pending
            }),
            drain,
        );
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        assert_eq!(wire.writes(), [10 * 1055]);
        let expected: Vec<u8> = (0..10).flat_map(|i| frame(i, 1055)).collect();
        assert_eq!(wire.bytes(), expected);
        // Nothing left gathered: a poll with nothing written writes nothing.
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        assert_eq!(wire.writes(), [10 * 1055]);
    }

    #[test]
    fn what_the_socket_cannot_take_yet_waits_and_leaves_in_order() {
        let wire = socket(4000);
        let (mut io, drain) = gather(wire.clone());
        let frames: Vec<_> = (0..5).map(|i| frame(i, 1500)).collect();
        let mut first = true;
        let mut conn = Flushing::new(
            poll_fn(move |cx| {
                if std::mem::take(&mut first) {
                    write_frames(&mut io, cx, &frames);
                }
                Poll::<()>::Pending
            }),
            drain,
        );
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        assert_eq!(wire.writes(), [4000]);
        wire.0.borrow_mut().room = usize::MAX;
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        assert_eq!(wire.writes(), [4000, 3500]);
        let expected: Vec<u8> = (0..5).flat_map(|i| frame(i, 1500)).collect();
        assert_eq!(wire.bytes(), expected);
    }

    #[test]
    fn a_write_of_a_record_or_more_is_not_copied_and_follows_what_was_gathered() {
        let wire = socket(usize::MAX);
        let (mut io, _drain) = gather(wire.clone());
        let waker = Waker::from(Arc::new(Wakes::default()));
        let cx = &mut Context::from_waker(&waker);
        let small = frame(1, 100);
        let big = frame(2, LIMIT + 9);
        assert!(Pin::new(&mut io).poll_write(cx, &small).is_ready());
        assert!(wire.writes().is_empty());
        assert!(Pin::new(&mut io).poll_write(cx, &big).is_ready());
        assert_eq!(wire.writes(), [100, LIMIT + 9]);
        // Gathering stops short of LIMIT: a turn's bytes never make more than one record.
        let many: Vec<_> = (0..20).map(|i| frame(i, 1000)).collect();
        for f in &many {
            assert!(Pin::new(&mut io).poll_write(cx, f).is_ready());
        }
        assert_eq!(wire.writes(), [100, LIMIT + 9, 16_000]);
    }

    #[test]
    fn what_a_tls_stream_took_but_held_is_flushed_before_the_task_sleeps() {
        let wire = socket(usize::MAX);
        wire.0.borrow_mut().holds = true;
        let (mut io, drain) = gather(wire.clone());
        let mut first = true;
        let mut conn = Flushing::new(
            poll_fn(move |cx| {
                if std::mem::take(&mut first) {
                    write_frames(&mut io, cx, &[frame(7, 1055)]);
                }
                Poll::<()>::Pending
            }),
            drain,
        );
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        assert_eq!(wire.writes(), [1055]);
        assert_eq!(wire.0.borrow().flushes, 1);
        // A turn that wrote nothing flushes nothing.
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        assert_eq!(wire.0.borrow().flushes, 1);
    }

    #[test]
    fn a_shutdown_writes_everything_first() {
        let wire = socket(usize::MAX);
        let (mut io, _drain) = gather(wire.clone());
        let waker = Waker::from(Arc::new(Wakes::default()));
        let cx = &mut Context::from_waker(&waker);
        assert!(Pin::new(&mut io).poll_write(cx, b"GOAWAY").is_ready());
        assert!(Pin::new(&mut io).poll_shutdown(cx).is_ready());
        assert_eq!(wire.bytes(), b"GOAWAY");
        assert!(wire.0.borrow().shut);
    }

    #[test]
    fn the_connection_ends_only_once_its_last_bytes_are_written() {
        let wire = socket(0);
        let (mut io, drain) = gather(wire.clone());
        let mut conn = Flushing::new(
            poll_fn(move |cx| {
                assert!(Pin::new(&mut io).poll_write(cx, b"last words").is_ready());
                Poll::Ready("ended")
            }),
            drain,
        );
        assert!(poll_once(&mut conn, &Arc::default()).is_pending());
        wire.0.borrow_mut().room = usize::MAX;
        assert_eq!(poll_once(&mut conn, &Arc::default()), Poll::Ready("ended"));
        assert_eq!(wire.bytes(), b"last words");
    }

    #[test]
    fn a_failed_write_wakes_the_connection_once_and_fails_its_next_write() {
        let wire = socket(usize::MAX);
        wire.0.borrow_mut().broken = true;
        let (io, drain) = gather(wire.clone());
        let io = Rc::new(RefCell::new(io));
        let writer = Rc::clone(&io);
        let mut first = true;
        let mut conn = Flushing::new(
            poll_fn(move |cx| {
                if std::mem::take(&mut first) {
                    assert!(Pin::new(&mut *writer.borrow_mut())
                        .poll_write(cx, b"lost")
                        .is_ready());
                }
                Poll::<()>::Pending
            }),
            drain,
        );
        let wakes = Arc::new(Wakes::default());
        assert!(poll_once(&mut conn, &wakes).is_pending());
        assert_eq!(wakes.0.load(Ordering::Relaxed), 1);
        assert!(poll_once(&mut conn, &wakes).is_pending());
        assert_eq!(
            wakes.0.load(Ordering::Relaxed),
            1,
            "woken once, not in a loop"
        );
        let waker = Waker::from(Arc::clone(&wakes));
        let cx = &mut Context::from_waker(&waker);
        let next = Pin::new(&mut *io.borrow_mut())
            .poll_write(cx, b"more")
            .map_err(|e| e.kind());
        assert_eq!(next, Poll::Ready(Err(io::ErrorKind::BrokenPipe)));
        let flush = Pin::new(&mut *io.borrow_mut())
            .poll_flush(cx)
            .map_err(|e| e.kind());
        assert_eq!(flush, Poll::Ready(Err(io::ErrorKind::BrokenPipe)));
    }
}
