//! HTTP/1.1 to servers for HTTP/2 clients' streams, without an HTTP library: the request's
//! head is written from its `http` parts, the answer's head parsed with httparse, and its
//! body framed (Content-Length, chunked with trailers, or to the close) into the frames
//! hyper's HTTP/2 server sends on. It goes over the byte pump's pooled server streams
//! (`h1_pump::Link`), from the stream's own task: no task, channel or second header map
//! per server connection as with hyper's client, and HTTP/1.x and HTTP/2 clients share
//! one pool of kept-alive connections.
//!
//! Invariants: a link carries one request at a time; it goes back to the pool only when
//! all of the request was sent, the answer was read exactly to its end (no byte beyond)
//! and neither side said the connection ends — at the latest with the answer's last bytes,
//! since hyper may drop a body it knows has ended without polling it again; a failure
//! before the first byte of an answer is told apart (`Failure::Unanswered`: the caller
//! may send a bodiless idempotent request again over a new connection).

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Version};
use tokio::io::AsyncWrite;

use super::gateway::RequestBody;
use super::h1_pump::Link;
use super::http::{BadAnswer, ConnectionOptions, Lengths};
use super::pool::{self, Limits, Target};
use super::quickack::Acknowledge as _;
use crate::balance::ServerState;
use crate::state::State;

/// The most fields an answer's head (or its trailers) may have.
const MAX_FIELDS: usize = 100;
/// The longest answer head (or trailer section, or chunk-size line) quill reads.
const MAX_HEAD: usize = 64 * 1024;
/// What a read asks the socket for at least.
const READ_SIZE: usize = 16 * 1024;

/// A request ready to be written: its head's bytes, and its body.
pub(super) struct Outgoing {
    /// Shared, not copied, with each attempt to send it.
    head: Bytes,
    /// `None` when the request has no body (or it was sent).
    body: Option<RequestBody>,
    /// The body goes chunked (no `Content-Length` was given).
    chunked: bool,
    /// `HEAD`: the answer has no body whatever its head says.
    head_only: bool,
    /// Without a body and with an idempotent method: it may be sent twice.
    replayable: bool,
}

impl Outgoing {
    /// The request as a server gets it over HTTP/1.1 (its head was rewritten by the
    /// gateway: origin-form target, `Host`, forwarded fields, no hop-by-hop field).
    pub(super) fn new(req: Request<RequestBody>) -> Outgoing {
        let (parts, body) = req.into_parts();
        let bodiless = body.is_end_stream() || body.size_hint().exact() == Some(0);
        let has_length = parts.headers.contains_key(header::CONTENT_LENGTH);
        let chunked = !bodiless && !has_length;
        let mut head = Vec::with_capacity(256 + 48 * parts.headers.len());
        head.extend_from_slice(parts.method.as_str().as_bytes());
        head.push(b' ');
        // Origin form: `CONNECT` and upgrades never take this path.
        let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        head.extend_from_slice(target.as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\n");
        for (name, value) in &parts.headers {
            title_case(&mut head, name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        if chunked {
            head.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
        } else if bodiless
            && !has_length
            && matches!(parts.method, Method::POST | Method::PUT | Method::PATCH)
        {
            // A method whose request has content says it has none (RFC 9110 8.6).
            head.extend_from_slice(b"Content-Length: 0\r\n");
        }
        head.extend_from_slice(b"\r\n");
        let replayable = bodiless && idempotent(&parts.method);
        Outgoing {
            head: head.into(),
            body: (!bodiless).then_some(body),
            chunked,
            head_only: parts.method == Method::HEAD,
            replayable,
        }
    }

    /// It may be sent again over another connection (nothing of it is lost by sending).
    pub(super) fn replayable(&self) -> bool {
        self.replayable
    }
}

/// A method whose request has the same effect sent twice as once (RFC 9110 9.2.2): the
/// only ones quill sends again when it cannot know whether the server saw them.
pub(super) fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Writes a field name as HTTP/1.1 servers are used to seeing it (`x-forwarded-for` →
/// `X-Forwarded-For`): HTTP/2's names are lowercase, and the byte pump writes quill's own
/// fields in title case too.
fn title_case(out: &mut Vec<u8>, name: &[u8]) {
    let start = out.len();
    out.extend_from_slice(name);
    // In place: a push per byte checked the capacity at every byte.
    let mut upper = true;
    for b in &mut out[start..] {
        let was_dash = *b == b'-';
        if upper {
            b.make_ascii_uppercase();
        }
        upper = was_dash;
    }
}

/// How an exchange with a server failed.
#[derive(Debug)]
pub(super) enum Failure {
    /// Not a byte of an answer came (the connection failed or closed before).
    Unanswered(io::Error),
    /// The answer was broken off or malformed.
    Broken(io::Error),
    /// The client's request body failed (its stream was reset): not the server's doing.
    Client(io::Error),
}

/// Where a link goes when its answer has ended: back to this loop's pool, under the
/// limits of the request that used it.
pub(super) struct Back {
    pub state: &'static State,
    pub target: Target,
    pub server: &'static ServerState,
    pub limits: Limits,
}

/// Sends `out` over `link` and reads the answer's head (interim `1xx` answers skipped);
/// the answer's body reads on from the link, which it gives back at its end.
pub(super) async fn exchange(
    mut link: Link,
    out: &mut Outgoing,
    back: Back,
) -> Result<Response<Answer>, Failure> {
    let mut write = Writing {
        // A reference to the head (the request may be sent again), not a copy of it.
        pending: out.head.clone(),
        body: out.body.take(),
        chunked: out.chunked,
        flushed: false,
        failed: None,
    };
    let mut buf = BytesMut::with_capacity(READ_SIZE);
    let head = poll_fn(|cx| {
        // Written as far as the socket and the client's body allow, then read: a server
        // may answer (and close) before it has read the whole request, and that answer
        // is the client's even when the rest of the request could not be written.
        let sent = match write.poll(cx, &mut link) {
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(Failure::Client(e))) => return Poll::Ready(Err(Failure::Client(e))),
            Poll::Ready(Err(_)) | Poll::Pending => false,
        };
        loop {
            match parse_head(&mut buf, out.head_only)? {
                Parsed::Final(head) => return Poll::Ready(Ok((head, sent))),
                Parsed::Interim => continue,
                Parsed::Partial if buf.len() >= MAX_HEAD => {
                    return Poll::Ready(Err(Failure::Broken(invalid("answer head too long"))))
                }
                Parsed::Partial => {}
            }
            // Nothing came: the write's failure, if any, is the reason.
            let mut unanswered =
                |e: io::Error| Failure::Unanswered(write.failed.take().unwrap_or(e));
            match read(cx, &mut link, &mut buf) {
                Poll::Ready(Ok(0)) if buf.is_empty() => {
                    return Poll::Ready(Err(unanswered(io::ErrorKind::UnexpectedEof.into())))
                }
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(Failure::Broken(invalid("answer head cut short"))))
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) if buf.is_empty() => return Poll::Ready(Err(unanswered(e))),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(Failure::Broken(e))),
                // A write that failed with nothing to read yet: the server is gone, or
                // about to answer; its answer (or end) will wake this.
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await;
    let (head, sent) = head?;
    let Head {
        parts,
        framing,
        keeps,
    } = head;
    if framing.awaits_more(&buf) {
        // The rest of the answer is to follow: a server with Nagle's algorithm on holds
        // it until what came is acknowledged.
        link.stream().acknowledge();
    }
    let mut answer = Answer {
        link: Some(link),
        buf,
        decoder: Decoder { framing },
        back: (keeps && sent).then_some(back),
    };
    if framing == Framing::Length(0) {
        answer.decoder.framing = Framing::Done;
        answer.give_back();
    }
    Ok(Response::from_parts(parts, answer))
}

/// What is left to write of a request.
struct Writing {
    /// Bytes taken from the body (or the head), not yet written.
    pending: Bytes,
    body: Option<RequestBody>,
    chunked: bool,
    flushed: bool,
    /// Writing failed: the server may have answered and closed.
    failed: Option<io::Error>,
}

impl Writing {
    /// Ready once all of the request is written and flushed; a failure to write is kept
    /// in `failed` (and stops the writing) rather than returned, since an answer may
    /// still be read; the client's body failing is returned.
    fn poll(&mut self, cx: &mut Context<'_>, link: &mut Link) -> Poll<Result<(), Failure>> {
        if self.failed.is_some() {
            return Poll::Ready(Err(Failure::Broken(invalid("request not sent"))));
        }
        match self.poll_write(cx, link) {
            Poll::Ready(Err(Failure::Client(e))) => Poll::Ready(Err(Failure::Client(e))),
            Poll::Ready(Err(Failure::Unanswered(e) | Failure::Broken(e))) => {
                self.failed = Some(e);
                Poll::Ready(Err(Failure::Broken(invalid("request not sent"))))
            }
            polled => polled,
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, link: &mut Link) -> Poll<Result<(), Failure>> {
        let unanswered = Failure::Unanswered;
        loop {
            if !self.pending.is_empty() {
                let n = ready!(Pin::new(link.stream()).poll_write(cx, &self.pending))
                    .map_err(unanswered)?;
                if n == 0 {
                    return Poll::Ready(Err(unanswered(io::ErrorKind::WriteZero.into())));
                }
                self.pending.advance(n);
                continue;
            }
            let Some(body) = self.body.as_mut() else {
                if !self.flushed {
                    ready!(Pin::new(link.stream()).poll_flush(cx)).map_err(unanswered)?;
                    self.flushed = true;
                }
                return Poll::Ready(Ok(()));
            };
            match ready!(Pin::new(body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) if self.chunked => {
                        use std::io::Write as _;
                        let mut framed = Vec::with_capacity(data.len() + 20);
                        // Writing into a Vec cannot fail.
                        let _ = write!(framed, "{:X}\r\n", data.len());
                        framed.extend_from_slice(&data);
                        framed.extend_from_slice(b"\r\n");
                        self.pending = framed.into();
                    }
                    Ok(data) => self.pending = data,
                    Err(frame) => {
                        if let (Ok(trailers), true) = (frame.into_trailers(), self.chunked) {
                            self.pending = last_chunk(Some(&trailers));
                            self.chunked = false;
                        }
                    }
                },
                None => {
                    if self.chunked {
                        self.pending = last_chunk(None);
                        self.chunked = false;
                    }
                    self.body = None;
                }
                Some(Err(e)) => return Poll::Ready(Err(Failure::Client(io::Error::other(e)))),
            }
        }
    }
}

/// The end of a chunked body, with its trailer fields.
fn last_chunk(trailers: Option<&HeaderMap>) -> Bytes {
    let mut out = b"0\r\n".to_vec();
    for (name, value) in trailers.into_iter().flatten() {
        title_case(&mut out, name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.into()
}

fn read(cx: &mut Context<'_>, link: &mut Link, buf: &mut BytesMut) -> Poll<io::Result<usize>> {
    if buf.capacity() - buf.len() < READ_SIZE / 4 {
        buf.reserve(READ_SIZE);
    }
    tokio_util::io::poll_read_buf(Pin::new(link.stream()), cx, buf)
}

fn invalid(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// An answer's head, and how its body is framed.
struct Head {
    parts: hyper::http::response::Parts,
    framing: Framing,
    /// The server keeps the connection after this answer.
    keeps: bool,
}

/// How an answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// After this many more bytes.
    Length(u64),
    Chunked(Chunk),
    /// When the server closes the connection.
    Close,
    /// It has ended.
    Done,
}

impl Framing {
    /// Whether a body so framed needs more than `buf` (what came with its head). A
    /// chunked body is taken as whole when `buf` ends as a body without trailers does.
    fn awaits_more(self, buf: &[u8]) -> bool {
        match self {
            Framing::Length(n) => (buf.len() as u64) < n,
            Framing::Chunked(_) => !buf.ends_with(b"0\r\n\r\n"),
            Framing::Close => true,
            Framing::Done => false,
        }
    }
}

/// Where a chunked body's reader stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Before a chunk-size line.
    Size,
    /// In a chunk's data, with this many bytes left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
}

/// What the front of the bytes read holds.
enum Parsed {
    /// Not yet a whole head.
    Partial,
    /// An interim (`1xx`) answer, dropped (consumed): the answer follows.
    Interim,
    Final(Head),
}

/// An answer whose body cannot be framed: the error carries why, for
/// `gateway`'s report (`tcp::bad_answer`).
fn framing(why: BadAnswer) -> Failure {
    Failure::Broken(io::Error::new(io::ErrorKind::InvalidData, why))
}

/// Parses a complete answer head at the front of `buf`, consuming it.
fn parse_head(buf: &mut BytesMut, head_only: bool) -> Result<Parsed, Failure> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
    let mut parsed = httparse::Response::new(&mut fields);
    let malformed =
        |e: httparse::Error| Failure::Broken(io::Error::new(io::ErrorKind::InvalidData, e));
    let len = match parsed.parse(buf).map_err(malformed)? {
        httparse::Status::Partial => return Ok(Parsed::Partial),
        httparse::Status::Complete(len) => len,
    };
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| Failure::Broken(invalid("bad status")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        // Never asked for on this path (upgrades take hyper's): what follows is not HTTP.
        return Err(Failure::Broken(invalid(
            "101 to a request that asked for no upgrade",
        )));
    }
    if status.is_informational() {
        // `100 Continue`, `103 Early Hints`: the answer follows.
        buf.advance(len);
        return Ok(Parsed::Interim);
    }
    let http10 = parsed.version == Some(0);
    let mut headers = HeaderMap::with_capacity(parsed.headers.len());
    let mut lengths = Lengths::default();
    let mut transfer: Option<bool> = None; // Some(chunked last)
    let mut options = ConnectionOptions::default();
    for f in parsed.headers.iter() {
        let name = HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|_| Failure::Broken(invalid("bad field name")))?;
        let value = HeaderValue::from_bytes(f.value)
            .map_err(|_| Failure::Broken(invalid("bad field value")))?;
        if name == header::CONTENT_LENGTH {
            // Judged below, and written again as one number when it frames the body.
            lengths.read(f.value);
            continue;
        } else if name == header::TRANSFER_ENCODING {
            let last = f.value.rsplit(|&b| b == b',').next().unwrap_or_default();
            transfer = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            // Hop-by-hop (the decoder frames the body): left out here rather than removed
            // from the map later.
            continue;
        } else if name == header::CONNECTION {
            if !options.read(f.value) {
                // Only about this connection: nothing for `gateway::strip_hop_by_hop` (which
                // still sees every answer, and removes the rest) to strip by it.
                continue;
            }
        } else if name.as_str() == "keep-alive" {
            continue;
        }
        headers.append(name, value);
    }
    buf.advance(len);
    let bodyless =
        head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    // The byte pump's rules (`http::Lengths`): lengths that differ, or one that is no
    // number where it would frame the body, are the server's fault.
    let length = lengths
        .judge(transfer.is_some(), bodyless)
        .map_err(framing)?;
    if let (Some(n), None) = (length, transfer) {
        // One number, however the server wrote it (`5, 5`, two fields): an HTTP/2
        // client takes no list. Beside a transfer coding a length means nothing (RFC
        // 9112 6.3), and an HTTP/2 answer that kept it would say less than it carries
        // (a malformed answer its client resets).
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    let framing = if bodyless {
        Framing::Length(0)
    } else {
        match (transfer, length) {
            (Some(true), _) => Framing::Chunked(Chunk::Size),
            // Nor beside any other coding: the body runs to the close.
            (Some(false), _) => Framing::Close,
            (None, Some(n)) => Framing::Length(n),
            (None, None) => Framing::Close,
        }
    };
    let keeps = framing != Framing::Close && options.keeps(!http10);
    let mut parts = Response::new(()).into_parts().0;
    parts.status = status;
    parts.version = if http10 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    parts.headers = headers;
    Ok(Parsed::Final(Head {
        parts,
        framing,
        keeps,
    }))
}

/// What the bytes read so far of an answer's body give.
enum Decoded {
    /// A frame to hand on.
    Frame(Frame<Bytes>),
    /// More bytes are needed.
    More,
    /// The body has ended.
    End,
}

/// The framing of an answer's body over the bytes read so far (no I/O: `Answer` reads).
struct Decoder {
    framing: Framing,
}

impl Decoder {
    /// Takes the next frame from the front of `buf`. The end of the connection is not
    /// seen here: a close-delimited body (or a broken-off one) is ended by the reader.
    fn decode(&mut self, buf: &mut BytesMut) -> io::Result<Decoded> {
        loop {
            match self.framing {
                Framing::Done => return Ok(Decoded::End),
                Framing::Length(0) => {
                    self.framing = Framing::Done;
                    return Ok(Decoded::End);
                }
                Framing::Length(_) | Framing::Close | Framing::Chunked(Chunk::Data(_))
                    if buf.is_empty() =>
                {
                    return Ok(Decoded::More)
                }
                Framing::Length(left) => {
                    let take = left.min(buf.len() as u64);
                    self.framing = if take == left {
                        Framing::Done
                    } else {
                        Framing::Length(left - take)
                    };
                    return Ok(data(buf, take));
                }
                Framing::Close => return Ok(Decoded::Frame(Frame::data(buf.split().freeze()))),
                Framing::Chunked(Chunk::Data(left)) => {
                    let take = left.min(buf.len() as u64);
                    self.framing = Framing::Chunked(if take == left {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left - take)
                    });
                    return Ok(data(buf, take));
                }
                Framing::Chunked(Chunk::Size) => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((len, size))) => {
                        buf.advance(len);
                        self.framing = Framing::Chunked(if size == 0 {
                            Chunk::Trailers
                        } else {
                            Chunk::Data(size)
                        });
                    }
                    Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {
                        return Ok(Decoded::More)
                    }
                    _ => return Err(invalid("bad chunk size")),
                },
                Framing::Chunked(Chunk::DataEnd) => {
                    let end = if buf.starts_with(b"\r\n") {
                        2
                    } else if buf.starts_with(b"\n") {
                        1
                    } else if buf.is_empty() || buf[..] == b"\r"[..] {
                        return Ok(Decoded::More);
                    } else {
                        return Err(invalid("chunk data not followed by CRLF"));
                    };
                    buf.advance(end);
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Framing::Chunked(Chunk::Trailers) => return self.trailers(buf),
            }
        }
    }

    /// The trailer section after the last chunk: a frame of them, or the end.
    fn trailers(&mut self, buf: &mut BytesMut) -> io::Result<Decoded> {
        for end in [&b"\r\n"[..], b"\n"] {
            if buf.starts_with(end) {
                buf.advance(end.len());
                self.framing = Framing::Done;
                return Ok(Decoded::End);
            }
        }
        let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
        match httparse::parse_headers(buf, &mut fields) {
            Ok(httparse::Status::Complete((len, fields))) => {
                let mut trailers = HeaderMap::with_capacity(fields.len());
                for f in fields {
                    if let (Ok(name), Ok(value)) = (
                        HeaderName::from_bytes(f.name.as_bytes()),
                        HeaderValue::from_bytes(f.value),
                    ) {
                        trailers.append(name, value);
                    }
                }
                buf.advance(len);
                self.framing = Framing::Done;
                Ok(Decoded::Frame(Frame::trailers(trailers)))
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => Ok(Decoded::More),
            _ => Err(invalid("bad trailer section")),
        }
    }

    fn done(&self) -> bool {
        self.framing == Framing::Done
    }
}

/// A data frame of the first `n` bytes of `buf` (`n` ≤ its length).
fn data(buf: &mut BytesMut, n: u64) -> Decoded {
    Decoded::Frame(Frame::data(buf.split_to(n as usize).freeze()))
}

/// A server's answer body, read from its connection as the client takes it; the
/// connection goes back to the pool at its end (when it may).
pub struct Answer {
    link: Option<Link>,
    /// Bytes read from the server and not yet handed on.
    buf: BytesMut,
    decoder: Decoder,
    /// `None`: the connection closes after this answer.
    back: Option<Back>,
}

impl Answer {
    /// The body has ended: the connection goes back if nothing beyond the answer came.
    fn give_back(&mut self) {
        let link = self.link.take();
        if let (Some(link), Some(back)) = (link, self.back.take()) {
            if self.buf.is_empty() && pool::wanted(&link, back.limits) {
                pool::put(back.state, link, back.target, back.server, back.limits);
            }
        }
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        loop {
            match self.decoder.decode(&mut self.buf)? {
                Decoded::Frame(frame) => {
                    if self.decoder.done() {
                        // At once: hyper may drop a body it knows has ended unpolled.
                        self.give_back();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Decoded::End => {
                    self.give_back();
                    return Poll::Ready(None);
                }
                Decoded::More => {}
            }
            let Some(link) = self.link.as_mut() else {
                return Poll::Ready(Some(Err(invalid("answer read after its end"))));
            };
            if ready!(read(cx, link, &mut self.buf))? == 0 {
                if self.decoder.framing != Framing::Close {
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection before the end of its answer",
                    ))));
                }
                self.decoder.framing = Framing::Done;
                self.link = None;
                return Poll::Ready(None);
            }
        }
    }
}

/// Reads an answer (head and body) from `bytes` given `step` bytes at a time, as it
/// would come from a server: its status and how many body bytes it framed, or why it is
/// refused. For the fuzzer (`fuzz/fuzz_targets/h1_answer.rs`).
#[doc(hidden)]
pub fn read_answer(bytes: &[u8], head_only: bool, step: usize) -> io::Result<(u16, u64)> {
    let step = step.max(1);
    let mut chunks = bytes.chunks(step);
    let mut buf = BytesMut::new();
    let refused = |f: Failure| match f {
        Failure::Unanswered(e) | Failure::Broken(e) | Failure::Client(e) => e,
    };
    let head = loop {
        match parse_head(&mut buf, head_only).map_err(refused)? {
            Parsed::Final(head) => break head,
            Parsed::Interim => continue,
            Parsed::Partial => match chunks.next() {
                Some(c) => buf.extend_from_slice(c),
                None => return Err(io::ErrorKind::UnexpectedEof.into()),
            },
        }
    };
    let mut decoder = Decoder {
        framing: head.framing,
    };
    let mut body = 0u64;
    loop {
        match decoder.decode(&mut buf)? {
            Decoded::Frame(f) => {
                if let Some(d) = f.data_ref() {
                    body += d.len() as u64;
                }
            }
            Decoded::End => return Ok((head.parts.status.as_u16(), body)),
            Decoded::More => match chunks.next() {
                Some(c) => buf.extend_from_slice(c),
                None if decoder.framing == Framing::Close => {
                    return Ok((head.parts.status.as_u16(), body))
                }
                None => return Err(io::ErrorKind::UnexpectedEof.into()),
            },
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        let this = self.get_mut();
        let polled = this.poll_next(cx);
        if let Poll::Ready(Some(Err(_))) = polled {
            // A broken answer: the connection is not used again.
            this.decoder.framing = Framing::Done;
            this.link = None;
            this.back = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.decoder.done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer read whole and a byte at a time: the same either way.
    fn read(bytes: &[u8], head_only: bool) -> io::Result<(u16, u64)> {
        let whole = read_answer(bytes, head_only, bytes.len());
        let bytewise = read_answer(bytes, head_only, 1);
        assert_eq!(whole.as_ref().ok(), bytewise.as_ref().ok());
        whole
    }

    #[test]
    fn what_came_with_a_head_is_known_to_be_the_whole_body_or_not() {
        assert!(Framing::Length(4).awaits_more(b"ab"));
        assert!(!Framing::Length(4).awaits_more(b"abcd"));
        assert!(Framing::Chunked(Chunk::Size).awaits_more(b"2\r\nab\r\n"));
        assert!(!Framing::Chunked(Chunk::Size).awaits_more(b"2\r\nab\r\n0\r\n\r\n"));
        assert!(Framing::Close.awaits_more(b"anything"));
        assert!(!Framing::Done.awaits_more(b""));
    }

    #[test]
    fn a_body_is_framed_by_length_by_chunks_or_by_the_close() {
        let length = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(read(length, false).unwrap(), (200, 5));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 99\r\n\r\n\
                        5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Sum: 1\r\n\r\n";
        assert_eq!(read(chunked, false).unwrap(), (200, 11));
        let close = b"HTTP/1.0 200 OK\r\n\r\nto the close";
        assert_eq!(read(close, false).unwrap(), (200, 12));
    }

    #[test]
    fn head_204_and_304_have_no_body_whatever_their_fields_say() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n";
        assert_eq!(read(head, true).unwrap(), (200, 0));
        let no_content = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(read(no_content, false).unwrap(), (204, 0));
        let not_modified = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 7\r\n\r\n";
        assert_eq!(read(not_modified, false).unwrap(), (304, 0));
    }

    #[test]
    fn interim_answers_are_passed_over_but_an_unasked_101_is_refused() {
        let continued =
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n\
                          HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok";
        assert_eq!(read(continued, false).unwrap(), (201, 2));
        let switched = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n";
        assert!(read(switched, false).is_err());
    }

    #[test]
    fn malformed_framing_is_refused_rather_than_guessed() {
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\ncut",
        ] {
            assert!(
                read(bad, false).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    /// The head `parse_head` makes of `answer`, or why it refused it.
    fn head_of(answer: &[u8], head_only: bool) -> Result<Head, String> {
        match parse_head(&mut BytesMut::from(answer), head_only) {
            Ok(Parsed::Final(head)) => Ok(head),
            Ok(Parsed::Interim | Parsed::Partial) => Err("no final head".into()),
            Err(Failure::Unanswered(e) | Failure::Broken(e) | Failure::Client(e)) => {
                Err(e.to_string())
            }
        }
    }

    fn lengths(head: &Head) -> Vec<&HeaderValue> {
        head.parts
            .headers
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .collect()
    }

    /// As the byte pump judges them (`http::Lengths`), so that an HTTP/2 client gets the
    /// answer an HTTP/1.1 client gets.
    #[test]
    fn lengths_are_judged_as_the_byte_pump_judges_them() {
        // One number however written, given to the HTTP/2 client once.
        let listed = head_of(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nContent-Length: 05\r\n\r\n",
            false,
        )
        .unwrap();
        assert_eq!(listed.framing, Framing::Length(5));
        assert_eq!(lengths(&listed), ["5"]);
        // A length that is no number frames nothing beside chunked framing, nor on an
        // answer without a body: left out, not a 502.
        for (answer, head_only) in [
            (
                &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 12abc\r\n\r\n"
                    [..],
                false,
            ),
            (b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n", true),
            (
                b"HTTP/1.1 304 Not Modified\r\nContent-Length: -1\r\n\r\n",
                false,
            ),
        ] {
            let head = head_of(answer, head_only).unwrap();
            assert!(
                lengths(&head).is_empty(),
                "{:?}",
                String::from_utf8_lossy(answer)
            );
        }
        // Where it would frame the body, it is the server's fault; and lengths that differ
        // are, whatever the answer.
        for (answer, head_only, why) in [
            (&b"HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n"[..], false, BadAnswer::BadLength),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", true, BadAnswer::TwoLengths),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                false,
                BadAnswer::TwoLengths,
            ),
        ] {
            let refused = head_of(answer, head_only).err().unwrap_or_default();
            assert!(refused.contains(&why.to_string()), "{refused}: {:?}", String::from_utf8_lossy(answer));
        }
    }

    #[test]
    fn a_request_head_is_written_in_title_case_with_its_framing() {
        let mut out = Vec::new();
        title_case(&mut out, b"x-forwarded-for");
        assert_eq!(out, b"X-Forwarded-For");
        assert_eq!(
            &last_chunk(None)[..],
            b"0\r\n\r\n",
            "a chunked body without trailers ends with the last chunk"
        );
    }
}
