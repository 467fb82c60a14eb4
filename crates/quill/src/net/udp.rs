//! UDP sockets for the datagram data plane: listening sockets (one per event loop, spread
//! by SO_REUSEPORT), upstream sockets connected to one server, and batched I/O.
//!
//! * [`open`] binds the listening sockets. On a wildcard address (`0.0.0.0`, `::`) it also
//!   asks for the destination address of every datagram (IP_PKTINFO / IPV6_RECVPKTINFO), so
//!   that a reply leaves from the very address the client sent to, even on a host with
//!   several addresses. On a specific address the kernel picks that address by itself and
//!   no control message is needed.
//! * [`RecvBatch`] receives up to its size of datagrams in one `recvmmsg`, into buffers
//!   allocated once, each big enough for the largest datagram (65,507 bytes over IPv4), so
//!   nothing is allocated per datagram and nothing is truncated.
//! * [`send`] and [`send_to`] are plain non-blocking system calls that do not consult the
//!   event loop's readiness: a UDP send either goes out or fails at once (EAGAIN when the
//!   socket buffer is full, which the caller counts as a drop, as the network would).
//!
//! Linux-only calls (recvmmsg, pktinfo) live here and nowhere else.

use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd};

use nix::sys::socket::{
    self as nixsock, sockopt, ControlMessage, ControlMessageOwned, MsgFlags, MultiHeaders,
    SockaddrStorage,
};
use socket2::{Domain, Protocol, Socket, Type};

use super::listen::ListenError;
use super::ListenAddr;

/// The largest UDP payload (over IPv6 without jumbograms it is 65,527, over IPv4 65,507);
/// a receive buffer this size never truncates a datagram.
pub const MAX_DATAGRAM: usize = 65_536;

/// Distance between two receive buffers: one datagram plus one cache line, so that the
/// starts of consecutive buffers do not all fall into the same L1 cache set.
const STRIDE: usize = MAX_DATAGRAM + 64;

/// A UDP socket bound for listening, not yet registered with an event loop.
#[derive(Debug)]
pub struct UdpListener {
    pub socket: std::net::UdpSocket,
    /// The socket reports each datagram's destination address (wildcard listeners).
    pub pktinfo: bool,
}

/// A UDP socket bound to `addr`; with `pktinfo`, asking for each datagram's destination
/// address before it is bound, so that no datagram can arrive without it.
fn listen_socket(addr: SocketAddr, reuse_port: bool, pktinfo: bool) -> io::Result<Socket> {
    super::listen::bound_socket(addr, Type::DGRAM, Protocol::UDP, reuse_port, |socket| {
        if !pktinfo {
            return Ok(());
        }
        let fd = socket.as_fd();
        let set = if addr.is_ipv6() {
            nixsock::setsockopt(&fd, sockopt::Ipv6RecvPacketInfo, &true)
        } else {
            nixsock::setsockopt(&fd, sockopt::Ipv4PacketInfo, &true)
        };
        set.map_err(io::Error::from)
    })
}

/// Opens `count` UDP listening sockets on `addr` (one per event loop).
///
/// As for TCP, one bind without SO_REUSEPORT first checks that nobody else holds the port
/// (SO_REUSEPORT alone would silently share it with another process of the same user).
pub fn open(addr: &ListenAddr, count: usize) -> Result<Vec<UdpListener>, ListenError> {
    let addr = match addr {
        ListenAddr::Tcp(a) => *a,
        ListenAddr::Unix(p) => {
            return Err(ListenError {
                addr: p.display().to_string(),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "UDP (-U) needs a [host:]port to listen on, not a Unix socket",
                ),
            })
        }
    };
    let err = |source| ListenError {
        addr: format!("udp {addr}"),
        source,
    };
    drop(listen_socket(addr, false, false).map_err(err)?);
    let pktinfo = addr.ip().is_unspecified();
    let mut out = Vec::with_capacity(count.max(1));
    for _ in 0..count.max(1) {
        let socket = listen_socket(addr, true, pktinfo).map_err(err)?;
        out.push(UdpListener {
            socket: socket.into(),
            pktinfo,
        });
    }
    Ok(out)
}

/// The upstream socket of a new flow from `client`: in `transparent` mode bound to the
/// client's own address and port (IP_TRANSPARENT), so that the server sees the client;
/// otherwise bound to the `source` setting, if any.
pub fn upstream(
    server: SocketAddr,
    settings: &crate::settings::Settings,
    client: SocketAddr,
) -> io::Result<std::net::UdpSocket> {
    if !settings.transparent {
        return connect(server, settings.source);
    }
    let server = SocketAddr::new(server.ip().to_canonical(), server.port());
    let client = SocketAddr::new(client.ip().to_canonical(), client.port());
    let socket = Socket::new(
        Domain::for_address(server),
        Type::DGRAM.nonblocking(),
        Some(Protocol::UDP),
    )?;
    if client.is_ipv4() == server.is_ipv4() {
        crate::net::connect::transparent(&socket)?;
        // Another flow's socket may still hold the same client address for another server.
        socket.set_reuse_address(true)?;
        socket.bind(&client.into())?;
    }
    socket.connect(&server.into())?;
    Ok(socket.into())
}

/// A non-blocking UDP socket connected to `server`, bound to `source` if that is of the
/// same family. A v4-mapped server address is used as the IPv4 address it stands for.
pub fn connect(server: SocketAddr, source: Option<IpAddr>) -> io::Result<std::net::UdpSocket> {
    let server = SocketAddr::new(server.ip().to_canonical(), server.port());
    let socket = Socket::new(
        Domain::for_address(server),
        Type::DGRAM.nonblocking(),
        Some(Protocol::UDP),
    )?;
    if let Some(ip) = source.map(|ip| ip.to_canonical()) {
        if ip.is_ipv4() == server.is_ipv4() {
            socket.bind(&SocketAddr::new(ip, 0).into())?;
        }
    }
    socket.connect(&server.into())?;
    Ok(socket.into())
}

/// Registers a UDP socket with the current event loop for readability only: a UDP send
/// never waits, so write readiness would only bring wake-ups for nothing (every datagram
/// sent on loopback would report the socket writable again).
// `AsyncFd::with_interest` is deprecated (tokio#8587) because a type whose descriptor can
// change under the registration would be unsound; `std::net::UdpSocket` owns one
// descriptor for its whole life, so the safe constructor is sound here.
#[allow(deprecated)]
pub fn register_readable(
    sock: std::net::UdpSocket,
) -> io::Result<tokio::io::unix::AsyncFd<std::net::UdpSocket>> {
    tokio::io::unix::AsyncFd::with_interest(sock, tokio::io::Interest::READABLE)
}

/// Sends one datagram on a connected socket, without waiting.
pub fn send(sock: &impl AsFd, data: &[u8]) -> io::Result<usize> {
    rustix::net::send(sock, data, rustix::net::SendFlags::DONTWAIT).map_err(io::Error::from)
}

/// Sends `msgs`, in order, with as few `sendmmsg` calls as possible: on a connected socket
/// when `dest` is None, else to `dest`. Never waits. Returns how many were sent and, if
/// not all, the error that stopped the rest (EAGAIN for a full buffer, ECONNREFUSED for a
/// server that is gone...).
///
/// One small allocation per call (the message headers), never one per datagram.
pub fn send_many(
    sock: &impl AsFd,
    msgs: &[&[u8]],
    dest: Option<SocketAddr>,
) -> (usize, Option<io::Error>) {
    use rustix1::net::addr::SocketAddrArg;
    use rustix1::net::{sendmmsg, MMsgHdr, SendAncillaryBuffer, SendFlags};
    match msgs {
        [] => return (0, None),
        [one] => {
            let r = match dest {
                None => send(sock, one),
                Some(d) => send_to(sock, one, d, None),
            };
            return match r {
                Ok(_) => (1, None),
                Err(e) => (0, Some(e)),
            };
        }
        _ => {}
    }
    if let Some(size) = gso_size(msgs) {
        match send_gso(sock, msgs, size, dest) {
            Ok(()) => return (msgs.len(), None),
            Err(e) if gso_unsupported(&e) => GSO.with(|g| g.set(false)),
            // Refused for this path or these sizes only: send them one by one below.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {}
            Err(e) => return (0, Some(e)),
        }
    }
    let addr = dest.map(|d| d.as_any());
    let iovs: Vec<[io::IoSlice<'_>; 1]> = msgs.iter().map(|m| [io::IoSlice::new(m)]).collect();
    let mut control: Vec<SendAncillaryBuffer<'_, '_, '_>> = msgs
        .iter()
        .map(|_| SendAncillaryBuffer::default())
        .collect();
    let mut headers: Vec<MMsgHdr<'_>> = iovs
        .iter()
        .zip(control.iter_mut())
        .map(|(iov, c)| match &addr {
            Some(a) => MMsgHdr::new_with_addr(a, iov, c),
            None => MMsgHdr::new(iov, c),
        })
        .collect();
    let mut sent = 0;
    while sent < headers.len() {
        match sendmmsg(sock, &mut headers[sent..], SendFlags::DONTWAIT) {
            Ok(0) => return (sent, Some(io::ErrorKind::WriteZero.into())),
            Ok(n) => sent += n,
            Err(rustix1::io::Errno::INTR) => {}
            Err(e) => return (sent, Some(e.into())),
        }
    }
    (sent, None)
}

thread_local! {
    /// UDP segmentation offload works here (cleared at the first refusal: old kernels,
    /// UDP-Lite, IPsec paths).
    static GSO: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Most segments one UDP GSO send may carry (the kernel's UDP_MAX_SEGMENTS).
const GSO_MAX_SEGMENTS: usize = 64;
/// Most payload bytes in one GSO send (a UDP datagram's own limit, with room for headers).
const GSO_MAX_BYTES: usize = 65_000;
/// Largest segment sent with GSO: every segment must fit the path MTU (the kernel refuses
/// the send otherwise), and 1,232 bytes fit IPv6's minimum MTU of 1,280 with headers.
const GSO_MAX_SEGMENT: usize = 1_232;

/// The segment size when `msgs` can go out as one UDP GSO send: two or more datagrams, all
/// of one size but the last, which is not empty and not longer (the kernel cuts the
/// payload at every `size` bytes, so that the receiver gets exactly these datagrams).
fn gso_size(msgs: &[&[u8]]) -> Option<u16> {
    if msgs.len() < 2 || msgs.len() > GSO_MAX_SEGMENTS || !GSO.with(|g| g.get()) {
        return None;
    }
    let (last, rest) = msgs.split_last()?;
    let size = rest.first()?.len();
    let total: usize = msgs.iter().map(|m| m.len()).sum();
    let fits = size > 0
        && size <= GSO_MAX_SEGMENT
        && total <= GSO_MAX_BYTES
        && !last.is_empty()
        && last.len() <= size
        && rest.iter().all(|m| m.len() == size);
    fits.then(|| u16::try_from(size).ok()).flatten()
}

/// Errors that say UDP GSO is not available on this path (as opposed to the server or
/// the socket buffer).
fn gso_unsupported(e: &io::Error) -> bool {
    use rustix::io::Errno;
    [Errno::IO, Errno::NOPROTOOPT, Errno::OPNOTSUPP]
        .iter()
        .any(|errno| e.raw_os_error() == Some(errno.raw_os_error()))
}

/// One `sendmsg` carrying `msgs` as segments of `size` bytes (UDP_SEGMENT): one trip
/// through the IP stack instead of one per datagram.
fn send_gso(
    sock: &impl AsFd,
    msgs: &[&[u8]],
    size: u16,
    dest: Option<SocketAddr>,
) -> io::Result<()> {
    let iov: Vec<io::IoSlice<'_>> = msgs.iter().map(|m| io::IoSlice::new(m)).collect();
    let cmsg = [ControlMessage::UdpGsoSegments(&size)];
    let fd = sock.as_fd().as_raw_fd();
    let flags = MsgFlags::MSG_DONTWAIT;
    let sent = match dest {
        Some(d) => nixsock::sendmsg(fd, &iov, &cmsg, flags, Some(&SockaddrStorage::from(d))),
        None => nixsock::sendmsg::<SockaddrStorage>(fd, &iov, &cmsg, flags, None),
    };
    sent.map(|_| ()).map_err(io::Error::from)
}

/// Sends one datagram to `dest`, from the local address `src` when given (listeners with
/// pktinfo), without waiting.
pub fn send_to(
    sock: &impl AsFd,
    data: &[u8],
    dest: SocketAddr,
    src: Option<IpAddr>,
) -> io::Result<usize> {
    let Some(src) = src else {
        return rustix::net::sendto(sock, data, rustix::net::SendFlags::DONTWAIT, &dest)
            .map_err(io::Error::from);
    };
    let iov = [io::IoSlice::new(data)];
    let addr = SockaddrStorage::from(dest);
    let fd = sock.as_fd().as_raw_fd();
    let flags = MsgFlags::MSG_DONTWAIT;
    let sent = match (dest, src) {
        (SocketAddr::V4(_), IpAddr::V4(ip)) => {
            let info = nix::libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: nix::libc::in_addr {
                    s_addr: u32::from_ne_bytes(ip.octets()),
                },
                ipi_addr: nix::libc::in_addr { s_addr: 0 },
            };
            nixsock::sendmsg(
                fd,
                &iov,
                &[ControlMessage::Ipv4PacketInfo(&info)],
                flags,
                Some(&addr),
            )
        }
        (SocketAddr::V6(_), ip) => {
            let ip = match ip {
                IpAddr::V6(v6) => v6,
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            };
            let info = nix::libc::in6_pktinfo {
                ipi6_addr: nix::libc::in6_addr {
                    s6_addr: ip.octets(),
                },
                ipi6_ifindex: 0,
            };
            nixsock::sendmsg(
                fd,
                &iov,
                &[ControlMessage::Ipv6PacketInfo(&info)],
                flags,
                Some(&addr),
            )
        }
        // An IPv6 source for an IPv4 socket cannot happen (the source comes from the same
        // socket); let the kernel choose.
        (SocketAddr::V4(_), IpAddr::V6(_)) => nixsock::sendmsg(fd, &iov, &[], flags, Some(&addr)),
    };
    sent.map_err(io::Error::from)
}

/// One received datagram: where it came from, where it was sent to (with pktinfo), and
/// its length in the batch's buffer.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub from: SocketAddr,
    /// The destination address of the datagram (only on pktinfo listeners).
    pub local: Option<IpAddr>,
    pub len: usize,
}

const NO_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));

/// Buffers and headers for receiving up to `N` datagrams with one `recvmmsg`.
pub struct RecvBatch<const N: usize> {
    /// N buffers of [`MAX_DATAGRAM`] bytes, [`STRIDE`] apart. Allocated zeroed, so pages
    /// that no datagram ever reached stay untouched (they cost address space, not memory).
    bufs: Box<[u8]>,
    headers: MultiHeaders<SockaddrStorage>,
    got: [Received; N],
    count: usize,
}

impl<const N: usize> RecvBatch<N> {
    /// A batch; `pktinfo` reserves room for the destination-address control message.
    pub fn new(pktinfo: bool) -> RecvBatch<N> {
        let cmsg = pktinfo.then(|| nix::cmsg_space!(nix::libc::in6_pktinfo));
        RecvBatch {
            bufs: vec![0u8; STRIDE * N].into_boxed_slice(),
            headers: MultiHeaders::preallocate(N, cmsg),
            got: [Received {
                from: NO_ADDR,
                local: None,
                len: 0,
            }; N],
            count: 0,
        }
    }

    /// Receives what is queued on `sock`, up to `N` datagrams, without waiting. Returns
    /// how many arrived; `Err(WouldBlock)` when none was queued.
    pub fn recv(&mut self, sock: &impl AsFd) -> io::Result<usize> {
        self.count = 0;
        let mut chunks = self.bufs.chunks_mut(STRIDE);
        let mut iovs: [[IoSliceMut<'_>; 1]; N] = std::array::from_fn(|_| {
            let chunk = chunks.next().unwrap_or_default();
            let len = chunk.len().min(MAX_DATAGRAM);
            [IoSliceMut::new(&mut chunk[..len])]
        });
        let results = nixsock::recvmmsg(
            sock.as_fd().as_raw_fd(),
            &mut self.headers,
            iovs.iter_mut(),
            MsgFlags::MSG_DONTWAIT,
            None,
        )
        .map_err(io::Error::from)?;
        for (slot, msg) in self.got.iter_mut().zip(results) {
            let from = msg.address.as_ref().and_then(to_socket_addr);
            let local = msg.cmsgs().ok().and_then(|mut c| c.find_map(destination));
            *slot = Received {
                from: from.unwrap_or(NO_ADDR),
                local,
                len: msg.bytes,
            };
            self.count += 1;
        }
        Ok(self.count)
    }

    /// The datagrams of the last [`recv`](Self::recv), with their bytes.
    pub fn iter(&self) -> impl Iterator<Item = (&Received, &[u8])> + '_ {
        self.got[..self.count].iter().enumerate().map(|(i, r)| {
            let start = i * STRIDE;
            let bytes = self.bufs.get(start..start + r.len).unwrap_or_default();
            (r, bytes)
        })
    }

    /// How many datagrams the last [`recv`](Self::recv) got.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether the last [`recv`](Self::recv) got nothing.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Datagram `i` of the last [`recv`](Self::recv).
    pub fn get(&self, i: usize) -> Option<(&Received, &[u8])> {
        let r = self.got[..self.count].get(i)?;
        let start = i * STRIDE;
        Some((r, self.bufs.get(start..start + r.len)?))
    }

    /// How many datagrams one call can receive.
    pub const fn capacity(&self) -> usize {
        N
    }
}

fn to_socket_addr(s: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::V4(SocketAddrV4::from(*v4)));
    }
    if let Some(v6) = s.as_sockaddr_in6() {
        return Some(SocketAddr::V6(SocketAddrV6::from(*v6)));
    }
    None
}

/// The destination address of a datagram from its pktinfo control message. Broadcast and
/// multicast destinations cannot be a reply's source: the kernel then chooses.
fn destination(c: ControlMessageOwned) -> Option<IpAddr> {
    let ip = match c {
        ControlMessageOwned::Ipv4PacketInfo(info) => {
            IpAddr::V4(Ipv4Addr::from(info.ipi_addr.s_addr.to_ne_bytes()))
        }
        ControlMessageOwned::Ipv6PacketInfo(info) => {
            IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr))
        }
        _ => return None,
    };
    let unicast = match ip.to_canonical() {
        IpAddr::V4(v4) => !(v4.is_broadcast() || v4.is_multicast() || v4.is_unspecified()),
        IpAddr::V6(v6) => !(v6.is_multicast() || v6.is_unspecified()),
    };
    unicast.then_some(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_receives_several_datagrams_whole() {
        let l = open(&ListenAddr::Tcp("127.0.0.1:0".parse().unwrap()), 1)
            .unwrap()
            .remove(0);
        let addr = l.socket.local_addr().unwrap();
        let c = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let big = vec![7u8; 65_507];
        c.send_to(b"one", addr).unwrap();
        c.send_to(b"", addr).unwrap();
        c.send_to(&big, addr).unwrap();
        let mut b = RecvBatch::<4>::new(false);
        let mut got = Vec::new();
        while got.len() < 3 {
            if let Ok(n) = b.recv(&l.socket) {
                assert!(n <= b.capacity());
                got.extend(b.iter().map(|(r, d)| (r.from, d.to_vec())));
            }
        }
        assert_eq!(got[0], (c.local_addr().unwrap(), b"one".to_vec()));
        assert_eq!(got[1].1, b"");
        assert_eq!(got[2].1, big);
        assert_eq!(
            b.recv(&l.socket).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }

    #[test]
    fn send_many_keeps_datagram_boundaries() {
        let l = open(&ListenAddr::Tcp("127.0.0.1:0".parse().unwrap()), 1)
            .unwrap()
            .remove(0);
        let addr = l.socket.local_addr().unwrap();
        let c = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        c.connect(addr).unwrap();
        let same = [&b"aaaa"[..], b"bbbb", b"cc"]; // one GSO send where supported
        let mixed = [&b"x"[..], b"yyyyy", b"", b"zz"]; // sendmmsg
        assert_eq!(gso_size(&same), Some(4));
        assert_eq!(gso_size(&mixed), None);
        assert_eq!(send_many(&c, &same, None).0, 3);
        assert!(GSO.with(|g| g.get()), "this kernel refused UDP GSO");
        assert_eq!(send_many(&c, &mixed, None).0, 4);
        let mut b = RecvBatch::<8>::new(false);
        let mut got: Vec<Vec<u8>> = Vec::new();
        while got.len() < 7 {
            if b.recv(&l.socket).is_ok() {
                got.extend(b.iter().map(|(_, d)| d.to_vec()));
            }
        }
        let want: Vec<Vec<u8>> = same
            .iter()
            .chain(mixed.iter())
            .map(|d| d.to_vec())
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn wildcard_listener_learns_and_replies_from_the_destination() {
        let l = open(&ListenAddr::Tcp("0.0.0.0:0".parse().unwrap()), 1)
            .unwrap()
            .remove(0);
        assert!(l.pktinfo);
        let port = l.socket.local_addr().unwrap().port();
        let c = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let to: SocketAddr = format!("127.0.0.3:{port}").parse().unwrap();
        c.connect(to).unwrap();
        c.send(b"hi").unwrap();
        let mut b = RecvBatch::<2>::new(true);
        let r = loop {
            if b.recv(&l.socket).is_ok() {
                break *b.iter().next().unwrap().0;
            }
        };
        assert_eq!(r.local, Some("127.0.0.3".parse().unwrap()));
        send_to(&l.socket, b"back", r.from, r.local).unwrap();
        // The client's connected socket only accepts a reply from 127.0.0.3.
        c.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(c.recv(&mut buf).unwrap(), 4);
    }
}
