//! Listening addresses (`[host:]port` or a Unix socket path) and the listeners built on them.
//!
//! TCP: every event loop gets its own socket bound with SO_REUSEPORT, so the kernel spreads
//! new connections over the loops with no shared accept queue. Before binding those, one
//! plain bind checks that the address is really free (SO_REUSEPORT alone would silently
//! share a port another quill already holds). Unix sockets cannot be spread that way; the
//! loops share one listening socket, each through its own descriptor.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};

use socket2::{Domain, Protocol, Socket, Type};

use crate::command::{parse_port, split_host_port, Host, ParseError};
use crate::settings::{resolve, ApplyError};

/// Where quill listens for clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl ListenAddr {
    /// Parses `port`, `host:port`, `[v6]:port`, `:::port` or `/path/to/socket`.
    pub fn parse(s: &str) -> Result<ListenAddr, ListenParseError> {
        if s.starts_with('/') || s.starts_with("./") {
            return Ok(ListenAddr::Unix(PathBuf::from(s)));
        }
        let (host, port) = match split_host_port(s)? {
            (port, None) => ("", port),
            (host, Some(port)) => (host, port),
        };
        let port = parse_port(port)?;
        let ip = if host.is_empty() {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            resolve(&Host::new(host)?)?
        };
        Ok(ListenAddr::Tcp(SocketAddr::new(ip, port)))
    }

    /// The TCP port, which is also the default port of servers.
    pub fn port(&self) -> Option<u16> {
        match self {
            ListenAddr::Tcp(a) => Some(a.port()),
            ListenAddr::Unix(_) => None,
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Why a listening address is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListenParseError {
    #[error(transparent)]
    Syntax(#[from] ParseError),
    #[error(transparent)]
    Resolve(#[from] ApplyError),
}

/// A socket could not be opened for listening.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct ListenError {
    pub addr: String,
    #[source]
    pub source: io::Error,
}

/// A bound, listening socket, not yet registered with an event loop.
#[derive(Debug)]
pub enum Listener {
    Tcp(std::net::TcpListener),
    Unix(StdUnixListener),
}

impl Listener {
    /// Another descriptor of the same socket (same accept queue).
    pub fn try_clone(&self) -> io::Result<Listener> {
        Ok(match self {
            Listener::Tcp(l) => Listener::Tcp(l.try_clone()?),
            Listener::Unix(l) => Listener::Unix(l.try_clone()?),
        })
    }

    /// A duplicate of the descriptor, to hand to another process.
    pub fn dup_fd(&self) -> io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd;
        match self {
            Listener::Tcp(l) => l.as_fd().try_clone_to_owned(),
            Listener::Unix(l) => l.as_fd().try_clone_to_owned(),
        }
    }
}

/// A non-blocking socket of `kind` bound to `addr` for listening (TCP or UDP), with
/// SO_REUSEADDR, SO_REUSEPORT if asked, and dual-stack for `:::port`. `before_bind` gives
/// it the options that must be there before the first packet can reach it: with
/// SO_REUSEPORT, the kernel may hand it one as soon as it is bound.
pub(crate) fn bound_socket(
    addr: SocketAddr,
    kind: Type,
    protocol: Protocol,
    reuse_port: bool,
    before_bind: impl FnOnce(&Socket) -> io::Result<()>,
) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), kind, Some(protocol))?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        // `:::port` serves IPv4 clients too, as users of a dual-stack host expect.
        socket.set_only_v6(false)?;
    }
    socket.set_nonblocking(true)?;
    before_bind(&socket)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

fn tcp_socket(addr: SocketAddr, reuse_port: bool, backlog: u32) -> io::Result<Socket> {
    // Before `listen`: a connection inherits its listener's options when its handshake
    // completes, which may be long before the event loop's first accept.
    let socket = bound_socket(addr, Type::STREAM, Protocol::TCP, reuse_port, |s| {
        set_inherited_options(s)
    })?;
    socket.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    Ok(socket)
}

/// Sets what accepted sockets inherit from their listener on Linux, so that no connection
/// pays a system call for it: SO_KEEPALIVE (dead clients are eventually noticed; Pen's
/// client sockets behave the same way) and TCP_NODELAY (`tcp_nodelay`, on by default;
/// [`crate::net::connect::apply_options`] turns it off per connection when the setting
/// is off). A connection takes them from its listener when its handshake completes, not
/// when it is accepted: quill's own listeners get them before `listen`.
pub fn set_inherited_options(socket: &impl std::os::fd::AsFd) -> io::Result<()> {
    let socket = socket2::SockRef::from(socket);
    socket.set_keepalive(true)?;
    socket.set_nodelay(true)
}

/// Readies a TCP listener for its event loop's first accept, whoever opened it: quill,
/// systemd, or the binary that handed it over in an upgrade. Returns how many connections
/// already wait in its queue: those may have been made before the listener had the
/// options of [`set_inherited_options`] (socket activation starts quill for a client that
/// is already connected), so the loop gives them those options one by one; the queue is
/// first in, first out, and every later connection inherits them.
pub fn prepare(listener: &std::net::TcpListener) -> io::Result<u32> {
    set_inherited_options(listener)?;
    match crate::net::sockopt::accept_queue_len(listener) {
        Ok(queued) => Ok(queued),
        Err(e) => {
            tracing::warn!(
                "cannot read the listener's accept queue ({e}): clients that connected \
                 before quill took the listener may lack TCP_NODELAY and SO_KEEPALIVE"
            );
            Ok(0)
        }
    }
}

/// Opens `count` listeners on `addr` (one per event loop).
pub fn open(addr: &ListenAddr, count: usize, backlog: u32) -> Result<Vec<Listener>, ListenError> {
    let err = |source| ListenError {
        addr: addr.to_string(),
        source,
    };
    match addr {
        ListenAddr::Tcp(a) => {
            // Probe without SO_REUSEPORT: fails with EADDRINUSE if anyone holds the port.
            // Bound only, never listening: a client that connected to a listening probe
            // would sit in its accept queue and be reset when the probe closes.
            drop(bound_socket(*a, Type::STREAM, Protocol::TCP, false, |_| Ok(())).map_err(err)?);
            let mut out = Vec::with_capacity(count);
            for _ in 0..count.max(1) {
                out.push(Listener::Tcp(
                    tcp_socket(*a, true, backlog).map_err(err)?.into(),
                ));
            }
            Ok(out)
        }
        ListenAddr::Unix(path) => {
            remove_stale_socket(path).map_err(err)?;
            let first = StdUnixListener::bind(path).map_err(err)?;
            first.set_nonblocking(true).map_err(err)?;
            let mut out = Vec::with_capacity(count);
            for _ in 1..count.max(1) {
                out.push(Listener::Unix(first.try_clone().map_err(err)?));
            }
            out.push(Listener::Unix(first));
            Ok(out)
        }
    }
}

/// A socket file left by a process that is gone is removed; a live one is left alone.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(meta) if !meta.file_type().is_socket() => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "exists and is not a socket",
        )),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another process is listening there",
            )),
            Err(_) => std::fs::remove_file(path),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_forms() {
        assert_eq!(
            ListenAddr::parse("8080"),
            Ok(ListenAddr::Tcp("0.0.0.0:8080".parse().unwrap()))
        );
        assert_eq!(
            ListenAddr::parse(":::8080"),
            Ok(ListenAddr::Tcp("[::]:8080".parse().unwrap()))
        );
        assert_eq!(
            ListenAddr::parse("[::1]:81"),
            Ok(ListenAddr::Tcp("[::1]:81".parse().unwrap()))
        );
        assert_eq!(
            ListenAddr::parse("127.0.0.2:82"),
            Ok(ListenAddr::Tcp("127.0.0.2:82".parse().unwrap()))
        );
        assert_eq!(
            ListenAddr::parse("/run/q.sock"),
            Ok(ListenAddr::Unix("/run/q.sock".into()))
        );
        assert!(ListenAddr::parse("70000").is_err());
        assert!(ListenAddr::parse("0").is_err());
        assert!(ListenAddr::parse("300.1.1.1:80").is_err());
    }
}
