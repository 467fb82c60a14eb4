//! The `Accept` header a scraper sends to `/metrics` (any HTTP client that reaches the
//! metrics listener): choosing OpenMetrics or the text format never panics, and OpenMetrics
//! is chosen only when the header names it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(accept) = std::str::from_utf8(data) else {
        return;
    };
    if quill::control::metrics::wants_openmetrics(accept) {
        assert!(accept
            .to_ascii_lowercase()
            .contains("application/openmetrics-text"));
    }
});
