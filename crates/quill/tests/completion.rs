//! The bash completions in contrib/completions/: real bash (`--norc --noprofile`) sources
//! each file, is given COMP_WORDS/COMP_CWORD/COMP_LINE/COMP_POINT as readline would set
//! them, calls the completion function and prints COMPREPLY. Their word lists are checked
//! against quill itself (the command parser's `NAMES`, `--help`, the option parser), so a
//! new command or option that the completions lack fails here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command as Process;

use quill::command::{Command, ParseError, NAMES};
use support::TempDir;

fn contrib(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../contrib/completions")
        .join(file)
}

fn quill_file() -> PathBuf {
    contrib("quill.bash")
}

fn quillctl_file() -> PathBuf {
    contrib("quillctl.bash")
}

/// Whether bash can be run; prints why not.
fn have_bash() -> bool {
    let ok = Process::new("bash")
        .args(["--norc", "--noprofile", "-c", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: bash is not installed (.ci/run installs it)");
    }
    ok
}

/// Runs `script` in a bash that has sourced `file`, with `args` as "$@" and `env` in its
/// environment; returns stdout. Anything on stderr (a syntax error, a failing builtin)
/// fails the test.
fn bash_env(file: &Path, script: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Process::new("bash")
        .args(["--norc", "--noprofile", "-c"])
        .arg(format!("source \"$0\" || exit 99\n{script}"))
        .arg(file)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run bash");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "bash {script:?} {args:?} with {}: {}\n{stderr}",
        file.display(),
        out.status
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

fn bash(file: &Path, script: &str, args: &[&str]) -> String {
    bash_env(file, script, args, &[])
}

/// How bash cuts a typed argument into COMP_WORDS: runs of the default COMP_WORDBREAKS
/// characters ':' and '=' are words of their own (`localhost:8000` is three words).
fn comp_words(arg: &str) -> Vec<String> {
    let mut pieces: Vec<String> = Vec::new();
    let mut last_break = None;
    for c in arg.chars() {
        let is_break = c == ':' || c == '=';
        match pieces.last_mut() {
            Some(piece) if last_break == Some(is_break) => piece.push(c),
            _ => pieces.push(c.to_string()),
        }
        last_break = Some(is_break);
    }
    if pieces.is_empty() {
        pieces.push(String::new());
    }
    pieces
}

/// What the completion function `func` of `file` offers for the command line `args` (the
/// arguments as the shell will pass them, separated by one space, the cursor at the end of
/// the last one). COMP_WORDS, COMP_CWORD, COMP_LINE and COMP_POINT are set as readline
/// sets them; `prelude` runs first (after sourcing).
fn complete_with(file: &Path, prelude: &str, func: &str, args: &[&str]) -> Vec<String> {
    let words: Vec<String> = args.iter().flat_map(|a| comp_words(a)).collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let line = args.join(" ");
    let script = format!(
        r#"{prelude}
COMP_WORDS=("$@")
COMP_CWORD=$(($# - 1))
COMP_LINE=$LINE
COMP_POINT=${{#COMP_LINE}}
{func} "$1" "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
printf '%s\n' "${{COMPREPLY[@]}}""#
    );
    let mut offered: Vec<String> = bash_env(file, &script, &words, &[("LINE", &line)])
        .lines()
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    offered.sort();
    offered
}

fn quill(words: &[&str]) -> Vec<String> {
    let mut line = vec!["quill"];
    line.extend_from_slice(words);
    complete_with(&quill_file(), "", "_quill", &line)
}

fn quillctl(words: &[&str]) -> Vec<String> {
    let mut line = vec!["quillctl"];
    line.extend_from_slice(words);
    complete_with(&quillctl_file(), "", "_quillctl", &line)
}

/// The words of the shell variable `var` set by `file`.
fn list(file: &Path, var: &str) -> BTreeSet<String> {
    let words: BTreeSet<String> = bash(file, &format!("printf '%s\\n' ${var}"), &[])
        .split_whitespace()
        .map(String::from)
        .collect();
    assert!(!words.is_empty(), "{var} is empty in {}", file.display());
    words
}

fn sorted(words: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = words.iter().map(|w| w.to_string()).collect();
    v.sort();
    v
}

/// Command `name` with the first of a few typical arguments that makes it parse.
fn sample(name: &str) -> Command {
    const ARGS: &[&str] = &[
        "",
        " 1",
        " x",
        " 0 port 1",
        " 1 deny 10.0.0.1",
        " tcp",
        " h:1",
        " 127.0.0.1",
        " tls1.2",
        " up",
        " v1",
        " no_sslv2",
        " auto",
        " h2",
    ];
    ARGS.iter()
        .find_map(|args| format!("{name}{args}").parse::<Command>().ok())
        .unwrap_or_else(|| panic!("no sample parses for '{name}': add one to sample()"))
}

/// Whether `line` is a command, or the start of one that only lacks arguments.
fn accepted(line: &str) -> bool {
    matches!(
        line.parse::<Command>(),
        Ok(_) | Err(ParseError::Missing { .. })
    )
}

/// The comma-separated list in the parentheses of `line`'s parse error.
fn listed_in_error(line: &str) -> BTreeSet<String> {
    let e = line.parse::<Command>().expect_err(line).to_string();
    let inner = e
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(')'))
        .unwrap_or_else(|| panic!("no list in the error of '{line}': {e}"))
        .0;
    inner
        .split(',')
        .map(|w| w.trim().to_string())
        .filter(|w| !w.is_empty())
        .collect()
}

#[test]
fn files_have_valid_syntax_and_register() {
    if !have_bash() {
        return;
    }
    for file in [quill_file(), quillctl_file()] {
        let out = Process::new("bash")
            .arg("-n")
            .arg(&file)
            .output()
            .expect("bash -n");
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "bash -n {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(
        bash(&quill_file(), "complete -p quill", &[]).trim(),
        "complete -F _quill quill"
    );
    assert_eq!(
        bash(&quillctl_file(), "complete -p quillctl", &[]).trim(),
        "complete -F _quillctl quillctl"
    );
}

/// The command words: -O/-o offer exactly the configuration commands, quillctl exactly
/// every command, split as quill splits them (`Command::is_setting`).
#[test]
fn command_words_are_the_parsers() {
    if !have_bash() {
        return;
    }
    let settings: BTreeSet<String> = NAMES
        .iter()
        .filter(|n| sample(n).is_setting())
        .map(|n| n.to_string())
        .collect();
    let operations: BTreeSet<String> = NAMES
        .iter()
        .filter(|n| !sample(n).is_setting())
        .map(|n| n.to_string())
        .collect();
    assert_eq!(list(&quill_file(), "_quill_settings"), settings);
    assert_eq!(list(&quillctl_file(), "_quillctl_settings"), settings);
    assert_eq!(list(&quillctl_file(), "_quillctl_operations"), operations);

    // `no X`: the parser answers "unknown command 'no X'" exactly for words without one.
    let negatable: BTreeSet<String> = NAMES
        .iter()
        .filter(|n| {
            format!("no {n}").parse::<Command>() != Err(ParseError::Unknown(format!("no {n}")))
        })
        .map(|n| n.to_string())
        .collect();
    assert_eq!(list(&quillctl_file(), "_quillctl_negatable"), negatable);
}

/// Keyword lists: server fields and ssl_option words as the parser's errors list them,
/// protocol versions as -L and ssl_protocol accept them.
#[test]
fn keyword_lists_are_the_parsers() {
    if !have_bash() {
        return;
    }
    assert_eq!(
        list(&quillctl_file(), "_quillctl_server_fields"),
        listed_in_error("server 0")
    );
    assert_eq!(
        list(&quillctl_file(), "_quillctl_ssl_options"),
        listed_in_error("ssl_option x")
    );
    let protocols = list(&quill_file(), "_quill_protocols");
    assert_eq!(list(&quillctl_file(), "_quillctl_protocols"), protocols);
    for p in &protocols {
        assert!(
            format!("ssl_protocol {p}").parse::<Command>().is_ok(),
            "{p}"
        );
        let args = ["-L", p.as_str(), "443", "h"].map(std::ffi::OsString::from);
        assert!(quill::cli::parse(args).is_ok(), "-L {p}");
    }
}

/// The options offered are those of `quill --help`, and the option parser agrees on which
/// of them take a value.
#[test]
fn options_are_those_of_usage() {
    if !have_bash() {
        return;
    }
    let usage: BTreeSet<String> = quill::cli::USAGE
        .split(|c: char| c.is_whitespace() || c == '/' || c == ',')
        .filter(|t| {
            let short = t.len() == 2 && t.starts_with('-') && t.as_bytes()[1].is_ascii_alphabetic();
            let long = t.len() > 2
                && t.starts_with("--")
                && t[2..].bytes().all(|b| b.is_ascii_lowercase() || b == b'-');
            short || long
        })
        .map(String::from)
        .collect();
    assert_eq!(list(&quill_file(), "_quill_options"), usage);

    let letters = bash(&quill_file(), "printf %s \"$_quill_value_letters\"", &[]);
    for c in ('a'..='z').chain('A'..='Z') {
        let needs_value = match quill::cli::parse([std::ffi::OsString::from(format!("-{c}"))]) {
            Err(e) => e.reason.contains("needs a value"),
            Ok(_) => false,
        };
        assert_eq!(
            letters.contains(c),
            needs_value,
            "-{c}: takes a value for quill: {needs_value}"
        );
    }
}

#[test]
fn quill_options_and_commands() {
    if !have_bash() {
        return;
    }
    let options = quill(&["-"]);
    for o in [
        "-F",
        "-O",
        "-r",
        "-x",
        "--check",
        "--takeover",
        "--help",
        "--version",
    ] {
        assert!(options.iter().any(|w| w == o), "{o} not in {options:?}");
    }
    assert_eq!(quill(&["--ch"]), ["--check"]);
    assert_eq!(quill(&["-O", "rou"]), ["roundrobin"]);
    assert_eq!(quill(&["-o", "ssl_ca"]), ["ssl_ca", "ssl_ca_dir"]);
    assert_eq!(quill(&["-Orou"]), ["-Oroundrobin"]);
    // Operations are for the control socket: -O refuses them.
    assert_eq!(quill(&["-O", "serv"]), ["server"]);
    assert_eq!(quill(&["-L", ""]), sorted(&["ssl23", "tls1.2", "tls1.3"]));
    assert_eq!(quill(&["-f", "-L", "tls1."]), ["tls1.2", "tls1.3"]);
    assert_eq!(quill(&["-u", "roo"]), ["root"]);
    // The first positional argument may be the demo; values and later ones are free.
    assert_eq!(quill(&[""]), ["demo"]);
    assert_eq!(quill(&["-x", "5", "d"]), ["demo"]);
    assert!(quill(&["-x", ""]).is_empty());
    assert!(quill(&["-fx", ""]).is_empty());
    assert!(quill(&["-fx5", "-rO", ""]).len() > 50);
    assert!(quill(&["8080", ""]).is_empty());
    assert_eq!(quill(&["-e", "backup:80", "-B", "[::1]:81", "d"]), ["demo"]);
    assert!(quill(&["-O", "-x", ""]).contains(&"demo".to_string()));
}

#[test]
fn quill_completes_files_and_directories() {
    if !have_bash() {
        return;
    }
    let tmp = TempDir::new("completion");
    let dir = tmp.path();
    std::fs::create_dir(dir.join("a dir")).unwrap();
    std::fs::write(dir.join("quill.cfg"), "listen 80\n").unwrap();
    std::fs::write(dir.join("cert.pem"), "").unwrap();
    let d = format!("{}/", dir.display());
    let all = sorted(&[
        &format!("{d}a dir"),
        &format!("{d}cert.pem"),
        &format!("{d}quill.cfg"),
    ]);
    for opt in ["-F", "-l", "-w", "-p", "-E", "-K", "-G", "-C"] {
        assert_eq!(quill(&[opt, &d]), all, "{opt}");
    }
    assert_eq!(quill(&["-fF", &d]), all, "-fF");
    assert_eq!(quill(&["-F", &format!("{d}q")]), [format!("{d}quill.cfg")]);
    for opt in ["-A", "-j"] {
        assert_eq!(quill(&[opt, &d]), [format!("{d}a dir")], "{opt}");
    }
}

#[test]
fn quillctl_address_and_commands() {
    if !have_bash() {
        return;
    }
    assert_eq!(quillctl(&["/path/to.ctl", "ser"]), ["server", "servers"]);
    assert_eq!(quillctl(&["8000", "stat"]), ["status"]);
    assert_eq!(quillctl(&["h:8000", "n"]), ["no"]);
    // COMP_WORDBREAKS cuts `[::1]:8000` into five words; they are still one argument.
    assert_eq!(quillctl(&["[::1]:8000", "server", "0", "w"]), ["weight"]);
    assert_eq!(quillctl(&["localhost:8000", "no", "tcp_"]), ["tcp_nodelay"]);
    let every = quillctl(&["/s", ""]);
    assert_eq!(every.len(), NAMES.len() + 1, "{every:?}");
    assert_eq!(quillctl(&["-"]), ["--help"]);
    assert!(quillctl(&["--help", ""]).is_empty());

    // The address: control sockets in the systemd units' directory, else files.
    let tmp = TempDir::new("completion-ctl");
    let dir = tmp.path();
    let _web = UnixListener::bind(dir.join("web.ctl")).unwrap();
    let _dns = UnixListener::bind(dir.join("dns.ctl")).unwrap();
    std::fs::write(dir.join("not-a-socket.ctl"), "").unwrap();
    let d = format!("{}/", dir.display());
    let glob = format!("_quillctl_sockets_glob='{d}*.ctl'");
    assert_eq!(
        complete_with(&quillctl_file(), &glob, "_quillctl", &["quillctl", ""]),
        [format!("{d}dns.ctl"), format!("{d}web.ctl")]
    );
    assert_eq!(
        quillctl(&[&format!("{d}w")]),
        [format!("{d}web.ctl")],
        "a path"
    );
    // Readline replaces what follows the last ':' of the word.
    std::fs::write(dir.join("a:b.ctl"), "").unwrap();
    assert_eq!(quillctl(&[&format!("{d}a:")]), ["b.ctl"]);
    assert_eq!(quill(&["-C", &format!("{d}a:b")]), ["b.ctl"]);
    assert!(quillctl(&["80"]).is_empty(), "a port");
    assert!(quillctl(&["localhost:80"]).is_empty(), "host:port");

    // File arguments.
    for command in ["write", "include", "ssl_cert"] {
        assert_eq!(
            quillctl(&["/s", command, &format!("{d}w")]),
            [format!("{d}web.ctl")]
        );
    }
}

/// Arguments of commands: each keyword offered makes a command quill accepts.
#[test]
fn quillctl_arguments() {
    if !have_bash() {
        return;
    }
    let fields = quillctl(&["/s", "server", "0", ""]);
    assert_eq!(fields.len(), 11, "{fields:?}");
    let cases: &[(&[&str], &[&str])] = &[
        (&["status", ""], &["html", "json"]),
        (&["tcp_fastclose", ""], &["both", "down", "off", "up"]),
        (&["ssl_protocol", "tls"], &["tls1.2", "tls1.3"]),
        (&["ssl_option", "no_tlsv1."], &["no_tlsv1.1", "no_tlsv1.2"]),
        (&["proxy_protocol", ""], &["v1", "v2"]),
        (&["check", ""], &["http", "tcp"]),
        (&["acl", "1", ""], &["deny", "permit"]),
        (&["acl", "1", "deny", "c"], &["country"]),
        (&["hsts", "600", "p"], &["preload"]),
        (&["hsts", "600", "preload", "i"], &["include_subdomains"]),
        (
            &["no", "ssl_c"],
            &[
                "ssl_ca",
                "ssl_ca_dir",
                "ssl_cert",
                "ssl_ciphers",
                "ssl_compat",
            ],
        ),
        (&["no", "ssl_option", "no_ssl"], &["no_sslv2", "no_sslv3"]),
        (&["server", "0", "p"], &["port", "prio", "proxy_protocol"]),
        (
            &["server", "0", "check", ""],
            &["default", "http", "off", "tcp"],
        ),
        (
            &["server", "0", "proxy_protocol", ""],
            &["global", "off", "v1", "v2"],
        ),
        (&["server", "0", "drain", "d"], &["drain"]),
        (&["server", "0", "drain", "0", "w"], &["weight"]),
        (&["server", "0", "check", "http", "/h", "w"], &["weight"]),
        (
            &["server", "0", "check", "http", "/h", "200", "w"],
            &["weight"],
        ),
        (&["server", "0", "check", "tcp", "max", "5", "h"], &["hard"]),
    ];
    for (words, expected) in cases {
        let mut line = vec!["/s"];
        line.extend_from_slice(words);
        assert_eq!(quillctl(&line), sorted(expected), "{words:?}");
        let command = words[..words.len() - 1].join(" ");
        for w in *expected {
            let candidate = format!("{command} {w}");
            assert!(accepted(&candidate), "quill refuses '{candidate}'");
        }
    }
    // Values that are the user's own get nothing.
    for words in [
        &["server", ""][..],
        &["server", "0", "port", ""],
        &["server", "0", "check", "http", ""],
        &["timeout", ""],
        &["no", "acl", ""],
    ] {
        let mut line = vec!["/s"];
        line.extend_from_slice(words);
        assert!(quillctl(&line).is_empty(), "{words:?}");
    }
}
