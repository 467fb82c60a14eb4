//! HTTP response framing (`http`): never panics, and without HSTS the bytes sent to the
//! client are exactly the server's bytes, however they are split, whatever requests came
//! before (HEAD, CONNECT, Upgrade, pipelined) and whatever the server sends. With HSTS, and
//! with the connection asked to close after its last answer (a reload, a drain, a stop:
//! `Connection: close` written into that answer), the output is the same split or not.
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

fn run(data: &[u8], split: bool, hsts: bool, closing: bool) -> Vec<u8> {
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
    let (reqs, rest) = data.split_at(data.len().min(4));
    let mut sink = Vec::new();
    for r in reqs {
        let _ = ex.client_bytes(REQUESTS[usize::from(*r) % REQUESTS.len()], &mut sink);
    }
    if closing {
        ex.close_after_answer();
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
    ex.server_closed(&mut out);
    out
}

fuzz_target!(|data: &[u8]| {
    let server = &data[data.len().min(4)..];
    assert_eq!(run(data, false, false, false), server);
    assert_eq!(run(data, true, false, false), server);
    assert_eq!(run(data, false, true, false), run(data, true, true, false));
    assert_eq!(run(data, false, false, true), run(data, true, false, true));
    assert_eq!(run(data, false, true, true), run(data, true, true, true));
});
