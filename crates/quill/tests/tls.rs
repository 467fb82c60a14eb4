//! TLS termination and origination against the real binary, with real clients: the test's
//! own rustls client, `openssl s_client` and `curl` (Debian's, OpenSSL 3). Every test makes
//! its own CA and certificates (rcgen) in a private directory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use support::ctl::*;
use support::*;

// ---------------------------------------------------------------------------
// A test PKI
// ---------------------------------------------------------------------------

/// A CA that signs certificates into files of a directory.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate (PEM file).
    cert: PathBuf,
    key: PathBuf,
    dir: PathBuf,
}

/// A certificate and key written to files.
struct Leaf {
    cert: PathBuf,
    key: PathBuf,
    der: CertificateDer<'static>,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        let cert_path = dir.join(format!("{name}-ca.pem"));
        let key_path = dir.join(format!("{name}-ca.key"));
        fs::write(&cert_path, cert.pem()).unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        Ca {
            issuer: Issuer::new(params, key),
            cert: cert_path,
            key: key_path,
            dir: dir.to_path_buf(),
        }
    }

    /// A server (or client) certificate for `names` (DNS names; 127.0.0.1 is added for
    /// `Role::Server`), with the given key algorithm and serial number.
    fn leaf(
        &self,
        file: &str,
        names: &[&str],
        alg: &'static rcgen::SignatureAlgorithm,
        serial: u64,
        role: Role,
    ) -> Leaf {
        let key = KeyPair::generate_for(alg).unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().copied().unwrap_or("client"),
        );
        params.serial_number = Some(SerialNumber::from(serial.to_be_bytes().to_vec()));
        if role == Role::Client {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        } else {
            if role == Role::Server {
                params
                    .subject_alt_names
                    .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
            }
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let cert_path = self.dir.join(format!("{file}.crt"));
        let key_path = self.dir.join(format!("{file}.key"));
        fs::write(&cert_path, cert.pem()).unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        Leaf {
            cert: cert_path,
            key: key_path,
            der: cert.der().clone(),
        }
    }

    fn server(&self, file: &str, names: &[&str], serial: u64) -> Leaf {
        self.leaf(
            file,
            names,
            &rcgen::PKCS_ECDSA_P256_SHA256,
            serial,
            Role::Server,
        )
    }
}

/// What a test certificate is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Client,
    /// A server, valid for its DNS names and 127.0.0.1.
    Server,
    /// A server valid for its DNS names only: reached at 127.0.0.1, it verifies only if
    /// the name is what is checked.
    ServerByName,
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// ---------------------------------------------------------------------------
// The test's own rustls client
// ---------------------------------------------------------------------------

type TlsClient = StreamOwned<ClientConnection, TcpStream>;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn client_config(ca: &Path, identity: Option<&Leaf>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some(leaf) => {
            let chain: Vec<_> = CertificateDer::pem_file_iter(&leaf.cert)
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let key = PrivateKeyDer::from_pem_file(&leaf.key).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
    };
    Arc::new(config)
}

use rustls::pki_types::pem::PemObject;

/// Connects and completes the handshake (as far as the client can tell).
fn tls_connect(addr: SocketAddr, name: &str, config: &Arc<ClientConfig>) -> io::Result<TlsClient> {
    let sock = connect(addr);
    let name = ServerName::try_from(name.to_string()).unwrap();
    let conn = ClientConnection::new(Arc::clone(config), name).map_err(io::Error::other)?;
    let mut tls = StreamOwned::new(conn, sock);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// Reads the identity backend's name line through TLS, then checks an echo.
fn backend_over_tls(tls: &mut TlsClient) -> io::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match tls.read(&mut b)? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            _ if b[0] == b'\n' => break,
            _ => line.push(b[0]),
        }
    }
    tls.write_all(b"ping")?;
    let mut back = [0u8; 4];
    tls.read_exact(&mut back)?;
    assert_eq!(&back, b"ping");
    Ok(String::from_utf8_lossy(&line).into_owned())
}

// ---------------------------------------------------------------------------
// openssl s_client and curl
// ---------------------------------------------------------------------------

/// Runs `openssl s_client` against `addr` with stdin closed; returns stdout+stderr and
/// whether it exited successfully.
fn s_client(addr: SocketAddr, args: &[&str]) -> (bool, String) {
    let out = Command::new("openssl")
        .arg("s_client")
        .arg("-connect")
        .arg(addr.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("openssl s_client (install openssl)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The protocol or the cipher s_client negotiated, from its `New, TLSv1.3, Cipher is X`
/// line.
fn session_field(text: &str, key: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("New, "))?;
    let rest = line.strip_prefix("New, ")?;
    let (proto, cipher) = rest.split_once(", Cipher is ")?;
    Some(match key {
        "Protocol" => proto.to_string(),
        _ => cipher.trim().to_string(),
    })
}

fn tls_fixture() -> (TempDir, Ca, Leaf) {
    let dir = TempDir::new("tls");
    let ca = Ca::new(dir.path(), "main");
    let leaf = ca.server("server", &["localhost"], 0x1234);
    (dir, ca, leaf)
}

/// quill as a TLS-terminating web server (its dummy server) with `leaf`'s certificate.
fn tls_dummy(leaf: &Leaf) -> Quill {
    Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "dummy",
        "{port}",
        "127.0.0.1:9",
    ])
}

fn needs_openssl() -> bool {
    Command::new("openssl").arg("version").output().is_ok()
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[test]
fn tls13_and_tls12_succeed_and_tls11_is_refused() {
    assert!(needs_openssl(), "openssl is needed (.ci/run installs it)");
    let (_dir, ca, leaf) = tls_fixture();
    let backend = IdentityBackend::start("b0");
    let q = Quill::start(&[
        "-d",
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "{port}",
        &backend.spec(),
    ]);
    let config = client_config(&ca.cert, None);
    let mut tls = tls_connect(q.addr(), "localhost", &config).unwrap();
    assert_eq!(backend_over_tls(&mut tls).unwrap(), "b0");
    assert_eq!(
        tls.conn.alpn_protocol(),
        None,
        "no ALPN asked for, none answered"
    );

    for (flag, proto) in [("-tls1_3", "TLSv1.3"), ("-tls1_2", "TLSv1.2")] {
        let (ok, out) = s_client(
            q.addr(),
            &[flag, "-CAfile", s(&ca.cert), "-servername", "localhost"],
        );
        assert!(ok, "{flag}: {out}");
        assert_eq!(
            session_field(&out, "Protocol").as_deref(),
            Some(proto),
            "{out}"
        );
        assert!(out.contains("Verify return code: 0 (ok)"), "{out}");
    }
    // The client really offers TLS 1.1 (security level 0), and quill refuses it.
    let (ok, out) = s_client(
        q.addr(),
        &[
            "-tls1_1",
            "-cipher",
            "DEFAULT@SECLEVEL=0",
            "-servername",
            "localhost",
        ],
    );
    assert!(!ok, "TLS 1.1 was accepted: {out}");
    assert!(out.to_lowercase().contains("alert"), "{out}");
    wait_until(
        Duration::from_secs(5),
        "quill logs the refused handshake",
        || q.stderr().contains("TLS handshake"),
    );
}

#[test]
fn no_tlsv1_2_leaves_only_tls13() {
    let (_dir, ca, leaf) = tls_fixture();
    let backend = IdentityBackend::start("b0");
    let q = Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "ssl_option no_tlsv1.2",
        "{port}",
        &backend.spec(),
    ]);
    let (ok, out) = s_client(q.addr(), &["-tls1_2", "-CAfile", s(&ca.cert)]);
    assert!(!ok, "TLS 1.2 was accepted: {out}");
    let (ok, out) = s_client(q.addr(), &["-tls1_3", "-CAfile", s(&ca.cert)]);
    assert!(ok, "{out}");
    assert_eq!(session_field(&out, "Protocol").as_deref(), Some("TLSv1.3"));
}

#[test]
fn negotiated_cipher_follows_the_server_preference() {
    let (_dir, ca, leaf) = tls_fixture();
    let backend = IdentityBackend::start("b0");
    let client_order = "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-CHACHA20-POLY1305";
    let server_order = "ssl_ciphers ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-ECDSA-AES128-GCM-SHA256";
    let spec = backend.spec();
    let negotiated = |extra: &[&str]| {
        let mut args = vec!["-E", s(&leaf.cert), "-K", s(&leaf.key), "-O", server_order];
        args.extend(extra);
        args.extend(["{port}", spec.as_str()]);
        let q = Quill::start(&args);
        let (ok, out) = s_client(
            q.addr(),
            &["-tls1_2", "-cipher", client_order, "-CAfile", s(&ca.cert)],
        );
        assert!(ok, "{out}");
        session_field(&out, "Cipher").unwrap_or_default()
    };
    assert_eq!(negotiated(&[]), "ECDHE-ECDSA-CHACHA20-POLY1305");
    assert_eq!(
        negotiated(&["-O", "ssl_option cipher_server_preference"]),
        "ECDHE-ECDSA-CHACHA20-POLY1305"
    );
    assert_eq!(
        negotiated(&["-O", "no ssl_option cipher_server_preference"]),
        "ECDHE-ECDSA-AES128-GCM-SHA256"
    );

    // TLS 1.3: the server's order of the 1.3 suites named in the list wins too.
    let q = Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "ssl_ciphers TLS_CHACHA20_POLY1305_SHA256:TLS_AES_128_GCM_SHA256:ECDHE-ECDSA-AES128-GCM-SHA256",
        "{port}",
        &backend.spec(),
    ]);
    let (ok, out) = s_client(
        q.addr(),
        &[
            "-tls1_3",
            "-ciphersuites",
            "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256",
            "-CAfile",
            s(&ca.cert),
        ],
    );
    assert!(ok, "{out}");
    assert_eq!(
        session_field(&out, "Cipher").as_deref(),
        Some("TLS_CHACHA20_POLY1305_SHA256")
    );
}

#[test]
fn cipher_names_quill_cannot_honour_are_start_up_errors() {
    let (_dir, _ca, leaf) = tls_fixture();
    let (code, err) = Quill::start_expect_exit(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "ssl_ciphers ECDHE-ECDSA-AES128-GCM-SHA256:DHE-RSA-AES256-SHA",
        "{port}",
        "127.0.0.1:9",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("'DHE-RSA-AES256-SHA'"), "{err}");
}

#[test]
fn sni_picks_the_certificate_and_unknown_names_get_the_default() {
    let (dir, ca, leaf) = tls_fixture();
    let sni = dir.path().join("sni");
    fs::create_dir(&sni).unwrap();
    let sni_ca = Ca {
        issuer: Issuer::new(
            {
                let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
                p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
                p.distinguished_name
                    .push(DnType::CommonName, "main test CA");
                p
            },
            KeyPair::from_pem(&fs::read_to_string(&ca.key).unwrap()).unwrap(),
        ),
        cert: ca.cert.clone(),
        key: ca.key.clone(),
        dir: sni.clone(),
    };
    let other = sni_ca.leaf(
        "other.test",
        &["other.test"],
        &rcgen::PKCS_ED25519,
        7,
        Role::Server,
    );
    let rsa = sni_ca.leaf(
        "rsa.test",
        &["rsa.test"],
        &rcgen::PKCS_RSA_SHA256,
        8,
        Role::Server,
    );
    let backend = IdentityBackend::start("b0");
    let q = Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        &format!("ssl_sni_path {}", s(&sni)),
        "{port}",
        &backend.spec(),
    ]);
    let config = client_config(&ca.cert, None);
    for (name, want) in [
        ("other.test", &other.der),
        ("rsa.test", &rsa.der),
        ("localhost", &leaf.der),
    ] {
        let mut tls = tls_connect(q.addr(), name, &config)
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", q.stderr()));
        let got = tls.conn.peer_certificates().unwrap()[0].clone();
        assert_eq!(&got, want, "certificate for {name}");
        assert_eq!(backend_over_tls(&mut tls).unwrap(), "b0");
    }
    // An unknown name gets the default certificate (which does not name it).
    let (_, out) = s_client(
        q.addr(),
        &["-servername", "unknown.test", "-CAfile", s(&ca.cert)],
    );
    assert!(out.contains("CN = localhost"), "{out}");
}

#[test]
fn ocsp_response_is_stapled_and_re_read_when_the_command_is_repeated() {
    let (dir, ca, leaf) = tls_fixture();
    let d = dir.path();
    let index = d.join("index.txt");
    let respond = |status: &str, out: &Path| {
        // openssl ca's database: status, expiry, revocation date, serial, file, subject.
        let revoked = if status == "R" { "240101000000Z" } else { "" };
        fs::write(
            &index,
            format!(
                "{status}\t491231235959Z\t{revoked}\t0000000000001234\tunknown\t/CN=localhost\n"
            ),
        )
        .unwrap();
        let req = d.join("req.der");
        let run = |args: &[&str]| {
            let o = Command::new("openssl").args(args).output().unwrap();
            assert!(
                o.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        run(&[
            "ocsp",
            "-issuer",
            s(&ca.cert),
            "-cert",
            s(&leaf.cert),
            "-no_nonce",
            "-reqout",
            s(&req),
        ]);
        run(&[
            "ocsp",
            "-index",
            s(&index),
            "-rsigner",
            s(&ca.cert),
            "-rkey",
            s(&ca.key),
            "-CA",
            s(&ca.cert),
            "-reqin",
            s(&req),
            "-respout",
            s(out),
            "-ndays",
            "1",
        ]);
    };
    let ocsp = d.join("ocsp.der");
    respond("V", &ocsp);
    let backend = IdentityBackend::start("b0");
    let mut args = vec!["-C", "127.0.0.1:{ctl}"];
    args.extend(run_as_args());
    let ocsp_cmd = format!("ssl_ocsp_response {}", s(&ocsp));
    let spec = backend.spec();
    args.extend([
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        &ocsp_cmd,
        "{port}",
        &spec,
    ]);
    let (q, ctl) = start_with_control(&args);
    let (ok, out) = s_client(q.addr(), &["-status", "-CAfile", s(&ca.cert)]);
    assert!(ok, "{out}");
    assert!(out.contains("OCSP Response Status: successful"), "{out}");
    assert!(out.contains("Cert Status: good"), "{out}");

    // A new response in the same file is served once the command is repeated.
    respond("R", &ocsp);
    let (ok, out) = s_client(q.addr(), &["-status", "-CAfile", s(&ca.cert)]);
    assert!(
        ok && out.contains("Cert Status: good"),
        "not re-read before the command: {out}"
    );
    ctl_ok(&ctl, &format!("ssl_ocsp_response {}", s(&ocsp)));
    let (ok, out) = s_client(q.addr(), &["-status", "-CAfile", s(&ca.cert)]);
    assert!(ok, "{out}");
    assert!(out.contains("Cert Status: revoked"), "{out}");
}

#[test]
fn required_client_certificates_are_verified_against_the_ca() {
    let (dir, ca, leaf) = tls_fixture();
    let stranger = Ca::new(dir.path(), "stranger");
    let good = ca.leaf(
        "alice",
        &["alice"],
        &rcgen::PKCS_ECDSA_P256_SHA256,
        21,
        Role::Client,
    );
    let bad = stranger.leaf(
        "mallory",
        &["mallory"],
        &rcgen::PKCS_ECDSA_P256_SHA256,
        22,
        Role::Client,
    );
    let backend = IdentityBackend::start("b0");
    let q = Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-G",
        s(&ca.cert),
        "-R",
        "{port}",
        &backend.spec(),
    ]);
    let refused = |config: Arc<ClientConfig>| {
        // TLS 1.3 clients finish their side first; the refusal arrives as an alert.
        match tls_connect(q.addr(), "localhost", &config) {
            Err(_) => {}
            Ok(mut tls) => assert!(backend_over_tls(&mut tls).is_err()),
        }
    };
    refused(client_config(&ca.cert, None));
    refused(client_config(&ca.cert, Some(&bad)));
    assert_eq!(
        backend.accepted(),
        0,
        "a refused client reached the backend"
    );
    let mut tls =
        tls_connect(q.addr(), "localhost", &client_config(&ca.cert, Some(&good))).unwrap();
    assert_eq!(backend_over_tls(&mut tls).unwrap(), "b0");
    // openssl without a certificate is refused as well (TLS 1.2: during the handshake).
    let (_, out) = s_client(q.addr(), &["-tls1_2", "-CAfile", s(&ca.cert)]);
    assert!(out.to_lowercase().contains("alert"), "{out}");
}

#[test]
fn sighup_reloads_certificates_without_dropping_connections() {
    let (dir, ca, leaf) = tls_fixture();
    let backend = IdentityBackend::start("b0");
    let cfg = dir.path().join("quill.cfg");
    let cert = dir.path().join("live.crt");
    let key = dir.path().join("live.key");
    fs::copy(&leaf.cert, &cert).unwrap();
    fs::copy(&leaf.key, &key).unwrap();
    fs::write(
        &cfg,
        format!(
            "ssl_cert {}\nssl_key {}\nserver 0 address 127.0.0.1 port {}\n",
            s(&cert),
            s(&key),
            backend.port()
        ),
    )
    .unwrap();
    let q = Quill::start(&["-F", s(&cfg), "{port}"]);
    let config = client_config(&ca.cert, None);
    let mut old = tls_connect(q.addr(), "localhost", &config).unwrap();
    assert_eq!(backend_over_tls(&mut old).unwrap(), "b0");
    assert_eq!(old.conn.peer_certificates().unwrap()[0], leaf.der);

    // Renew: a new certificate and key in the same files.
    let renewed = ca.server("renewed", &["localhost"], 0x5678);
    fs::copy(&renewed.cert, &cert).unwrap();
    fs::copy(&renewed.key, &key).unwrap();
    q.signal("HUP");
    wait_until(
        Duration::from_secs(5),
        "new connections get the renewed certificate",
        || {
            let tls = tls_connect(q.addr(), "localhost", &config).unwrap();
            tls.conn.peer_certificates().unwrap()[0] == renewed.der
        },
    );
    // The connection made before the reload still relays.
    old.write_all(b"more").unwrap();
    let mut back = [0u8; 4];
    old.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"more");

    // A broken certificate keeps the running one, and says why.
    fs::write(&cert, "not a certificate\n").unwrap();
    q.signal("HUP");
    wait_until(
        Duration::from_secs(5),
        "quill reports the failed reload",
        || q.stderr().contains("reload failed"),
    );
    assert!(q.stderr().contains("live.crt"), "{}", q.stderr());
    let mut tls = tls_connect(q.addr(), "localhost", &config).unwrap();
    assert_eq!(tls.conn.peer_certificates().unwrap()[0], renewed.der);
    assert_eq!(backend_over_tls(&mut tls).unwrap(), "b0");
}

#[test]
fn sessions_resume_also_across_a_reload() {
    let (dir, ca, leaf) = tls_fixture();
    let backend = IdentityBackend::start("b0");
    let cfg = dir.path().join("quill.cfg");
    fs::write(
        &cfg,
        format!(
            "ssl_cert {}\nssl_key {}\nserver 0 address 127.0.0.1 port {}\n",
            s(&leaf.cert),
            s(&leaf.key),
            backend.port()
        ),
    )
    .unwrap();
    let q = Quill::start(&["-d", "-F", s(&cfg), "{port}"]);
    let config = client_config(&ca.cert, None);
    let mut first = tls_connect(q.addr(), "localhost", &config).unwrap();
    // TLS 1.3 tickets arrive after the handshake: read application data first.
    backend_over_tls(&mut first).unwrap();
    let mut second = tls_connect(q.addr(), "localhost", &config).unwrap();
    backend_over_tls(&mut second).unwrap();
    assert_eq!(
        second.conn.handshake_kind(),
        Some(rustls::HandshakeKind::Resumed)
    );
    q.signal("HUP");
    wait_until(Duration::from_secs(5), "the reload is done", || {
        q.stderr().contains("configuration reloaded")
    });
    let mut third = tls_connect(q.addr(), "localhost", &config).unwrap();
    backend_over_tls(&mut third).unwrap();
    assert_eq!(
        third.conn.handshake_kind(),
        Some(rustls::HandshakeKind::Resumed)
    );
}

#[test]
fn start_up_errors_name_the_file_and_the_problem() {
    let (dir, ca, leaf) = tls_fixture();
    let other = ca.server("other", &["localhost"], 99);
    let missing = dir.path().join("missing.pem");
    let combined = dir.path().join("combined.pem");
    fs::write(
        &combined,
        fs::read_to_string(&leaf.cert).unwrap() + &fs::read_to_string(&leaf.key).unwrap(),
    )
    .unwrap();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["-E", s(&missing)], vec!["missing.pem", "cannot read"]),
        (
            vec!["-E", s(&leaf.cert), "-K", s(&other.key)],
            vec!["other.key", "does not match", "server.crt"],
        ),
        (
            vec!["-E", s(&leaf.cert)],
            vec!["server.crt", "no private key"],
        ),
        (
            vec!["-E", s(&ca.key), "-K", s(&leaf.key)],
            vec!["main-ca.key", "no PEM certificate"],
        ),
        (
            vec!["-E", s(&leaf.cert), "-K", s(&leaf.key), "-R"],
            vec!["-G"],
        ),
        (vec!["-K", s(&leaf.key)], vec!["ssl_cert"]),
    ];
    for (flags, words) in cases {
        let mut args = flags.clone();
        args.extend(["{port}", "127.0.0.1:9"]);
        let (code, err) = Quill::start_expect_exit(&args);
        assert_eq!(code, Some(2), "{flags:?}: {err}");
        for w in words {
            assert!(err.contains(w), "{flags:?}: {w:?} not in {err}");
        }
    }
    // The key may be in the certificate file.
    let backend = IdentityBackend::start("b0");
    let q = Quill::start(&["-E", s(&combined), "{port}", &backend.spec()]);
    let mut tls = tls_connect(q.addr(), "localhost", &client_config(&ca.cert, None)).unwrap();
    assert_eq!(backend_over_tls(&mut tls).unwrap(), "b0");
}

#[test]
fn curl_gets_http_over_tls_with_alpn_http11() {
    let (_dir, ca, leaf) = tls_fixture();
    let q = tls_dummy(&leaf);
    let out = Command::new("curl")
        .args(["-sS", "-v", "--max-time", "10", "--cacert", s(&ca.cert)])
        .arg("--resolve")
        .arg(format!("localhost:{}:127.0.0.1", q.port))
        .arg(format!("https://localhost:{}/", q.port))
        .output()
        .expect("curl (install curl)");
    let body = String::from_utf8_lossy(&out.stdout);
    let verbose = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{verbose}");
    assert!(body.contains("quill dummy server"), "{body}");
    assert!(
        verbose.contains("ALPN: server accepted http/1.1"),
        "{verbose}"
    );
}

/// A client whose ALPN list names none of quill's protocols is served without ALPN, as by
/// HAProxy, not refused with `no_application_protocol` (rustls's own answer): curl's
/// `--http1.0` offers `http/1.0` alone (which NGINX offers too), and a raw relay's client
/// may name its own protocol.
#[test]
fn a_client_offering_none_of_quills_alpn_protocols_is_served_without_alpn() {
    use support::http_echo::EchoServer;
    let (_dir, ca, leaf) = tls_fixture();
    let echo = EchoServer::start();
    let q = Quill::start(&[
        "-H",
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "{port}",
        &echo.spec(),
    ]);
    let out = Command::new("curl")
        .args([
            "-sS",
            "-v",
            "--http1.0",
            "--max-time",
            "10",
            "--cacert",
            s(&ca.cert),
        ])
        .args(["-o", "/dev/null", "-w", "%{http_code}"])
        .arg("--resolve")
        .arg(format!("localhost:{}:127.0.0.1", q.port))
        .arg(format!("https://localhost:{}/old", q.port))
        .output()
        .expect("curl (install curl)");
    let verbose = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{verbose}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200", "{verbose}");
    assert!(verbose.contains("ALPN: offers http/1.0"), "{verbose}");
    assert!(!verbose.contains("server accepted"), "{verbose}");

    // A raw relay (offering `http/1.1` by default) and a client that asks for `imap`.
    let backend = IdentityBackend::start("b0");
    let q = Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "{port}",
        &backend.spec(),
    ]);
    let mut config = (*client_config(&ca.cert, None)).clone();
    config.alpn_protocols = vec![b"imap".to_vec()];
    let mut tls = tls_connect(q.addr(), "localhost", &Arc::new(config)).unwrap();
    assert_eq!(tls.conn.alpn_protocol(), None);
    assert_eq!(backend_over_tls(&mut tls).unwrap(), "b0");
    // One of quill's among others is still chosen.
    let mut config = (*client_config(&ca.cert, None)).clone();
    config.alpn_protocols = vec![b"imap".to_vec(), b"http/1.1".to_vec()];
    let tls = tls_connect(q.addr(), "localhost", &Arc::new(config)).unwrap();
    assert_eq!(tls.conn.alpn_protocol(), Some(&b"http/1.1"[..]));
}

/// quill in front of a TLS backend (another quill terminating TLS with the dummy server):
/// plain and TLS clients reach it when its certificate verifies, and nothing does with the
/// wrong CA.
#[test]
fn re_encryption_verifies_the_backend_certificate() {
    let (dir, ca, leaf) = tls_fixture();
    let backend = tls_dummy(&leaf);
    // An IP address as the host: the certificate is checked for that address.
    let upstream = format!("127.0.0.1:{}", backend.port);
    let get = |front: &Quill, tls: bool| -> String {
        if tls {
            let mut c = tls_connect(front.addr(), "localhost", &client_config(&ca.cert, None))
                .unwrap_or_else(|e| panic!("{e}"));
            let _ = c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            let mut out = Vec::new();
            let _ = c.read_to_end(&mut out);
            String::from_utf8_lossy(&out).into_owned()
        } else {
            let mut c = front.connect();
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut out = Vec::new();
            let _ = c.read_to_end(&mut out);
            String::from_utf8_lossy(&out).into_owned()
        }
    };
    let want = format!("quill dummy server on port {}", backend.port);
    let plain_front = Quill::start(&[
        "-O",
        "upstream_tls",
        "-O",
        &format!("upstream_ca {}", s(&ca.cert)),
        "{port}",
        &upstream,
    ]);
    assert!(
        get(&plain_front, false).contains(&want),
        "{}",
        plain_front.stderr()
    );
    let tls_front = Quill::start(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "upstream_tls",
        "-O",
        &format!("upstream_ca {}", s(&ca.cert)),
        "{port}",
        &upstream,
    ]);
    assert!(
        get(&tls_front, true).contains(&want),
        "{}",
        tls_front.stderr()
    );

    // The wrong CA: the backend's certificate does not verify and nothing is relayed.
    let stranger = Ca::new(dir.path(), "stranger");
    let wrong = Quill::start(&[
        "-d",
        "-O",
        "upstream_tls",
        "-O",
        &format!("upstream_ca {}", s(&stranger.cert)),
        "{port}",
        &upstream,
    ]);
    assert_eq!(get(&wrong, false), "");
    wait_until(
        Duration::from_secs(5),
        "quill logs the certificate failure",
        || wrong.stderr().to_lowercase().contains("certificate"),
    );
    // The name checked is the server's host as written unless upstream_sni says otherwise.
    let misnamed = Quill::start(&[
        "-O",
        "upstream_tls",
        "-O",
        &format!("upstream_ca {}", s(&ca.cert)),
        "-O",
        "upstream_sni not-the-backend.test",
        "{port}",
        &upstream,
    ]);
    assert_eq!(get(&misnamed, false), "");
}

/// The emergency server is verified by the name it was configured with, as a table
/// server is, on each data plane that can reach it: the raw relay, HTTP/1.x request by
/// request (`h1_pump`), and hyper's gateway (here chosen by `upstream_h2`; the server,
/// offered `h2` and `http/1.1`, picks neither and is spoken HTTP/1.1).
#[test]
fn the_emergency_server_is_verified_by_its_configured_name() {
    let (_dir, ca, _) = tls_fixture();
    let named = ca.leaf(
        "named",
        &["localhost"],
        &rcgen::PKCS_ECDSA_P256_SHA256,
        0x77,
        Role::ServerByName,
    );
    let emergency = tls_dummy(&named);
    let want = format!("quill dummy server on port {}", emergency.port);
    let down = format!("127.0.0.1:{}", free_port());
    for extra in [&[][..], &["-H"][..], &["-H", "-O", "upstream_h2"][..]] {
        let mut args = vec![
            "-O".to_string(),
            "upstream_tls".into(),
            "-O".into(),
            format!("upstream_ca {}", s(&ca.cert)),
            "-e".into(),
            format!("localhost:{}", emergency.port),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        args.extend(["{port}".to_string(), down.clone()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let q = Quill::start(&args);
        let mut c = q.connect();
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        let out = String::from_utf8_lossy(&out);
        assert!(
            out.contains(&want),
            "quill {extra:?}: {out}\n{}",
            q.stderr()
        );
    }
}

/// With `http` (-H), TLS-terminated requests carry `X-Forwarded-Proto: https` (and the
/// client's address) on every request of a keep-alive connection, and `hsts` adds
/// `Strict-Transport-Security` to every response.
#[test]
fn http_after_tls_gets_forwarded_proto_https_and_hsts() {
    use support::http_echo::{read_final_response, EchoServer};
    let (_dir, ca, leaf) = tls_fixture();
    let echo = EchoServer::start();
    let q = Quill::start(&[
        "-H",
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "hsts 31536000 include_subdomains",
        "{port}",
        &echo.spec(),
    ]);
    let mut tls = tls_connect(q.addr(), "localhost", &client_config(&ca.cert, None)).unwrap();
    assert_eq!(tls.conn.alpn_protocol(), None);
    for i in 0..3 {
        let body = format!("request {i}");
        tls.write_all(
            format!(
                "POST /{i} HTTP/1.1\r\nHost: x\r\nX-Forwarded-Proto: http\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap();
        let resp = read_final_response(&mut tls).unwrap_or_else(|| panic!("no response {i}"));
        let seen = resp.seen();
        assert_eq!(seen.request_line(), format!("POST /{i} HTTP/1.1"));
        assert_eq!(seen.fields("X-Forwarded-Proto"), ["https"], "{}", seen.head);
        assert_eq!(
            seen.fields("X-Forwarded-For"),
            ["127.0.0.1"],
            "{}",
            seen.head
        );
        assert_eq!(seen.body_len, body.len());
        assert_eq!(
            resp.field("Strict-Transport-Security").as_deref(),
            Some("max-age=31536000; includeSubDomains")
        );
    }
    assert_eq!(
        echo.connections(),
        1,
        "one backend connection for the keep-alive client"
    );
}

/// quill's own answers over TLS carry `hsts` as the servers' do: 503 when no server can
/// take the request (on the byte pump, and through hyper with `upstream_h2`), 400 to a
/// request quill refuses.
#[test]
fn quills_own_answers_over_tls_carry_hsts_too() {
    use support::http_echo::read_final_response;
    if skip_on_pen("quill's own answers (Pen closes)") {
        return;
    }
    let (_dir, ca, leaf) = tls_fixture();
    let nowhere = format!("127.0.0.1:{}", free_port());
    for extra in [&[][..], &["-O", "upstream_h2"][..]] {
        let mut args = vec!["-H", "-E", s(&leaf.cert), "-K", s(&leaf.key)];
        args.extend(["-O", "hsts 600", "{port}", &nowhere]);
        args.extend_from_slice(extra);
        let q = Quill::start(&args);
        for (request, status) in [
            (&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], 503),
            (
                &b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n"[..],
                400,
            ),
        ] {
            let mut tls =
                tls_connect(q.addr(), "localhost", &client_config(&ca.cert, None)).unwrap();
            tls.write_all(request).unwrap();
            let resp = read_final_response(&mut tls).expect("quill's answer");
            assert_eq!(resp.status, status, "{extra:?}: {}", resp.head);
            assert_eq!(
                resp.field("Strict-Transport-Security").as_deref(),
                Some("max-age=600"),
                "{extra:?}: {}",
                resp.head
            );
        }
    }
}

/// With `http` (-H) after TLS, an idle keep-alive client parks between requests (hyper
/// let go, rustls kept) and its next requests are served on the same TLS session.
#[test]
fn http_after_tls_parks_idle_clients_between_requests() {
    use support::http_echo::{read_final_response, EchoServer};
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (_dir, ca, leaf) = tls_fixture();
    let echo = EchoServer::start();
    let (q, ctl) = start_with_tcp_control(&[
        "-H",
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "idle_park 1",
        "127.0.0.1:{port}",
        &echo.spec(),
    ]);
    let mut tls = tls_connect(q.addr(), "localhost", &client_config(&ca.cert, None)).unwrap();
    tls.sock
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    for i in 0..3 {
        tls.write_all(format!("GET /{i} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        let resp = read_final_response(&mut tls).unwrap_or_else(|| panic!("no response {i}"));
        assert_eq!(resp.seen().request_line(), format!("GET /{i} HTTP/1.1"));
        wait_until(Duration::from_secs(15), "the client parked", || {
            status_json(&ctl)["connections"]["parked"] == 1
        });
    }
    assert_eq!(status_json(&ctl)["connections"]["accepted"], 1);
}

/// With `http` (-H) after TLS, the server is connected only once the handshake is done
/// and a whole request head has come; a head that trickles gets 408 through TLS.
#[test]
fn http_after_tls_connects_no_server_before_a_whole_head() {
    use support::http_echo::{read_final_response, EchoServer};
    let (_dir, ca, leaf) = tls_fixture();
    let echo = EchoServer::start();
    let q = Quill::start(&[
        "-H",
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "http_request_timeout 1",
        "{port}",
        &echo.spec(),
    ]);
    let config = client_config(&ca.cert, None);
    let mut slow = tls_connect(q.addr(), "localhost", &config).unwrap();
    slow.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    slow.flush().unwrap();
    // Handshaken and silent.
    let mut silent = tls_connect(q.addr(), "localhost", &config).unwrap();
    let mut good = tls_connect(q.addr(), "localhost", &config).unwrap();
    good.write_all(b"GET /good HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let resp = read_final_response(&mut good).unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(echo.connections(), 1, "only the client that sent a request");
    slow.sock
        .set_read_timeout(Some(Duration::from_secs(6)))
        .unwrap();
    let mut answer = Vec::new();
    slow.read_to_end(&mut answer).unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 408 Request Timeout\r\n"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    silent
        .sock
        .set_read_timeout(Some(Duration::from_secs(6)))
        .unwrap();
    let mut nothing = Vec::new();
    // Closed without a word (a TCP close: rustls reports the missing close_notify).
    if let Err(e) = silent.read_to_end(&mut nothing) {
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
    }
    assert!(
        nothing.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&nothing)
    );
    assert_eq!(
        echo.connections(),
        1,
        "none for the slow or the silent client"
    );
}

#[test]
fn http_health_checks_speak_tls_to_tls_servers() {
    let (dir, ca, leaf) = tls_fixture();
    let backend = tls_dummy(&leaf);
    let upstream = format!("127.0.0.1:{}", backend.port);
    // The health the check settles on with `upstream_ca` = `ca_file`.
    let settled = |ca_file: &Path, want: &str| {
        let mut args = vec!["-C", "127.0.0.1:{ctl}"];
        args.extend(run_as_args());
        let ca_cmd = format!("upstream_ca {}", s(ca_file));
        args.extend([
            "-O",
            "upstream_tls",
            "-O",
            &ca_cmd,
            "-O",
            "check http /",
            "-O",
            "check_interval 200ms",
            "{port}",
            &upstream,
        ]);
        let (_front, ctl) = start_with_control(&args);
        wait_health(&ctl, 0, want);
    };
    // Verified against the CA that signed the server's certificate: up.
    settled(&ca.cert, "up");
    // A CA that did not sign it: the check's handshake fails, as clients' would.
    let other = Ca::new(dir.path(), "other");
    settled(&other.cert, "down");
}

/// A TLS client queued for a full server (`queue_timeout`) that closes after its handshake
/// is seen on its socket at once: its place goes to no one, no server connection is made.
#[test]
fn a_tls_client_that_leaves_the_queue_gives_up_its_place_at_once() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (_dir, ca, leaf) = tls_fixture();
    let config = client_config(&ca.cert, None);
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&[
        "-E",
        s(&leaf.cert),
        "-K",
        s(&leaf.key),
        "-O",
        "queue_timeout 30",
        "127.0.0.1:{port}",
        &a.spec_with("1"),
    ]);
    let queue = || {
        let status = status_json(&ctl);
        let c = &status["connections"];
        (
            c["queued"].as_u64().unwrap(),
            c["queue_abandoned"].as_u64().unwrap(),
        )
    };
    let mut first = tls_connect(q.addr(), "localhost", &config).unwrap();
    assert_eq!(backend_over_tls(&mut first).unwrap(), "a");
    let second = tls_connect(q.addr(), "localhost", &config).unwrap();
    wait_until(Duration::from_secs(5), "the second client queued", || {
        queue() == (1, 0)
    });
    // Gone without a word after its handshake (no close_notify: a FIN).
    drop(second);
    wait_until(
        Duration::from_secs(5),
        "the second client left the queue",
        || queue() == (0, 1),
    );
    drop(first);
    let mut third = tls_connect(q.addr(), "localhost", &config).unwrap();
    assert_eq!(backend_over_tls(&mut third).unwrap(), "a");
    assert_eq!(
        a.accepted(),
        2,
        "a connection was made for a client that had left"
    );
}
