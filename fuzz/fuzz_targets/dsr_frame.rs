//! The DSR plane's frame parser: any bytes from the wire must parse or fail, never panic,
//! and the checksum and MAC-rewrite helpers must cope with whatever parsed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::dsr::frame;

fuzz_target!(|data: &[u8]| {
    let parsed = frame::parse(data);
    let _ = frame::checksums_valid(data);
    let mut copy = data.to_vec();
    let rewritten = frame::set_macs(&mut copy, [2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
    if parsed.is_ok() {
        // Anything that parsed has an Ethernet header to rewrite.
        assert!(rewritten);
        assert_eq!(&copy[12..], &data[12..]);
    }
});
