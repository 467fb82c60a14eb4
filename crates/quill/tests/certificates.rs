//! The certificates and keys operators really have, made with the `openssl` command line
//! as tutorials and older private CAs make them: an X.509 v1 leaf (`openssl x509 -req`
//! without `-extfile`), an expired one, a chain out of order, keys in PKCS#1, PKCS#8 and
//! SEC1 form, an encrypted key, a key of another certificate. What Debian's NGINX loads,
//! quill serves (and `openssl s_client` / `curl` then judge the certificate, as they do
//! with NGINX); what NGINX refuses, quill refuses at start-up with the real cause and the
//! file's name. Each case is checked against `nginx -t` too, where NGINX is installed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::*;

/// Runs `openssl ARGS` in `dir`; panics with its output when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl is needed (.ci/run installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A private CA, an intermediate, and leaves for `localhost` made from them.
struct Pki {
    dir: TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = TempDir::new("pki");
        let d = dir.path();
        std::fs::write(d.join("ca.ext"), "basicConstraints=critical,CA:TRUE\n").unwrap();
        std::fs::write(
            d.join("leaf.ext"),
            "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n",
        )
        .unwrap();
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "root.key",
                "-out",
                "root.pem",
                "-days",
                "30",
                "-subj",
                "/CN=Test Root",
            ],
        );
        openssl(
            d,
            &[
                "req",
                "-new",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "inter.key",
                "-out",
                "inter.csr",
                "-subj",
                "/CN=Test Intermediate",
            ],
        );
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "inter.csr",
                "-CA",
                "root.pem",
                "-CAkey",
                "root.key",
                "-CAcreateserial",
                "-days",
                "30",
                "-extfile",
                "ca.ext",
                "-out",
                "inter.pem",
            ],
        );
        // Keys in the three PEM forms a user may hold.
        openssl(
            d,
            &[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                "ec-sec1.key",
            ],
        );
        openssl(d, &["pkey", "-in", "ec-sec1.key", "-out", "ec-pkcs8.key"]);
        openssl(
            d,
            &[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                "ec-other.key",
            ],
        );
        openssl(
            d,
            &["genrsa", "-traditional", "-out", "rsa-pkcs1.key", "2048"],
        );
        openssl(
            d,
            &[
                "pkey",
                "-in",
                "ec-sec1.key",
                "-aes256",
                "-passout",
                "pass:secret",
                "-out",
                "ec-encrypted.key",
            ],
        );
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A leaf for `localhost` with `key`, signed by `ca` (`root` or `inter`) for `days`;
    /// `v3`: with extensions (subjectAltName), else an X.509 v1 certificate.
    fn leaf(&self, name: &str, key: &str, ca: &str, days: &str, v3: bool) -> PathBuf {
        let d = self.dir.path();
        let csr = format!("{name}.csr");
        let out = format!("{name}.pem");
        openssl(
            d,
            &[
                "req",
                "-new",
                "-key",
                key,
                "-subj",
                "/CN=localhost",
                "-out",
                &csr,
            ],
        );
        let (ca_cert, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
        let mut args = vec![
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_cert,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            days,
            "-out",
            &out,
        ];
        if v3 {
            args.extend(["-extfile", "leaf.ext"]);
        }
        openssl(d, &args);
        self.path(&out)
    }

    /// A file holding `parts` one after the other.
    fn bundle(&self, name: &str, parts: &[&Path]) -> PathBuf {
        let text: String = parts
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap())
            .collect();
        let path = self.path(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Whether Debian's NGINX loads `cert` with `key` (`nginx -t`); `None` when NGINX is
/// not installed. Without a terminal NGINX cannot ask for a passphrase, as quill cannot.
fn nginx_loads(cert: &Path, key: &Path) -> Option<bool> {
    let dir = TempDir::new("nginx-t");
    let d = dir.path().display().to_string();
    let conf = format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{}}\nhttp {{\n access_log off;\n client_body_temp_path {d}/body;\n\
         proxy_temp_path {d}/proxy;\n fastcgi_temp_path {d}/fcgi;\n uwsgi_temp_path {d}/uwsgi;\n\
         scgi_temp_path {d}/scgi;\n server {{\n  listen 127.0.0.1:{} ssl;\n  \
         ssl_certificate {};\n  ssl_certificate_key {};\n }}\n}}\n",
        free_port(),
        cert.display(),
        key.display()
    );
    let path = dir.path().join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let out = Command::new("/usr/sbin/nginx")
        .args(["-t", "-p", &d, "-e", &format!("{d}/error.log"), "-c"])
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    Some(out.status.success())
}

/// quill serves `cert` + `key` (its dummy web server over TLS) and `curl`, trusting the
/// test root, gets the page — or, for `curl_ok == false`, refuses the certificate (and
/// `openssl s_client` says why: `why`).
fn serves(pki: &Pki, cert: &Path, key: &Path, curl_ok: bool, why: &str) {
    if let Some(loads) = nginx_loads(cert, key) {
        assert!(
            loads,
            "NGINX refuses {cert:?} + {key:?}: the case is not what it claims"
        );
    }
    let q = Quill::start(&[
        "-E",
        s(cert),
        "-K",
        s(key),
        "-O",
        "dummy",
        "{port}",
        "127.0.0.1:9",
    ]);
    let port = q.addr().port();
    let out = Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "10", "--cacert"])
        .arg(pki.path("root.pem"))
        .args([
            "--resolve",
            &format!("localhost:{port}:127.0.0.1"),
            &format!("https://localhost:{port}/"),
        ])
        .output()
        .expect("curl is needed (.ci/run installs it)");
    let body = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    if curl_ok {
        assert!(out.status.success(), "curl: {err}\nquill: {}", q.stderr());
        assert!(body.contains("quill dummy server"), "{body}");
    } else {
        assert!(!out.status.success(), "curl accepted {cert:?}: {body}");
        let verdict = Command::new("openssl")
            .args([
                "s_client",
                "-connect",
                &format!("127.0.0.1:{port}"),
                "-CAfile",
            ])
            .arg(pki.path("root.pem"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&verdict.stdout);
        assert!(text.contains(why), "s_client: {text}");
    }
}

/// quill refuses to start, exit status 2, with every word of `words` in its message
/// (and so does NGINX, when `like_nginx`).
fn refuses(cert: &Path, key: &Path, like_nginx: bool, words: &[&str]) {
    if let Some(loads) = nginx_loads(cert, key).filter(|_| like_nginx) {
        assert!(!loads, "NGINX loads {cert:?} + {key:?}: quill should too");
    }
    let (code, err) = Quill::start_expect_exit(&[
        "-E",
        s(cert),
        "-K",
        s(key),
        "-O",
        "dummy",
        "{port}",
        "127.0.0.1:9",
    ]);
    assert_eq!(code, Some(2), "{err}");
    for w in words {
        assert!(err.contains(w), "{w:?} not in: {err}");
    }
}

#[test]
fn an_x509_v1_leaf_is_served_with_its_key_in_each_pem_form() {
    let pki = Pki::new();
    let ec_v1 = pki.leaf("ec-v1", "ec-sec1.key", "root", "30", false);
    let rsa_v1 = pki.leaf("rsa-v1", "rsa-pkcs1.key", "root", "30", false);
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(&ec_v1)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("Version: 1 (0x0)"));
    // The same EC key as SEC1 ("EC PRIVATE KEY") and as PKCS#8 ("PRIVATE KEY"); an RSA
    // key as PKCS#1 ("RSA PRIVATE KEY").
    serves(&pki, &ec_v1, &pki.path("ec-sec1.key"), true, "");
    serves(&pki, &ec_v1, &pki.path("ec-pkcs8.key"), true, "");
    serves(&pki, &rsa_v1, &pki.path("rsa-pkcs1.key"), true, "");
}

#[test]
fn expired_and_disordered_chains_are_served_and_judged_by_the_client() {
    let pki = Pki::new();
    // An intermediate-signed leaf with its chain in the wrong order (leaf, root,
    // intermediate): served as given; OpenSSL's clients build the path anyway.
    let leaf = pki.leaf("leaf", "ec-sec1.key", "inter", "30", true);
    let disordered = pki.bundle(
        "disordered.pem",
        &[&leaf, &pki.path("root.pem"), &pki.path("inter.pem")],
    );
    serves(&pki, &disordered, &pki.path("ec-pkcs8.key"), true, "");
    // Expired (valid for no time at all, so expired by the time a client looks): NGINX
    // and HAProxy load it, clients refuse it, and quill says so in its log.
    let expired = pki.leaf("expired", "ec-sec1.key", "root", "0", true);
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let q = Quill::start(&[
        "-E",
        s(&expired),
        "-K",
        s(&pki.path("ec-sec1.key")),
        "-O",
        "dummy",
        "{port}",
        "127.0.0.1:9",
    ]);
    wait_until(START_DEADLINE, "the expiry warning", || {
        q.stderr().contains("clients will refuse it")
    });
    drop(q);
    serves(
        &pki,
        &expired,
        &pki.path("ec-sec1.key"),
        false,
        "certificate has expired",
    );
}

#[test]
fn an_encrypted_or_foreign_key_is_refused_with_its_real_cause() {
    let pki = Pki::new();
    let leaf = pki.leaf("leaf", "ec-sec1.key", "root", "30", false);
    refuses(
        &leaf,
        &pki.path("ec-encrypted.key"),
        true,
        &["ec-encrypted.key", "encrypted", "passphrase"],
    );
    refuses(
        &leaf,
        &pki.path("ec-other.key"),
        true,
        &["ec-other.key", "does not match", "leaf.pem"],
    );
    // A key of another type: NGINX (OpenSSL) files it beside the certificate instead of
    // refusing, starts, and then fails every handshake; quill refuses at start-up.
    refuses(
        &leaf,
        &pki.path("rsa-pkcs1.key"),
        false,
        &["rsa-pkcs1.key", "does not match", "leaf.pem"],
    );
    // The v1 certificate never shows up as the key's fault again.
    let (_, err) = Quill::start_expect_exit(&[
        "-E",
        s(&leaf),
        "-K",
        s(&pki.path("rsa-pkcs1.key")),
        "{port}",
        "127.0.0.1:9",
    ]);
    assert!(!err.contains("UnsupportedCertVersion"), "{err}");
}
