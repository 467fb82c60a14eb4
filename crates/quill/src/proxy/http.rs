//! HTTP/1.x message framing for `http` (`-H`): inserts `X-Forwarded-For` and
//! `X-Forwarded-Proto` into every request of a connection and, optionally,
//! `Strict-Transport-Security` into the responses of TLS-terminated connections.
//!
//! Sans-IO: an [`Exchange`] is fed the bytes each side sends and appends what must be
//! forwarded. Invariants: body and tunnel bytes are forwarded verbatim and in order; a
//! request head is forwarded only once it is complete and valid (else the client gets 400
//! or 431 after the answers to its earlier requests); responses are forwarded byte for byte
//! (with HSTS one header line is added); nothing here panics on any input.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::io::Write;
use std::net::IpAddr;

use crate::accesslog::{Arrival, CLIENT_CLOSED_REQUEST};
use crate::balance::servers::Tally;
use crate::command::Hsts;

/// Header fields per request; more is answered with 431.
const MAX_HEADERS: usize = 128;
/// What a rewritten request head may add beyond the client's head and address: the
/// `X-Forwarded-For: `, `X-Forwarded-Proto: https` lines and their line ends.
const REWRITE_EXTRA: usize = 64;
/// Responses heads larger than this are not framed any more (passed through raw).
const RESPONSE_HEAD_MAX: usize = 64 * 1024;
/// Requests forwarded but not yet answered; beyond this the client is not read (pipelining
/// backpressure), so the queue stays bounded.
const MAX_PIPELINE: usize = 128;
/// Longest chunk-size line (with extensions) accepted in a chunked request body.
const CHUNK_LINE_MAX: usize = 4096;

/// How the client reached quill: what `X-Forwarded-Proto` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    fn as_bytes(self) -> &'static [u8] {
        match self {
            Scheme::Http => b"http",
            Scheme::Https => b"https",
        }
    }
}

/// What the rewriting needs to know about one client connection.
#[derive(Debug, Clone)]
pub struct HttpParams {
    /// The client's address (after `accept_proxy`), for `X-Forwarded-For`.
    pub client: IpAddr,
    /// `Https` when quill terminated TLS for this connection.
    pub scheme: Scheme,
    /// Largest request head accepted (431 beyond).
    pub header_max: usize,
    /// `Strict-Transport-Security` for responses; used only when `scheme` is `Https`.
    pub hsts: Option<Hsts>,
}

/// Why a request was refused; the client gets this status and the connection closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 400: not HTTP/1.x, or ambiguous framing.
    BadRequest,
    /// 431: the head (or the trailer section) is larger than `http_header_max`.
    TooLarge,
    /// 408: the head did not arrive whole within `http_request_timeout`.
    Timeout,
}

impl Refusal {
    /// The whole response sent to the client.
    pub const fn response(self) -> &'static [u8] {
        match self {
            Refusal::BadRequest => b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 12\r\nConnection: close\r\n\r\nBad Request\n",
            Refusal::TooLarge => b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\nContent-Length: 32\r\nConnection: close\r\n\r\nRequest Header Fields Too Large\n",
            Refusal::Timeout => b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain\r\nContent-Length: 16\r\nConnection: close\r\n\r\nRequest Timeout\n",
        }
    }
}

/// The request side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Req {
    /// Expecting a request head.
    Head,
    /// Content-Length body: bytes left.
    Body(u64),
    Chunked(Chunk),
    /// An `Upgrade` or `CONNECT` request was forwarded: nothing more is read until its
    /// response says whether the connection switches to a tunnel.
    AwaitDecision,
    /// Plain byte relay.
    Tunnel,
    /// A request was refused: nothing more is forwarded.
    Failed(Refusal),
}

/// Position inside a chunked body (RFC 9112 section 7.1). Framing bytes are forwarded
/// unchanged; only CRLF line ends are accepted, so quill and the server cannot disagree
/// on where the body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// In the chunk-size line: value so far, hex digits read, past the digits, line length.
    Size {
        size: u64,
        digits: u8,
        ext: bool,
        len: usize,
    },
    /// CR of the size line seen.
    SizeLf { size: u64 },
    /// Chunk data left.
    Data(u64),
    /// Expecting the CR after chunk data.
    DataCr,
    /// Expecting the LF after chunk data.
    DataLf,
    /// In the trailer section: length of the current line, CR seen, bytes so far.
    Trailer { line: usize, cr: bool, total: usize },
}

const CHUNK_START: Chunk = Chunk::Size {
    size: 0,
    digits: 0,
    ext: false,
    len: 0,
};

/// What a forwarded request needs from its response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Pending {
    head: bool,
    connect: bool,
    /// The request asked to switch protocols (`Upgrade`) or is a `CONNECT`.
    switch: bool,
    /// An HTTP/1.0 request: its client reads an answer without `Connection: keep-alive`
    /// as the connection's last.
    http10: bool,
    /// The request said the client's connection ends with its answer (`Connection:
    /// close`, HTTP/1.0 without keep-alive). Kept per request, not for the connection: a
    /// pipelining client's later request that asks to close must not make the answers to
    /// its earlier ones say close (it would take them for the last, and send the rest of
    /// its pipeline again).
    close: bool,
}

/// The response side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resp {
    Head,
    Body(u64),
    Chunked(Chunk),
    /// Body delimited by the server closing the connection.
    UntilClose,
    Tunnel,
    /// The server does not speak HTTP/1.x as quill understands it: everything it sends
    /// passes through untouched from here on.
    Raw,
    /// The server's answer could not be framed without guessing (two lengths), or came
    /// for no request: quill answered in its place, or the answer in hand is whole, and
    /// nothing more the server sends reaches the client. The connections end.
    Discard,
}

/// Why a server's answer was replaced by quill's 502 ([`Exchange::take_bad_answer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BadAnswer {
    #[error("two different Content-Length values")]
    TwoLengths,
    #[error("a Content-Length that is no number")]
    BadLength,
    #[error("bytes that are no HTTP answer, over a connection reused from the pool")]
    NotHttp,
}

/// Outcome of feeding the client's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fed {
    /// Everything from here on, in this direction, may be forwarded verbatim.
    Verbatim,
    /// `n` input bytes were consumed and their rewrite appended to the output.
    Consumed(usize),
}

/// The HTTP state of one client connection.
#[derive(Debug)]
pub struct Exchange {
    params: HttpParams,
    /// The client address as text, written into every request.
    client_text: Box<str>,
    req: Req,
    /// A request head not complete yet (empty, and unallocated, between requests).
    req_head: Vec<u8>,
    /// How much of `req_head` has been searched for the end of the head.
    req_scanned: usize,
    /// Whether the head of the request being received has been forwarded.
    req_forwarded: bool,
    /// The request being received asked to switch protocols (`Upgrade`, `CONNECT`).
    req_switch: bool,
    /// Forwarded requests without a final response yet, oldest first.
    pending: VecDeque<Pending>,
    resp: Resp,
    resp_head: Vec<u8>,
    resp_scanned: usize,
    /// Some response bytes for the oldest pending request have been forwarded.
    resp_started: bool,
    /// The server's last bytes brought a response head, and not all of its body
    /// ([`Exchange::head_awaits_body`]).
    head_alone: bool,
    /// The refusal has been handed out for sending.
    refusal_sent: bool,
    /// Final answers (or switches) the server has sent whole; saturating.
    answers: u32,
    /// The statuses of the server's final answers (and switches) whose heads were
    /// forwarded since the driver last took them ([`Exchange::take_statuses`]).
    statuses: Tally,
    /// The connection is to end after an answer that leaves no request pending (a reload,
    /// a drain, quill stopping): that answer says `Connection: close`.
    closing: bool,
    /// No more requests are read: the answer that says `Connection: close` has been
    /// forwarded, or the connection ends between requests ([`Exchange::close_now`]).
    last: bool,
    /// Request by request ([`Exchange::request_by_request`]): no byte of a next request is
    /// taken before [`Exchange::resume`].
    one_at_a_time: bool,
    /// A request was received whole: the client's bytes wait for `resume`.
    paused: bool,
    /// The client's connection goes on after the answer: the request it answers did not
    /// say it ends (`Connection: close`, HTTP/1.0 without keep-alive), nor, when the server
    /// connection is the client's own (not request by request), did the answer; and the
    /// answer's end is framed, not the server's close. Set as each answer's head is
    /// written, never by a request head read before it; once false it stays false, so
    /// every answer after the one that said close says it too.
    client_keep: bool,
    /// The server's connection goes on after the answer: neither the request as forwarded
    /// nor the answer said it ends.
    server_keep: bool,
    /// The server closed its connection between requests.
    server_left: bool,
    /// The client closed its side (its EOF went on to the server): a server that then
    /// closes without answering was told its client had gone, and quill answers nothing in
    /// its place.
    client_closed: bool,
    /// Requests the client abandoned ([`Exchange::client_closed`],
    /// [`Exchange::client_left`]), until the driver takes the count.
    abandoned: u64,
    /// Request by request: the server connection carrying the request carried others
    /// before (a pooled one, possibly for another client).
    server_reused: bool,
    /// An answer replaced by quill's 502, until the driver takes it to report it.
    bad_answer: Option<BadAnswer>,
    /// The last request received has no body, and its method is idempotent: it can be sent
    /// again, to another connection, if the first went away without a byte of answer.
    replayable: bool,
    /// What the access log needs of the requests being relayed, kept only while asked for
    /// ([`Exchange::log_requests`]): most connections pay no copy of their heads.
    log: Option<Box<LogBook>>,
}

/// One request as the access log sees it: its head as the client sent it, the final
/// answer's status, and the body bytes each way (a chunked body's data, not its framing; a
/// tunnel's bytes after a `101` or a `CONNECT`'s 2xx).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Logged {
    pub method: String,
    /// The `Host` field, if any.
    pub authority: Option<String>,
    pub target: String,
    pub http10: bool,
    /// The final (or switching) answer's status; 0 while none came.
    pub status: u16,
    pub body_in: u64,
    pub body_out: u64,
    /// When its head came, stamped by the driver ([`Exchange::stamp_arrivals`]): this
    /// module reads no clock.
    pub arrived: Option<Arrival>,
}

/// The access log's requests of one connection. Pipelined requests are answered in
/// order, so the oldest open one is the one being answered (status, bytes out), and the
/// newest the one whose body is being read (bytes in). An entry is added with each
/// request that gets a [`Pending`] entry, so the book grows no more than `pending` does.
#[derive(Debug, Default)]
struct LogBook {
    /// Requests whose answers have not ended, oldest first.
    open: VecDeque<Logged>,
    /// Requests whose answers ended, oldest first, until the driver takes them.
    answered: VecDeque<Logged>,
}

/// How the `Connection` field of a forwarded request differs from the client's: request
/// by request the server's connection is quill's, kept for the next request of any client.
#[derive(Debug, Clone, Copy)]
struct Towards {
    /// The client's `close` option is left out (the field too when it named nothing else).
    drop_close: bool,
    /// `Connection: keep-alive` is added (an HTTP/1.0 request that did not ask for it).
    add_keep_alive: bool,
    /// The client's `Connection` has options beyond `close` and `keep-alive` (fields it
    /// names, to leave behind): most requests have none, and skip looking for them.
    names: bool,
    /// The request still asks to switch to a protocol quill may tunnel to; when not, its
    /// `upgrade` option and `Upgrade` field are left out (it goes on as a plain request).
    upgrade: bool,
}

/// The result of looking for the end of a message head.
enum HeadEnd {
    /// Not complete yet.
    Partial,
    /// A complete head of this many bytes (from httparse).
    Complete(usize),
}

impl Exchange {
    pub fn new(params: HttpParams) -> Exchange {
        let client_text = params.client.to_canonical().to_string().into_boxed_str();
        Exchange {
            params,
            client_text,
            req: Req::Head,
            req_head: Vec::new(),
            req_scanned: 0,
            req_forwarded: false,
            req_switch: false,
            pending: VecDeque::new(),
            resp: Resp::Head,
            resp_head: Vec::new(),
            resp_scanned: 0,
            resp_started: false,
            head_alone: false,
            refusal_sent: false,
            answers: 0,
            statuses: Tally::default(),
            closing: false,
            last: false,
            one_at_a_time: false,
            paused: false,
            client_keep: true,
            server_keep: true,
            server_left: false,
            client_closed: false,
            abandoned: 0,
            server_reused: false,
            bad_answer: None,
            replayable: false,
            log: None,
        }
    }

    /// Keeps, or stops keeping, what the access log needs of each request from the next
    /// head on ([`Exchange::take_logged`]).
    pub fn log_requests(&mut self, on: bool) {
        match (on, self.log.is_some()) {
            (true, false) => self.log = Some(Box::default()),
            (false, true) => self.log = None,
            _ => {}
        }
    }

    /// The newest request's facts, when kept (to take its text before its answer).
    pub fn logged_newest(&mut self) -> Option<&mut Logged> {
        self.log.as_mut()?.open.back_mut()
    }

    /// The oldest request whose answer has ended, when kept.
    pub fn take_answered(&mut self) -> Option<Logged> {
        self.log.as_mut()?.answered.pop_front()
    }

    /// The oldest request kept, answered or not (at the end of a request's relay, or of the
    /// connection: a request left unanswered has status 0).
    pub fn take_logged(&mut self) -> Option<Logged> {
        let book = self.log.as_mut()?;
        book.answered.pop_front().or_else(|| book.open.pop_front())
    }

    /// Stamps the requests whose heads came since the last call with the time `now`
    /// gives (asked only when there are such requests).
    pub fn stamp_arrivals(&mut self, now: impl FnOnce() -> Arrival) {
        let Some(book) = &mut self.log else {
            return;
        };
        let fresh = book.open.iter().rev().take_while(|l| l.arrived.is_none());
        let fresh = fresh.count();
        if fresh > 0 {
            let now = now();
            let first = book.open.len() - fresh;
            for l in book.open.range_mut(first..) {
                l.arrived = Some(now);
            }
        }
    }

    /// The request whose body is being read.
    fn logged_in(&mut self) -> Option<&mut Logged> {
        self.log.as_mut()?.open.back_mut()
    }

    /// The request being answered.
    fn logged_out(&mut self) -> Option<&mut Logged> {
        self.log.as_mut()?.open.front_mut()
    }

    /// The statuses of the server's answers forwarded since the last call: for the driver,
    /// which knows the server, to count (quill's own answers are not among them).
    pub fn take_statuses(&mut self) -> Tally {
        std::mem::take(&mut self.statuses)
    }

    /// Why an answer was replaced by quill's 502 since the last call, if one was: for the
    /// driver, which knows the server, to report.
    pub fn take_bad_answer(&mut self) -> Option<BadAnswer> {
        self.bad_answer.take()
    }

    /// Takes one request at a time (request-level relaying, `proxy::h1_pump`): once a
    /// request has been received whole, no byte of the next is taken until its answer is
    /// complete ([`Exchange::at_boundary`]) and the driver calls [`Exchange::resume`], so
    /// that each request can go to a server of its own.
    pub fn request_by_request(&mut self) {
        self.one_at_a_time = true;
    }

    /// Whether [`Exchange::request_by_request`] was asked for.
    pub fn is_request_by_request(&self) -> bool {
        self.one_at_a_time
    }

    /// Takes the client's bytes again after a boundary.
    pub fn resume(&mut self) {
        self.paused = false;
    }

    /// A server connection carries the next request; `reused`: it carried others before.
    pub fn new_server(&mut self, reused: bool) {
        self.server_left = false;
        self.server_reused = reused;
    }

    /// Request by request: the request taken has been answered whole and nothing of the
    /// next one has been taken; the server connection is free.
    pub fn at_boundary(&self) -> bool {
        self.paused && !self.last && self.between()
    }

    /// Whether the server connection can carry another request after this answer (not
    /// ended by a header, by the server, by a body delimited by the close, a tunnel or
    /// answers quill cannot frame).
    pub fn server_keeps(&self) -> bool {
        self.server_keep && !self.server_left && self.resp == Resp::Head
    }

    /// Whether the client's connection goes on after this answer: what the answer the
    /// client got says (quill's `Connection` field in it, when it had to write its own).
    pub fn client_keeps(&self) -> bool {
        self.client_keep
    }

    /// The server closed its connection after a complete answer (request by request),
    /// or the client half-closed (its EOF went to the server).
    pub fn server_left(&mut self) {
        self.server_left = true;
    }

    /// Request by request: whether the request taken was received whole, body included
    /// (a client that closes before then has given it up).
    pub fn request_whole(&self) -> bool {
        self.paused
    }

    /// Whether the last request received may be sent again (no body, idempotent method).
    pub fn replayable(&self) -> bool {
        self.replayable
    }

    /// Whether the client's bytes can be accepted now. While this is false the driver
    /// should not read from the client (an `Upgrade` waits for its answer, too many
    /// unanswered requests, or a refusal).
    pub fn accepts_client_bytes(&self) -> bool {
        if self.last {
            return false;
        }
        match self.req {
            Req::AwaitDecision | Req::Failed(_) => false,
            Req::Head if self.paused => false,
            Req::Head => self.pending.len() < MAX_PIPELINE || self.resp == Resp::Raw,
            _ => true,
        }
    }

    /// Whether quill is waiting for the client to send a request head, the time that
    /// `http_request_timeout` bounds: from the first byte of a head, or from the end of
    /// the answer to the previous request (nothing else outstanding), until the head is
    /// complete. False while the client is held back (it cannot finish a head that is not
    /// read), while a body or a tunnel flows, and while answers are due from the server
    /// (a pipelining client waits for them; that wait is the server's, not the client's).
    pub fn awaiting_head(&self) -> bool {
        self.req == Req::Head
            && self.accepts_client_bytes()
            && (!self.req_head.is_empty()
                || (self.pending.is_empty()
                    && self.resp == Resp::Head
                    && self.resp_head.is_empty()))
    }

    /// Whether part of a request head has arrived (and waits for the rest).
    pub fn head_started(&self) -> bool {
        self.req == Req::Head && !self.req_head.is_empty()
    }

    /// Whether the connection is between requests: nothing pending, nothing of a next
    /// request head read, and HTTP still followed both ways (no tunnel, no raw responses).
    pub fn between(&self) -> bool {
        self.req == Req::Head
            && self.req_head.is_empty()
            && self.pending.is_empty()
            && self.resp == Resp::Head
            && self.resp_head.is_empty()
    }

    /// Whether every request forwarded so far has its whole final answer (none pending, no
    /// answer begun), whatever the client is still sending: a server may answer a request
    /// before reading its body (413), and what it does with the connection afterwards is
    /// no failure of its answer.
    pub fn answered(&self) -> bool {
        self.pending.is_empty()
            && self.resp == Resp::Head
            && self.resp_head.is_empty()
            && matches!(self.req, Req::Head | Req::Body(_) | Req::Chunked(_))
    }

    /// Whether a request forwarded to the server still waits for its answer, or for the
    /// rest of it (not in a tunnel, nor once the server's bytes pass raw or are dropped:
    /// quill no longer knows what they answer).
    pub fn answer_due(&self) -> bool {
        !self.pending.is_empty() && !matches!(self.resp, Resp::Tunnel | Resp::Raw | Resp::Discard)
    }

    /// The client left (closed or failed) before the server did, with answers due: the
    /// requests still waiting for an answer's head are logged with
    /// [`CLIENT_CLOSED_REQUEST`] (an answer cut in its body keeps its status), and counted
    /// as abandoned ([`Exchange::take_abandoned`]).
    pub fn client_left(&mut self) {
        if !self.answer_due() {
            return;
        }
        if let Some(book) = &mut self.log {
            for l in book.open.iter_mut().filter(|l| l.status == 0) {
                l.status = CLIENT_CLOSED_REQUEST;
            }
        }
        self.abandoned = self.abandoned.max(self.pending.len() as u64);
    }

    /// The client closed its side of the connection (the driver read its EOF). The
    /// requests whose answers had not ended are abandoned even if their answers then pass:
    /// the client's kernel takes them, and only a client that half-closed reads them (few
    /// HTTP clients do; one that left is seen only when a later write fails, or never).
    pub fn client_closed(&mut self) {
        if !self.client_closed && self.answer_due() {
            self.abandoned = self.pending.len() as u64;
        }
        self.client_closed = true;
    }

    /// How many requests the client abandoned since the last call.
    pub fn take_abandoned(&mut self) -> u64 {
        std::mem::take(&mut self.abandoned)
    }

    /// Whether the answer in hand is one that the server's close ends: a body delimited by
    /// the close, or answers quill cannot frame.
    pub fn ended_by_close(&self) -> bool {
        matches!(self.resp, Resp::UntilClose | Resp::Raw)
    }

    /// Whether the server closing its connection now cuts an answer short: one due, or
    /// begun and framed by a length or chunks (not one the close ends, nor a tunnel).
    pub fn cut_by_close(&self) -> bool {
        match self.resp {
            Resp::Body(_) | Resp::Chunked(_) => true,
            Resp::Head => !self.resp_head.is_empty() || !self.pending.is_empty(),
            Resp::UntilClose | Resp::Tunnel | Resp::Raw | Resp::Discard => false,
        }
    }

    /// Asks the client to end the connection: the next final response that leaves no
    /// request pending, with no other request begun, gets `Connection: close` (the
    /// server's own `Connection` and the fields about its connection dropped), and the
    /// client is read no more after it. Between requests the client's next request is
    /// still taken, and its answer is that response.
    pub fn close_after_answer(&mut self) {
        self.closing = true;
    }

    /// Reads no more requests: only [`Exchange::between`] requests, so that the connection
    /// can end at once ([`Exchange::finished`]).
    pub fn close_now(&mut self) {
        if self.between() {
            self.last = true;
        }
    }

    /// Whether the connection is done: the answer that said `Connection: close` has been
    /// forwarded whole (or [`Exchange::close_now`] ended it between requests), so the
    /// client's side can be shut once it is written.
    pub fn finished(&self) -> bool {
        self.last && (self.between() || self.resp == Resp::Discard)
    }

    /// The request head being waited for took longer than `http_request_timeout`: the
    /// client gets 408 (after the answers to its earlier requests), and the connection
    /// closes.
    pub fn head_timed_out(&mut self) {
        self.refuse(Refusal::Timeout);
    }

    /// The refusal of the client's request, if one happened (the connection ends).
    pub fn refusal(&self) -> Option<Refusal> {
        match self.req {
            Req::Failed(r) => Some(r),
            _ => None,
        }
    }

    /// Feeds bytes from the client; the rewritten bytes are appended to `out`. Consumes
    /// less than all of `input` only when [`Exchange::accepts_client_bytes`] turned false.
    pub fn client_bytes(&mut self, input: &[u8], out: &mut Vec<u8>) -> Fed {
        if self.req == Req::Tunnel {
            if let Some(l) = self.logged_in() {
                l.body_in += input.len() as u64;
            }
            return Fed::Verbatim;
        }
        let mut pos = 0;
        while pos < input.len() && self.accepts_client_bytes() {
            let rest = &input[pos..];
            pos += match self.req {
                Req::Head => self.request_head(rest, out),
                Req::Body(left) => {
                    let n = left.min(rest.len() as u64) as usize;
                    out.extend_from_slice(&rest[..n]);
                    if let Some(l) = self.logged_in() {
                        l.body_in += n as u64;
                    }
                    if left == n as u64 {
                        self.request_done();
                    } else {
                        self.req = Req::Body(left - n as u64);
                    }
                    n
                }
                Req::Chunked(state) => {
                    let mut data = 0;
                    let (n, next) = chunked(state, rest, self.params.header_max, &mut data);
                    out.extend_from_slice(&rest[..n]);
                    if let Some(l) = self.logged_in() {
                        l.body_in += data;
                    }
                    match next {
                        Ok(Some(state)) => self.req = Req::Chunked(state),
                        Ok(None) => self.request_done(),
                        Err(refusal) => self.req = Req::Failed(refusal),
                    }
                    n
                }
                Req::Tunnel => {
                    out.extend_from_slice(rest);
                    if let Some(l) = self.logged_in() {
                        l.body_in += rest.len() as u64;
                    }
                    rest.len()
                }
                Req::AwaitDecision | Req::Failed(_) => 0,
            };
        }
        Fed::Consumed(pos)
    }

    /// The end of a request message.
    fn request_done(&mut self) {
        self.req_forwarded = false;
        self.paused = self.one_at_a_time;
        if self.resp == Resp::Raw {
            // Responses cannot be followed: assume the server switched.
            self.req = if self.req_switch {
                Req::Tunnel
            } else {
                Req::Head
            };
            return;
        }
        // The request is the newest pending one, unless its answer came already (then it
        // is gone, and so is any reason to wait).
        let switch = self.pending.back().is_some_and(|p| p.switch);
        self.req = if switch {
            Req::AwaitDecision
        } else {
            Req::Head
        };
    }

    /// Handles bytes while expecting a request head; returns how many were consumed.
    fn request_head(&mut self, input: &[u8], out: &mut Vec<u8>) -> usize {
        let max = self.params.header_max;
        let before = self.req_head.len();
        if before == 0 {
            // The common case: the whole head arrived in one read. Parse it in place.
            if worth_parsing(input, 0, 0) {
                match self.parse_request(input, out) {
                    Ok(HeadEnd::Complete(n)) => return n,
                    Ok(HeadEnd::Partial) => {}
                    Err(refusal) => return self.refuse(refusal),
                }
            }
            if input.len() > max {
                return self.refuse(Refusal::TooLarge);
            }
            self.req_head.extend_from_slice(input);
            self.req_scanned = input.len();
            return input.len();
        }
        // `before <= max` always holds: more is refused below.
        let take = input.len().min((max + 1).saturating_sub(before));
        self.req_head.extend_from_slice(&input[..take]);
        let scan_from = self.req_scanned.saturating_sub(2);
        self.req_scanned = self.req_head.len();
        if worth_parsing(&self.req_head, before, scan_from) {
            let head = std::mem::take(&mut self.req_head);
            self.req_scanned = 0;
            match self.parse_request(&head, out) {
                // The head began in earlier input; the rest of it came from this input.
                Ok(HeadEnd::Complete(n)) => return n.saturating_sub(before),
                Ok(HeadEnd::Partial) => {
                    self.req_head = head;
                    self.req_scanned = self.req_head.len();
                }
                Err(refusal) => return self.refuse(refusal),
            }
        }
        if self.req_head.len() > max {
            return self.refuse(Refusal::TooLarge);
        }
        take
    }

    /// Refuses the request being received; returns the bytes consumed (none).
    fn refuse(&mut self, refusal: Refusal) -> usize {
        self.req = Req::Failed(refusal);
        self.req_head = Vec::new();
        0
    }

    /// Parses a request head at the start of `buf`; on success forwards it rewritten and
    /// sets up the body.
    fn parse_request(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<HeadEnd, Refusal> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        let n = match req.parse(buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Ok(HeadEnd::Partial),
            Err(httparse::Error::TooManyHeaders) => return Err(Refusal::TooLarge),
            Err(_) => return Err(Refusal::BadRequest),
        };
        if n > self.params.header_max {
            return Err(Refusal::TooLarge);
        }
        let (Some(method), Some(path), Some(version)) = (req.method, req.path, req.version) else {
            return Err(Refusal::BadRequest);
        };
        let connect = method == "CONNECT";
        let mut length: Option<u64> = None;
        let mut chunked: Option<bool> = None;
        let mut upgrade = false;
        let mut host: Option<&[u8]> = None;
        let mut options = ConnectionOptions::default();
        for h in req.headers.iter() {
            let name = h.name.as_bytes();
            if name.eq_ignore_ascii_case(b"host") {
                // Two `Host` fields name two sites: servers and quill's own log would not
                // agree on which one was asked (RFC 9112 3.2: 400, as HAProxy and NGINX).
                if host.is_some() {
                    return Err(Refusal::BadRequest);
                }
                host = Some(h.value);
            } else if name.eq_ignore_ascii_case(b"connection") {
                options.read(h.value);
            } else if name.eq_ignore_ascii_case(b"content-length") {
                let n = content_length(h.value).ok_or(Refusal::BadRequest)?;
                if length.is_some_and(|l| l != n) {
                    return Err(Refusal::BadRequest);
                }
                length = Some(n);
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                // The final coding decides; a later header continues the list. An empty
                // one, or one in an HTTP/1.0 request (whose servers may ignore it and read
                // the body as the next request: RFC 9112 6.1), is refused.
                let last = list(h.value).last().ok_or(Refusal::BadRequest)?;
                if version == 0 {
                    return Err(Refusal::BadRequest);
                }
                let coding = last.split(|&b| b == b';').next().unwrap_or_default();
                chunked = Some(coding.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            } else if name.eq_ignore_ascii_case(b"upgrade") {
                // Only a protocol quill may tunnel to makes an upgrade (not HTTP/2: see
                // `is_http2_token`); an `Upgrade` that offers nothing else is left out.
                upgrade |= list(h.value).any(|p| !is_http2_token(p));
            }
        }
        // An absolute-form target names the site itself (RFC 9112 3.2.2): a `Host` that
        // names another one is ambiguous, servers and quill's access log (`Host`) may each
        // take a different one. Refused as HAProxy does, rather than `Host` rewritten to
        // the target's: a client that says two things is broken or probing, and a server
        // behind quill must never route by a name the client did not put in `Host`.
        if let (Some(target), Some(host)) = (absolute_authority(path), host) {
            if !same_authority(target, host) {
                return Err(Refusal::BadRequest);
            }
        }
        let body = match (chunked, length) {
            // Both framings at once is how requests are smuggled: refuse (RFC 9112 6.1).
            (Some(_), Some(_)) => return Err(Refusal::BadRequest),
            // A request body must end by its framing, not by a close.
            (Some(false), None) => return Err(Refusal::BadRequest),
            (Some(true), None) => Req::Chunked(CHUNK_START),
            (None, Some(n)) if n > 0 => Req::Body(n),
            (None, _) => Req::Head,
        };
        // HTTP/1.0 closes unless asked to keep alive; HTTP/1.1 keeps alive unless asked.
        let keeps = options.keeps(version != 0);
        // Request by request the server's connection outlives the client's: the client's
        // `close` is for quill (its answer says it), not for the server, and an HTTP/1.0
        // request asks the server to keep its connection (as NGINX's `keepalive` upstreams
        // need `proxy_http_version 1.1` for), so that clients such as `ab` without `-k` do
        // not cost a server connection each.
        let towards = Towards {
            drop_close: self.one_at_a_time && options.close,
            add_keep_alive: self.one_at_a_time && version == 0 && !options.keep_alive,
            names: options.names,
            upgrade,
        };
        // One allocation: growing from empty field by field reallocated four times.
        out.reserve(n + self.client_text.len() + REWRITE_EXTRA);
        self.write_request_head(method, path, version, req.headers, towards, out);
        self.req_switch = connect || upgrade;
        if self.one_at_a_time {
            // Each request may go to another server connection: only its own head counts.
            self.server_keep = true;
        } else {
            self.server_keep &= keeps;
        }
        self.replayable = body == Req::Head
            && !self.req_switch
            && matches!(
                method,
                "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE"
            );
        if self.resp != Resp::Raw {
            // Raw answers are never paired with requests: nothing to remember.
            self.pending.push_back(Pending {
                head: method == "HEAD",
                connect,
                switch: self.req_switch,
                http10: version == 0,
                close: !keeps,
            });
        }
        // One at a time, the driver takes each request's facts before the next head.
        let paired = self.resp != Resp::Raw || self.one_at_a_time;
        if let Some(book) = self.log.as_mut().filter(|_| paired) {
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .map(|h| String::from_utf8_lossy(h.value).into_owned());
            book.open.push_back(Logged {
                method: method.to_string(),
                authority: host,
                target: path.to_string(),
                http10: version == 0,
                ..Logged::default()
            });
        }
        self.req_forwarded = true;
        if body == Req::Head {
            self.request_done();
        } else {
            self.req = body;
        }
        Ok(HeadEnd::Complete(n))
    }

    /// Writes the request head as the server will see it: the client's request line and
    /// fields, except `X-Forwarded-For` (merged into one, the client appended),
    /// `X-Forwarded-Proto` (replaced: a client cannot claim `https` over plain HTTP), the
    /// fields about the client's connection only (RFC 9110 7.6.1: `Keep-Alive`,
    /// `Proxy-Connection` and the fields its `Connection` names, unless they frame or
    /// route the request) and the `Connection` options `towards` changes. Of the
    /// client's `Connection` options only those about the message pass (`close`,
    /// `keep-alive`, `upgrade`, `te`: the server's connection carries the same request and
    /// the same framing).
    fn write_request_head(
        &self,
        method: &str,
        path: &str,
        version: u8,
        headers: &[httparse::Header<'_>],
        towards: Towards,
        out: &mut Vec<u8>,
    ) {
        out.extend_from_slice(method.as_bytes());
        out.push(b' ');
        out.extend_from_slice(path.as_bytes());
        out.extend_from_slice(if version == 0 {
            b" HTTP/1.0\r\n"
        } else {
            b" HTTP/1.1\r\n"
        });
        let named = if towards.names {
            connection_names(headers, is_message_option)
        } else {
            Vec::new()
        };
        let mut xff: Vec<&[u8]> = Vec::new();
        for h in headers {
            let name = h.name.as_bytes();
            if is_hop_field(name) || (names(&named, name) && !frames_or_routes(name)) {
                continue;
            }
            if name.eq_ignore_ascii_case(b"upgrade") {
                // `h2c` (and `h2`) left out: a server that switched would be spoken to in
                // HTTP/2 through a raw tunnel, each request of it unseen by quill (no
                // `X-Forwarded-For` of its own): h2c smuggling. NGINX never forwards
                // `Upgrade` unless told to; HAProxy forwards it as it came.
                if !towards.upgrade {
                    continue;
                }
                if list(h.value).any(is_http2_token) {
                    write_list(out, name, list(h.value).filter(|p| !is_http2_token(p)));
                    continue;
                }
            }
            if name.eq_ignore_ascii_case(b"x-forwarded-for") {
                let v = h.value.trim_ascii();
                if !v.is_empty() {
                    xff.push(v);
                }
                continue;
            }
            if name.eq_ignore_ascii_case(b"x-forwarded-proto") {
                continue;
            }
            if name.eq_ignore_ascii_case(b"connection") {
                let kept = list(h.value).filter(|t| {
                    is_message_option(t)
                        && !(towards.drop_close && t.eq_ignore_ascii_case(b"close"))
                        && (towards.upgrade || !t.eq_ignore_ascii_case(b"upgrade"))
                });
                write_list(out, name, kept);
                continue;
            }
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(h.value);
            out.extend_from_slice(b"\r\n");
        }
        if towards.add_keep_alive {
            out.extend_from_slice(b"Connection: keep-alive\r\n");
        }
        out.extend_from_slice(b"X-Forwarded-For: ");
        for v in xff {
            out.extend_from_slice(v);
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(self.client_text.as_bytes());
        out.extend_from_slice(b"\r\nX-Forwarded-Proto: ");
        out.extend_from_slice(self.params.scheme.as_bytes());
        out.extend_from_slice(b"\r\n\r\n");
    }

    /// Feeds bytes from the server; what goes to the client is appended to `out` (or, with
    /// `Verbatim`, is the input itself). Always consumes everything.
    pub fn server_bytes(&mut self, input: &[u8], out: &mut Vec<u8>) -> Fed {
        self.head_alone = false;
        if matches!(self.resp, Resp::Raw | Resp::Tunnel) && self.resp_head.is_empty() {
            if let Some(l) = self.logged_out() {
                l.body_out += input.len() as u64;
            }
            return Fed::Verbatim;
        }
        let mut pos = 0;
        let mut head_came = false;
        while pos < input.len() {
            let rest = &input[pos..];
            if self.unsolicited() {
                // Bytes after the end of every answer due: a body sent to a `HEAD` or with
                // a 204/304, or an answer no request asked for. Relayed, they would be the
                // answer to the client's next request (its answers shifted by one, or
                // whatever a server chose to put there); dropped instead, and the server's
                // connection, out of step, is not used again.
                self.discard_surplus();
                return Fed::Consumed(input.len());
            }
            head_came |= self.resp == Resp::Head;
            pos += match self.resp {
                Resp::Head => self.response_head(rest, out),
                Resp::Body(left) => {
                    let n = left.min(rest.len() as u64) as usize;
                    out.extend_from_slice(&rest[..n]);
                    if let Some(l) = self.logged_out() {
                        l.body_out += n as u64;
                    }
                    self.resp = if left == n as u64 {
                        self.response_done();
                        Resp::Head
                    } else {
                        Resp::Body(left - n as u64)
                    };
                    n
                }
                Resp::Chunked(state) => {
                    let mut data = 0;
                    let (n, next) = chunked(state, rest, RESPONSE_HEAD_MAX, &mut data);
                    out.extend_from_slice(&rest[..n]);
                    if let Some(l) = self.logged_out() {
                        l.body_out += data;
                    }
                    match next {
                        Ok(Some(state)) => self.resp = Resp::Chunked(state),
                        Ok(None) => {
                            self.response_done();
                            self.resp = Resp::Head;
                        }
                        Err(_) => self.give_up_responses(),
                    }
                    n
                }
                Resp::UntilClose | Resp::Tunnel | Resp::Raw => {
                    out.extend_from_slice(rest);
                    if let Some(l) = self.logged_out() {
                        l.body_out += rest.len() as u64;
                    }
                    rest.len()
                }
                Resp::Discard => rest.len(),
            };
        }
        self.head_alone = head_came
            && matches!(
                self.resp,
                Resp::Body(_) | Resp::Chunked(_) | Resp::UntilClose
            );
        Fed::Consumed(pos)
    }

    /// Whether the server's bytes just fed brought a response head (the last one in
    /// them), and not all of its body. A server that writes an answer in two writes (the
    /// head, or the head and the start of the body, then the rest) with Nagle's algorithm
    /// on (no `TCP_NODELAY`) holds the second back until the first is acknowledged, and
    /// the kernel delays that acknowledgement (up to 40 ms) unless the reader asks for it
    /// at once (`TCP_QUICKACK`).
    pub fn head_awaits_body(&self) -> bool {
        self.head_alone
    }

    /// Handles bytes while expecting a response head; returns how many were consumed.
    fn response_head(&mut self, input: &[u8], out: &mut Vec<u8>) -> usize {
        let before = self.resp_head.len();
        if before == 0 {
            if worth_parsing(input, 0, 0) {
                match self.parse_response(input, out) {
                    Some(HeadEnd::Complete(n)) => return n,
                    Some(HeadEnd::Partial) => {}
                    None => {
                        out.extend_from_slice(input);
                        return input.len();
                    }
                }
            }
            if input.len() > RESPONSE_HEAD_MAX {
                self.give_up_responses();
                out.extend_from_slice(input);
                return input.len();
            }
            self.resp_head.extend_from_slice(input);
            self.resp_scanned = input.len();
            return input.len();
        }
        let take = input
            .len()
            .min((RESPONSE_HEAD_MAX + 1).saturating_sub(before));
        self.resp_head.extend_from_slice(&input[..take]);
        let scan_from = self.resp_scanned.saturating_sub(2);
        self.resp_scanned = self.resp_head.len();
        if worth_parsing(&self.resp_head, before, scan_from) {
            let head = std::mem::take(&mut self.resp_head);
            self.resp_scanned = 0;
            match self.parse_response(&head, out) {
                Some(HeadEnd::Complete(n)) => return n.saturating_sub(before),
                Some(HeadEnd::Partial) => {
                    self.resp_head = head;
                    self.resp_scanned = self.resp_head.len();
                }
                None => {
                    out.extend_from_slice(&head);
                    return take;
                }
            }
        }
        if self.resp_head.len() > RESPONSE_HEAD_MAX {
            let head = std::mem::take(&mut self.resp_head);
            self.give_up_responses();
            out.extend_from_slice(&head);
        }
        take
    }

    /// Parses a response head at the start of `buf` and forwards it. `None`: not a
    /// response quill can frame; responses are passed raw from then on (the caller
    /// forwards `buf`).
    fn parse_response(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Option<HeadEnd> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        let parsed = response_parser().parse_response(&mut resp, buf);
        let n = match parsed {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Some(HeadEnd::Partial),
            // On a connection that carried earlier answers, bytes that are no answer are
            // most likely what the server owed an earlier request and sent late (a body to
            // a `HEAD`): passed raw, they would be this client's answer, though they may
            // have been written for another client. quill's 502 instead, as HAProxy's.
            Err(_) if self.one_at_a_time && self.server_reused => {
                self.bad_gateway(BadAnswer::NotHttp, out);
                return Some(HeadEnd::Complete(buf.len()));
            }
            Err(_) => {
                self.give_up_responses();
                return None;
            }
        };
        let code = resp.code.unwrap_or_default();
        let mut lengths = Lengths::default();
        let mut chunked: Option<bool> = None;
        let mut has_hsts = false;
        let mut options = ConnectionOptions::default();
        // `Keep-Alive`, `Proxy-Connection`: about the server's connection only.
        let mut hop_fields = false;
        for h in resp.headers.iter() {
            let name = h.name.as_bytes();
            if name.eq_ignore_ascii_case(b"connection") {
                options.read(h.value);
            } else if name.eq_ignore_ascii_case(b"content-length") {
                lengths.read(h.value);
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                if let Some(last) = list(h.value).last() {
                    let coding = last.split(|&b| b == b';').next().unwrap_or_default();
                    chunked = Some(coding.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                }
            } else if name.eq_ignore_ascii_case(b"strict-transport-security") {
                has_hsts = true;
            } else if is_hop_field(name) {
                hop_fields = true;
            }
        }
        let head = &buf[..n];
        let request = self.pending.front().copied().unwrap_or_default();
        if let Some(l) = self.logged_out() {
            if code >= 200 || code == 101 {
                l.status = code;
            }
        }
        if code < 200 {
            // Interim (100 Continue, 103 Early Hints) and 101 Switching Protocols pass as
            // they are: a 101's `Connection: upgrade` and `Upgrade` are what the client
            // asked for.
            out.extend_from_slice(head);
            if code == 101 {
                // Switching protocols: a tunnel from here on, both ways.
                self.statuses.count(code);
                self.pending.pop_front();
                self.enter_tunnel();
            } else {
                // The final response follows.
                self.resp_started = true;
            }
            return Some(HeadEnd::Complete(n));
        }
        let bodyless = request.head || code == 204 || code == 304;
        let length = match lengths.judge(chunked.is_some(), bodyless) {
            Ok(length) => length,
            Err(why) => {
                // Which length the client would take cannot be known: a 502 in its place
                // (as HAProxy; NGINX 1.22 passes both with a 200), and neither connection
                // goes on (RFC 9112 6.3: unrecoverable).
                self.bad_gateway(why, out);
                return Some(HeadEnd::Complete(n));
            }
        };
        self.statuses.count(code);
        let hsts = match self.params.hsts {
            Some(h) if self.params.scheme == Scheme::Https && !has_hsts => Some(h),
            _ => None,
        };
        if request.connect && (200..300).contains(&code) {
            write_with_hsts(head, hsts, out);
            self.pending.pop_front();
            self.enter_tunnel();
            return Some(HeadEnd::Complete(n));
        }
        let server_keeps = options.keeps(resp.version != Some(0));
        self.server_keep &= server_keeps;
        if request.close {
            // This answer's own request asked to close: it, and every answer after it, says
            // so. The requests pipelined before it keep their answers' say.
            self.client_keep = false;
        }
        if !self.one_at_a_time {
            // The server's connection is the client's: it ends with it.
            self.client_keep &= server_keeps;
        }
        let framing = if bodyless {
            Resp::Head
        } else {
            match (chunked, length) {
                (Some(true), _) => Resp::Chunked(CHUNK_START),
                (Some(false), _) | (None, None) => Resp::UntilClose,
                (None, Some(len)) => Resp::Body(len),
            }
        };
        if framing == Resp::UntilClose {
            // The body ends with the server's connection, and so does the client's.
            self.client_keep = false;
        }
        // The answer that ends a closing connection: the only one due, and no other
        // request begun.
        let closes = self.closing
            && self.pending.len() == 1
            && self.req == Req::Head
            && self.req_head.is_empty();
        if closes {
            self.last = true;
        }
        // What the client must read in the answer's `Connection` field, and what it
        // would read in the server's (its default by the older of the two versions).
        let client_keeps = self.client_keep && !closes;
        let says_keep = options.keeps(resp.version != Some(0) && !request.http10);
        let verbatim = !hop_fields && !options.names && says_keep == client_keeps;
        // A length beside a transfer coding means nothing (the coding frames the body),
        // and RFC 9112 6.3 has an intermediary remove it: a client that believed it
        // would read the rest of the body as the next answer.
        let drop_length = chunked.is_some() && lengths.present();
        if verbatim && !drop_length {
            write_with_hsts(head, hsts, out);
        } else {
            write_own_connection(
                head,
                &resp.headers[..],
                Own {
                    keeps: client_keeps,
                    drop_length,
                },
                hsts,
                out,
            );
        }
        self.resp_started = true;
        self.resp = framing;
        match framing {
            Resp::Head => self.response_done(),
            Resp::Body(0) => {
                self.response_done();
                self.resp = Resp::Head;
            }
            _ => {}
        }
        Some(HeadEnd::Complete(n))
    }

    /// The server closed its side: a body delimited by the close is complete. A request
    /// still waiting for its answer's head (none of it forwarded, or only interim ones)
    /// gets quill's 502 in `out`, as HAProxy's and NGINX's clients get theirs, rather than
    /// a connection closed in silence; a head cut short is dropped with it.
    pub fn server_closed(&mut self, out: &mut Vec<u8>) {
        // Only a close that ends no answer of its own (after a close-delimited body, what
        // follows would read as more of that body), and not after an answer that told the
        // client the connection ends (the requests it pipelined go unanswered, as it knows).
        // A head held back that cannot be an answer's is passed raw, as it would have been
        // had the rest of it come (and had it not been, on a reused connection).
        let unanswered = self.resp == Resp::Head
            && !self.pending.is_empty()
            && self.client_keep
            && !self.client_closed
            && ((self.one_at_a_time && self.server_reused) || !broken_head(&self.resp_head));
        if self.resp == Resp::UntilClose {
            self.response_done();
        }
        if unanswered {
            self.answer_bad_gateway(out);
        } else {
            // Otherwise the client gets every byte the server sent.
            out.append(&mut self.resp_head);
            self.resp_head = Vec::new();
        }
    }

    /// quill's 502 in place of an answer that cannot be framed; the server's bytes are
    /// dropped from here on, and the client's connection ends after it
    /// ([`Exchange::finished`]): the requests pipelined after this one go unanswered, as
    /// its `Connection: close` tells the client.
    fn bad_gateway(&mut self, why: BadAnswer, out: &mut Vec<u8>) {
        self.bad_answer = Some(why);
        self.answer_bad_gateway(out);
    }

    /// quill's 502 for the request being answered (logged so); the requests after it go
    /// unanswered, and neither connection is used again.
    fn answer_bad_gateway(&mut self, out: &mut Vec<u8>) {
        if let Some(l) = self.logged_out() {
            l.status = 502;
        }
        out.extend_from_slice(&self.own_answer(BAD_GATEWAY));
        self.response_done();
        self.pending.clear();
        self.discard();
    }

    /// Drops whatever the server sends from here on; neither connection is used again.
    fn discard(&mut self) {
        self.resp = Resp::Discard;
        self.resp_head = Vec::new();
        self.resp_started = false;
        self.server_keep = false;
        self.client_keep = false;
        self.last = true;
    }

    /// Whether server bytes now would answer no request: every request forwarded has
    /// its whole answer, at least one came (a server that speaks first, not HTTP, still
    /// passes raw), and no head has begun.
    fn unsolicited(&self) -> bool {
        self.answers > 0
            && self.pending.is_empty()
            && self.resp == Resp::Head
            && self.resp_head.is_empty()
    }

    /// Drops the server's surplus bytes. Request by request, the client's connection goes
    /// on (its answer was whole) and only the server's ends ([`Exchange::server_keeps`]);
    /// when the server's connection is the client's own, both end after the answers
    /// already forwarded.
    fn discard_surplus(&mut self) {
        if self.one_at_a_time {
            self.server_keep = false;
        } else {
            self.resp = Resp::Discard;
            self.server_keep = false;
            self.last = true;
        }
    }

    /// The end of a final response: its request is answered.
    fn response_done(&mut self) {
        self.resp_started = false;
        self.answers = self.answers.saturating_add(1);
        if let Some(book) = &mut self.log {
            if let Some(l) = book.open.pop_front() {
                book.answered.push_back(l);
            }
        }
        let answered = self.pending.pop_front();
        if answered.is_some_and(|p| p.switch) && self.req == Req::AwaitDecision {
            // The server did not switch protocols: HTTP continues.
            self.req = Req::Head;
        }
    }

    fn enter_tunnel(&mut self) {
        self.resp = Resp::Tunnel;
        self.resp_started = false;
        if !matches!(self.req, Req::Failed(_)) {
            self.req = Req::Tunnel;
        }
        self.req_head = Vec::new();
    }

    /// Stops following responses (the server's bytes pass through untouched).
    fn give_up_responses(&mut self) {
        self.resp = Resp::Raw;
        self.resp_head = Vec::new();
        self.pending.clear();
        self.resp_started = false;
        if self.req == Req::AwaitDecision {
            self.req = Req::Tunnel;
        }
    }

    /// When the client's request was refused: the response to send now, once the answers
    /// to its earlier requests have been forwarded. After it the connection closes and
    /// nothing more from the server may be forwarded. `None` while earlier answers are
    /// still due, and after it was handed out once.
    pub fn take_refusal(&mut self) -> Option<Cow<'static, [u8]>> {
        let Req::Failed(refusal) = self.req else {
            return None;
        };
        if self.refusal_sent {
            return None;
        }
        let at_boundary = self.resp == Resp::Head && self.resp_head.is_empty();
        let due = self.resp == Resp::Raw
            || (at_boundary && self.pending.is_empty())
            || (at_boundary && self.req_forwarded && self.pending.len() == 1 && !self.resp_started);
        if !due {
            return None;
        }
        self.refusal_sent = true;
        Some(self.own_answer(refusal.response()))
    }

    /// What the client is sent when no server could take its connection (one server
    /// connection per client connection, chosen after the first head): its refusal if that
    /// head was refused (a `400` needs no server), else quill's 503 for the first request
    /// (its access log status). Requests pipelined behind it go unanswered, as the answer's
    /// `Connection: close` tells the client.
    pub fn unserved(&mut self) -> Cow<'static, [u8]> {
        if let Some(refusal) = self.take_refusal() {
            return refusal;
        }
        if let Some(l) = self.logged_out() {
            l.status = 503;
        }
        self.own_answer(UNAVAILABLE)
    }

    /// One of quill's own answers (head and body in one) as this connection sends it:
    /// with `Strict-Transport-Security` over TLS when `hsts` is set, as every answer.
    pub fn own_answer(&self, answer: &'static [u8]) -> Cow<'static, [u8]> {
        let hsts = self
            .params
            .hsts
            .filter(|_| self.params.scheme == Scheme::Https);
        let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n");
        let (Some(_), Some(end)) = (hsts, head_end) else {
            return Cow::Borrowed(answer);
        };
        let mut out = Vec::with_capacity(answer.len() + 64);
        write_with_hsts(&answer[..end + 4], hsts, &mut out);
        out.extend_from_slice(&answer[end + 4..]);
        Cow::Owned(out)
    }
}

/// The options of a head's `Connection` fields (RFC 9110 7.6.1); also what `h1_client`
/// reads of a server's answer.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ConnectionOptions {
    close: bool,
    keep_alive: bool,
    /// Some option names a field (`Upgrade`, or any other): one about this hop only.
    names: bool,
}

impl ConnectionOptions {
    /// Adds the options of one `Connection` field; true when this field names another
    /// field (one about this hop only).
    pub(super) fn read(&mut self, value: &[u8]) -> bool {
        let mut names = false;
        for token in list(value) {
            if token.eq_ignore_ascii_case(b"close") {
                self.close = true;
            } else if token.eq_ignore_ascii_case(b"keep-alive") {
                self.keep_alive = true;
            } else {
                names = true;
            }
        }
        self.names |= names;
        names
    }

    /// Whether the connection goes on: `close` ends it, `keep-alive` keeps it (HTTP/1.0),
    /// else `by_default` (the version's default) stands.
    pub(super) fn keeps(self, by_default: bool) -> bool {
        !self.close && (self.keep_alive || by_default)
    }
}

/// `Keep-Alive`, `Proxy-Connection` and `HTTP2-Settings`: fields about one connection
/// whether or not `Connection` names them (RFC 7540 3.2.1 says `HTTP2-Settings` is, and a
/// client that leaves it out of `Connection` must not get it to the server: with
/// `Upgrade: h2c` it switches an h2c server's connection to HTTP/2).
fn is_hop_field(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"keep-alive")
        || name.eq_ignore_ascii_case(b"proxy-connection")
        || name.eq_ignore_ascii_case(b"http2-settings")
}

/// An `Upgrade` protocol naming HTTP/2 (`h2c`, or `h2`, which RFC 7540 3.2 says is never
/// upgraded to over cleartext): never forwarded, so that no server switches a connection
/// quill relays to HTTP/2, whose requests would pass through it as tunnel bytes.
pub(super) fn is_http2_token(protocol: &[u8]) -> bool {
    let name = protocol.split(|&b| b == b'/').next().unwrap_or_default();
    let name = name.trim_ascii();
    name.eq_ignore_ascii_case(b"h2c") || name.eq_ignore_ascii_case(b"h2")
}

/// The authority of an absolute-form `http` or `https` target and the port its scheme
/// implies; `None` for any other form.
fn absolute_authority(target: &str) -> Option<(&[u8], &'static [u8])> {
    let t = target.as_bytes();
    let (rest, port): (&[u8], &'static [u8]) =
        if t.len() >= 7 && t[..7].eq_ignore_ascii_case(b"http://") {
            (&t[7..], b"80")
        } else if t.len() >= 8 && t[..8].eq_ignore_ascii_case(b"https://") {
            (&t[8..], b"443")
        } else {
            return None;
        };
    let end = rest
        .iter()
        .position(|&b| matches!(b, b'/' | b'?' | b'#'))
        .unwrap_or(rest.len());
    Some((&rest[..end], port))
}

/// Writes the field `name` with the comma-separated `items`; nothing if there are none.
fn write_list<'a>(out: &mut Vec<u8>, name: &[u8], items: impl Iterator<Item = &'a [u8]>) {
    let mut items = items.peekable();
    if items.peek().is_none() {
        return;
    }
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(item);
    }
    out.extend_from_slice(b"\r\n");
}

/// Whether a `Host` value names the authority of an absolute-form target: the same host
/// (case aside) and port, a missing port being the scheme's; the target's user
/// information (`user@`), which `Host` never carries, left out.
pub(super) fn same_authority((target, default_port): (&[u8], &[u8]), host: &[u8]) -> bool {
    let target = match target.iter().rposition(|&b| b == b'@') {
        Some(at) => &target[at + 1..],
        None => target,
    };
    let (th, tp) = host_and_port(target);
    let (hh, hp) = host_and_port(host.trim_ascii());
    th.eq_ignore_ascii_case(hh) && tp.unwrap_or(default_port) == hp.unwrap_or(default_port)
}

/// An authority's host (an IPv6 literal with its brackets) and port, if it has one.
fn host_and_port(a: &[u8]) -> (&[u8], Option<&[u8]>) {
    let host_end = if a.first() == Some(&b'[') {
        a.iter().position(|&b| b == b']').map_or(a.len(), |p| p + 1)
    } else {
        a.iter().position(|&b| b == b':').unwrap_or(a.len())
    };
    let (host, rest) = a.split_at(host_end);
    let port = rest.strip_prefix(b":").filter(|p| !p.is_empty());
    (host, port)
}

/// The options of a head's `Connection` fields that `passes` does not let through: the
/// fields they name are about this hop only. More names than a head has fields can only
/// repeat or name nothing: bounded.
fn connection_names<'h>(
    headers: &[httparse::Header<'h>],
    passes: fn(&[u8]) -> bool,
) -> Vec<&'h [u8]> {
    headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("connection"))
        .flat_map(|h| list(h.value))
        .filter(|t| !passes(t))
        .take(MAX_HEADERS)
        .collect()
}

/// Whether `name` is among the fields `named` (by [`connection_names`]).
fn names(named: &[&[u8]], name: &[u8]) -> bool {
    named.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// The `Connection` options a request's forwarded head keeps: about the connection's
/// end (quill's relay follows them) or about the message itself (an upgrade, trailers).
fn is_message_option(token: &[u8]) -> bool {
    [b"close".as_slice(), b"keep-alive", b"upgrade", b"te"]
        .iter()
        .any(|o| token.eq_ignore_ascii_case(o))
}

/// Fields a `Connection` option may name but that quill forwards all the same: the server
/// must find the request's end where quill did (a body framed by a field the server never
/// saw would be read as the next request) and its `Host`.
fn frames_or_routes(name: &[u8]) -> bool {
    [b"content-length".as_slice(), b"transfer-encoding", b"host"]
        .iter()
        .any(|f| name.eq_ignore_ascii_case(f))
}

/// Writes a response head as the server sent it, with HSTS inserted before its empty line
/// (the server's line ends kept) when due.
fn write_with_hsts(head: &[u8], hsts: Option<Hsts>, out: &mut Vec<u8>) {
    let Some(h) = hsts else {
        out.extend_from_slice(head);
        return;
    };
    let eol: &[u8] = if head.ends_with(b"\r\n") {
        b"\r\n"
    } else {
        b"\n"
    };
    let split = head.len().saturating_sub(eol.len());
    out.extend_from_slice(&head[..split]);
    write_hsts(h, eol, out);
    out.extend_from_slice(&head[split..]);
}

/// The `Strict-Transport-Security` line, ended as the head's other lines are.
fn write_hsts(h: Hsts, eol: &[u8], out: &mut Vec<u8>) {
    let _ = write!(out, "Strict-Transport-Security: {}", h.header_value());
    out.extend_from_slice(eol);
}

/// How [`write_own_connection`] changes a response head.
#[derive(Debug, Clone, Copy)]
struct Own {
    /// The client's connection goes on (`Connection: keep-alive`, else `close`).
    keeps: bool,
    /// `Content-Length` is left out (a transfer coding frames the body).
    drop_length: bool,
}

/// quill's answer in place of a server's that cannot be framed, or that failed (the same
/// words on every path: the byte pump, `h1_pump`, and `gateway` for HTTP/2 clients).
pub(super) const BAD_GATEWAY: &[u8] =
    b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: 12\r\nConnection: close\r\n\r\nBad Gateway\n";

/// quill's answer when no server could take a request.
pub(super) const UNAVAILABLE: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 20\r\nConnection: close\r\n\r\nService Unavailable\n";

/// The `Content-Length` fields of one answer, judged by the rules of both paths that read
/// HTTP/1.1 answers (the byte pump's `Exchange`, and `h1_client` for HTTP/2 clients), so
/// that a client gets the same answer whichever way it came.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Lengths {
    /// The first value that is a number.
    number: Option<u64>,
    /// A field was there.
    present: bool,
    /// Two numbers differ, in one field (`2, 40`) or two.
    differ: bool,
    /// A value is no number (a sign, letters, empty, too long).
    bad: bool,
}

impl Lengths {
    /// Takes in one `Content-Length` field's value.
    pub(super) fn read(&mut self, value: &[u8]) {
        self.present = true;
        self.differ |= lengths_disagree(value);
        match content_length(value) {
            Some(n) => {
                self.differ |= self.number.is_some_and(|first| first != n);
                self.number.get_or_insert(n);
            }
            None => self.bad = true,
        }
    }

    /// Whether the answer has a `Content-Length` field.
    pub(super) fn present(&self) -> bool {
        self.present
    }

    /// The length that frames the body, if one does. Lengths that differ are refused
    /// whatever the answer (which one the client believes cannot be known); one that is no
    /// number only when it would frame the body: not beside a transfer coding (`coded`,
    /// which frames the body instead: the length is dropped, RFC 9112 6.3), nor on an
    /// answer without a body (`bodyless`: to a `HEAD`, 204, 304).
    pub(super) fn judge(&self, coded: bool, bodyless: bool) -> Result<Option<u64>, BadAnswer> {
        if self.differ {
            Err(BadAnswer::TwoLengths)
        } else if !self.bad {
            Ok(self.number)
        } else if coded || bodyless {
            Ok(None)
        } else {
            Err(BadAnswer::BadLength)
        }
    }
}

/// `digits` without its leading zeros.
fn without_leading_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|&&b| b == b'0').count();
    &digits[zeros..]
}

/// Whether one `Content-Length` field lists numbers that differ (`2, 40`).
fn lengths_disagree(v: &[u8]) -> bool {
    // Compared as digits without their leading zeros: `02` and `2` agree, at any length
    // (slices of the field: nothing allocated for each answer).
    let mut numbers = list(v).filter(|p| p.iter().all(u8::is_ascii_digit));
    let Some(first) = numbers.next().map(without_leading_zeros) else {
        return false;
    };
    numbers.any(|p| without_leading_zeros(p) != first)
}

/// Writes a response head with quill's own `Connection` field: the server's status line
/// and fields, without those about the server's connection only (`Connection`,
/// `Keep-Alive`, `Proxy-Connection`, the fields `Connection` names, and the lines that
/// continue them), then `Connection: keep-alive` or `close` as the client's connection
/// goes on or not and, when due, HSTS; the server's line ends are kept. `headers` are the
/// head's fields as parsed. The fields that frame the body are never left out: the
/// client must find its end where quill did.
fn write_own_connection(
    head: &[u8],
    headers: &[httparse::Header<'_>],
    own: Own,
    hsts: Option<Hsts>,
    out: &mut Vec<u8>,
) {
    let keeps = own.keeps;
    let named = connection_names(headers, |t| {
        t.eq_ignore_ascii_case(b"close") || t.eq_ignore_ascii_case(b"keep-alive")
    });
    let hop = |name: &[u8]| {
        if name.eq_ignore_ascii_case(b"content-length") {
            return own.drop_length;
        }
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return false;
        }
        name.eq_ignore_ascii_case(b"connection") || is_hop_field(name) || names(&named, name)
    };
    let mut lines = head.split_inclusive(|&b| b == b'\n');
    let Some(status) = lines.next() else {
        return;
    };
    out.extend_from_slice(status);
    let crlf = status.ends_with(b"\r\n");
    let mut dropping = false;
    for line in lines {
        let content = line.strip_suffix(b"\n").unwrap_or(line);
        let content = content.strip_suffix(b"\r").unwrap_or(content);
        if content.is_empty() {
            break; // the empty line that ends the head
        }
        if matches!(content[0], b' ' | b'\t') {
            // An obsolete continuation of the field before.
            if !dropping {
                out.extend_from_slice(line);
            }
            continue;
        }
        let name = content
            .split(|&b| b == b':')
            .next()
            .unwrap_or_default()
            .trim_ascii();
        dropping = hop(name);
        if !dropping {
            out.extend_from_slice(line);
        }
    }
    let eol: &[u8] = if crlf { b"\r\n" } else { b"\n" };
    out.extend_from_slice(if keeps {
        b"Connection: keep-alive"
    } else {
        b"Connection: close"
    });
    out.extend_from_slice(eol);
    if let Some(h) = hsts {
        write_hsts(h, eol, out);
    }
    out.extend_from_slice(eol);
}

/// Whether parsing the head buffered in `buf` (of which the first `before` bytes were
/// there already) can tell more than last time: these are its first bytes, the head may
/// be complete, its first line just ended (a line that is not HTTP is refused without
/// waiting for the rest), or it is still short enough that a wrong start shows cheaply.
/// Bounds the work on a head sent in small pieces to about linear.
fn worth_parsing(buf: &[u8], before: usize, scan_from: usize) -> bool {
    let (old, new) = buf.split_at(before.min(buf.len()));
    before == 0
        || buf.len() <= 16
        || find_head_end(buf, scan_from).is_some()
        || (new.contains(&b'\n') && !old.contains(&b'\n'))
}

/// Whether a response head cut short is already no answer (what [`Exchange`] passes raw).
fn broken_head(buf: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    response_parser().parse_response(&mut resp, buf).is_err()
}

/// How response heads are parsed: as leniently as RFC 9112 lets a recipient be.
fn response_parser() -> httparse::ParserConfig {
    let mut config = httparse::ParserConfig::default();
    config
        .allow_obsolete_multiline_headers_in_responses(true)
        .allow_spaces_after_header_name_in_responses(true);
    config
}

/// Where the empty line ending a head could be: a complete head contains `\n\n` or
/// `\n\r\n`. Searching only new bytes (from `from`) keeps a slowly sent head linear.
fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    let tail = buf.get(from..)?;
    tail.windows(2)
        .position(|w| w == b"\n\n")
        .or_else(|| tail.windows(3).position(|w| w == b"\n\r\n"))
        .map(|p| from + p)
}

/// `Content-Length`: digits, or a list of the same number repeated (RFC 9110 8.6).
fn content_length(v: &[u8]) -> Option<u64> {
    let mut result: Option<u64> = None;
    for part in v.split(|&b| b == b',') {
        let p = part.trim_ascii();
        if p.is_empty() || p.len() > 18 || !p.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = p
            .iter()
            .fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0'));
        if result.is_some_and(|r| r != n) {
            return None;
        }
        result = Some(n);
    }
    result
}

/// The non-empty elements of a comma-separated field value.
fn list(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|p| !p.is_empty())
}

/// Advances through a chunked body. Returns the bytes consumed (all part of the body, to
/// be forwarded) and the next state: `Ok(None)` when the body (with its trailers) ended.
/// The chunks' data bytes among them are added to `data`.
fn chunked(
    mut state: Chunk,
    input: &[u8],
    trailer_max: usize,
    data: &mut u64,
) -> (usize, Result<Option<Chunk>, Refusal>) {
    let mut pos = 0;
    while pos < input.len() {
        if let Chunk::Data(left) = state {
            let n = left.min((input.len() - pos) as u64);
            pos += n as usize;
            *data += n;
            state = if n == left {
                Chunk::DataCr
            } else {
                Chunk::Data(left - n)
            };
            continue;
        }
        let b = input[pos];
        pos += 1;
        state = match state {
            Chunk::Size {
                size,
                digits,
                ext,
                len,
            } => {
                if len + 1 > CHUNK_LINE_MAX {
                    return (pos, Err(Refusal::BadRequest));
                }
                let len = len + 1;
                match b {
                    b'\r' if digits > 0 => Chunk::SizeLf { size },
                    _ if ext => {
                        if b == b'\n' || (b < 0x20 && b != b'\t') || b == 0x7f {
                            return (pos, Err(Refusal::BadRequest));
                        }
                        Chunk::Size {
                            size,
                            digits,
                            ext,
                            len,
                        }
                    }
                    _ if b.is_ascii_hexdigit() && digits < 15 && len == usize::from(digits) + 1 => {
                        let d = (b as char).to_digit(16).unwrap_or(0);
                        Chunk::Size {
                            size: size * 16 + u64::from(d),
                            digits: digits + 1,
                            ext,
                            len,
                        }
                    }
                    b' ' | b'\t' | b';' if digits > 0 => Chunk::Size {
                        size,
                        digits,
                        ext: b == b';',
                        len,
                    },
                    _ => return (pos, Err(Refusal::BadRequest)),
                }
            }
            Chunk::SizeLf { size } => match b {
                b'\n' if size == 0 => Chunk::Trailer {
                    line: 0,
                    cr: false,
                    total: 0,
                },
                b'\n' => Chunk::Data(size),
                _ => return (pos, Err(Refusal::BadRequest)),
            },
            Chunk::DataCr => match b {
                b'\r' => Chunk::DataLf,
                _ => return (pos, Err(Refusal::BadRequest)),
            },
            Chunk::DataLf => match b {
                b'\n' => CHUNK_START,
                _ => return (pos, Err(Refusal::BadRequest)),
            },
            Chunk::Trailer { line, cr, total } => {
                let total = total + 1;
                if total > trailer_max {
                    return (pos, Err(Refusal::TooLarge));
                }
                match (b, cr) {
                    (b'\n', true) if line == 0 => return (pos, Ok(None)),
                    (b'\n', true) => Chunk::Trailer {
                        line: 0,
                        cr: false,
                        total,
                    },
                    (b'\r', false) => Chunk::Trailer {
                        line,
                        cr: true,
                        total,
                    },
                    (b'\n' | b'\r', _) | (_, true) => return (pos, Err(Refusal::BadRequest)),
                    (_, false) => Chunk::Trailer {
                        line: line + 1,
                        cr: false,
                        total,
                    },
                }
            }
            Chunk::Data(_) => state,
        };
    }
    (pos, Ok(Some(state)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(scheme: Scheme, hsts: Option<Hsts>) -> HttpParams {
        HttpParams {
            client: "127.0.0.9".parse().unwrap(),
            scheme,
            header_max: 1024,
            hsts,
        }
    }

    fn exchange() -> Exchange {
        Exchange::new(params(Scheme::Http, None))
    }

    /// Feeds `input` in pieces of `step` bytes, as the driver would (held bytes re-fed).
    fn client(ex: &mut Exchange, input: &[u8], step: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut held: Vec<u8> = Vec::new();
        for piece in input.chunks(step.max(1)) {
            held.extend_from_slice(piece);
            let mut o = Vec::new();
            match ex.client_bytes(&held, &mut o) {
                Fed::Verbatim => {
                    out.extend_from_slice(&held);
                    held.clear();
                }
                Fed::Consumed(n) => {
                    out.extend_from_slice(&o);
                    held.drain(..n);
                }
            }
        }
        out
    }

    fn server(ex: &mut Exchange, input: &[u8]) -> Vec<u8> {
        let mut o = Vec::new();
        match ex.server_bytes(input, &mut o) {
            Fed::Verbatim => input.to_vec(),
            Fed::Consumed(n) => {
                assert_eq!(n, input.len());
                o
            }
        }
    }

    const XFF: &str = "X-Forwarded-For: 127.0.0.9\r\nX-Forwarded-Proto: http\r\n\r\n";

    #[test]
    fn what_the_access_log_needs_is_kept_per_request_only_when_asked() {
        let mut ex = exchange();
        ex.request_by_request();
        client(&mut ex, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", 1000);
        assert_eq!(ex.take_logged(), None, "not asked for: nothing kept");
        server(&mut ex, b"HTTP/1.1 204 No Content\r\n\r\n");
        ex.resume();
        ex.log_requests(true);
        // A chunked upload counts its data, not its framing; an interim answer is not
        // the status; a chunked answer likewise.
        client(
            &mut ex,
            b"POST /up?x=1 HTTP/1.1\r\nhost: example.org\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\n\r\n",
            7,
        );
        server(&mut ex, b"HTTP/1.1 100 Continue\r\n\r\n");
        assert_eq!(ex.logged_newest().map(|l| l.status), Some(0));
        assert_eq!(ex.take_answered(), None, "not answered yet");
        server(
            &mut ex,
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nmade\r\n0\r\n\r\n",
        );
        let want = Logged {
            method: "POST".into(),
            authority: Some("example.org".into()),
            target: "/up?x=1".into(),
            http10: false,
            status: 201,
            body_in: 8,
            body_out: 4,
            arrived: None,
        };
        assert_eq!(ex.take_logged(), Some(want));
        assert_eq!(ex.take_logged(), None, "taken once");
        // The next request starts afresh: no Host, HTTP/1.0, a sized answer.
        ex.resume();
        client(&mut ex, b"HEAD /h HTTP/1.0\r\n\r\n", 1000);
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n");
        let l = ex.take_logged().unwrap();
        assert_eq!(
            (l.authority.as_deref(), l.http10, l.status),
            (None, true, 200)
        );
        assert_eq!(
            (l.body_in, l.body_out),
            (0, 0),
            "a HEAD's answer has no body"
        );
        ex.resume();
        client(&mut ex, b"GET /g HTTP/1.1\r\n\r\n", 1000);
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab");
        server(&mut ex, b"cde");
        assert_eq!(ex.take_logged().map(|l| l.body_out), Some(5));
        // A tunnel after a 101: every byte each way counts, forwarded verbatim or not; the
        // request stays open as long as the tunnel.
        ex.resume();
        client(
            &mut ex,
            b"GET /ws HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
            1000,
        );
        server(
            &mut ex,
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\nhi",
        );
        server(&mut ex, b"there");
        client(&mut ex, b"ping", 1);
        assert_eq!(ex.take_answered(), None);
        let l = ex.take_logged().unwrap();
        assert_eq!((l.status, l.body_in, l.body_out), (101, 4, 7));
        ex.log_requests(false);
        client(&mut ex, b"more", 1);
        assert_eq!(ex.take_logged(), None);
    }

    #[test]
    fn a_head_that_came_without_all_of_its_body_is_known() {
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /a HTTP/1.1\r\n\r\nHEAD /b HTTP/1.1\r\n\r\nGET /c HTTP/1.1\r\n\r\n",
            1000,
        );
        // An interim answer is not the head of a body.
        server(&mut ex, b"HTTP/1.1 100 Continue\r\n\r\n");
        assert!(!ex.head_awaits_body());
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n");
        assert!(
            ex.head_awaits_body(),
            "the body comes in a write of its own"
        );
        server(&mut ex, b"ab");
        assert!(!ex.head_awaits_body(), "no head in these bytes");
        // A HEAD's answer has no body; the next head and its whole body come together.
        server(
            &mut ex,
            b"cdHTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert!(ex.head_awaits_body(), "the last head's chunks are to come");
        server(&mut ex, b"1\r\nx\r\n0\r\n\r\n");
        assert!(!ex.head_awaits_body());
        assert!(ex.answered());
        // A head with the start of its body: the rest is awaited; with all of it, nothing.
        client(
            &mut ex,
            b"GET /d HTTP/1.1\r\n\r\nGET /e HTTP/1.1\r\n\r\n",
            1000,
        );
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab");
        assert!(ex.head_awaits_body());
        server(&mut ex, b"cdHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx");
        assert!(!ex.head_awaits_body(), "both answers are whole");
    }

    #[test]
    fn pipelined_requests_are_logged_each_with_its_own_answer() {
        // One server connection for the client's (not request by request): heads come
        // before their answers, and answers end in order.
        let mut ex = exchange();
        ex.log_requests(true);
        client(
            &mut ex,
            b"GET /a HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nxyz\
              GET /c HTTP/1.1\r\n\r\n",
            1000,
        );
        let t = Arrival::now();
        ex.stamp_arrivals(|| t);
        assert_eq!(ex.take_answered(), None);
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        server(
            &mut ex,
            b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n",
        );
        let a = ex.take_answered().unwrap();
        let b = ex.take_answered().unwrap();
        assert_eq!(ex.take_answered(), None, "/c is still waiting");
        assert_eq!(
            (
                a.target.as_str(),
                a.status,
                a.body_in,
                a.body_out,
                a.arrived
            ),
            ("/a", 200, 0, 2, Some(t))
        );
        assert_eq!(
            (b.target.as_str(), b.status, b.body_in, b.body_out),
            ("/b", 201, 3, 0)
        );
        // A head after the stamp gets a later one; the earlier keep theirs.
        client(&mut ex, b"GET /d HTTP/1.1\r\n\r\n", 1000);
        let later = Arrival::now();
        ex.stamp_arrivals(|| later);
        server(
            &mut ex,
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
        );
        let c = ex.take_answered().unwrap();
        assert_eq!(
            (c.target.as_str(), c.status, c.arrived),
            ("/c", 404, Some(t))
        );
        // The connection ends before /d's answer: it is left, unanswered.
        let d = ex.take_logged().unwrap();
        assert_eq!(
            (d.target.as_str(), d.status, d.arrived),
            ("/d", 0, Some(later))
        );
        assert_eq!(ex.take_logged(), None);
    }

    #[test]
    fn an_answer_that_comes_before_the_body_leaves_the_request_answered() {
        let mut ex = exchange();
        ex.request_by_request();
        client(
            &mut ex,
            b"POST /up HTTP/1.1\r\nContent-Length: 100\r\n\r\nab",
            1000,
        );
        assert!(!ex.answered(), "the request waits for its answer");
        server(
            &mut ex,
            b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 3\r\n",
        );
        assert!(!ex.answered(), "half a head is no answer");
        server(&mut ex, b"\r\nto");
        assert!(!ex.answered(), "nor is part of a body");
        server(&mut ex, b"o");
        assert!(ex.answered());
        assert!(!ex.between(), "the client is still sending its body");
        // An interim answer is not the request's.
        let mut ex = exchange();
        client(
            &mut ex,
            b"PUT /up HTTP/1.1\r\nContent-Length: 9\r\n\r\n",
            1000,
        );
        server(&mut ex, b"HTTP/1.1 100 Continue\r\n\r\n");
        assert!(!ex.answered());
    }

    #[test]
    fn every_request_of_a_keep_alive_connection_gets_the_headers() {
        let input = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET /c HTTP/1.0\r\n\r\n";
        let expected = format!(
            "GET /a HTTP/1.1\r\nHost: x\r\n{XFF}POST /b HTTP/1.1\r\nContent-Length: 5\r\n{XFF}helloGET /c HTTP/1.0\r\n{XFF}"
        );
        for step in [1, 2, 3, 7, 16, 1000] {
            let mut ex = exchange();
            assert_eq!(
                String::from_utf8_lossy(&client(&mut ex, input, step)),
                expected,
                "step {step}"
            );
            assert_eq!(ex.pending.len(), 3);
        }
    }

    #[test]
    fn existing_forwarded_headers_are_appended_to_or_replaced() {
        let mut ex = exchange();
        let out = client(
            &mut ex,
            b"GET / HTTP/1.1\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: https\r\nx-forwarded-for: 10.0.0.2, 10.0.0.3\r\n\r\n",
            1000,
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "GET / HTTP/1.1\r\nX-Forwarded-For: 10.0.0.1, 10.0.0.2, 10.0.0.3, 127.0.0.9\r\nX-Forwarded-Proto: http\r\n\r\n"
        );
        let mut tls = Exchange::new(params(Scheme::Https, None));
        let out = client(&mut tls, b"GET / HTTP/1.1\r\n\r\n", 1000);
        assert!(String::from_utf8_lossy(&out).contains("X-Forwarded-Proto: https\r\n"));
    }

    #[test]
    fn chunked_bodies_pass_verbatim_with_trailers() {
        let body = b"5;ext=1\r\nhello\r\n10\r\n0123456789abcdef\r\n0\r\nTrailer: yes\r\n\r\n";
        let mut input = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        input.extend_from_slice(body);
        input.extend_from_slice(b"GET /next HTTP/1.1\r\n\r\n");
        for step in [1, 5, 1000] {
            let mut ex = exchange();
            let out = client(&mut ex, &input, step);
            let expected = [
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n".as_slice(),
                XFF.as_bytes(),
                body,
                b"GET /next HTTP/1.1\r\n",
                XFF.as_bytes(),
            ]
            .concat();
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&expected)
            );
        }
    }

    #[test]
    fn malformed_requests_are_refused() {
        for (input, refusal) in [
            (&b"garbage garbage\r\n\r\n"[..], Refusal::BadRequest),
            (b"GET / HTTP/2.0\r\n\r\n", Refusal::BadRequest),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: \r\n\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                Refusal::BadRequest,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc",
                Refusal::BadRequest,
            ),
        ] {
            for step in [1, 1000] {
                let mut ex = exchange();
                client(&mut ex, input, step);
                assert_eq!(
                    ex.refusal(),
                    Some(refusal),
                    "{:?}",
                    String::from_utf8_lossy(input)
                );
            }
        }
        let mut big = b"GET / HTTP/1.1\r\n".to_vec();
        big.extend(std::iter::repeat_n(b"X-A: b\r\n", 200).flatten());
        for step in [1, 100, 5000] {
            let mut ex = exchange();
            client(&mut ex, &big, step);
            assert_eq!(ex.refusal(), Some(Refusal::TooLarge));
        }
        // Equal repeated lengths are one length.
        let mut ex = exchange();
        client(
            &mut ex,
            b"POST / HTTP/1.1\r\nContent-Length: 2, 2\r\n\r\nok",
            1000,
        );
        assert_eq!(ex.refusal(), None);
        assert_eq!(ex.req, Req::Head);
    }

    #[test]
    fn a_refusal_waits_for_earlier_answers() {
        let mut ex = exchange();
        client(&mut ex, b"GET /1 HTTP/1.1\r\n\r\nBAD\r\n\r\n", 1000);
        assert_eq!(ex.refusal(), Some(Refusal::BadRequest));
        assert_eq!(ex.take_refusal(), None, "the answer to /1 is due first");
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no");
        assert_eq!(ex.take_refusal(), None);
        server(&mut ex, b"k");
        assert_eq!(
            ex.take_refusal().as_deref(),
            Some(Refusal::BadRequest.response())
        );
        assert_eq!(ex.take_refusal(), None, "handed out once");
    }

    #[test]
    fn the_wait_for_a_head_is_known_and_ends_in_408() {
        let mut ex = exchange();
        assert!(
            ex.awaiting_head(),
            "a new connection waits for its first head"
        );
        assert!(!ex.head_started());
        client(&mut ex, b"GET /1 HTTP/1.1\r\n\r\n", 1000);
        assert!(!ex.awaiting_head(), "the answer is the server's to give");
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n");
        assert!(!ex.awaiting_head(), "the answer is not over");
        server(&mut ex, b"x");
        assert!(ex.awaiting_head(), "keep-alive: the next head is due");
        // A body is not a head.
        client(
            &mut ex,
            b"POST /2 HTTP/1.1\r\nContent-Length: 9\r\n\r\nabc",
            1000,
        );
        assert!(!ex.awaiting_head());
        client(&mut ex, b"defghi", 1000);
        // A pipelined head begun while an answer is due is waited for.
        client(&mut ex, b"GET /3 HTT", 1000);
        assert!(ex.head_started() && ex.awaiting_head());
        ex.head_timed_out();
        assert_eq!(ex.refusal(), Some(Refusal::Timeout));
        assert!(!ex.awaiting_head() && !ex.accepts_client_bytes());
        assert_eq!(ex.take_refusal(), None, "the answer to /2 is due first");
        server(&mut ex, b"HTTP/1.1 204 No Content\r\n\r\n");
        let answer = ex.take_refusal().unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 408 Request Timeout\r\n"));
        let text = String::from_utf8_lossy(&answer);
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("\r\nConnection: close"));
        assert!(head.contains(&format!("\r\nContent-Length: {}", body.len())));
        // Not while the client is held back (an Upgrade waiting for its answer).
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            1000,
        );
        assert!(!ex.awaiting_head());
    }

    #[test]
    fn upgrade_waits_for_the_answer() {
        let mut ex = exchange();
        let req = b"GET /ws HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
        let mut input = req.to_vec();
        input.extend_from_slice(b"\x81\x05hello");
        let mut out = Vec::new();
        let Fed::Consumed(n) = ex.client_bytes(&input, &mut out) else {
            panic!("verbatim")
        };
        assert_eq!(n, req.len(), "frames after the upgrade wait");
        assert!(!ex.accepts_client_bytes());
        let answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x02hi";
        assert_eq!(server(&mut ex, answer), answer);
        assert!(ex.accepts_client_bytes());
        assert_eq!(ex.client_bytes(b"\x81\x05hello", &mut out), Fed::Verbatim);
        assert_eq!(
            ex.server_bytes(b"GET / HTTP/1.1\r\n\r\n", &mut out),
            Fed::Verbatim
        );

        // Declined: HTTP goes on, with the headers.
        let mut ex = exchange();
        client(&mut ex, req, 1000);
        assert!(!ex.accepts_client_bytes());
        server(
            &mut ex,
            b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
        );
        assert!(ex.accepts_client_bytes());
        let out = client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 1000);
        assert!(String::from_utf8_lossy(&out).contains("X-Forwarded-For"));
    }

    #[test]
    fn connect_tunnels_on_success_only() {
        let mut ex = exchange();
        client(&mut ex, b"CONNECT a:443 HTTP/1.1\r\n\r\n", 1000);
        server(&mut ex, b"HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!(
            ex.client_bytes(b"\x16\x03\x01", &mut Vec::new()),
            Fed::Verbatim
        );
        let mut ex = exchange();
        client(&mut ex, b"CONNECT a:443 HTTP/1.1\r\n\r\n", 1000);
        server(
            &mut ex,
            b"HTTP/1.1 403 Forbidden\r\nContent-Length: 1\r\n\r\nx",
        );
        assert!(ex.accepts_client_bytes());
        assert!(matches!(
            ex.client_bytes(b"GET", &mut Vec::new()),
            Fed::Consumed(3)
        ));
    }

    #[test]
    fn responses_are_framed_and_untouched() {
        let mut ex = exchange();
        client(
            &mut ex,
            b"HEAD / HTTP/1.1\r\n\r\nGET /a HTTP/1.1\r\nExpect: 100-continue\r\n\r\nGET /b HTTP/1.1\r\n\r\nGET /c HTTP/1.1\r\n\r\nGET /d HTTP/1.1\r\n\r\n",
            1000,
        );
        assert_eq!(ex.pending.len(), 5);
        let answers: &[&[u8]] = &[
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
            b"HTTP/1.0 200 OK\r\n\r\nuntil close",
        ];
        let all = answers.concat();
        for step in [1, 3, 1000] {
            let mut ex2 = exchange();
            client(
                &mut ex2,
                b"HEAD / HTTP/1.1\r\n\r\nGET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\nGET /c HTTP/1.1\r\n\r\nGET /d HTTP/1.1\r\n\r\n",
                1000,
            );
            let mut out = Vec::new();
            for piece in all.chunks(step) {
                out.extend(server(&mut ex2, piece));
            }
            assert_eq!(out, all, "step {step}");
            assert_eq!(
                ex2.pending.len(),
                1,
                "the close-delimited answer is still open"
            );
            let mut after = Vec::new();
            ex2.server_closed(&mut after);
            assert!(ex2.pending.is_empty());
            assert!(
                after.is_empty(),
                "the close ends the body: nothing follows it"
            );
        }
    }

    #[test]
    fn a_client_that_leaves_abandons_the_requests_still_waiting_for_answers() {
        // Two pipelined requests; the first's answer begun, the second's not: both are
        // abandoned, the first logged with its status, the second 499.
        let mut ex = exchange();
        ex.log_requests(true);
        client(
            &mut ex,
            b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
            1000,
        );
        server(
            &mut ex,
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234",
        );
        assert!(ex.answer_due());
        ex.client_closed();
        ex.client_left();
        assert_eq!(ex.take_abandoned(), 2);
        let statuses: Vec<u16> =
            std::iter::from_fn(|| ex.take_logged().map(|l| l.status)).collect();
        assert_eq!(statuses, [200, CLIENT_CLOSED_REQUEST]);
        // The server, told of it by the client's EOF, closes without answering: quill
        // answers nothing in its place.
        let mut ex = exchange();
        client(&mut ex, b"GET /a HTTP/1.1\r\n\r\n", 1000);
        ex.client_closed();
        let mut out = Vec::new();
        ex.server_closed(&mut out);
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
        assert_eq!(ex.take_abandoned(), 1);
        // Or it answers all the same: the answer passes (logged with its status), and the
        // request was abandoned all the same (a client that only half-closed reads it).
        let mut ex = exchange();
        ex.log_requests(true);
        client(&mut ex, b"GET /a HTTP/1.1\r\n\r\n", 1000);
        ex.client_closed();
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        assert!(!ex.answer_due());
        assert_eq!(ex.take_abandoned(), 1);
        assert_eq!(ex.take_logged().map(|l| l.status), Some(200));
        // Every answer given: nothing is abandoned.
        let mut ex = exchange();
        client(&mut ex, b"GET /a HTTP/1.1\r\n\r\n", 1000);
        server(&mut ex, b"HTTP/1.1 204 No Content\r\n\r\n");
        assert!(!ex.answer_due());
        ex.client_left();
        assert_eq!(ex.take_abandoned(), 0);
        // Nor in a tunnel, whose end is no request's.
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /ws HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
            1000,
        );
        server(
            &mut ex,
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
        );
        ex.client_left();
        assert_eq!(ex.take_abandoned(), 0);
    }

    #[test]
    fn a_server_that_closes_before_answering_leaves_the_client_quills_502() {
        // Nothing of an answer yet, or an interim one, or a head cut short: the client
        // gets the 502 (and `Connection: close`), logged as such, and the statuses tally
        // none of the server's.
        for sent in [
            &b""[..],
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-",
        ] {
            let mut ex = exchange();
            ex.log_requests(true);
            client(&mut ex, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", 1000);
            server(&mut ex, sent);
            let mut out = Vec::new();
            ex.server_closed(&mut out);
            let answer = String::from_utf8_lossy(&out);
            assert!(answer.starts_with("HTTP/1.1 502 "), "{sent:?}: {answer}");
            assert!(answer.contains("Connection: close"), "{answer}");
            assert!(ex.finished());
            assert_eq!(ex.take_logged().map(|l| l.status), Some(502));
            assert_eq!(ex.take_statuses(), Tally::default(), "{sent:?}");
        }
        // After an answer that said `Connection: close`, the requests pipelined behind it
        // go unanswered, as the client was told.
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
            1000,
        );
        server(
            &mut ex,
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        let mut out = Vec::new();
        ex.server_closed(&mut out);
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
        // Between requests, a close leaves nothing to answer.
        let mut ex = exchange();
        client(&mut ex, b"GET /a HTTP/1.1\r\n\r\n", 1000);
        server(&mut ex, b"HTTP/1.1 204 No Content\r\n\r\n");
        let mut out = Vec::new();
        ex.server_closed(&mut out);
        assert!(out.is_empty());
        assert_eq!(ex.take_statuses(), Tally::of(204));
    }

    #[test]
    fn hsts_only_on_tls_and_final_responses() {
        let hsts = Hsts {
            max_age: 63072000,
            include_subdomains: true,
            preload: false,
        };
        let resp = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        let mut tls = Exchange::new(params(Scheme::Https, Some(hsts)));
        client(&mut tls, b"GET / HTTP/1.1\r\n\r\n", 1000);
        assert_eq!(
            String::from_utf8_lossy(&server(&mut tls, resp)),
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\nStrict-Transport-Security: max-age=63072000; includeSubDomains\r\n\r\n"
        );
        // The server's own policy wins.
        client(&mut tls, b"GET / HTTP/1.1\r\n\r\n", 1000);
        let own =
            b"HTTP/1.1 200 OK\r\nStrict-Transport-Security: max-age=1\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(server(&mut tls, own), own);
        // A head whose lines end in a bare LF gets its HSTS line ended the same way.
        client(&mut tls, b"GET / HTTP/1.1\r\n\r\n", 1000);
        assert_eq!(
            String::from_utf8_lossy(&server(
                &mut tls,
                b"HTTP/1.1 204 No Content\nServer: lf\n\n"
            )),
            "HTTP/1.1 204 No Content\nServer: lf\nStrict-Transport-Security: max-age=63072000; includeSubDomains\n\n"
        );
        let mut plain = Exchange::new(params(Scheme::Http, Some(hsts)));
        client(&mut plain, b"GET / HTTP/1.1\r\n\r\n", 1000);
        assert_eq!(server(&mut plain, resp), resp);
    }

    #[test]
    fn request_by_request_takes_one_request_and_pauses_until_its_answer() {
        let mut ex = exchange();
        ex.request_by_request();
        let two = b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n";
        let mut out = Vec::new();
        // Only the first request is taken; the second waits, unread by the exchange.
        let Fed::Consumed(n) = ex.client_bytes(two, &mut out) else {
            panic!("a head is consumed, not passed verbatim");
        };
        assert_eq!(n, 19);
        assert!(!ex.accepts_client_bytes());
        assert!(!ex.at_boundary());
        assert!(ex.replayable());
        // A body in pieces and the end of the answer make the boundary.
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no");
        assert!(!ex.at_boundary());
        server(&mut ex, b"k");
        assert!(ex.at_boundary() && ex.server_keeps());
        ex.resume();
        assert!(!ex.at_boundary());
        let rest = client(&mut ex, &two[n..], 1000);
        assert!(String::from_utf8_lossy(&rest).starts_with("GET /b HTTP/1.1\r\n"));
    }

    #[test]
    fn request_by_request_knows_when_the_connections_end() {
        // After `resp` answered `req` on a new exchange: whether the client's and the
        // server's connections go on, and the answer as the client got it.
        let answer = |req: &[u8], resp: &[u8]| {
            let mut ex = exchange();
            ex.request_by_request();
            client(&mut ex, req, 1000);
            let out = server(&mut ex, resp);
            assert!(
                ex.at_boundary(),
                "answered: {}",
                String::from_utf8_lossy(resp)
            );
            let out = String::from_utf8(out).unwrap();
            (ex.client_keeps(), ex.server_keeps(), out)
        };
        let get = b"GET / HTTP/1.1\r\n\r\n";
        let ok = b"HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(
            answer(get, ok),
            (true, true, "HTTP/1.1 204 No Content\r\n\r\n".into())
        );
        // The server's `close` ends its own connection, not the client's.
        assert_eq!(
            answer(get, b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"),
            (
                true,
                false,
                "HTTP/1.1 204 No Content\r\nConnection: keep-alive\r\n\r\n".into()
            )
        );
        // The client's `close` ends its connection, not the server's: the server does not
        // hear of it, the client's answer says it.
        let mut ex = exchange();
        ex.request_by_request();
        let sent = client(
            &mut ex,
            b"GET / HTTP/1.1\r\nConnection: Close\r\nX: 1\r\nConnection: TE, close\r\n\r\n",
            1000,
        );
        assert_eq!(
            String::from_utf8_lossy(&sent),
            format!("GET / HTTP/1.1\r\nX: 1\r\nConnection: TE\r\n{XFF}")
        );
        assert_eq!(
            String::from_utf8_lossy(&server(&mut ex, ok)),
            "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
        );
        assert!(!ex.client_keeps() && ex.server_keeps());
        // An HTTP/1.0 answer with a length: the server closes, the client's connection
        // goes on and is told so.
        assert_eq!(
            answer(get, b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"),
            (
                true,
                false,
                "HTTP/1.0 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n".into()
            )
        );
        let (_, server_keeps, _) = answer(
            get,
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
        );
        assert!(server_keeps);
        // An HTTP/1.0 request without keep-alive ends the client's connection only: the
        // server is asked to keep its own, and the client's answer says close.
        let mut ex = exchange();
        ex.request_by_request();
        let sent = client(
            &mut ex,
            b"GET / HTTP/1.0\r\nConnection: close\r\n\r\n",
            1000,
        );
        assert_eq!(
            String::from_utf8_lossy(&sent),
            format!("GET / HTTP/1.0\r\nConnection: keep-alive\r\n{XFF}")
        );
        assert_eq!(
            String::from_utf8_lossy(&server(
                &mut ex,
                b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"
            )),
            "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        assert!(!ex.client_keeps() && ex.server_keeps());
        // An answer without `Connection` already says close to an HTTP/1.0 client.
        assert_eq!(
            answer(
                b"GET / HTTP/1.0\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
            ),
            (
                false,
                true,
                "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".into()
            )
        );
        // With keep-alive both go on, and the client's answer must say so.
        assert_eq!(
            answer(
                b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
            ),
            (
                true,
                true,
                "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n".into()
            )
        );
        // A server that closed between requests ends its connection, not the client's.
        let mut ex = exchange();
        ex.request_by_request();
        client(&mut ex, get, 1000);
        server(&mut ex, ok);
        ex.server_left();
        assert!(!ex.server_keeps() && ex.client_keeps());
        ex.new_server(false);
        assert!(ex.server_keeps());
        // Only bodiless requests of idempotent methods may be sent twice.
        ex.resume();
        client(
            &mut ex,
            b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            1000,
        );
        assert!(!ex.replayable());
        server(&mut ex, ok);
        ex.resume();
        client(
            &mut ex,
            b"PUT / HTTP/1.1\r\nContent-Length: 1\r\n\r\nx",
            1000,
        );
        assert!(!ex.replayable());
    }

    #[test]
    fn an_earlier_answer_of_a_pipeline_keeps_alive_when_a_later_request_asks_to_close() {
        // One server connection per client's: every request head of the pipeline is read
        // before the first answer comes. Each answer says what its own request asked.
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\n\r\nGET /3 HTTP/1.1\r\nConnection: close\r\n\r\n",
            1000,
        );
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx";
        for _ in 0..2 {
            let out = server(&mut ex, ok);
            assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(ok));
            assert!(ex.client_keeps());
        }
        // The answer to the request that asked to close says it, whatever the server wrote.
        assert_eq!(
            String::from_utf8_lossy(&server(&mut ex, ok)),
            "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
        );
        assert!(!ex.client_keeps() && ex.between());
        // Fed a byte at a time, with an HTTP/1.0 request that did not ask to keep alive as
        // the closing one.
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.0\r\n\r\n",
            1,
        );
        let out = server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no"
        );
        assert!(ex.client_keeps());
        assert_eq!(server(&mut ex, b"k"), b"k");
        // The server's own `close` for the HTTP/1.0 request passes as it came.
        let last = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(
            String::from_utf8_lossy(&server(&mut ex, last)),
            String::from_utf8_lossy(last)
        );
        assert!(!ex.client_keeps());
    }

    #[test]
    fn every_answer_after_the_one_to_a_request_that_asked_to_close_says_close() {
        // A server ought to answer nothing after the request that asked to close (RFC 9112
        // 9.6); one that does anyway is not made to look as if the connection went on.
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /1 HTTP/1.1\r\nConnection: close\r\n\r\nGET /2 HTTP/1.1\r\n\r\n",
            1000,
        );
        let ok = b"HTTP/1.1 204 No Content\r\n\r\n";
        let close = "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n";
        assert_eq!(String::from_utf8_lossy(&server(&mut ex, ok)), close);
        assert!(!ex.client_keeps());
        assert_eq!(String::from_utf8_lossy(&server(&mut ex, ok)), close);
        assert!(!ex.client_keeps());
        // A later request's head asking to close does not undo an earlier `keep-alive`
        // of an HTTP/1.0 client either.
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /2 HTTP/1.0\r\n\r\n",
            1000,
        );
        let ok10 = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(
            String::from_utf8_lossy(&server(&mut ex, ok10)),
            String::from_utf8_lossy(ok10)
        );
        assert!(ex.client_keeps());
        assert_eq!(
            String::from_utf8_lossy(&server(
                &mut ex,
                b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"
            )),
            "HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"
        );
        assert!(!ex.client_keeps());
    }

    #[test]
    fn hop_by_hop_fields_of_an_answer_stay_behind() {
        let resp = b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Drop\r\nX-Drop: 1\r\nKeep-Alive: timeout=5,\r\n max=9\r\nX-Keep: 2\r\nProxy-Connection: keep-alive\r\nContent-Length: 2\r\n\r\nok";
        let kept =
            "HTTP/1.1 200 OK\r\nX-Keep: 2\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok";
        for by_request in [false, true] {
            let mut ex = exchange();
            if by_request {
                ex.request_by_request();
            }
            client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 1000);
            assert_eq!(String::from_utf8_lossy(&server(&mut ex, resp)), kept);
            assert!(ex.client_keeps() && ex.server_keeps());
        }
        // An `Upgrade` offer outside a 101 is the server's hop too; the fields that frame
        // the body stay whatever `Connection` names.
        let mut ex = exchange();
        client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 1000);
        let out = server(
            &mut ex,
            b"HTTP/1.1 200 OK\r\nUpgrade: h2c\r\nConnection: Upgrade, Content-Length\r\nContent-Length: 2\r\n\r\nok",
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
        );
        assert!(ex.between(), "the answer ended where its length said");
        // A body delimited by the close ends the client's connection too, and says so.
        let mut ex = exchange();
        ex.request_by_request();
        client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 1000);
        let out = server(&mut ex, b"HTTP/1.1 200 OK\r\n\r\nto the end");
        assert_eq!(
            String::from_utf8_lossy(&out),
            "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the end"
        );
        assert!(!ex.client_keeps());
    }

    #[test]
    fn hop_by_hop_fields_of_a_request_stay_behind() {
        // The fields about the client's connection to quill do not reach the server
        // (RFC 9110 7.6.1), in either mode; a named field that frames the body or routes
        // the request passes all the same, or the server would read its body as the next
        // request.
        let req = b"POST / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, X-Drop, Content-Length, Host\r\nX-Drop: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nX-Keep: 2\r\nContent-Length: 2\r\n\r\nok";
        for by_request in [false, true] {
            let mut ex = exchange();
            if by_request {
                ex.request_by_request();
            }
            assert_eq!(
                String::from_utf8_lossy(&client(&mut ex, req, 1000)),
                format!(
                    "POST / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\nX-Keep: 2\r\nContent-Length: 2\r\n{XFF}ok"
                )
            );
        }
        // An upgrade keeps its `Upgrade` and the option that names it; what else the
        // client's connection carried stays behind.
        let mut ex = exchange();
        ex.request_by_request();
        let sent = client(
            &mut ex,
            b"GET / HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: websocket\r\nHTTP2-Settings: AAA\r\n\r\n",
            7,
        );
        assert_eq!(
            String::from_utf8_lossy(&sent),
            format!("GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n{XFF}")
        );
    }

    #[test]
    fn a_closing_connection_ends_after_the_answer_that_leaves_none_pending() {
        let mut ex = exchange();
        // Asked between requests: the next request is still taken.
        assert!(ex.between());
        ex.close_after_answer();
        assert!(ex.accepts_client_bytes());
        client(&mut ex, b"GET /a HTTP/1.1\r\n\r\n", 1000);
        let out = server(
            &mut ex,
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5,\r\n max=9\r\nContent-Length: 2\r\n\r\n",
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
        );
        // No more requests are read; the body goes on, then the connection is done.
        assert!(!ex.accepts_client_bytes());
        assert!(!ex.finished());
        assert_eq!(server(&mut ex, b"ok"), b"ok");
        assert!(ex.finished());
    }

    #[test]
    fn a_closing_connection_answers_pipelined_requests_first() {
        let mut ex = Exchange::new(params(
            Scheme::Https,
            Some(Hsts {
                max_age: 1,
                include_subdomains: false,
                preload: false,
            }),
        ));
        client(
            &mut ex,
            b"GET /1 HTTP/1.1\r\n\r\nHEAD /2 HTTP/1.1\r\n\r\n",
            1000,
        );
        ex.close_after_answer();
        let first = b"HTTP/1.1 200 OK\nContent-Length: 1\n\nx";
        assert_eq!(
            String::from_utf8_lossy(&server(&mut ex, first)),
            "HTTP/1.1 200 OK\nContent-Length: 1\nStrict-Transport-Security: max-age=1\n\nx"
        );
        assert!(ex.accepts_client_bytes() && !ex.finished());
        // The last one due: LF line ends kept, HSTS after `Connection: close`.
        assert_eq!(
            String::from_utf8_lossy(&server(
                &mut ex,
                b"HTTP/1.1 204 No Content\nConnection: Keep-Alive\n\n"
            )),
            "HTTP/1.1 204 No Content\nConnection: close\nStrict-Transport-Security: max-age=1\n\n"
        );
        assert!(ex.finished());
    }

    #[test]
    fn close_now_ends_a_connection_only_between_requests() {
        let mut ex = exchange();
        client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 1000);
        ex.close_now();
        assert!(!ex.finished() && ex.accepts_client_bytes());
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        // Part of a next head is not between requests either.
        client(&mut ex, b"GET /ne", 1000);
        ex.close_now();
        assert!(!ex.finished());
        client(&mut ex, b"xt HTTP/1.1\r\n\r\n", 1000);
        server(&mut ex, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        ex.close_now();
        assert!(ex.finished() && !ex.accepts_client_bytes());
    }

    #[test]
    fn a_closing_connection_switches_to_a_tunnel_unchanged() {
        let mut ex = exchange();
        client(
            &mut ex,
            b"GET /ws HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
            1000,
        );
        ex.close_after_answer();
        let switch = b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
        assert_eq!(server(&mut ex, switch), switch);
        assert!(!ex.finished() && ex.accepts_client_bytes());
    }

    #[test]
    fn non_http_servers_pass_raw() {
        let mut ex = exchange();
        client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 1000);
        assert_eq!(server(&mut ex, b"hello\nworld"), b"hello\nworld");
        assert_eq!(ex.server_bytes(b"more", &mut Vec::new()), Fed::Verbatim);
        // Requests are still rewritten.
        let out = client(&mut ex, b"GET /2 HTTP/1.1\r\n\r\n", 1000);
        assert!(String::from_utf8_lossy(&out).contains("X-Forwarded-For"));
        for _ in 0..1000 {
            client(&mut ex, b"GET /n HTTP/1.1\r\n\r\n", 1000);
        }
        assert!(
            ex.pending.is_empty(),
            "nothing is remembered for raw answers"
        );
        // And a refusal is due at once: answers cannot be followed.
        client(&mut ex, b"\x00\x01\r\n\r\n", 1000);
        assert!(ex.take_refusal().is_some());
    }

    #[test]
    fn an_absolute_target_must_name_its_host() {
        for (target, host, passes) in [
            ("http://a.example/x", "a.example", true),
            ("http://a.example/x", "A.EXAMPLE:80", true),
            ("https://a.example?q", "a.example:443", true),
            ("http://u@a.example:8080#f", "a.example:8080", true),
            ("http://[::1]:8080/", "[::1]:8080", true),
            ("http://[::1]/", "[::1]:8080", false),
            ("http://a.example:8080/", "a.example", false),
            ("http://admin.internal/", "a.example", false),
            // Not absolute-form: `Host` alone names the site.
            ("/x", "a.example", true),
        ] {
            let mut ex = exchange();
            let req = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n");
            client(&mut ex, req.as_bytes(), 1000);
            let refused = ex.refusal() == Some(Refusal::BadRequest);
            assert_eq!(!refused, passes, "{target} with Host {host}");
        }
    }

    #[test]
    fn an_h2c_upgrade_goes_on_as_a_plain_request() {
        let mut ex = exchange();
        let out = client(
            &mut ex,
            b"GET / HTTP/1.1\r\nConnection: Upgrade, keep-alive\r\nUpgrade: h2c\r\nHTTP2-Settings: AAA\r\n\r\n",
            1000,
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("GET / HTTP/1.1\r\nConnection: keep-alive\r\n{XFF}")
        );
        assert!(!ex.pending[0].switch, "no upgrade waits for its answer");
        let mut ex = exchange();
        let out = client(
            &mut ex,
            b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c, websocket\r\n\r\n",
            1000,
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n{XFF}")
        );
        assert!(ex.pending[0].switch);
    }

    #[test]
    fn ipv6_and_mapped_clients() {
        let mut p = params(Scheme::Http, None);
        p.client = "::ffff:10.1.2.3".parse().unwrap();
        let mut ex = Exchange::new(p.clone());
        assert!(
            String::from_utf8_lossy(&client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 99))
                .contains("X-Forwarded-For: 10.1.2.3\r\n")
        );
        p.client = "2001:db8::7".parse().unwrap();
        let mut ex = Exchange::new(p);
        assert!(
            String::from_utf8_lossy(&client(&mut ex, b"GET / HTTP/1.1\r\n\r\n", 99))
                .contains("X-Forwarded-For: 2001:db8::7\r\n")
        );
    }
}
