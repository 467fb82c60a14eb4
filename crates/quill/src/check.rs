//! `quill --check`: build everything a start with the same arguments would (command line,
//! configuration file and its includes, ACLs, GeoIP database, TLS certificates and keys, the
//! SNI directory, addresses, the account of `-u`) and report every problem, not only the
//! first. Nothing is bound, no file is written, no running quill is asked anything.
//!
//! Problems are collected, not returned early: a bad line of the file is reported and the
//! next one applied, and the files the settings name are read even when a line failed, so
//! one run lists what an operator must fix. A problem found in a file a command named (a
//! certificate) names the line that gave the file.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::cli::{CliError, Invocation, Protocol};
use crate::command::Command;
use crate::config::{self, ConfigError, Origin};
use crate::control::ControlAddr;
use crate::daemon::{self, StartError};
use crate::privileges;
use crate::settings::Settings;
use crate::tls::TlsError;

/// Where a command came from: an argument of the command line or a line of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Argument(String),
    Line(Origin),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Argument(arg) => write!(f, "command line: '{arg}'"),
            Source::Line(origin) => write!(f, "{origin}"),
        }
    }
}

/// One problem `--check` found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Problem {
    /// An argument of the command line that could not be parsed.
    Argument(CliError),
    /// A command of the command line (flag, `-O`, server) that the settings refused.
    Command { arg: String, reason: String },
    /// A line of the configuration file or of a file it includes.
    Config(ConfigError),
    /// A TLS file or setting, with the command that named it when one can be told.
    Tls {
        source: Option<Source>,
        error: TlsError,
    },
    /// Anything else a start would refuse.
    Start(StartError),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Argument(e) => write!(f, "command line: {e}"),
            Problem::Command { arg, reason } => write!(f, "command line: '{arg}': {reason}"),
            Problem::Config(e) => write!(f, "{e}"),
            Problem::Tls {
                source: Some(source),
                error,
            } => write!(f, "{source}: {error}"),
            Problem::Tls {
                source: None,
                error,
            } => write!(f, "{error}"),
            Problem::Start(e) => write!(f, "{e}"),
        }
    }
}

/// Checks what a start with `inv` would build; `cli_errors` are the arguments that could not
/// be parsed. An empty result means the start would get as far as binding its sockets.
pub fn run(inv: &Invocation, cli_errors: Vec<CliError>) -> Vec<Problem> {
    let mut problems: Vec<Problem> = cli_errors.into_iter().map(Problem::Argument).collect();
    let account = match &inv.user {
        None => None,
        Some(user) => match privileges::lookup_account(inv.jail.as_deref(), user) {
            Ok(account) => Some(account),
            Err(e) => {
                problems.push(Problem::Start(StartError::Privileges(e.to_string())));
                None
            }
        },
    };
    if let Some(jail) = &inv.jail {
        // A start reads every file inside the jail: so does the check, from inside it.
        if let Err(e) = privileges::enter_jail(jail) {
            problems.push(Problem::Start(StartError::Privileges(format!(
                "{e} (the files inside the jail were not checked)"
            ))));
            return problems;
        }
    }

    let (settings, sources) = settings(inv, &mut problems);
    // Without a listening address a start stops there; say so only when no earlier problem
    // (a bad `listen` line, an unreadable file) explains it.
    let explained = !problems.is_empty();
    for error in crate::tls::check(&settings.tls) {
        let source = blame(&error, &sources);
        problems.push(Problem::Tls { source, error });
    }
    match &settings.listen {
        None if !explained => problems.push(Problem::Start(StartError::NoListen)),
        None => {}
        Some(listen) => {
            if let Some(interface) = &settings.dsr_if {
                let transport = match inv.protocol {
                    Protocol::Tcp => crate::dsr::Transport::Tcp,
                    Protocol::Udp => crate::dsr::Transport::Udp,
                };
                if let Err(e) =
                    crate::dsr::DsrConfig::new(interface.as_str(), &settings, listen, transport)
                {
                    problems.push(Problem::Start(e.into()));
                }
                if nix::net::if_::if_nametoindex(interface.as_str()).is_err() {
                    let interface = interface.to_string();
                    problems.push(Problem::Start(
                        crate::dsr::DsrError::NoInterface { interface }.into(),
                    ));
                }
            }
        }
    }
    problems.extend(process(inv).into_iter().map(Problem::Start));
    if let (Some(account), Some(path)) = (&account, &inv.pidfile) {
        privileges::warn_if_pid_file_stays(account, path);
    }
    if let Some(addr) = settings.metrics_listen {
        crate::control::web::warn_if_control_open(&settings, addr);
    }
    if settings.transparent && settings.dsr_if.is_none() && inv.user.is_none() {
        if let Err(e) = crate::net::connect::check_transparent() {
            problems.push(Problem::Start(StartError::Transparent(e)));
        }
    }
    problems
}

/// The settings from the command line and the file, every refused command and line
/// recorded, and where each applied command came from.
fn settings(inv: &Invocation, problems: &mut Vec<Problem>) -> (Settings, Vec<(Source, Command)>) {
    let mut settings = Settings::default();
    let mut actions = Vec::new();
    let mut sources = Vec::new();
    for (arg, cmd) in &inv.commands {
        match settings.apply(cmd) {
            Ok(applied) => {
                actions.extend(applied.actions);
                sources.push((Source::Argument(arg.clone()), cmd.clone()));
            }
            Err(e) => problems.push(Problem::Command {
                arg: arg.clone(),
                reason: e.to_string(),
            }),
        }
    }
    if let Some(file) = &inv.config {
        let checked = config::check(file, &mut settings, &mut actions);
        problems.extend(checked.errors.into_iter().map(Problem::Config));
        sources.extend(
            checked
                .applied
                .into_iter()
                .map(|(origin, cmd)| (Source::Line(origin), cmd)),
        );
    }
    (settings, sources)
}

/// What a start checks of the process options before binding: the control socket's
/// address, the binary upgrade's needs, and the pid file's directory (not written here).
fn process(inv: &Invocation) -> Vec<StartError> {
    let mut found = Vec::new();
    match daemon::control_address(inv) {
        Err(e) => found.push(e),
        Ok(_) if inv.takeover && inv.protocol == Protocol::Udp => {
            found.push(crate::control::upgrade::UpgradeError::Udp.into());
        }
        Ok(control) if inv.takeover && !matches!(control, Some(ControlAddr::Unix(_))) => {
            found.push(crate::control::upgrade::UpgradeError::NeedsUnixControl.into());
        }
        Ok(_) => {}
    }
    if let Some(path) = &inv.pidfile {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            found.push(StartError::PidFile {
                path: path.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("its directory {} does not exist", dir.display()),
                ),
            });
        }
    }
    found
}

/// The command that named the file (or gave the setting) a TLS error is about: the last
/// one, as the last one is what counts.
fn blame(error: &TlsError, sources: &[(Source, Command)]) -> Option<Source> {
    let file = error.file();
    sources
        .iter()
        .rev()
        .find(|(_, cmd)| match (file, tls_path(cmd)) {
            (Some(file), Some(named)) => file == named.as_path() || file.starts_with(named),
            (None, _) => error.is_about(cmd),
            _ => false,
        })
        .map(|(source, _)| source.clone())
}

/// The file or directory a TLS command names.
fn tls_path(cmd: &Command) -> Option<PathBuf> {
    match cmd {
        Command::SslCert(Some(w))
        | Command::SslKey(Some(w))
        | Command::SslCa(Some(w))
        | Command::SslCaDir(Some(w))
        | Command::SslSniPath(Some(w))
        | Command::SslOcspResponse(Some(w))
        | Command::UpstreamCa(Some(w)) => Some(PathBuf::from(w.as_str())),
        _ => None,
    }
}
