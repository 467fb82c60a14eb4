//! A backend's answer to an HTTP health check: finding and parsing its status line never
//! panics, and a status found is a three-digit code.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::health::probe::status_code;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(code)) = status_code(data) {
        assert!(code <= 999);
    }
});
