//! A whole configuration file: never panics; errors name a line inside the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::config::apply_text;
use quill::settings::Settings;

fuzz_target!(|data: &[u8]| {
    // Lines that would resolve host names or open files are left out (see the command target).
    let text: Vec<u8> = data
        .split(|&b| b == b'\n')
        .filter(|l| {
            let l = String::from_utf8_lossy(l);
            !["include", "geoip_db", "listen", "emergency", "abuse", "server"].iter().any(|w| l.contains(w))
        })
        .flat_map(|l| l.iter().copied().chain(std::iter::once(b'\n')))
        .collect();
    let lines = text.split(|&b| b == b'\n').count();
    if let Err(e) = apply_text(std::path::Path::new("fuzz.cfg"), &text, &mut Settings::default()) {
        assert!(e.line <= lines, "error line {} beyond the {} lines", e.line, lines);
    }
});
