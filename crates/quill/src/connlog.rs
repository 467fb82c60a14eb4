//! Pen's connection log (`-l FILE`, `log FILE`): one line per connection,
//! `CLIENT_IP UNIX_TIME SERVER_IP FIRST_LINE_OF_REQUEST`, the format `mergelogs` reads.
//! Or, given `IP:PORT` instead of a file, Pen's entries for `penlogd` (which puts the real
//! client's address into the web servers' logs): one UDP datagram per connection,
//! `+ CLIENT_IP SERVER_IP FIRST_LINE_OF_REQUEST`, sent as soon as the client's first bytes
//! came (penlogd matches an entry only with a web server's line that comes after it).
//!
//! The file is opened in append mode and reopened on SIGHUP, so `mv quill.log quill.log.1;
//! kill -HUP` rotates it. Lines are written whole, in batches, by the file's own thread
//! (`logfile`): an event loop never waits for the disk.

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::logfile::LogFile;

/// Bytes of the request kept for the log line (Pen keeps "the first few bytes").
pub const REQUEST_BYTES: usize = 200;

/// An open connection log.
#[derive(Debug)]
pub enum ConnLog {
    /// A file, a line per connection when it ends.
    File(LogFile),
    /// penlogd's UDP port (a connected, non-blocking socket), an entry per connection
    /// when its first bytes come.
    Penlogd(UdpSocket),
}

impl ConnLog {
    /// Opens `target`: penlogd's address if it is `IP:PORT` (`[IPv6]:PORT`) or
    /// `HOST:PORT` (a host name, resolved now: its first address), else a file (created
    /// if needed) to append to.
    pub fn open(target: &str) -> io::Result<ConnLog> {
        match penlogd_address(target) {
            Some(addr) => {
                let addr = addr?;
                let local: SocketAddr = match addr {
                    SocketAddr::V4(_) => ([0, 0, 0, 0], 0).into(),
                    SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
                };
                let socket = UdpSocket::bind(local)?;
                socket.connect(addr)?;
                socket.set_nonblocking(true)?;
                Ok(ConnLog::Penlogd(socket))
            }
            None => Ok(ConnLog::File(LogFile::open(
                Path::new(target),
                "connection log",
            )?)),
        }
    }

    /// Writes one line for a connection started at `started` (Unix seconds), when it ends
    /// (a file only: penlogd was told when the first bytes came, see [`Tell`]).
    pub fn record(&self, client: IpAddr, started: u64, server: Option<IpAddr>, request: &[u8]) {
        let ConnLog::File(file) = self else {
            return;
        };
        let first = printable(first_line(request));
        let server = server.map_or_else(|| "-".to_string(), |ip| ip.to_string());
        let line = format!("{client} {started} {server} {first}\n");
        file.append(line.as_bytes());
    }

    /// The file, unless the log goes to penlogd.
    pub fn file(&self) -> Option<&LogFile> {
        match self {
            ConnLog::File(file) => Some(file),
            ConnLog::Penlogd(_) => None,
        }
    }

    /// Whether the log wants to hear of a connection as soon as its first bytes come.
    pub fn tells(&self) -> bool {
        matches!(self, ConnLog::Penlogd(_))
    }

    /// Sends penlogd the entry of a client's request to `server` (nothing for a file).
    /// Never waits: a datagram the socket cannot take now is lost, as UDP would lose it.
    pub fn tell(&self, client: IpAddr, server: Option<IpAddr>, request: &[u8]) {
        let ConnLog::Penlogd(socket) = self else {
            return;
        };
        // As much of the request as the file's line keeps: a long target must not make
        // a datagram of the size of a head.
        let request = &request[..request.len().min(REQUEST_BYTES)];
        let first = printable(first_line(request));
        let server = server.map_or_else(|| "-".to_string(), |ip| ip.to_string());
        let entry = format!("+ {} {server} {first}\n", client.to_canonical());
        if let Err(e) = socket.send(entry.as_bytes()) {
            tracing::debug!("penlogd: {e}");
        }
    }
}

/// penlogd's address, if `target` names one rather than a file: a socket address, or a
/// host name (letters, digits, dots and dashes, as Pen takes any `HOST:PORT`) and a port
/// number, resolved here.
fn penlogd_address(target: &str) -> Option<io::Result<SocketAddr>> {
    if let Ok(addr) = target.parse::<SocketAddr>() {
        return Some(Ok(addr));
    }
    let (host, port) = target.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let is_host = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
    if !is_host {
        return None;
    }
    Some((host, port).to_socket_addrs().and_then(|mut addrs| {
        addrs.next().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("penlogd host {host} has no address"),
            )
        })
    }))
}

/// `bytes` with each byte that is not printable ASCII (control bytes, bytes of UTF-8 or
/// other encodings, binary protocols' bytes) written as `.`, as Pen writes them: the line
/// stays one line of ASCII for the tools that read Pen's log byte by byte.
fn printable(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| {
            if (0x20..0x7f).contains(&b) {
                char::from(b)
            } else {
                '.'
            }
        })
        .collect()
}

/// The request's first line (up to the first CR or LF).
fn first_line(request: &[u8]) -> &[u8] {
    request
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default()
}

/// Who to tell penlogd about once a connection's first bytes come (boxed where it waits:
/// only connections logged to penlogd pay for it).
#[derive(Debug)]
pub struct Tell {
    pub log: Arc<ConnLog>,
    pub client: IpAddr,
    pub server: Option<IpAddr>,
}

/// The start of a client's first read, kept for the connection log, and told to penlogd
/// as it comes.
#[derive(Debug, Default)]
pub struct Capture {
    bytes: Vec<u8>,
    tell: Option<Box<Tell>>,
}

impl Capture {
    /// A capture that tells penlogd too, if `tell` says so.
    pub fn new(tell: Option<Box<Tell>>) -> Capture {
        Capture {
            bytes: Vec::new(),
            tell,
        }
    }

    /// Keeps the start of `data` if nothing was kept yet (the client's first read).
    pub fn first_read(&mut self, data: &[u8]) {
        if !self.bytes.is_empty() || data.is_empty() {
            return;
        }
        self.bytes
            .extend_from_slice(&data[..data.len().min(REQUEST_BYTES)]);
        if let Some(t) = self.tell.take() {
            t.log.tell(t.client, t.server, &self.bytes);
        }
    }

    /// What was kept.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}

/// Unix time in seconds now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_name_and_a_port_name_penlogd_anything_else_a_file() {
        let penlogd = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = penlogd.local_addr().unwrap().port();
        let at = |t: &str| penlogd_address(t).map(|r| r.unwrap().port());
        assert_eq!(at(&format!("localhost:{port}")), Some(port));
        assert_eq!(at(&format!("127.0.0.1:{port}")), Some(port));
        assert_eq!(at(&format!("[::1]:{port}")), Some(port));
        for file in [
            "quill.log",
            "/var/log/quill:1",
            "logs:x",
            ":80",
            "a b:80",
            "host:70000",
        ] {
            assert!(penlogd_address(file).is_none(), "{file}");
        }
        let log = ConnLog::open(&format!("localhost:{port}")).unwrap();
        assert!(log.tells());
    }

    #[test]
    fn penlogd_gets_pens_entry_cut_as_the_files_line() {
        let penlogd = UdpSocket::bind("127.0.0.1:0").unwrap();
        penlogd
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let log = ConnLog::open(&penlogd.local_addr().unwrap().to_string()).unwrap();
        assert!(log.tells());
        let long = format!("GET /{} HTTP/1.1\r\nHost: a\r\n", "x".repeat(60_000));
        log.tell(
            "::ffff:10.0.0.1".parse().unwrap(),
            Some("10.0.0.9".parse().unwrap()),
            long.as_bytes(),
        );
        let mut buf = [0u8; 65_536];
        let n = penlogd.recv(&mut buf).unwrap();
        let entry = std::str::from_utf8(&buf[..n]).unwrap();
        let kept = &long[..REQUEST_BYTES];
        assert_eq!(entry, format!("+ 10.0.0.1 10.0.0.9 {kept}\n"));
    }

    #[test]
    fn bytes_that_are_not_printable_ascii_are_dots_as_in_pen() {
        assert_eq!(printable(b"GET /caf\xc3\xa9\x00\x7f\tx"), "GET /caf.....x");
        assert_eq!(printable(b"\x16\x03\x01"), "...");
    }

    #[test]
    fn lines_have_pens_format() {
        let dir = std::env::temp_dir().join(format!("quill-connlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pen.log");
        let log = ConnLog::open(path.to_str().unwrap()).unwrap();
        log.record(
            "10.0.0.1".parse().unwrap(),
            1700000000,
            Some("10.0.0.9".parse().unwrap()),
            b"GET /x HTTP/1.1\r\nHost: a\r\n",
        );
        log.record("10.0.0.2".parse().unwrap(), 1700000001, None, b"");
        drop(log);
        crate::logfile::finish(std::time::Duration::from_secs(5));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "10.0.0.1 1700000000 10.0.0.9 GET /x HTTP/1.1\n10.0.0.2 1700000001 - \n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
