//! Pen-compatible command-line parsing: `quill [options] [host:]port|/path h1[:p1[:max[:hard[:weight[:prio]]]]] ...`
//!
//! Flags are sugar for commands of the command language (`-r` is `roundrobin`, `-x 500` is
//! `conn_max 500`), so the result is mostly a list of [`Command`]s, each remembered with the
//! argument it came from so that an error can name it. Process-level options (`-f`, `-d`)
//! are kept apart. Nothing is started here.

use std::ffi::OsString;
use std::fmt;
use std::net::Ipv6Addr;
use std::path::PathBuf;

use crate::command::{
    parse_port, Command, CompatWord, EventEngine, Host, HostPort, ParseError, ServerField, Word,
};
use crate::net::ListenAddr;

/// What the user asked for.
#[derive(Debug)]
pub enum Parsed {
    Run(Invocation),
    /// `--check`: build everything a start with these arguments would, start nothing.
    Check(Invocation),
    Help,
    Version,
    Demo,
}

/// Which transport the balancer serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    #[default]
    Tcp,
    /// `-U`: UDP datagrams, balanced per client flow.
    Udp,
}

/// A balancer to start.
#[derive(Debug)]
pub struct Invocation {
    /// `-f`: stay in the foreground (otherwise become a daemon).
    pub foreground: bool,
    /// `-U` selects UDP.
    pub protocol: Protocol,
    /// `-C`: the control socket address, as given.
    pub control: Option<String>,
    /// `-F`: the configuration file.
    pub config: Option<PathBuf>,
    /// `-p`: the pid file.
    pub pidfile: Option<PathBuf>,
    /// `-X`: allow the `exit` control command.
    pub exit_enabled: bool,
    /// `-u`: the user to run as after binding.
    pub user: Option<String>,
    /// `-j`: the directory to chroot into.
    pub jail: Option<PathBuf>,
    /// Commands in order, each with the argument it came from.
    pub commands: Vec<(String, Command)>,
    /// `--takeover`: take the listening sockets over from the quill serving on the same
    /// Unix control socket (binary upgrade, docs/UPGRADE.md).
    pub takeover: bool,
}

/// A command-line error: the offending argument and why. Exit status 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CliError {
    pub arg: String,
    pub reason: String,
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.arg.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "'{}': {}", self.arg, self.reason)
        }
    }
}

impl std::error::Error for CliError {}

fn err(arg: impl Into<String>, reason: impl ToString) -> CliError {
    CliError {
        arg: arg.into(),
        reason: reason.to_string(),
    }
}

/// The usage text of `--help`.
pub const USAGE: &str = "\
usage: quill [options] [host:]port|/path/to/socket h1[:p1[:maxc1[:hard1[:weight1[:prio1]]]]] [h2...]
       quill --check [options] ...   check the arguments and files of that start, bind nothing
       quill demo            run two dummy backends and a balancer on loopback

Selection (Pen's):
  (default)     client tracking: a client returns to the server it used last
  -r            round robin, no tracking            -h   hash of the client address
  -N            hash, without saving clients        -W   least connections per weight
  -s            stubborn: never fail over           -O prio   lowest prio value first
HTTP:
  -H            add X-Forwarded-For / X-Forwarded-Proto to every request (command: http)
Limits and timers:
  -x N          max simultaneous connections        -c N  client table size [2048]
  -t sec        connect timeout [5]                 -b sec blacklist time [30]
  -T sec        client tracking time (0 = forever) [0]
  -e host:port  emergency server                    -B host:port  abuse server
Process and operation:
  -f            stay in the foreground              -d    more debug output (repeatable)
  -U            balance UDP datagrams (per client flow) instead of TCP connections
  -C [addr:]port|/path  control socket (quillctl, penctl)   -X  allow the exit command
  -F file       configuration file of commands, read again on SIGHUP
  -l file       connection log                      -w file  HTML status on SIGUSR1
  -p file       pid file                            -u user  run as user after binding
  -j dir        chroot to dir after binding
  -m N          accept up to N connections at once  -q N  listen backlog [4096]
  -o/-O cmd     any command of the command language (see quill(1), docs/COMPATIBILITY.md)
  --takeover    binary upgrade: take the listening sockets over from the quill on the
                same Unix control socket (-C), which then finishes its connections
  -P -Q -D -n -a -S N   accepted for compatibility with Pen, no effect
  --help, --version
TLS (rustls; TLS 1.3 and 1.2 only):
  -E certfile   terminate TLS with this PEM chain   -K keyfile  its key (else in certfile)
  -G cafile     CA for client certificates          -A cadir    directory of CA certificates
  -R            require a client certificate        -L ssl23|tls1.2|tls1.3  versions offered
  -Z            accepted (OpenSSL workarounds; rustls needs none)
Server fields: host (name, IPv4, or [IPv6]), port (default: the listening port),
  maxc soft limit (0 = none), hard limit for returning clients (0 = maxc), weight, prio.

Example: quill -f -r 8080 127.0.0.1:9001 127.0.0.1:9002
";

fn takes_value(opt: char) -> bool {
    "BCFOSTbceijlmopqtuwxEKGAL".contains(opt)
}

/// Parses the arguments after the program name; the first error ends it.
pub fn parse<I: IntoIterator<Item = OsString>>(args: I) -> Result<Parsed, CliError> {
    let (parsed, mut errors) = parse_all(args);
    if errors.is_empty() {
        Ok(parsed)
    } else {
        Err(errors.swap_remove(0))
    }
}

/// Process-level options, which are not commands.
#[derive(Default)]
struct Process {
    foreground: bool,
    protocol: Protocol,
    control: Option<String>,
    config: Option<PathBuf>,
    pidfile: Option<PathBuf>,
    exit_enabled: bool,
    user: Option<String>,
    jail: Option<PathBuf>,
    takeover: bool,
    check: bool,
    debug: u32,
    emergency: Option<String>,
    abuse: Option<String>,
}

/// Parses the arguments after the program name, on past each bad argument: the result is
/// what could be parsed and every error, in the order of the arguments (`--check` reports
/// them all; a start refuses to run with any).
pub fn parse_all<I: IntoIterator<Item = OsString>>(args: I) -> (Parsed, Vec<CliError>) {
    use lexopt::Arg::{Long, Short, Value};
    let mut parser = lexopt::Parser::from_args(args);
    let mut p = Process::default();
    let mut commands: Vec<(String, Command)> = Vec::new();
    let mut positional: Vec<String> = Vec::new();
    let mut errors = Vec::new();

    loop {
        let arg = match parser.next() {
            Ok(Some(arg)) => arg,
            Ok(None) => break,
            Err(e) => {
                // lexopt cannot go on after its own error (e.g. `--help=x`).
                errors.push(err("", e));
                break;
            }
        };
        match arg {
            Long("help") => return (Parsed::Help, Vec::new()),
            Long("version") => return (Parsed::Version, Vec::new()),
            Long("takeover") => p.takeover = true,
            Long("check") => p.check = true,
            Long(other) => errors.push(err(format!("--{other}"), "unknown option")),
            Value(v) => match v.into_string() {
                Ok(v) => positional.push(v),
                Err(v) => errors.push(err(v.to_string_lossy(), "not valid UTF-8")),
            },
            Short(c) => match short_option(c, &mut parser, &mut p) {
                Ok(Some(command)) => commands.push(command),
                Ok(None) => {}
                Err(e) => errors.push(e),
            },
        }
    }

    if positional.first().map(String::as_str) == Some("demo") && positional.len() == 1 && !p.check {
        return (Parsed::Demo, errors);
    }
    let mut positional = positional.into_iter();
    let mut listen_bad = false;
    let listen = match positional.next() {
        Some(arg) => match (ListenAddr::parse(&arg), Word::new(&arg)) {
            (Ok(addr), Some(word)) => {
                commands.insert(0, (arg, Command::Listen(Some(word))));
                Some(addr)
            }
            (Err(e), _) => {
                errors.push(err(&arg, e));
                listen_bad = true;
                None
            }
            (Ok(_), None) => {
                errors.push(err(&arg, "not a usable address"));
                listen_bad = true;
                None
            }
        },
        // With a configuration file, the file may say where to listen.
        None if p.config.is_some() => None,
        None => {
            errors.push(err(
                "",
                "missing the listening [host:]port (see quill --help)",
            ));
            None
        }
    };
    let default_port = listen.as_ref().and_then(ListenAddr::port);
    if p.debug > 0 {
        commands.insert(
            0,
            (
                format!("-{}", "d".repeat(p.debug as usize)),
                Command::Debug(Some(p.debug)),
            ),
        );
    }
    for (opt, value, make) in [
        (
            "-e",
            p.emergency,
            Command::Emergency as fn(Option<HostPort>) -> Command,
        ),
        ("-B", p.abuse, Command::Abuse),
    ] {
        if let Some(v) = value {
            let arg = format!("{opt} {v}");
            match HostPort::parse(&v, default_port) {
                Ok(hp) => commands.push((arg, make(Some(hp)))),
                Err(e) => errors.push(err(&arg, e)),
            }
        }
    }
    // The servers' default port is the listening one: with a bad listening address, their
    // errors would only repeat it.
    let servers = if listen_bad {
        Vec::new()
    } else {
        positional.collect()
    };
    for (index, spec) in servers.into_iter().enumerate() {
        match parse_server_spec(&spec, default_port) {
            Ok(fields) => commands.push((spec, Command::Server { index, fields })),
            Err(e) => errors.push(err(&spec, e)),
        }
    }
    let inv = Invocation {
        foreground: p.foreground,
        protocol: p.protocol,
        control: p.control,
        config: p.config,
        pidfile: p.pidfile,
        exit_enabled: p.exit_enabled,
        user: p.user,
        jail: p.jail,
        commands,
        takeover: p.takeover,
    };
    let parsed = if p.check {
        Parsed::Check(inv)
    } else {
        Parsed::Run(inv)
    };
    (parsed, errors)
}

/// One short option (`-c`, with its value if it takes one): the command it stands for, or
/// `None` for a process-level option, which is recorded in `p`.
fn short_option(
    c: char,
    parser: &mut lexopt::Parser,
    p: &mut Process,
) -> Result<Option<(String, Command)>, CliError> {
    let flag = format!("-{c}");
    let value = if takes_value(c) {
        let v = parser.value().map_err(|_| err(&flag, "needs a value"))?;
        Some(
            v.into_string()
                .map_err(|v| err(v.to_string_lossy(), "not valid UTF-8"))?,
        )
    } else {
        None
    };
    let v = value.as_deref().unwrap_or("");
    let arg = if value.is_some() {
        format!("{flag} {v}")
    } else {
        flag.clone()
    };
    let number = |what: &str| -> Result<u64, CliError> {
        if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
            v.parse()
                .map_err(|_| err(&arg, format!("{what} is too large")))
        } else {
            Err(err(&arg, format!("{what} must be a number")))
        }
    };
    let size = |what: &str| {
        number(what).and_then(|n| usize::try_from(n).map_err(|_| err(&arg, "too large")))
    };
    let file = || Word::new(v).ok_or_else(|| err(&arg, "not a usable file name"));
    // Process-level options are recorded in `p`; every other option stands for a command.
    match c {
        'S' => {
            // Obsolete server-table size: checked, then ignored (the table grows).
            number("server count")?;
        }
        'f' => p.foreground = true,
        'U' => p.protocol = Protocol::Udp,
        'C' => p.control = Some(v.to_string()),
        'F' => p.config = Some(PathBuf::from(v)),
        'p' => p.pidfile = Some(PathBuf::from(v)),
        'X' => p.exit_enabled = true,
        'u' => p.user = Some(v.to_string()),
        'j' => p.jail = Some(PathBuf::from(v)),
        'd' => p.debug += 1,
        'e' => p.emergency = Some(v.to_string()),
        'B' => p.abuse = Some(v.to_string()),
        _ => {
            let cmd = match c {
                'b' => Command::Blacklist(Some(number("blacklist time")?)),
                'c' => Command::ClientsMax(Some(size("client table size")?)),
                't' => {
                    let t = number("timeout")?;
                    if t == 0 {
                        return Err(err(&arg, "timeout must be at least 1 second"));
                    }
                    Command::Timeout(Some(t))
                }
                'x' => Command::ConnMax(Some(size("connection limit")?)),
                'T' => Command::Tracking(Some(number("tracking time")?)),
                'm' => {
                    let n = size("multi-accept count")?;
                    Command::MultiAccept(n.max(1))
                }
                'q' => Command::Backlog(
                    u32::try_from(number("backlog")?)
                        .map_err(|_| err(&arg, "backlog is too large"))?,
                ),
                'h' => Command::Hash(true),
                'H' => Command::Http(true),
                'N' => Command::HashOnly(true),
                'r' => Command::RoundRobin(true),
                's' => Command::Stubborn(true),
                'W' => Command::Weight(true),
                'P' => Command::EventEngine(EventEngine::Poll),
                'Q' => Command::EventEngine(EventEngine::Kqueue),
                'D' => Command::Compat(CompatWord::DelayedForward, true),
                'n' => Command::Compat(CompatWord::Block, true),
                'a' => Command::Compat(CompatWord::Ascii, true),
                'l' => Command::Log(Some(file()?)),
                'w' => Command::WebStats(Some(file()?)),
                'o' | 'O' => v.parse::<Command>().map_err(|e| err(&arg, e))?,
                'E' => Command::SslCert(Some(file()?)),
                'K' => Command::SslKey(Some(file()?)),
                'G' => Command::SslCa(Some(file()?)),
                'A' => Command::SslCaDir(Some(file()?)),
                'R' => Command::SslVerifyClient(true),
                'L' => format!("ssl_protocol {v}")
                    .parse::<Command>()
                    .map_err(|e| err(&arg, e))?,
                'Z' => Command::Compat(CompatWord::SslCompat, true),
                'i' => {
                    return Err(err(
                        &arg,
                        "installing a Windows service does not apply here",
                    ))
                }
                _ => return Err(err(&flag, "unknown option (see quill --help)")),
            };
            return Ok(Some((arg, cmd)));
        }
    }
    Ok(None)
}

/// Parses `host[:port[:maxc[:hard[:weight[:prio]]]]]`, IPv6 hosts in brackets.
pub fn parse_server_spec(
    spec: &str,
    default_port: Option<u16>,
) -> Result<Vec<ServerField>, ParseError> {
    let (host, rest): (&str, Vec<&str>) = if let Some(inner) = spec.strip_prefix('[') {
        let (host, after) = inner
            .split_once(']')
            .ok_or_else(|| ParseError::InvalidHost(spec.to_string()))?;
        match after {
            "" => (host, Vec::new()),
            _ => match after.strip_prefix(':') {
                Some(fields) => (host, fields.split(':').collect()),
                None => return Err(ParseError::InvalidHost(spec.to_string())),
            },
        }
    } else if spec.parse::<Ipv6Addr>().is_ok() {
        (spec, Vec::new())
    } else {
        let mut parts = spec.split(':');
        let host = parts.next().unwrap_or_default();
        (host, parts.collect())
    };
    if rest.len() > 5 {
        return Err(ParseError::Invalid {
            command: "server",
            what: "server (too many ':' fields)",
            value: spec.to_string(),
        });
    }
    let mut fields = vec![ServerField::Address(Host::new(host)?)];
    let port = match (rest.first(), default_port) {
        (Some(p), _) => parse_port(p)?,
        (None, Some(p)) => p,
        (None, None) => return Err(ParseError::MissingPort(spec.to_string())),
    };
    fields.push(ServerField::Port(port));
    let names = ["max connections", "hard limit", "weight", "prio"];
    for (i, value) in rest.iter().enumerate().skip(1) {
        let what = names[i - 1];
        let n: u32 = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
            value.parse().map_err(|_| ParseError::Invalid {
                command: "server",
                what,
                value: value.to_string(),
            })?
        } else {
            return Err(ParseError::Invalid {
                command: "server",
                what,
                value: value.to_string(),
            });
        };
        fields.push(match i {
            1 => ServerField::Max(n),
            2 => ServerField::Hard(n),
            3 => ServerField::Weight(n),
            _ => ServerField::Prio(n),
        });
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Invocation, CliError> {
        match parse(args.iter().map(OsString::from))? {
            Parsed::Run(inv) => Ok(inv),
            other => panic!("unexpected {other:?}"),
        }
    }

    fn lines(inv: &Invocation) -> Vec<String> {
        inv.commands.iter().map(|(_, c)| c.to_string()).collect()
    }

    #[test]
    fn flags_become_commands() {
        let inv = run(&[
            "-f",
            "-r",
            "-x",
            "500",
            "-b30",
            "-dd",
            "8080",
            "127.0.0.1:9001",
            "h2",
        ])
        .unwrap();
        assert!(inv.foreground);
        assert_eq!(
            lines(&inv),
            [
                "debug 2",
                "listen 8080",
                "roundrobin",
                "conn_max 500",
                "blacklist 30",
                "server 0 address 127.0.0.1 port 9001",
                "server 1 address h2 port 8080"
            ]
        );
    }

    #[test]
    fn clustered_flags_and_o_commands() {
        let inv = run(&[
            "-frs",
            "-O",
            "acl 1 deny 10.0.0.0 255.0.0.0",
            "-e",
            "127.0.0.1",
            "80",
            "b1",
        ])
        .unwrap();
        assert_eq!(
            lines(&inv),
            [
                "listen 80",
                "roundrobin",
                "stubborn",
                "acl 1 deny 10.0.0.0 255.0.0.0",
                "emergency 127.0.0.1:80",
                "server 0 address b1 port 80"
            ]
        );
    }

    #[test]
    fn tls_flags_become_commands() {
        let inv = run(&[
            "-E", "c.pem", "-K", "k.pem", "-G", "ca.pem", "-A", "/etc/ca", "-R", "-L", "tls1.3",
            "-Z", "443", "h",
        ])
        .unwrap();
        assert_eq!(
            lines(&inv),
            [
                "listen 443",
                "ssl_cert c.pem",
                "ssl_key k.pem",
                "ssl_ca ca.pem",
                "ssl_ca_dir /etc/ca",
                "ssl_verify_client",
                "ssl_protocol tls1.3",
                "ssl_compat",
                "server 0 address h port 443"
            ]
        );
    }

    #[test]
    fn server_specs() {
        let f = parse_server_spec("web2:80:100:200", None).unwrap();
        assert_eq!(f.len(), 4);
        let f = parse_server_spec("[::1]:81:1:2:3:4", None).unwrap();
        assert_eq!(f.last(), Some(&ServerField::Prio(4)));
        assert!(parse_server_spec("::1", Some(80)).is_ok());
        assert!(parse_server_spec("127.0.0.1:80:abc", None)
            .unwrap_err()
            .to_string()
            .contains("abc"));
        assert!(parse_server_spec("h:80:1:2:3:4:5", None).is_err());
        assert!(parse_server_spec("h", None).is_err());
    }

    #[test]
    fn errors_name_the_argument() {
        assert_eq!(run(&["-Y", "80", "h"]).unwrap_err().arg, "-Y");
        assert_eq!(run(&["80", "300.1.1.1"]).unwrap_err().arg, "300.1.1.1");
        assert_eq!(run(&["70000", "h"]).unwrap_err().arg, "70000");
        assert_eq!(
            run(&["80", "127.0.0.1:80:abc"]).unwrap_err().arg,
            "127.0.0.1:80:abc"
        );
        assert_eq!(run(&["-x", "many", "80"]).unwrap_err().arg, "-x many");
        assert!(run(&["-L", "tls1", "443", "h"])
            .unwrap_err()
            .reason
            .contains("below 1.2"));
        assert!(run(&[]).is_err());
    }

    #[test]
    fn help_version_demo() {
        assert!(matches!(
            parse([OsString::from("--help")]),
            Ok(Parsed::Help)
        ));
        assert!(matches!(
            parse([OsString::from("--version")]),
            Ok(Parsed::Version)
        ));
        assert!(matches!(parse([OsString::from("demo")]), Ok(Parsed::Demo)));
    }
}
