//! The dummy web server's request framing: never panics, and a framed head lies within the
//! bytes given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::proxy::dummy::parse_head;

fuzz_target!(|data: &[u8]| {
    if let Some(req) = parse_head(data) {
        assert!(req.head_len <= data.len());
    }
});
