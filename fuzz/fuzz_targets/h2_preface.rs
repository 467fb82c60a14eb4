//! The first bytes an HTTP/2 server sends (`upstream_h2`), in pieces cut where the input's
//! first byte says: never panics, the verdict never changes once given, and it does not
//! depend on how the bytes were cut.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::proxy::pool_h2::Preface;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, bytes)) = data.split_first() else {
        return;
    };
    let whole = Preface::default();
    whole.feed(bytes);
    let pieces = Preface::default();
    let mut first = None;
    for chunk in bytes.chunks(usize::from(cut).max(1)) {
        pieces.feed(chunk);
        if first.is_none() {
            first = pieces.verdict();
        }
        if first.is_some() {
            assert_eq!(pieces.verdict(), first);
        }
    }
    assert_eq!(pieces.verdict(), whole.verdict());
});
