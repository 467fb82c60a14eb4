//! A server's HTTP/1.1 answer as quill's own client reads it for HTTP/2 clients (head,
//! then a body by Content-Length, chunks with trailers, or to the close), the bytes
//! arriving a few at a time: never panics, never frames more body than it was given, and
//! reads the same answer however the bytes are split.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::proxy::h1_client::read_answer;

fuzz_target!(|data: &[u8]| {
    let Some((&first, bytes)) = data.split_first() else {
        return;
    };
    let head_only = first & 0x80 != 0;
    let step = usize::from(first & 0x7f) + 1;
    let split = read_answer(bytes, head_only, step);
    let whole = read_answer(bytes, head_only, bytes.len());
    assert_eq!(
        split.as_ref().ok(),
        whole.as_ref().ok(),
        "split every {step} bytes"
    );
    if let Ok((status, body)) = split {
        // Interim answers are passed over, a 101 refused: what is read is final.
        assert!((200..1000).contains(&status), "{status}");
        assert!(body <= bytes.len() as u64);
    }
});
