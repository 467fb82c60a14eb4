//! The Pen-compatible command line: arbitrary argument vectors never panic, and every
//! command they produce prints back to a line that parses to the same command.
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::cli::{parse, Parsed};
use quill::command::Command;

fuzz_target!(|data: &[u8]| {
    let args = data
        .split(|&b| b == 0)
        .map(|a| std::ffi::OsString::from(String::from_utf8_lossy(a).into_owned()));
    if let Ok(Parsed::Run(inv)) = parse(args) {
        for (_, cmd) in inv.commands {
            assert_eq!(cmd.to_string().parse::<Command>().ok(), Some(cmd));
        }
    }
});
