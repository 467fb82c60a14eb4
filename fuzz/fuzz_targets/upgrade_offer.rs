//! The offer line a running quill sends to a new one during a binary upgrade: parsing
//! never panics, and an offer that parses prints back to the same offer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::control::upgrade::parse_offer;

fuzz_target!(|data: &[u8]| {
    if let Ok(line) = std::str::from_utf8(data) {
        if let Ok(offer) = parse_offer(line) {
            assert!(offer.listeners > 0);
            assert_eq!(parse_offer(&offer.to_string()).ok(), Some(offer));
        }
    }
});
