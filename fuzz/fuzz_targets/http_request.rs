//! HTTP request framing and rewriting (`http`): never panics; the output does not depend on
//! how the input is split into reads; the consumed count never exceeds the input; and body
//! bytes (Content-Length and chunked, built from the fuzz input) come out verbatim, in order,
//! between the rewritten heads. Taken request by request (each answered before the next
//! is read, as `proxy::h1_pump` drives it), the same bytes reach the servers but for the
//! `Connection` fields, which quill writes for its pooled server connections; the access
//! log's facts pair every answer with one request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::proxy::http::{Exchange, Fed, HttpParams, Scheme};

fn exchange() -> Exchange {
    let mut ex = Exchange::new(HttpParams {
        client: "192.0.2.1".parse().unwrap(),
        scheme: Scheme::Http,
        header_max: 512,
        hsts: None,
    });
    // What the access log keeps is taken from the same parse: it must change nothing.
    ex.log_requests(true);
    ex
}

/// Feeds `input` split at the sizes `steps` cycles through, re-feeding what the exchange
/// held back, as the driver does. Returns the output and whether a refusal happened.
fn feed(input: &[u8], steps: &[u8]) -> (Vec<u8>, bool) {
    let mut ex = exchange();
    let mut out = Vec::new();
    let mut held = Vec::new();
    let mut pos = 0;
    let mut i = 0;
    while pos < input.len() {
        let step = steps
            .get(i % steps.len().max(1))
            .map_or(input.len(), |s| usize::from(*s) + 1);
        i += 1;
        let end = (pos + step).min(input.len());
        held.extend_from_slice(&input[pos..end]);
        pos = end;
        let mut o = Vec::new();
        match ex.client_bytes(&held, &mut o) {
            Fed::Verbatim => {
                out.extend_from_slice(&held);
                held.clear();
            }
            Fed::Consumed(n) => {
                assert!(n <= held.len());
                out.extend_from_slice(&o);
                held.drain(..n);
            }
        }
        if ex.refusal().is_some() || !ex.accepts_client_bytes() {
            break;
        }
    }
    (out, ex.refusal().is_some())
}

/// The answer the driver feeds whenever the exchange stops taking the client's bytes.
const ANSWER: &[u8] = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";

/// Like [`feed`], but answers the requests whenever the exchange stops taking bytes
/// (every request when `by_request`; else a full pipeline or an `Upgrade` waiting for its
/// answer) and goes on, resuming at each boundary. Returns what went to the servers.
fn feed_answered(input: &[u8], steps: &[u8], by_request: bool) -> Vec<u8> {
    let mut ex = exchange();
    if by_request {
        ex.request_by_request();
    }
    let mut fed_answers = 0;
    let mut out = Vec::new();
    let mut held = Vec::new();
    let mut pos = 0;
    let mut i = 0;
    while pos < input.len() || !held.is_empty() {
        if pos < input.len() {
            let step = steps
                .get(i % steps.len().max(1))
                .map_or(input.len(), |s| usize::from(*s) + 1);
            i += 1;
            let end = (pos + step).min(input.len());
            held.extend_from_slice(&input[pos..end]);
            pos = end;
        }
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
        if ex.refusal().is_some() {
            break;
        }
        let mut answers = 0;
        while !ex.accepts_client_bytes() && answers < 200 {
            answers += 1;
            fed_answers += 1;
            let _ = ex.server_bytes(ANSWER, &mut Vec::new());
            if by_request {
                assert!(ex.at_boundary(), "an answered request is a boundary");
                ex.resume();
            }
        }
        if !ex.accepts_client_bytes() || (pos == input.len() && !held.is_empty() && answers == 0) {
            break;
        }
    }
    // The access log pairs each answer with one request, in order.
    let mut logged = 0;
    while let Some(l) = ex.take_answered() {
        assert_eq!(l.status, 404);
        logged += 1;
    }
    assert!(logged <= fed_answers);
    out
}

/// `bytes` without the lines that are `Connection` fields. Request by request the server's
/// connection is quill's, pooled for any client: the client's `close` option is left out
/// and an HTTP/1.0 request asks for keep-alive. Everything else reaches the server as it
/// does on a connection of its own. (A body line that looks like such a field goes from
/// both outputs alike.)
fn without_connection_fields(bytes: &[u8]) -> Vec<u8> {
    bytes
        .split_inclusive(|&b| b == b'\n')
        .filter(|line| {
            !line
                .get(..11)
                .is_some_and(|name| name.eq_ignore_ascii_case(b"connection:"))
        })
        .flatten()
        .copied()
        .collect()
}

fn head(extra: &str) -> String {
    format!("POST /p HTTP/1.1\r\nHost: h\r\n{extra}\r\n")
}

const ADDED: &str = "X-Forwarded-For: 192.0.2.1\r\nX-Forwarded-Proto: http\r\n\r\n";

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let (steps, input) = data.split_at(3);
    // 1. Arbitrary bytes: the same output whatever the reads. A refusal may come later
    //    when the input trickles in (a head is parsed again only when that can tell
    //    more), never earlier.
    let (whole, whole_refused) = feed(input, &[]);
    let (split, split_refused) = feed(input, steps);
    assert_eq!(whole, split);
    assert!(whole_refused || !split_refused);
    assert_eq!(
        without_connection_fields(&feed_answered(input, steps, true)),
        without_connection_fields(&feed_answered(input, steps, false))
    );

    // 2. A Content-Length body, then a chunked one, then a last request: bodies verbatim.
    let body = input;
    let mut msg = head(&format!("Content-Length: {}\r\n", body.len())).into_bytes();
    msg.extend_from_slice(body);
    let mut expected = head(&format!("Content-Length: {}\r\n", body.len())).into_bytes();
    expected.truncate(expected.len() - 2);
    expected.extend_from_slice(ADDED.as_bytes());
    expected.extend_from_slice(body);
    let te = "Transfer-Encoding: chunked\r\n";
    msg.extend_from_slice(head(te).as_bytes());
    let mut h = head(te).into_bytes();
    h.truncate(h.len() - 2);
    expected.extend_from_slice(&h);
    expected.extend_from_slice(ADDED.as_bytes());
    let mut chunked = Vec::new();
    let mut rest = body;
    let mut k = 0;
    while !rest.is_empty() {
        let n = (usize::from(steps[k % 3]) + 1).min(rest.len());
        k += 1;
        chunked.extend_from_slice(format!("{n:X}\r\n").as_bytes());
        chunked.extend_from_slice(&rest[..n]);
        chunked.extend_from_slice(b"\r\n");
        rest = &rest[n..];
    }
    chunked.extend_from_slice(b"0\r\nT: x\r\n\r\n");
    msg.extend_from_slice(&chunked);
    expected.extend_from_slice(&chunked);
    msg.extend_from_slice(b"GET /last HTTP/1.1\r\n\r\n");
    expected.extend_from_slice(b"GET /last HTTP/1.1\r\n");
    expected.extend_from_slice(ADDED.as_bytes());
    let (out, refused) = feed(&msg, steps);
    assert!(!refused);
    assert_eq!(out, expected);
});
