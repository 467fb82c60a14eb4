//! GeoIP access rules: `geoip_db FILE` and `acl N permit|deny country CC`, checked with a
//! small MaxMind DB fixture (tests/fixtures/make_geoip.py): 127.0.0.2 is in SE, 127.0.0.3
//! in US.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::*;

fn fixture() -> String {
    format!(
        "{}/tests/fixtures/geoip-test.mmdb",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn a_country_deny_rule_sends_that_country_to_the_abuse_server() {
    if skip_on_pen("quill's GeoIP uses MaxMind DB files; Pen's build here has none") {
        return;
    }
    let normal = IdentityBackend::start("normal");
    let abuse = IdentityBackend::start("abuse");
    let db = fixture();
    let q = Quill::start(&[
        "-B",
        &abuse.addr().to_string(),
        "-O",
        &format!("geoip_db {db}"),
        "-O",
        "acl 1 deny country SE",
        "-O",
        "client_acl 1",
        "127.0.0.1:{port}",
        &normal.spec(),
    ]);
    assert_eq!(q.name_from("127.0.0.2").0, "abuse", "SE client");
    assert_eq!(q.name_from("127.0.0.3").0, "normal", "US client");
    assert_eq!(
        q.name_from("127.0.0.9").0,
        "normal",
        "client of unknown country"
    );
}

#[test]
fn a_country_permit_rule_closes_other_countries() {
    if skip_on_pen("quill's GeoIP uses MaxMind DB files") {
        return;
    }
    let normal = IdentityBackend::start("normal");
    let db = fixture();
    let q = Quill::start(&[
        "-O",
        &format!("geoip_db {db}"),
        "-O",
        "acl 2 permit country us",
        "-O",
        "client_acl 2",
        "127.0.0.1:{port}",
        &normal.spec(),
    ]);
    assert_eq!(q.name_from("127.0.0.3").0, "normal", "US client");
    let mut denied = client_from("127.0.0.2", q.addr()).unwrap();
    expect_closed_without_data(&mut denied, Duration::from_secs(5));
}

#[test]
fn country_rules_without_a_database_are_an_error() {
    let (code, stderr) = Quill::start_expect_exit(&[
        "-O",
        "acl 1 deny country SE",
        "127.0.0.1:{port}",
        "127.0.0.1:9",
    ]);
    if is_pen() {
        return;
    }
    assert_eq!(code, Some(2));
    assert!(stderr.contains("geoip_db"), "stderr: {stderr}");
    let (code, stderr) = Quill::start_expect_exit(&[
        "-O",
        "geoip_db /nonexistent/db.mmdb",
        "127.0.0.1:{port}",
        "127.0.0.1:9",
    ]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("/nonexistent/db.mmdb"), "stderr: {stderr}");
}
