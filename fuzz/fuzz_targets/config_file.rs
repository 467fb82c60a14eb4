//! A whole configuration file: never panics; errors name a line inside the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::command::{Command, ServerField};
use quill::config::apply_text;
use quill::settings::Settings;

/// Lines the target leaves out: those that would read files (include, geoip_db) or resolve
/// host names, which would make runs slow and depend on the network. Everything else stays,
/// including every line that does not parse, so the error paths are fuzzed too.
fn left_out(line: &[u8]) -> bool {
    let Ok(line) = std::str::from_utf8(line) else {
        return false;
    };
    match line.trim().parse::<Command>() {
        Ok(Command::Server { fields, .. }) => fields
            .iter()
            .any(|f| matches!(f, ServerField::Address(h) if h.ip().is_none())),
        Ok(
            Command::Include(_)
            | Command::GeoipDb(_)
            | Command::Listen(Some(_))
            | Command::Emergency(Some(_))
            | Command::Abuse(Some(_)),
        ) => true,
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let text: Vec<u8> = data
        .split(|&b| b == b'\n')
        .filter(|l| !left_out(l))
        .flat_map(|l| l.iter().copied().chain(std::iter::once(b'\n')))
        .collect();
    let lines = text.split(|&b| b == b'\n').count();
    if let Err(e) = apply_text(
        std::path::Path::new("fuzz.cfg"),
        &text,
        &mut Settings::default(),
    ) {
        assert!(
            e.line <= lines,
            "error line {} beyond the {} lines",
            e.line,
            lines
        );
    }
});
