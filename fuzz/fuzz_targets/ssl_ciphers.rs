//! `ssl_ciphers` lists (OpenSSL syntax, from config files and the control socket): parsing
//! never panics, and what it accepts names only suites quill offers, each once.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(list) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(sel) = quill::tls::ciphers::parse(list) {
        let all = quill::tls::ciphers::defaults();
        let mut seen = Vec::new();
        for s in sel.tls12.iter().chain(sel.tls13.iter().flatten()) {
            assert!(all.iter().any(|a| a.suite() == s.suite()));
            assert!(!seen.contains(&s.suite()), "{list}: a suite twice");
            seen.push(s.suite());
        }
    }
});
