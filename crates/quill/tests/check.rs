//! `quill --check ARGS`: what `nginx -t` and `haproxy -c` do. With the arguments of a real
//! start it builds everything that start would (command line, `-F` file and its includes,
//! ACLs, GeoIP database, TLS certificates, keys and SNI directory, addresses, the `-u`
//! account) and binds nothing, writes nothing and leaves a running quill alone. It says
//! "configuration ok" and exits 0, or lists every problem, files as `FILE:LINE: reason`,
//! and exits 2.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;

use support::ctl::{ctl_ok, run_as_args};
use support::*;

/// Runs `quill --check ARGS` in `dir` to completion.
fn check(dir: &Path, args: &[&str]) -> Exit {
    let out = Command::new(bin())
        .arg("--check")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run quill --check");
    Exit {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A self-signed P-256 certificate for `name` and its key: `NAME.crt`, `NAME.key` in `dir`.
fn certificate(dir: &Path, name: &str) {
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "2", "-subj"])
        .arg(format!("/CN={name}"))
        .arg("-keyout")
        .arg(format!("{name}.key"))
        .arg("-out")
        .arg(format!("{name}.crt"))
        .current_dir(dir)
        .output()
        .expect("openssl is needed (.ci/run installs it)");
    assert!(
        out.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn geoip_fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/geoip-test.mmdb")
        .to_string_lossy()
        .into_owned()
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

#[test]
fn a_good_configuration_is_ok_and_nothing_is_bound_or_written() {
    let dir = TempDir::new("check-ok");
    let d = dir.path();
    certificate(d, "default");
    fs::create_dir(d.join("sni")).unwrap();
    certificate(&d.join("sni"), "shop.example");
    let port = free_port();
    let metrics = free_port();
    fs::write(
        d.join("servers.cfg"),
        "server 0 address 127.0.0.1 port 9001\nserver 1 address localhost port 9002 weight 2\n",
    )
    .unwrap();
    fs::write(
        d.join("quill.cfg"),
        format!(
            "# a whole configuration\nlisten 127.0.0.1:{port}\nroundrobin\ninclude servers.cfg\n\
             geoip_db {geo}\nacl 1 deny country XX\nacl 1 permit 10.0.0.0 255.0.0.0\nclient_acl 1\n\
             ssl_cert default.crt\nssl_key default.key\nssl_sni_path sni\n\
             metrics_listen 127.0.0.1:{metrics}\n",
            geo = geoip_fixture()
        ),
    )
    .unwrap();
    let mut args = vec!["-F", "quill.cfg", "-p", "quill.pid", "-C", "./quill.ctl"];
    args.extend(run_as_args());
    let out = check(d, &args);
    assert_eq!(out.code, Some(0), "stderr:\n{}", out.stderr);
    assert_eq!(out.stdout.trim(), "quill: configuration ok");
    assert!(port_is_free(port), "--check bound the listening port");
    assert!(port_is_free(metrics), "--check bound the metrics port");
    for file in ["quill.pid", "quill.ctl"] {
        assert!(!d.join(file).exists(), "--check made {file}");
    }
}

#[test]
fn every_error_is_reported_with_its_file_and_line() {
    let dir = TempDir::new("check-bad");
    let d = dir.path();
    certificate(d, "a");
    certificate(d, "b");
    fs::create_dir(d.join("sni")).unwrap();
    certificate(&d.join("sni"), "shop.example");
    fs::remove_file(d.join("sni/shop.example.key")).unwrap();
    fs::write(
        d.join("more.cfg"),
        "hash\ntimeout soon\nacl 2 deny country FR\ninclude missing.cfg\n",
    )
    .unwrap();
    fs::write(
        d.join("quill.cfg"),
        [
            "listen 127.0.0.1:8080", // 1
            "frobnicate 3",          // 2: unknown command
            "server 0 address 127.0.0.1 port 9001",
            "server 0 max lots",              // 4: bad value
            "include more.cfg",               // 5
            "servers",                        // 6: an operation
            "geoip_db /nonexistent/geo.mmdb", // 7: unreadable database
            "ssl_cert a.crt",                 // 8
            "ssl_key b.key",                  // 9: not the key of a.crt
            "ssl_sni_path sni",               // 10: a site without its key
            "ssl_ca /nonexistent/ca.pem",     // 11
            "server 1 drain",                 // 12: no such server
        ]
        .join("\n"),
    )
    .unwrap();
    let out = check(
        d,
        &[
            "-F",
            "quill.cfg",
            "-x",
            "many",
            "-u",
            "no-such-user-here",
            "-p",
            "/nonexistent/quill.pid",
        ],
    );
    assert_eq!(out.code, Some(2), "stdout:\n{}", out.stdout);
    let lines: Vec<&str> = out.stderr.lines().collect();
    let expected = [
        "command line: '-x many': ",
        "no-such-user-here",
        "quill.cfg:2: unknown command 'frobnicate'",
        "quill.cfg:4: ",
        "more.cfg:2: ",
        "more.cfg:3: ",
        "missing.cfg: cannot read",
        "quill.cfg:6: 'servers' is an operation",
        "quill.cfg:7: ",
        "quill.cfg:12: ",
        "quill.cfg:9: b.key: the private key does not match the certificate in a.crt",
        "quill.cfg:10: sni/shop.example.key: missing",
        "quill.cfg:11: /nonexistent/ca.pem: cannot read",
        "pid file /nonexistent/quill.pid",
    ];
    for (i, want) in expected.iter().enumerate() {
        let found = lines.iter().position(|l| l.contains(want));
        assert!(
            found.is_some(),
            "no line with {want:?} (#{i}); stderr:\n{}",
            out.stderr
        );
    }
    // One line per problem, in the order given, and the verdict that counts them.
    let positions: Vec<usize> = expected
        .iter()
        .map(|w| lines.iter().position(|l| l.contains(w)).unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "problems out of order: {positions:?}; stderr:\n{}",
        out.stderr
    );
    assert_eq!(
        lines.last().copied(),
        Some(
            format!(
                "quill: configuration check failed: {} errors",
                expected.len()
            )
            .as_str()
        ),
        "stderr:\n{}",
        out.stderr
    );
}

#[test]
fn a_configuration_without_listen_address_or_with_an_unusable_control_address_fails() {
    let dir = TempDir::new("check-nolisten");
    let d = dir.path();
    fs::write(d.join("quill.cfg"), "server 0 address 127.0.0.1 port 80\n").unwrap();
    let out = check(d, &["-F", "quill.cfg"]);
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("no listening address"),
        "{}",
        out.stderr
    );

    let mut args = vec!["-C", "127.0.0.1:99999"];
    args.extend(run_as_args());
    args.extend(["8080", "127.0.0.1:80"]);
    let out = check(d, &args);
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("control socket 127.0.0.1:99999"),
        "{}",
        out.stderr
    );
}

#[test]
fn a_check_leaves_the_running_quill_alone() {
    let backend = IdentityBackend::start("a");
    let spec = backend.spec();
    let mut args = vec!["-C", "{dir}/ctl.sock", "-p", "{dir}/quill.pid"];
    args.extend(run_as_args());
    args.extend(["127.0.0.1:{port}", spec.as_str()]);
    let mut q = Quill::start(&args);
    let pid_file = q.dir().join("quill.pid");
    wait_until(START_DEADLINE, "the pid file", || pid_file.exists());
    let pid_before = fs::read_to_string(&pid_file).unwrap();

    // The very arguments of the running quill, listening port and control socket included.
    let same: Vec<&str> = q.args().iter().map(String::as_str).collect();
    let out = check(q.dir(), &same);
    assert_eq!(out.code, Some(0), "stderr:\n{}", out.stderr);

    q.assert_running();
    assert_eq!(fs::read_to_string(&pid_file).unwrap(), pid_before);
    let ctl = q.dir().join("ctl.sock").to_string_lossy().into_owned();
    assert!(ctl_ok(&ctl, "servers").contains("127.0.0.1"));
    let mut c = q.connect();
    assert_eq!(backend_name(&mut c).as_deref(), Some("a"));
}

#[test]
fn a_start_reports_every_bad_argument_not_only_the_first() {
    let (code, stderr) =
        Quill::start_expect_exit(&["-x", "many", "-t", "0", "{port}", "300.1.1.1"]);
    assert_eq!(code, Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(lines[0].contains("'-x many'"), "{stderr}");
    assert!(lines[1].contains("'-t 0'"), "{stderr}");
    assert!(lines[2].contains("300.1.1.1"), "{stderr}");
}
