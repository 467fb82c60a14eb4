//! One line of the command language (config files, -O, the control socket): never panics,
//! and whatever parses prints back to a line that parses to the same command. Applying it
//! to default settings never panics either (host names are not resolved: only IP literals
//! reach the resolver here, see `Host::new`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use quill::command::{Command, ServerField};
use quill::settings::Settings;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cmd) = line.parse::<Command>() else {
        return;
    };
    assert_eq!(cmd.to_string().parse::<Command>().ok(), Some(cmd.clone()));
    // Resolving names would make the target slow and network-dependent.
    let resolves = match &cmd {
        Command::Server { fields, .. } => fields
            .iter()
            .any(|f| matches!(f, ServerField::Address(h) if h.ip().is_none())),
        Command::Emergency(Some(_))
        | Command::Abuse(Some(_))
        | Command::Listen(Some(_))
        | Command::GeoipDb(_) => true,
        _ => false,
    };
    if !resolves {
        let _ = Settings::default().apply(&cmd);
    }
});
