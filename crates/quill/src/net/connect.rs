//! Connecting to an upstream server with the socket options and timeout of the settings.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Socket options applied to both sides of a proxied connection.
#[derive(Debug, Clone, Copy)]
pub struct SocketOptions {
    pub nodelay: bool,
    pub keepalive: bool,
    /// `transparent`: the upstream socket gets IP_TRANSPARENT, so that it may bind to the
    /// client's (foreign) address given as the source.
    pub transparent: bool,
}

/// The source address of upstream connections for a client at `peer`: the client's own
/// address in `transparent` mode, else the `source` setting.
pub fn source_for(settings: &crate::settings::Settings, peer: SocketAddr) -> Option<IpAddr> {
    if settings.transparent {
        Some(peer.ip().to_canonical())
    } else {
        settings.source
    }
}

/// Checks that this process may use IP_TRANSPARENT (CAP_NET_ADMIN), so that `transparent`
/// fails at start-up with a clear reason rather than on every connection.
pub fn check_transparent() -> io::Result<()> {
    let probe = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    probe.set_ip_transparent(true)
}

/// Applies the options to an accepted client stream. Neither SO_KEEPALIVE nor TCP_NODELAY
/// is set here: client sockets inherit both from the listener (see
/// [`crate::net::listen::set_inherited_options`]), which saves a system call per
/// connection; only `no tcp_nodelay` (Pen's default) costs one, to turn Nagle's algorithm
/// back on.
pub fn apply_options(stream: &TcpStream, opts: SocketOptions) -> io::Result<()> {
    if !opts.nodelay {
        stream.set_nodelay(false)?;
    }
    Ok(())
}

/// Lets `socket` bind to a foreign address. IP_TRANSPARENT sets the socket's `transparent`
/// flag, which Linux honours for IPv6 sockets too.
pub fn transparent(socket: &Socket) -> io::Result<()> {
    socket.set_ip_transparent(true)
}

/// Connects to `addr` from `source` (if set) within `timeout`.
///
/// The outcome is read from the readiness the event loop reports (writable = connected,
/// error or hang-up = failed), so a successful connect costs no `getsockopt(SO_ERROR)`;
/// the error is fetched only when there is one.
pub async fn connect(
    addr: SocketAddr,
    source: Option<IpAddr>,
    timeout: Duration,
    opts: SocketOptions,
) -> io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    if let Some(ip) = source {
        // Only bind a source of the same family; a mismatch would fail every connect.
        if ip.is_ipv4() == addr.is_ipv4() {
            if opts.transparent {
                transparent(&socket)?;
            }
            socket.bind(&SocketAddr::new(ip, 0).into())?;
        }
    }
    if opts.nodelay {
        socket.set_nodelay(true)?;
    }
    if opts.keepalive {
        socket.set_keepalive(true)?;
    }
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INPROGRESS.raw_os_error()) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(socket))?;
    let ready =
        match tokio::time::timeout(timeout, stream.ready(Interest::WRITABLE | Interest::ERROR))
            .await
        {
            Ok(ready) => ready?,
            Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
        };
    if ready.is_error() || ready.is_write_closed() {
        return Err(stream
            .take_error()?
            .unwrap_or_else(|| io::ErrorKind::ConnectionRefused.into()));
    }
    Ok(stream)
}

/// Whether a connect failed for a reason of this host, not of the server: out of file
/// descriptors, memory, buffers or local ports. Such a failure says nothing about the
/// server, so it must not be blacklisted for it (nor would another server fare better).
pub fn is_local_failure(e: &io::Error) -> bool {
    use rustix::io::Errno;
    [
        Errno::MFILE,
        Errno::NFILE,
        Errno::NOBUFS,
        Errno::NOMEM,
        Errno::ADDRNOTAVAIL,
    ]
    .iter()
    .any(|errno| e.raw_os_error() == Some(errno.raw_os_error()))
}
