//! tlsload: the HTTPS load generator of bench/tls.
//!
//! wrk spends most of its time in OpenSSL's client handshake and cannot open new TLS
//! connections fast enough to load a balancer; this tool does the client side with rustls
//! (aws-lc-rs) on as many threads as asked, skipping the certificate verification that a
//! benchmark client does not need (the server side, which is measured, is unchanged).
//!
//! Modes: `keepalive` (each connection sends requests one after another, HTTP/1.1
//! keep-alive) and `handshake` (each request on a new TCP + TLS connection, full handshake:
//! resumption is off). `--per-connection N` closes a keep-alive connection after N requests
//! and opens the next (session resumption on, as a browser's next visit), and `--pace MS`
//! waits that long after every answer (a paced load instead of saturation). Every response
//! is checked: status 200 and a body of `--expect-bytes`. Output: one JSON line, with the
//! requests' latency (request written to answer read, TLS handshakes not included) at the
//! 50th, 90th, 99th and 99.9th percentiles and the slowest, in microseconds.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

struct Args {
    addr: SocketAddr,
    mode: Mode,
    connections: usize,
    duration: Duration,
    threads: usize,
    path: String,
    sni: String,
    tls12: bool,
    plain: bool,
    expect: usize,
    /// Requests per connection in keep-alive mode (0: no limit).
    per_connection: u64,
    /// Wait after each answer.
    pace: Duration,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    KeepAlive,
    Handshake,
}

fn usage() -> ! {
    eprintln!(
        "usage: tlsload --addr IP:PORT [--mode keepalive|handshake] [--connections N] \
         [--duration S] [--threads T] [--path /1k] [--sni NAME] [--tls12] [--plain] \
         [--expect-bytes N] [--per-connection N] [--pace MS]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:443".parse().unwrap_or_else(|_| usage()),
        mode: Mode::KeepAlive,
        connections: 50,
        duration: Duration::from_secs(10),
        threads: 1,
        path: "/1k".into(),
        sni: "localhost".into(),
        tls12: false,
        plain: false,
        expect: 1024,
        per_connection: 0,
        pace: Duration::ZERO,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--addr" => a.addr = val().parse().unwrap_or_else(|_| usage()),
            "--mode" => {
                a.mode = match val().as_str() {
                    "keepalive" => Mode::KeepAlive,
                    "handshake" => Mode::Handshake,
                    _ => usage(),
                }
            }
            "--connections" => a.connections = val().parse().unwrap_or_else(|_| usage()),
            "--duration" => {
                a.duration = Duration::from_secs_f64(val().parse().unwrap_or_else(|_| usage()))
            }
            "--threads" => a.threads = val().parse().unwrap_or_else(|_| usage()),
            "--path" => a.path = val(),
            "--sni" => a.sni = val(),
            "--tls12" => a.tls12 = true,
            "--plain" => a.plain = true,
            "--expect-bytes" => a.expect = val().parse().unwrap_or_else(|_| usage()),
            "--per-connection" => a.per_connection = val().parse().unwrap_or_else(|_| usage()),
            "--pace" => a.pace = Duration::from_millis(val().parse().unwrap_or_else(|_| usage())),
            _ => usage(),
        }
    }
    a
}

/// Accepts any certificate: the client's verification cost is not what is measured.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn client_config(args: &Args) -> Arc<ClientConfig> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = if args.tls12 {
        &[&rustls::version::TLS12]
    } else {
        &[&rustls::version::TLS13]
    };
    let mut config = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(versions)
        .unwrap_or_else(|e| panic!("{e}"))
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    if args.mode == Mode::Handshake {
        // Every connection pays the full handshake.
        config.resumption = rustls::client::Resumption::disabled();
    }
    Arc::new(config)
}

#[derive(Default)]
struct Totals {
    requests: AtomicU64,
    errors: AtomicU64,
    handshakes: AtomicU64,
    /// Each answered request's latency in µs (a few hundred thousand at most in a run).
    latencies_us: Mutex<Vec<u32>>,
}

/// The latency below which `q` of the sorted samples lie (0 with none).
fn percentile(sorted: &[u32], q: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 * q) as usize).min(sorted.len() - 1);
    sorted[i]
}

/// Reads one HTTP/1.1 response (head + Content-Length body); checks 200 and the size.
async fn read_response<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut Vec<u8>,
    expect: usize,
) -> io::Result<()> {
    buf.clear();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| io::Error::other("response head is not UTF-8"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(io::Error::other(format!(
            "status: {}",
            head.lines().next().unwrap_or("")
        )));
    }
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .ok_or_else(|| io::Error::other("no Content-Length"))?;
    if len != expect {
        return Err(io::Error::other(format!(
            "body of {len} bytes, expected {expect}"
        )));
    }
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

async fn connect(args: &Args, config: &Arc<ClientConfig>) -> io::Result<Box<dyn Stream>> {
    let tcp = TcpStream::connect(args.addr).await?;
    tcp.set_nodelay(true)?;
    if args.plain {
        return Ok(Box::new(tcp));
    }
    let name = ServerName::try_from(args.sni.clone()).map_err(io::Error::other)?;
    let tls = tokio_rustls::TlsConnector::from(Arc::clone(config))
        .connect(name, tcp)
        .await?;
    Ok(Box::new(tls))
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

async fn worker(
    args: Arc<Args>,
    config: Arc<ClientConfig>,
    totals: Arc<Totals>,
    stop: Arc<AtomicBool>,
) {
    let keep = format!("GET {} HTTP/1.1\r\nHost: bench\r\n\r\n", args.path);
    let close = format!(
        "GET {} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n",
        args.path
    );
    let mut buf = Vec::with_capacity(4096);
    while !stop.load(Relaxed) {
        let mut conn = match connect(&args, &config).await {
            Ok(c) => c,
            Err(_) => {
                totals.errors.fetch_add(1, Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        };
        totals.handshakes.fetch_add(1, Relaxed);
        let mut sent = 0u64;
        loop {
            let req = if args.mode == Mode::Handshake {
                &close
            } else {
                &keep
            };
            let began = Instant::now();
            let r = async {
                conn.write_all(req.as_bytes()).await?;
                read_response(&mut conn, &mut buf, args.expect).await
            }
            .await;
            if stop.load(Relaxed) {
                return;
            }
            match r {
                Ok(()) => {
                    totals.requests.fetch_add(1, Relaxed);
                    let us = u32::try_from(began.elapsed().as_micros()).unwrap_or(u32::MAX);
                    if let Ok(mut l) = totals.latencies_us.lock() {
                        l.push(us);
                    }
                }
                Err(_) => {
                    totals.errors.fetch_add(1, Relaxed);
                    break;
                }
            }
            if !args.pace.is_zero() {
                tokio::time::sleep(args.pace).await;
            }
            sent += 1;
            let enough = args.per_connection > 0 && sent >= args.per_connection;
            if args.mode == Mode::Handshake || enough {
                let _ = conn.shutdown().await;
                break;
            }
        }
    }
}

fn main() {
    let args = Arc::new(parse_args());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let config = client_config(&args);
    let totals = Arc::new(Totals::default());
    let stop = Arc::new(AtomicBool::new(false));
    let elapsed = rt.block_on(async {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..args.connections {
            tasks.push(tokio::spawn(worker(
                Arc::clone(&args),
                Arc::clone(&config),
                Arc::clone(&totals),
                Arc::clone(&stop),
            )));
        }
        tokio::time::sleep(args.duration).await;
        stop.store(true, Relaxed);
        let elapsed = start.elapsed();
        for t in tasks {
            t.abort();
        }
        elapsed
    });
    let secs = elapsed.as_secs_f64();
    let requests = totals.requests.load(Relaxed);
    let mut lat = totals
        .latencies_us
        .lock()
        .map(|l| l.clone())
        .unwrap_or_default();
    lat.sort_unstable();
    println!(
        "{{\"mode\":\"{}\",\"requests\":{},\"errors\":{},\"handshakes\":{},\"seconds\":{:.3},\"rps\":{:.1},\
         \"p50_us\":{},\"p90_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{}}}",
        if args.mode == Mode::Handshake { "handshake" } else { "keepalive" },
        requests,
        totals.errors.load(Relaxed),
        totals.handshakes.load(Relaxed),
        secs,
        requests as f64 / secs,
        percentile(&lat, 0.50),
        percentile(&lat, 0.90),
        percentile(&lat, 0.99),
        percentile(&lat, 0.999),
        lat.last().copied().unwrap_or(0),
    );
}
