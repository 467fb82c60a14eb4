//! TLS on rustls (aws-lc-rs): the declarative settings ([`TlsConf`], part of `Settings`)
//! and the rustls configurations built from them ([`Built`]).
//!
//! Invariants: building reads every file it needs (certificates, keys, CAs, the SNI
//! directory, the OCSP response) and either succeeds as a whole or returns a [`TlsError`]
//! naming the file and the problem, so a reload with a broken certificate keeps the running
//! one. Session state (the resumption cache and the ticket keys) is carried over from the
//! previous build, so a reload does not cost clients a full handshake. Nothing here is on the
//! per-connection path except [`ServerTls::accept`] and [`UpstreamTls::connect`].

mod check;
pub mod ciphers;
mod files;

pub use check::check;

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::danger::ClientCertVerifier;
use rustls::server::{ProducesTickets, ServerSessionMemoryCache, StoresServerSessions};
use rustls::server::{ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig, SupportedProtocolVersion};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::command::{Alpn, Command, Host, SslOption, SslProtocol, Word};

pub use tokio_rustls::client::TlsStream as ClientTlsStream;
pub use tokio_rustls::server::TlsStream as ServerTlsStream;

/// TLS sessions remembered for resumption by session id (TLS 1.2 clients without tickets).
const SESSION_CACHE: usize = 20_480;

/// The ALPN protocol names (RFC 7301 registry).
const ALPN_HTTP11: &[u8] = b"http/1.1";
const ALPN_H2: &[u8] = b"h2";

/// Why a TLS configuration could not be built. Each names the file and the problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("{file}: cannot read: {source}")]
    Read { file: PathBuf, source: io::Error },
    #[error("{file}: no PEM certificate in it{detail}")]
    NoCertificate { file: PathBuf, detail: String },
    #[error("{file}: no private key in it (PEM: PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY){detail}")]
    NoKey { file: PathBuf, detail: String },
    #[error("{key}: the private key does not match the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("{file}: the private key is encrypted (a passphrase protects it); quill reads unencrypted keys only: decrypt it, e.g. openssl pkey -in KEY -out KEY.plain, and keep that file private")]
    EncryptedKey { file: PathBuf },
    #[error("{file}: unusable certificate: {reason}")]
    BadCert { file: PathBuf, reason: String },
    #[error("{file}: unusable private key: {reason}")]
    BadKey { file: PathBuf, reason: String },
    #[error("{file}: unusable CA certificate: {reason}")]
    BadCa { file: PathBuf, reason: String },
    #[error("ssl_verify_client (-R) needs CA certificates: give ssl_ca (-G) or ssl_ca_dir (-A)")]
    NoClientCa,
    #[error("{0} needs ssl_cert (-E): nothing is served over TLS without a certificate")]
    NeedsCert(&'static str),
    #[error(
        "ssl_ciphers '{list}': '{item}' is not a cipher quill can offer; it offers {supported}"
    )]
    Cipher {
        list: String,
        item: String,
        supported: String,
    },
    #[error("ssl_ciphers '{list}' leaves no suite for {what}")]
    NoSuites { list: String, what: String },
    #[error("no protocol version left: ssl_protocol tls1.2 with ssl_option no_tlsv1.2")]
    NoVersion,
    #[error("{file}: {reason}")]
    Sni { file: PathBuf, reason: String },
    #[error("{file}: empty OCSP response")]
    EmptyOcsp { file: PathBuf },
    #[error("TLS configuration: {0}")]
    Rustls(rustls::Error),
}

/// The TLS settings as the commands left them (no files read yet).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsConf {
    pub cert: Option<Word>,
    pub key: Option<Word>,
    pub ca: Option<Word>,
    pub ca_dir: Option<Word>,
    pub verify_client: bool,
    pub protocol: SslProtocol,
    /// `ssl_option`s given, in order, without repeats.
    pub options: Vec<SslOption>,
    /// `no ssl_option cipher_server_preference`: follow the client's order.
    pub client_order: bool,
    pub ciphers: Option<Word>,
    pub sni_path: Option<Word>,
    pub ocsp: Option<Word>,
    pub renegotiation_interval: Option<u64>,
    pub upstream: bool,
    pub upstream_ca: Option<Word>,
    pub upstream_sni: Option<Host>,
    /// `alpn`: the protocols offered, in order (`None`: the default for the mode).
    pub alpn: Option<Vec<Alpn>>,
    /// Mirrors `http` (set with it by `Settings::apply`): the default ALPN offers `h2`
    /// only to listeners that serve HTTP.
    pub http: bool,
}

impl TlsConf {
    /// Applies one TLS command; returns false for any other command. Cipher lists are
    /// checked here so that a bad one is refused where it is given.
    pub fn apply(&mut self, cmd: &Command) -> Result<bool, TlsError> {
        match cmd {
            Command::SslCert(v) => self.cert = v.clone(),
            Command::SslKey(v) => self.key = v.clone(),
            Command::SslCa(v) => self.ca = v.clone(),
            Command::SslCaDir(v) => self.ca_dir = v.clone(),
            Command::SslVerifyClient(on) => self.verify_client = *on,
            Command::SslProtocol(p) => self.protocol = *p,
            Command::SslOption(o, on) => {
                self.options.retain(|x| x != o);
                if *on {
                    self.options.push(*o);
                }
                if *o == SslOption::CipherServerPreference {
                    self.client_order = !*on;
                }
            }
            Command::SslCiphers(v) => {
                if let Some(list) = v {
                    ciphers::parse(list.as_str())?;
                }
                self.ciphers = v.clone();
            }
            Command::SslSniPath(v) => self.sni_path = v.clone(),
            Command::SslOcspResponse(v) => self.ocsp = v.clone(),
            Command::SslClientRenegotiationInterval(n) => self.renegotiation_interval = Some(*n),
            Command::UpstreamTls(on) => self.upstream = *on,
            Command::UpstreamCa(v) => self.upstream_ca = v.clone(),
            Command::UpstreamSni(v) => self.upstream_sni = v.clone(),
            Command::Alpn(v) => self.alpn = v.clone(),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The commands that rebuild these settings from the defaults.
    pub fn to_commands(&self) -> Vec<Command> {
        let mut out = Vec::new();
        let mut file = |v: &Option<Word>, make: fn(Option<Word>) -> Command| {
            if v.is_some() {
                out.push(make(v.clone()));
            }
        };
        file(&self.cert, Command::SslCert);
        file(&self.key, Command::SslKey);
        file(&self.ca, Command::SslCa);
        file(&self.ca_dir, Command::SslCaDir);
        file(&self.ciphers, Command::SslCiphers);
        file(&self.sni_path, Command::SslSniPath);
        file(&self.ocsp, Command::SslOcspResponse);
        file(&self.upstream_ca, Command::UpstreamCa);
        if self.verify_client {
            out.push(Command::SslVerifyClient(true));
        }
        if self.protocol != SslProtocol::default() {
            out.push(Command::SslProtocol(self.protocol));
        }
        out.extend(self.options.iter().map(|o| Command::SslOption(*o, true)));
        if self.client_order {
            out.push(Command::SslOption(SslOption::CipherServerPreference, false));
        }
        if let Some(n) = self.renegotiation_interval {
            out.push(Command::SslClientRenegotiationInterval(n));
        }
        if self.upstream {
            out.push(Command::UpstreamTls(true));
        }
        if let Some(h) = &self.upstream_sni {
            out.push(Command::UpstreamSni(Some(h.clone())));
        }
        if self.alpn.is_some() {
            out.push(Command::Alpn(self.alpn.clone()));
        }
        out
    }
}

/// The rustls configurations built from a [`TlsConf`]; cheap to clone (shared).
#[derive(Clone, Default)]
pub struct Built {
    /// TLS termination, when a certificate is configured.
    pub server: Option<Arc<ServerTls>>,
    /// TLS to the upstream servers, when `upstream_tls` is on.
    pub upstream: Option<Arc<UpstreamTls>>,
}

impl PartialEq for Built {
    /// Two builds are the same only if they are the same objects: a rebuild from the same
    /// settings may have read renewed files.
    fn eq(&self, other: &Built) -> bool {
        fn same<T>(a: &Option<Arc<T>>, b: &Option<Arc<T>>) -> bool {
            match (a, b) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
        }
        same(&self.server, &other.server) && same(&self.upstream, &other.upstream)
    }
}

impl Eq for Built {}

impl fmt::Debug for Built {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Built")
            .field("server", &self.server.is_some())
            .field("upstream", &self.upstream.is_some())
            .finish()
    }
}

/// TLS termination: the default configuration and one per `ssl_sni_path` name.
pub struct ServerTls {
    default: Site,
    by_name: HashMap<String, Site>,
    sessions: Arc<dyn StoresServerSessions>,
    ticketer: Arc<dyn ProducesTickets>,
    /// The certificates served, default first, as read when this was built (metrics).
    certificates: Vec<Certificate>,
}

/// A certificate quill serves, for the metrics: read once per build, never per scrape, so
/// a renewed file shows after the reload that serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certificate {
    /// The PEM file it came from.
    pub file: PathBuf,
    /// The SNI name it is served for (from the SNI directory); empty for the default.
    pub sni: String,
    /// The leaf's notAfter, in seconds since the Unix epoch.
    pub not_after: i64,
}

/// Why a client handshake failed (for the log; the client only sees an alert or a close).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("TLS handshake timed out")]
    Timeout,
    #[error("TLS handshake: {0}")]
    Io(#[from] io::Error),
}

impl ServerTls {
    /// The certificates served, default first, then the SNI directory's by name.
    pub fn certificates(&self) -> &[Certificate] {
        &self.certificates
    }

    /// The configurations for the name the client asked for (SNI), or the default ones.
    fn site_for(&self, name: Option<&str>) -> &Site {
        if !self.by_name.is_empty() {
            if let Some(name) = name {
                let key = name.trim_end_matches('.').to_ascii_lowercase();
                if let Some(site) = self.by_name.get(&key) {
                    return site;
                }
            }
        }
        &self.default
    }

    /// Runs the server side of the handshake on `io`, within `limit`.
    pub async fn accept<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: IO,
        limit: Duration,
    ) -> Result<ServerTlsStream<IO>, HandshakeError> {
        let handshake = async {
            let start =
                tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), io)
                    .await?;
            let hello = start.client_hello();
            let config = self.site_for(hello.server_name()).config_for(hello.alpn());
            start.into_stream(config).await
        };
        match tokio::time::timeout(limit, handshake).await {
            Err(_) => Err(HandshakeError::Timeout),
            Ok(r) => Ok(r?),
        }
    }
}

/// What a TLS connection to a server offers in ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Nothing: the server speaks what it speaks (raw relays, HTTP/1.1 pools).
    Nothing,
    /// `h2`, then `http/1.1` (`upstream_h2`: a server that picks neither, or has no ALPN,
    /// gets HTTP/1.1).
    H2First,
    /// `h2` alone: for a raw relay whose client chose `h2` (`alpn h2` without `http`), whose
    /// bytes only a server speaking HTTP/2 understands (gRPC servers insist on the ALPN).
    H2Only,
}

/// TLS to upstream servers.
pub struct UpstreamTls {
    connector: tokio_rustls::TlsConnector,
    /// The same configuration (and session cache) offering ALPN `h2` and `http/1.1`
    /// ([`Offer::H2First`]), and `h2` alone ([`Offer::H2Only`]).
    connector_h2: tokio_rustls::TlsConnector,
    connector_h2_only: tokio_rustls::TlsConnector,
    /// `upstream_sni`: overrides the name taken from the server's address.
    sni: Option<ServerName<'static>>,
}

impl UpstreamTls {
    /// The name to send and verify for an upstream written as `host`, at `ip`.
    fn name_for(&self, host: Option<&Host>, ip: IpAddr) -> ServerName<'static> {
        if let Some(n) = &self.sni {
            return n.clone();
        }
        host.filter(|h| h.ip().is_none())
            .and_then(|h| ServerName::try_from(h.as_str().to_string()).ok())
            .unwrap_or(ServerName::IpAddress(ip.into()))
    }

    /// Runs the client side of the handshake over an established connection, verifying
    /// the server's certificate, within `limit`; offers in ALPN what `offer` says.
    pub async fn connect<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: IO,
        host: Option<&Host>,
        ip: IpAddr,
        limit: Duration,
        offer: Offer,
    ) -> io::Result<ClientTlsStream<IO>> {
        let name = self.name_for(host, ip);
        let connector = match offer {
            Offer::Nothing => &self.connector,
            Offer::H2First => &self.connector_h2,
            Offer::H2Only => &self.connector_h2_only,
        };
        match tokio::time::timeout(limit, connector.connect(name, io)).await {
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "TLS handshake timed out",
            )),
            Ok(r) => r,
        }
    }
}

/// Builds the rustls configurations for `conf`, reading every file it names. Session
/// state is taken over from `previous` when there is one.
pub fn build(conf: &TlsConf, previous: Option<&Built>) -> Result<Built, TlsError> {
    let server = match &conf.cert {
        Some(cert) => Some(Arc::new(build_server(
            conf,
            cert,
            previous.and_then(|b| b.server.as_deref()),
        )?)),
        None => {
            for (set, what) in [
                (conf.key.is_some(), "ssl_key (-K)"),
                (conf.verify_client, "ssl_verify_client (-R)"),
                (conf.sni_path.is_some(), "ssl_sni_path"),
                (conf.ocsp.is_some(), "ssl_ocsp_response"),
            ] {
                if set {
                    return Err(TlsError::NeedsCert(what));
                }
            }
            None
        }
    };
    let upstream = if conf.upstream {
        Some(Arc::new(build_upstream(conf)?))
    } else {
        None
    };
    Ok(Built { server, upstream })
}

/// The crypto provider with the suites of `ssl_ciphers` and the protocol versions.
fn provider_and_versions(
    conf: &TlsConf,
) -> Result<(Arc<CryptoProvider>, Vec<&'static SupportedProtocolVersion>), TlsError> {
    let no12 = conf.options.contains(&SslOption::NoTlsv12);
    let (v13, v12) = match conf.protocol {
        SslProtocol::Any => (true, !no12),
        SslProtocol::Tls12 => (false, !no12),
        SslProtocol::Tls13 => (true, false),
    };
    if !v13 && !v12 {
        return Err(TlsError::NoVersion);
    }
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    let defaults = ciphers::defaults();
    let (mut tls13, mut tls12): (Vec<_>, Vec<_>) = defaults
        .iter()
        .partition(|s| matches!(s, rustls::SupportedCipherSuite::Tls13(_)));
    if let Some(list) = &conf.ciphers {
        let sel = ciphers::parse(list.as_str())?;
        let none = |what: &str| TlsError::NoSuites {
            list: list.to_string(),
            what: what.to_string(),
        };
        if v12 && sel.tls12.is_empty() {
            return Err(none("TLS 1.2 (name some, or give ssl_option no_tlsv1.2)"));
        }
        tls12 = sel.tls12;
        if let Some(t) = sel.tls13 {
            if v13 && t.is_empty() {
                return Err(none("TLS 1.3"));
            }
            tls13 = t;
        }
    }
    let mut suites = Vec::new();
    if v13 {
        suites.extend(tls13);
    }
    if v12 {
        suites.extend(tls12);
    }
    provider.cipher_suites = suites;
    let mut versions: Vec<&'static SupportedProtocolVersion> = Vec::new();
    if v13 {
        versions.push(&rustls::version::TLS13);
    }
    if v12 {
        versions.push(&rustls::version::TLS12);
    }
    Ok((Arc::new(provider), versions))
}

fn build_server(
    conf: &TlsConf,
    cert: &Word,
    previous: Option<&ServerTls>,
) -> Result<ServerTls, TlsError> {
    let (provider, versions) = provider_and_versions(conf)?;
    let alpn = alpn_protocols(conf);
    let cert_path = PathBuf::from(cert.as_str());
    let key_path = conf
        .key
        .as_ref()
        .map_or_else(|| cert_path.clone(), |k| PathBuf::from(k.as_str()));
    let (mut key, not_after) = files::certified_key(&cert_path, &key_path, &provider)?;
    let mut certificates = vec![Certificate {
        file: cert_path.clone(),
        sni: String::new(),
        not_after,
    }];
    if let Some(ocsp) = &conf.ocsp {
        let path = PathBuf::from(ocsp.as_str());
        let der = files::read(&path)?;
        if der.is_empty() {
            return Err(TlsError::EmptyOcsp { file: path });
        }
        key.ocsp = Some(der);
    }
    check_suites_fit_key(conf, &provider, &key, &cert_path)?;
    // The client CAs: from -G and -A, required with -R.
    let mut roots = RootCertStore::empty();
    if let Some(ca) = &conf.ca {
        files::add_roots(&mut roots, &PathBuf::from(ca.as_str()))?;
    }
    if let Some(dir) = &conf.ca_dir {
        files::add_roots_dir(&mut roots, &PathBuf::from(dir.as_str()))?;
    }
    if conf.verify_client && roots.is_empty() {
        return Err(TlsError::NoClientCa);
    }
    let (sessions, ticketer) = match previous {
        Some(p) => (Arc::clone(&p.sessions), Arc::clone(&p.ticketer)),
        None => (
            ServerSessionMemoryCache::new(SESSION_CACHE) as Arc<dyn StoresServerSessions>,
            rustls::crypto::aws_lc_rs::Ticketer::new().map_err(TlsError::Rustls)?,
        ),
    };
    let shared = Shared {
        provider: &provider,
        versions: &versions,
        sessions: &sessions,
        ticketer: &ticketer,
        client_order: conf.client_order,
        alpn,
    };
    let default_verifier = client_verifier(conf.verify_client, roots, &provider, None)?;
    let default = shared.config(Arc::clone(&default_verifier), Arc::new(key))?;
    let mut by_name = HashMap::new();
    if let Some(dir) = &conf.sni_path {
        for site in files::sni_sites(&PathBuf::from(dir.as_str()))? {
            let (key, not_after) = files::certified_key(&site.cert, &site.key, &provider)?;
            certificates.push(Certificate {
                file: site.cert.clone(),
                sni: site.name.clone(),
                not_after,
            });
            check_suites_fit_key(conf, &provider, &key, &site.cert)?;
            let verifier = match &site.ca {
                Some(ca) if conf.verify_client => {
                    let mut roots = RootCertStore::empty();
                    files::add_roots(&mut roots, ca)?;
                    client_verifier(true, roots, &provider, Some(ca))?
                }
                _ => Arc::clone(&default_verifier),
            };
            by_name.insert(site.name, shared.config(verifier, Arc::new(key))?);
        }
    }
    Ok(ServerTls {
        default,
        by_name,
        sessions,
        ticketer,
        certificates,
    })
}

/// A TLS 1.2-only configuration whose suites cannot sign with the certificate's key
/// would fail every handshake: refuse it at build time.
fn check_suites_fit_key(
    conf: &TlsConf,
    provider: &CryptoProvider,
    key: &CertifiedKey,
    file: &std::path::Path,
) -> Result<(), TlsError> {
    let alg = key.key.algorithm();
    let tls12: Vec<_> = provider
        .cipher_suites
        .iter()
        .filter(|s| matches!(s, rustls::SupportedCipherSuite::Tls12(_)))
        .collect();
    let has13 = provider
        .cipher_suites
        .iter()
        .any(|s| matches!(s, rustls::SupportedCipherSuite::Tls13(_)));
    if !tls12.is_empty() && !tls12.iter().any(|s| s.usable_for_signature_algorithm(alg)) {
        let list = conf
            .ciphers
            .as_ref()
            .map(Word::to_string)
            .unwrap_or_default();
        let what = format!("TLS 1.2 with the {alg:?} key of {}", file.display());
        if !has13 {
            return Err(TlsError::NoSuites { list, what });
        }
        tracing::warn!("ssl_ciphers '{list}' leaves no suite for {what}: only TLS 1.3 will work");
    }
    Ok(())
}

/// What every server configuration of one build shares.
struct Shared<'a> {
    provider: &'a Arc<CryptoProvider>,
    versions: &'a [&'static SupportedProtocolVersion],
    sessions: &'a Arc<dyn StoresServerSessions>,
    ticketer: &'a Arc<dyn ProducesTickets>,
    client_order: bool,
    alpn: Vec<Vec<u8>>,
}

/// What TLS listeners offer: `alpn` as given, else `h2` (only with `http`) and `http/1.1`.
/// A raw relay offers `h2` only when told to: its servers must then speak HTTP/2 (h2c, or
/// TLS with ALPN `h2`, which quill offers them for such a client).
fn alpn_protocols(conf: &TlsConf) -> Vec<Vec<u8>> {
    let default = if conf.http {
        vec![Alpn::H2, Alpn::Http11]
    } else {
        vec![Alpn::Http11]
    };
    let list = conf.alpn.as_ref().unwrap_or(&default);
    list.iter()
        .map(|p| match p {
            Alpn::H2 => ALPN_H2.to_vec(),
            Alpn::Http11 => ALPN_HTTP11.to_vec(),
        })
        .collect()
}

impl Shared<'_> {
    fn config(
        &self,
        verifier: Arc<dyn ClientCertVerifier>,
        key: Arc<CertifiedKey>,
    ) -> Result<Site, TlsError> {
        let mut config = ServerConfig::builder_with_provider(Arc::clone(self.provider))
            .with_protocol_versions(self.versions)
            .map_err(TlsError::Rustls)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(OneCert(key)));
        config.session_storage = Arc::clone(self.sessions);
        config.ticketer = Arc::clone(self.ticketer);
        config.alpn_protocols = self.alpn.clone();
        config.ignore_client_order = !self.client_order;
        Ok(Site::new(config))
    }
}

/// One certificate's configuration, twice: offering quill's ALPN protocols, and offering
/// none, for a client whose ALPN list names none of them. rustls would end such a
/// handshake with `no_application_protocol`; HAProxy goes on without ALPN, and so does
/// quill: the client then speaks what it speaks, HTTP/1.x (curl's `--http1.0` offers
/// `http/1.0` alone, which NGINX offers too) or a raw relay's protocol.
struct Site {
    offering: Arc<ServerConfig>,
    silent: Arc<ServerConfig>,
}

impl Site {
    fn new(config: ServerConfig) -> Site {
        let mut silent = config.clone();
        silent.alpn_protocols = Vec::new();
        Site {
            offering: Arc::new(config),
            silent: Arc::new(silent),
        }
    }

    /// The configuration for a client that offered `alpn` (`None`: no ALPN at all).
    fn config_for<'a>(&self, alpn: Option<impl Iterator<Item = &'a [u8]>>) -> Arc<ServerConfig> {
        let ours = &self.offering.alpn_protocols;
        let none_of_ours = alpn
            .is_some_and(|mut offered| !offered.any(|p| ours.iter().any(|o| o.as_slice() == p)));
        Arc::clone(if none_of_ours {
            &self.silent
        } else {
            &self.offering
        })
    }
}

/// The one certificate of a configuration (the SNI choice is made before, per config).
#[derive(Debug)]
struct OneCert(Arc<CertifiedKey>);

impl ResolvesServerCert for OneCert {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

fn client_verifier(
    required: bool,
    roots: RootCertStore,
    provider: &Arc<CryptoProvider>,
    file: Option<&std::path::Path>,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    if !required {
        return Ok(WebPkiClientVerifier::no_client_auth());
    }
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(provider))
        .build()
        .map_err(|e| TlsError::BadCa {
            file: file
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("ssl_ca")),
            reason: e.to_string(),
        })
}

fn build_upstream(conf: &TlsConf) -> Result<UpstreamTls, TlsError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = RootCertStore::empty();
    match &conf.upstream_ca {
        Some(ca) => files::add_roots(&mut roots, &PathBuf::from(ca.as_str()))?,
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(TlsError::Rustls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let sni = match &conf.upstream_sni {
        None => None,
        Some(h) => Some(match h.ip() {
            Some(ip) => ServerName::IpAddress(ip.into()),
            None => ServerName::try_from(h.as_str().to_string()).map_err(|e| {
                TlsError::Rustls(rustls::Error::General(format!("upstream_sni {h}: {e}")))
            })?,
        }),
    };
    // A clone shares the session store, so a resumed session serves either connector.
    let mut config_h2 = config.clone();
    config_h2.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()];
    let mut config_h2_only = config.clone();
    config_h2_only.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(UpstreamTls {
        connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        connector_h2: tokio_rustls::TlsConnector::from(Arc::new(config_h2)),
        connector_h2_only: tokio_rustls::TlsConnector::from(Arc::new(config_h2_only)),
        sni,
    })
}
