//! Prometheus the way operators use it: `promtool check metrics` finds nothing to say about
//! a live `/metrics`; every certificate quill serves exports its expiry time, renewed by a
//! reload; the alerting rules of `contrib/prometheus/` pass `promtool check rules` and their
//! unit tests (`promtool test rules`); and the rules and the Grafana dashboard of
//! `contrib/grafana/` query only metrics quill exports. promtool is Debian's `prometheus`
//! package (.ci/run installs it); without it those checks say SKIPPED.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rcgen::{CertificateParams, KeyPair};
use support::http::{get, get_openmetrics, request_from, start_with_metrics, Response};
use support::*;

fn contrib(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../contrib")
        .join(path)
}

fn promtool() -> Option<&'static str> {
    let found = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        Some("promtool")
    } else {
        eprintln!("SKIPPED: promtool not installed (Debian package prometheus)");
        None
    }
}

/// A self-signed certificate for `name` valid until `not_after` (year, month, day), written
/// as `NAME.crt` and `NAME.key` in `dir`; returns notAfter in Unix seconds.
fn certificate(dir: &Path, name: &str, not_after: (i32, u8, u8)) -> i64 {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
    params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
    let cert = params.self_signed(&key).unwrap();
    fs::write(dir.join(format!("{name}.crt")), cert.pem()).unwrap();
    fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    params.not_after.unix_timestamp()
}

/// A quill terminating TLS with a default certificate and an SNI directory, two servers,
/// and its metrics listener; the TLS lines are in a `-F` file, so a reload re-reads them.
struct Balancer {
    quill: Quill,
    metrics: SocketAddr,
    dir: TempDir,
}

impl Balancer {
    fn start(backends: &[&IdentityBackend]) -> Balancer {
        let dir = TempDir::new("monitoring");
        let d = dir.path();
        fs::create_dir(d.join("sni")).unwrap();
        certificate(d, "default", (2031, 5, 17));
        certificate(&d.join("sni"), "shop.example", (2030, 1, 2));
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let cfg = d.join("quill.cfg");
        fs::write(
            &cfg,
            format!(
                "ssl_cert {0}/default.crt\nssl_key {0}/default.key\nssl_sni_path {0}/sni\n\
                 metrics_listen {metrics}\n",
                d.display()
            ),
        )
        .unwrap();
        let specs: Vec<String> = backends.iter().map(|b| b.spec()).collect();
        let mut args = vec!["-F", cfg.to_str().unwrap(), "127.0.0.1:{port}"];
        args.extend(specs.iter().map(String::as_str));
        let quill = Quill::start(&args);
        wait_until(START_DEADLINE, "the metrics listener", || {
            request_from("127.0.0.1", metrics, "GET", "/metrics", &[], b"").is_ok()
        });
        Balancer {
            quill,
            metrics,
            dir,
        }
    }

    /// `GET /metrics` the way curl asks (no Accept header): the Prometheus text format.
    fn scrape(&self) -> Response {
        request_from("127.0.0.1", self.metrics, "GET", "/metrics", &[], b"").unwrap()
    }

    /// The value of the sample `name{labels}` (labels as written in the exposition).
    fn sample(&self, name_and_labels: &str) -> Option<f64> {
        let text = self.scrape().text();
        text.lines()
            .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    }
}

#[test]
fn promtool_finds_nothing_to_say_about_a_live_scrape() {
    let Some(promtool) = promtool() else { return };
    let (a, b) = (IdentityBackend::start("a"), IdentityBackend::start("b"));
    let lb = Balancer::start(&[&a, &b]);
    // Some traffic, so that the per-server families have samples.
    let mut c = lb.quill.connect();
    let _ = backend_name(&mut c);
    let r = lb.scrape();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(r.text().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics ({}):\n{said}\n--- metrics ---\n{}",
        out.status,
        r.text()
    );
    // Prometheus itself asks for OpenMetrics and gets it.
    let om = get_openmetrics(lb.metrics);
    assert!(om
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/openmetrics-text")));
    assert!(om.text().ends_with("# EOF\n"));
}

#[test]
fn every_served_certificate_exports_its_expiry_and_a_reload_renews_it() {
    let a = IdentityBackend::start("a");
    let lb = Balancer::start(&[&a]);
    let d = lb.dir.path();
    let family = "quill_tls_certificate_expiry_timestamp_seconds";
    let default = format!("{family}{{file=\"{}/default.crt\",sni=\"\"}}", d.display());
    let shop = format!(
        "{family}{{file=\"{}/sni/shop.example.crt\",sni=\"shop.example\"}}",
        d.display()
    );
    let default_until = rcgen::date_time_ymd(2031, 5, 17).unix_timestamp() as f64;
    let shop_until = rcgen::date_time_ymd(2030, 1, 2).unix_timestamp() as f64;
    assert_eq!(
        lb.sample(&default),
        Some(default_until),
        "{}",
        lb.scrape().text()
    );
    assert_eq!(lb.sample(&shop), Some(shop_until));
    assert_eq!(
        lb.sample("quill_connections_max"),
        Some(lb.sample("quill_connections_max").unwrap()),
        "connections_max is exported"
    );

    // The renewed certificate is served, and exported, after the reload.
    let renewed = certificate(&d.join("sni"), "shop.example", (2032, 3, 4));
    assert_eq!(
        lb.sample(&shop),
        Some(shop_until),
        "nothing changes before the reload"
    );
    lb.quill.signal("HUP");
    wait_until(IO_TIMEOUT, "the renewed certificate's expiry", || {
        lb.sample(&shop) == Some(renewed as f64)
    });
    assert_eq!(lb.sample(&default), Some(default_until));
}

#[test]
fn the_connection_limit_is_exported_as_set() {
    let a = IdentityBackend::start("a");
    let spec = a.spec();
    let metrics = free_port();
    let listen = format!("metrics_listen 127.0.0.1:{metrics}");
    let _q = Quill::start(&["-x", "777", "-O", &listen, "127.0.0.1:{port}", &spec]);
    let addr: SocketAddr = format!("127.0.0.1:{metrics}").parse().unwrap();
    wait_until(START_DEADLINE, "the metrics listener", || {
        request_from("127.0.0.1", addr, "GET", "/metrics", &[], b"").is_ok()
    });
    let text = request_from("127.0.0.1", addr, "GET", "/metrics", &[], b"")
        .unwrap()
        .text();
    assert!(
        text.lines().any(|l| l == "quill_connections_max 777"),
        "{text}"
    );
}

#[test]
fn the_alerting_rules_pass_promtool_and_their_unit_tests() {
    let Some(promtool) = promtool() else { return };
    let dir = contrib("prometheus");
    for args in [
        &["check", "rules", "quill-alerts.yml"][..],
        &["test", "rules", "quill-alerts.test.yml"][..],
    ] {
        let out = Command::new(promtool)
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// PromQL words that are not metric names: keywords, and the aggregation operators, which
/// may be followed by `by (...)` rather than by their `(`.
const KEYWORDS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

/// The metric names a PromQL expression reads: identifiers that are not functions (followed
/// by `(`), label names (inside `{...}` or in `by (...)`-style lists), keywords, numbers,
/// strings or range durations.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut braces, mut brackets) = (0, 0, 0);
    let mut label_list = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += usize::from(chars[i] == '\\') + 1;
                }
            }
            '{' => braces += 1,
            '}' => braces -= 1,
            '[' => brackets += 1,
            ']' => brackets -= 1,
            ')' => label_list = false,
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i + 1 < chars.len()
                    && (chars[i + 1].is_ascii_alphanumeric()
                        || chars[i + 1] == '_'
                        || chars[i + 1] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..=i].iter().collect();
                let preceded_by_dollar = start > 0 && chars[start - 1] == '$';
                let mut next = i + 1;
                while next < chars.len() && chars[next] == ' ' {
                    next += 1;
                }
                let is_call = chars.get(next) == Some(&'(');
                let lower = word.to_ascii_lowercase();
                if matches!(
                    lower.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                ) {
                    label_list = true;
                } else if !(is_call
                    || braces > 0
                    || brackets > 0
                    || label_list
                    || preceded_by_dollar
                    || KEYWORDS.contains(&lower.as_str()))
                {
                    names.insert(word);
                }
            }
            c if c.is_ascii_digit() => {
                // A number, possibly 1e3 or a duration: skip its letters too.
                while i + 1 < chars.len() && chars[i + 1].is_ascii_alphanumeric() {
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    names
}

#[test]
fn the_name_extractor_finds_metrics_and_nothing_else() {
    let got = metric_names(
        r#"sum by (instance, reason) (rate(quill_a_total{job="x",state=~"up|down"}[5m])) / on(instance) quill_b > 0.9 unless absent(c:d) and 2e3 < time() - quill_e offset 5m or $__rate_interval"#,
    );
    let want: BTreeSet<String> = ["quill_a_total", "quill_b", "c:d", "quill_e"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(got, want);
}

#[test]
fn the_rules_and_the_dashboard_use_only_metrics_quill_exports() {
    let (a, b) = (IdentityBackend::start("a"), IdentityBackend::start("b"));
    let lb = Balancer::start(&[&a, &b]);
    let mut c = lb.quill.connect();
    let _ = backend_name(&mut c);
    // And the families only `http` exports (answers by status class, client aborts).
    let (_http, http_metrics) = start_with_metrics(&[
        "-H",
        "-O",
        "metrics_listen 127.0.0.1:{metrics}",
        "{port}",
        &a.spec(),
    ]);
    let families = |text: String| -> BTreeSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(str::to_string)
            .collect()
    };
    let mut exported = families(lb.scrape().text());
    assert!(exported.contains("quill_connections_accepted_total"));
    exported.extend(families(get(http_metrics, "/metrics").text()));
    assert!(exported.contains("quill_server_http_responses_total"));

    let mut queries: Vec<(String, String)> = Vec::new();
    let rules = fs::read_to_string(contrib("prometheus/quill-alerts.yml")).unwrap();
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(expr) = line.trim().strip_prefix("expr:") else {
            continue;
        };
        let mut expr = expr.trim().to_string();
        if expr == "|" {
            // A block: the lines indented deeper than `expr:`.
            let indent = |l: &str| l.len() - l.trim_start().len();
            expr.clear();
            while let Some(next) = lines.next_if(|l| indent(l) > indent(line)) {
                expr.push_str(next.trim());
                expr.push(' ');
            }
        }
        queries.push(("quill-alerts.yml".into(), expr));
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(contrib("grafana/quill-dashboard.json")).unwrap())
            .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let title = panel["title"].as_str().unwrap_or_default();
            queries.push((
                title.to_string(),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        // label_values(METRIC, label): the metric is what matters.
        let query = variable["definition"].as_str().unwrap();
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.split(',').next())
            .unwrap();
        queries.push(("variable".into(), inner.to_string()));
    }
    assert!(queries.len() > 20, "too few queries found: {queries:?}");
    for (place, expr) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{place}: no metric in {expr}");
        for name in names {
            assert!(
                name == "up" || exported.contains(&name),
                "{place}: {name} is not a metric quill exports (in {expr}); it exports:\n{exported:#?}"
            );
        }
    }
}
