//! HTTP response framing (`http`): never panics, and the bytes sent to the client are the
//! same however the server's bytes are split, whatever requests came before (HEAD,
//! CONNECT, Upgrade, pipelined) and whatever the server sends, with HSTS or without, and
//! with the connection asked to close after its last answer (a reload, a drain, a stop:
//! `Connection: close` written into that answer) or not. A server that says nothing of
//! connections and frames its answers, one per request, gets its bytes through exactly
//! (without HSTS); when it closes with requests unanswered, quill's 502 follows its
//! answers, unless the client had closed first (its requests are then abandoned, never
//! more than it sent).
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::command::Hsts;
use quill::proxy::http::{Exchange, Fed, HttpParams, Scheme};

const REQUESTS: [&[u8]; 5] = [
    b"GET / HTTP/1.1\r\n\r\n",
    b"HEAD / HTTP/1.1\r\n\r\n",
    b"CONNECT h:443 HTTP/1.1\r\n\r\n",
    b"GET /ws HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nok",
];

/// The bytes for the client while the server sends, and those its close adds; with
/// `gone`, the client closed before the server sent anything, and how many of its
/// requests it abandoned.
fn run(data: &[u8], split: bool, hsts: bool, closing: bool, gone: bool) -> (Vec<u8>, Vec<u8>, u64) {
    let mut ex = Exchange::new(HttpParams {
        client: "192.0.2.1".parse().unwrap(),
        scheme: Scheme::Https,
        header_max: 1024,
        hsts: hsts.then_some(Hsts {
            max_age: 100,
            include_subdomains: false,
            preload: false,
        }),
    });
    ex.log_requests(true);
    let (reqs, rest) = data.split_at(data.len().min(4));
    let mut sink = Vec::new();
    for r in reqs {
        let _ = ex.client_bytes(REQUESTS[usize::from(*r) % REQUESTS.len()], &mut sink);
    }
    if closing {
        ex.close_after_answer();
    }
    if gone {
        ex.client_closed();
    }
    let mut out = Vec::new();
    let step = if split {
        rest.first().map_or(1, |b| usize::from(b % 7) + 1)
    } else {
        rest.len().max(1)
    };
    for piece in rest.chunks(step) {
        let mut o = Vec::new();
        match ex.server_bytes(piece, &mut o) {
            Fed::Verbatim => out.extend_from_slice(piece),
            Fed::Consumed(n) => {
                assert_eq!(n, piece.len());
                out.extend_from_slice(&o);
            }
        }
        let _ = ex.take_refusal();
    }
    let mut at_close = Vec::new();
    ex.server_closed(&mut at_close);
    if gone {
        ex.client_left();
    }
    let abandoned = ex.take_abandoned();
    (out, at_close, abandoned)
}

fuzz_target!(|data: &[u8]| {
    let server = &data[data.len().min(4)..];
    // What the client gets in all, at the server's close included.
    let whole = |(mut out, at_close, _): (Vec<u8>, Vec<u8>, u64)| {
        out.extend(at_close);
        out
    };
    for hsts in [false, true] {
        for closing in [false, true] {
            assert_eq!(
                whole(run(data, false, hsts, closing, false)),
                whole(run(data, true, hsts, closing, false))
            );
        }
    }
    // A client that closed first gets what it would have, but for quill's 502 at the
    // server's close; it abandoned at most the requests it sent.
    let (out, at_close, _) = run(data, false, false, false, false);
    let (out_gone, at_close_gone, abandoned) = run(data, false, false, false, true);
    assert_eq!(out, out_gone);
    assert!(at_close == at_close_gone || at_close.starts_with(b"HTTP/1.1 502 "));
    assert!(abandoned <= 4);
    // Each request byte (at most 4) sends one request, those after a CONNECT or an
    // Upgrade only once it is answered: answers beyond the requests sent are dropped.
    let sent = data[..data.len().min(4)]
        .iter()
        .position(|&r| matches!(usize::from(r) % REQUESTS.len(), 2 | 3))
        .map_or(data.len().min(4), |switch| switch + 1);
    if says_nothing_of_connections(server, sent) {
        let (mut out, at_close, _) = run(data, false, false, false, false);
        if at_close.starts_with(b"HTTP/1.1 502 ") {
            // The server closed with requests unanswered: its answers went through, and
            // what followed them (the start of a head, cut short) gave way to quill's 502.
            assert!(server.starts_with(&out));
            let rest = &server[out.len()..];
            assert!(!rest.windows(4).any(|w| w == b"\r\n\r\n"), "{rest:?}");
        } else {
            out.extend(at_close);
            assert_eq!(out, server);
        }
    }
});

/// Answers quill passes byte for byte: whole HTTP/1.1 heads with CRLF line ends, each
/// framed by one `Content-Length: 0` (the close ending a body is one more thing quill tells
/// the client), and nothing about connections (`Connection`, `Keep-Alive`,
/// `Proxy-Connection`, whatever the case) nor a `Transfer-Encoding`, and no more of them
/// than `requests` (what a server sends after the answers due never reaches the client).
fn says_nothing_of_connections(server: &[u8], requests: usize) -> bool {
    let lower = server.to_ascii_lowercase();
    let count =
        |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).filter(|w| *w == needle).count();
    if ["connection", "keep-alive", "http/1.0", "transfer-encoding"]
        .iter()
        .any(|word| count(&lower, word.as_bytes()) > 0)
    {
        return false;
    }
    let bare_lf = lower
        .iter()
        .enumerate()
        .any(|(i, &b)| b == b'\n' && (i == 0 || lower[i - 1] != b'\r'));
    // A line folded onto the one before it (obs-fold) belongs to that field: a
    // `Content-Length` continued so is no number, and quill's 502 replaces the answer.
    let folded = count(&lower, b"\r\n ") + count(&lower, b"\r\n\t") > 0;
    if bare_lf || folded || !lower.ends_with(b"\r\n\r\n") {
        return false;
    }
    // The heads, each without its empty line.
    let mut heads = Vec::new();
    let mut rest = &lower[..];
    while let Some(end) = rest.windows(4).position(|w| w == b"\r\n\r\n") {
        heads.push(&rest[..end + 2]);
        rest = &rest[end + 4..];
    }
    heads.len() <= requests
        && heads.iter().all(|head| {
            head.starts_with(b"http/1.1 ")
                && count(head, b"content-length") == 1
                && count(head, b"\r\ncontent-length: 0\r\n") == 1
        })
}
