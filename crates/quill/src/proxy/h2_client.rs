//! HTTP/2 to servers (`upstream_h2`), on the h2 crate directly: a request becomes a stream
//! of a shared connection (`proxy::pool_h2` keeps them), its body piped under the server's
//! flow control, its response body handed on as the server sends it.
//!
//! It runs in the request's own task: no dispatch channel, no task and no oneshot per
//! request as hyper's client has (a body still uploading when the answer comes goes on in
//! a task of its own). Invariants: a request is given back untouched when its connection
//! could take no new stream, so that it may go elsewhere; a request body is read from the
//! client only while the server's window has room for it (at most one chunk waits in
//! quill); response data is released to the server's window only as the client's side
//! takes it, so a client that does not read holds at most a stream window here.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use h2::{Reason, RecvStream, SendStream};
use hyper::body::{Body, Frame, SizeHint};
use hyper::header;
use hyper::http::uri::{Authority, PathAndQuery, Scheme};
use hyper::{Request, Response, Uri, Version};

use super::gateway::RequestBody;
use super::pool_h2::{Preface, Watched};
use crate::balance::ServerState;

/// The HTTP/2 receive window of a stream to a server.
const STREAM_WINDOW: u32 = 256 * 1024;

/// The receive window of a whole connection: how many clients that do not read it takes to
/// stall the others sharing the connection (32).
const CONNECTION_WINDOW: u32 = 32 * STREAM_WINDOW;

/// A response head larger than this ends its stream (as hyper's client bounded it).
const MAX_HEADER_LIST: u32 = 16 * 1024;

/// Streams opened before the server's SETTINGS say how many it takes (RFC 9113 §6.5.2's
/// recommended least).
const INITIAL_STREAMS: usize = 100;

/// How long the head of a refusal that came while the client was still uploading (an early
/// 413) waits for the start of its body before it goes on without it ([`Answer::ready`]).
const EARLY_REFUSAL_BODY_WAIT: Duration = Duration::from_millis(50);

/// A new connection, ready for requests.
pub struct Connected {
    pub sender: SendRequest<Bytes>,
    /// Reads the server's current `SETTINGS_MAX_CONCURRENT_STREAMS`.
    pub max_streams: Box<dyn Fn() -> usize>,
    /// Set once the connection has ended.
    pub closed: Rc<Cell<bool>>,
}

/// Starts HTTP/2 over `io`, ready once the server's SETTINGS have come (within `limit`);
/// the connection is driven by a task of its own on this event loop, counted in the
/// server's `pool_open` while it runs. It ends once the last handle to it
/// ([`Connected::sender`] and its clones) and its last stream have gone.
pub async fn connect<T>(
    io: T,
    server: &'static ServerState,
    limit: Duration,
) -> std::io::Result<Connected>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let preface = Rc::new(Preface::default());
    let io = Watched {
        io,
        preface: Rc::clone(&preface),
    };
    let (sender, conn) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .initial_max_send_streams(INITIAL_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST)
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await
        .map_err(std::io::Error::other)?;
    // The pool reads the stream limit between the task's polls (never during one: one
    // thread), and keeps the last value seen once the connection has gone.
    let conn = Rc::new(RefCell::new(Some(Box::pin(conn))));
    let seen = Rc::new(Cell::new(usize::MAX));
    let max_streams = {
        let conn = Rc::clone(&conn);
        let seen = Rc::clone(&seen);
        Box::new(move || {
            if let Ok(Some(c)) = conn.try_borrow().as_deref() {
                seen.set(c.max_concurrent_send_streams());
            }
            seen.get()
        })
    };
    let closed = Rc::new(Cell::new(false));
    let task = {
        let closed = Rc::clone(&closed);
        std::future::poll_fn(move |cx| {
            let Ok(mut slot) = conn.try_borrow_mut() else {
                // Never borrowed across a poll; should it be, look again rather than stall.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            };
            let Some(c) = slot.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            let polled = c.as_mut().poll(cx);
            if polled.is_ready() {
                *slot = None;
                closed.set(true);
            }
            polled
        })
    };
    super::gateway::drive(task, server);
    // Dropping the sender on failure ends the connection.
    preface
        .settled(limit)
        .await
        .map_err(std::io::Error::other)?;
    Ok(Connected {
        sender,
        max_streams,
        closed,
    })
}

/// How a request failed on an HTTP/2 connection.
pub enum Failure {
    /// The connection could take no new stream (it ended, or the server sent GOAWAY:
    /// `going_away`): nothing was sent, here is the request back.
    Unsent {
        req: Box<Request<RequestBody>>,
        error: std::io::Error,
        going_away: bool,
    },
    /// The server refused the stream before processing it (RFC 9113 §8.7):
    /// `REFUSED_STREAM`, or a GOAWAY whose last stream came before it.
    Refused(std::io::Error),
    /// The stream failed after the request (or part of it) went out: `ours` when quill
    /// reset it (the client's body failed, or the request could not be framed).
    Broken { error: std::io::Error, ours: bool },
}

/// Sends `req` (as [`gateway`](super::gateway) builds it for an HTTP/1.1 server) as a
/// stream over `sender`, and returns the server's response head once it has come.
pub async fn send(
    sender: &mut SendRequest<Bytes>,
    req: Request<RequestBody>,
    tls: bool,
    addr: SocketAddr,
) -> Result<Response<Answer>, Failure> {
    if let Err(e) = std::future::poll_fn(|cx| sender.poll_ready(cx)).await {
        return Err(Failure::Unsent {
            req: Box::new(req),
            going_away: e.is_go_away() && e.is_remote(),
            error: std::io::Error::other(e),
        });
    }
    let (head, body) = h2_request(req, tls, addr);
    let end = body.is_end_stream();
    // Between the readiness above and here the connection's task cannot run (one thread,
    // no await): an error now is the request's own (a field HTTP/2 cannot carry).
    let (mut response, tx) = sender
        .send_request(head, end)
        .map_err(|e| Failure::Broken {
            error: std::io::Error::other(e),
            ours: true,
        })?;
    let mut pipe = (!end).then(|| Pipe {
        body,
        tx,
        waiting: None,
    });
    // The body goes in the same task as the answer is awaited: most requests have none,
    // and a small one is gone before the answer comes.
    let answered = std::future::poll_fn(|cx| {
        if let Some(p) = pipe.as_mut() {
            if Pin::new(p).poll(cx).is_ready() {
                pipe = None;
            }
        }
        Pin::new(&mut response).poll(cx)
    })
    .await;
    let early = pipe.is_some();
    if let Some(rest) = pipe {
        // The server answered before the body's end (an early 413, or a stream it answers
        // as it reads): the body goes on beside the answer, as long as the server takes it.
        tokio::task::spawn_local(rest);
    }
    let mut resp = match answered {
        Ok(resp) => resp.map(|recv| Answer {
            recv,
            first: None,
            data_done: false,
        }),
        Err(e) => return Err(failure(e)),
    };
    if early && resp.status().as_u16() >= 300 {
        resp.body_mut().ready(EARLY_REFUSAL_BODY_WAIT).await;
    }
    Ok(resp)
}

/// Sorts a stream's error: refused before processing, reset by quill, or broken.
fn failure(e: h2::Error) -> Failure {
    let refused = e.reason() == Some(Reason::REFUSED_STREAM) || (e.is_go_away() && e.is_remote());
    let ours = e.is_reset() && !e.is_remote();
    let error = std::io::Error::other(e);
    if refused {
        Failure::Refused(error)
    } else {
        Failure::Broken { error, ours }
    }
}

/// The request head as an HTTP/2 server gets it: `Host` becomes `:authority`, with the
/// scheme quill speaks to the server. Without a `Host` that is a valid authority (a
/// client's mistake, which must not look like the server's), the server's address stands
/// in. Hop-by-hop fields are gone already (`gateway::upstream_request`), and tunnels never
/// come here.
fn h2_request(
    req: Request<RequestBody>,
    tls: bool,
    addr: SocketAddr,
) -> (Request<()>, RequestBody) {
    let (mut parts, body) = req.into_parts();
    let authority = parts
        .headers
        .remove(header::HOST)
        .and_then(|h| Authority::try_from(h.as_bytes()).ok())
        .or_else(|| Authority::try_from(addr.to_string()).ok());
    let mut uri = hyper::http::uri::Parts::default();
    uri.scheme = Some(if tls { Scheme::HTTPS } else { Scheme::HTTP });
    uri.authority = authority;
    uri.path_and_query = Some(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    if let Ok(u) = Uri::from_parts(uri) {
        parts.uri = u;
    }
    parts.version = Version::HTTP_2;
    (Request::from_parts(parts, ()), body)
}

/// A request body on its way into a stream, read from the client only when the stream's
/// window has room for it.
struct Pipe {
    body: RequestBody,
    tx: SendStream<Bytes>,
    /// A chunk read, waiting for the window to open (with whether it ends the body).
    waiting: Option<(Bytes, bool)>,
}

impl Future for Pipe {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        loop {
            // A reset from the server (it answered and wants no more, or gave up) ends
            // the body; waking on it while the client's bytes are awaited.
            if let Poll::Ready(reason) = this.tx.poll_reset(cx) {
                tracing::debug!("server ended a request body's stream: {reason:?}");
                return Poll::Ready(());
            }
            if let Some((chunk, end)) = this.waiting.take() {
                while this.tx.capacity() == 0 {
                    match this.tx.poll_capacity(cx) {
                        Poll::Ready(Some(Ok(_))) => {}
                        // The stream ended (reset) or the connection failed.
                        Poll::Ready(None | Some(Err(_))) => return Poll::Ready(()),
                        Poll::Pending => {
                            this.waiting = Some((chunk, end));
                            return Poll::Pending;
                        }
                    }
                }
                // Beyond the window the h2 crate holds the rest of this one chunk.
                if this.tx.send_data(chunk, end).is_err() || end {
                    return Poll::Ready(());
                }
                continue;
            }
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(chunk) => {
                        let end = this.body.is_end_stream();
                        if chunk.is_empty() {
                            if end {
                                let _ = this.tx.send_data(chunk, true);
                                return Poll::Ready(());
                            }
                            continue;
                        }
                        // Claim a byte only with a chunk in hand: a claim for a body that
                        // sends nothing would hold back the connection's other streams.
                        this.tx.reserve_capacity(1);
                        this.waiting = Some((chunk, end));
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            this.tx.reserve_capacity(0);
                            let _ = this.tx.send_trailers(trailers);
                            return Poll::Ready(());
                        }
                    }
                },
                Poll::Ready(None) => {
                    let _ = this.tx.send_data(Bytes::new(), true);
                    return Poll::Ready(());
                }
                Poll::Ready(Some(Err(e))) => {
                    // The client's body failed: the server must not take a part for the
                    // whole.
                    tracing::debug!("a request body failed on its way to a server: {e}");
                    this.tx.send_reset(Reason::CANCEL);
                    return Poll::Ready(());
                }
            }
        }
    }
}

/// A server's response body on a stream: data, then trailers if any.
pub struct Answer {
    recv: RecvStream,
    /// Data read before the head was handed on ([`Answer::ready`]).
    first: Option<Bytes>,
    data_done: bool,
}

impl Answer {
    /// Reads the body's first data (or its end) before the head goes to the client, for
    /// at most `wait`. For a refusal given while the client still uploads: curl 7.88 then
    /// ends its request stream short of its `Content-Length`, which the h2 crate answers
    /// with a reset (PROTOCOL_ERROR, RFC 9113 §8.1.1) that drops whatever of the answer it
    /// has not written yet. A head and body handed on together leave in one write, before
    /// the client has seen the head and cut its upload short.
    async fn ready(&mut self, wait: Duration) {
        let first = std::future::poll_fn(|cx| self.recv.poll_data(cx));
        match tokio::time::timeout(wait, first).await {
            Ok(Some(Ok(data))) => {
                let _ = self.recv.flow_control().release_capacity(data.len());
                self.first = Some(data);
            }
            Ok(None) => self.data_done = true,
            // An error comes again at the next read; a slow body goes on without waiting.
            Ok(Some(Err(_))) | Err(_) => {}
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if let Some(data) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if !self.data_done {
            match self.recv.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(data))) => {
                    // Taken on by the client's side: the server may send as much again.
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => self.data_done = true,
            }
        }
        match self.recv.poll_trailers(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(Some(t))) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.is_end_stream() {
            SizeHint::with_exact(0)
        } else {
            SizeHint::default()
        }
    }
}
