//! Connecting to an upstream server with the socket options and timeout of the settings.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream};

/// Socket options applied to both sides of a proxied connection.
#[derive(Debug, Clone, Copy)]
pub struct SocketOptions {
    pub nodelay: bool,
    pub keepalive: bool,
}

/// Applies the options to an accepted client stream. SO_KEEPALIVE is not set here: client
/// sockets inherit it from the listener.
pub fn apply_options(stream: &TcpStream, opts: SocketOptions) -> io::Result<()> {
    if opts.nodelay {
        stream.set_nodelay(true)?;
    }
    Ok(())
}

/// Connects to `addr` from `source` (if set) within `timeout`.
pub async fn connect(
    addr: SocketAddr,
    source: Option<IpAddr>,
    timeout: Duration,
    opts: SocketOptions,
) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(ip) = source {
        // Only bind a source of the same family; a mismatch would fail every connect.
        if ip.is_ipv4() == addr.is_ipv4() {
            socket.bind(SocketAddr::new(ip, 0))?;
        }
    }
    if opts.nodelay {
        socket.set_nodelay(true)?;
    }
    if opts.keepalive {
        socket.set_keepalive(true)?;
    }
    match tokio::time::timeout(timeout, socket.connect(addr)).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
    }
}
