//! The AF_PACKET socket of the DSR plane: raw Ethernet frames in and out of one interface.
//!
//! This is the only module of quill allowed to use `unsafe` (CI checks that no other file
//! allows it): binding a packet socket to an interface and setting the SOL_PACKET options
//! have no safe wrapper in rustix, nix or socket2. Everything else (socket creation,
//! receive, send, timeouts) goes through rustix's safe calls.
//!
//! Invariants: the socket is bound to one interface and protocol ETH_P_ALL before it can
//! receive anything (it is created with protocol 0, which receives nothing), it never
//! receives the frames sent by this host (`PACKET_IGNORE_OUTGOING`), and every frame read
//! or written starts with a 10-byte `virtio_net_hdr` (`PACKET_VNET_HDR`): passing it
//! through unchanged makes the kernel finish partial checksums and segment GSO super-frames
//! on send.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// Length of the `virtio_net_hdr` in front of every frame.
pub const VNET_HDR_LEN: usize = 10;

/// `PACKET_IGNORE_OUTGOING` (Linux 4.20) and `PACKET_VNET_HDR` from `<linux/if_packet.h>`.
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
const PACKET_VNET_HDR: libc::c_int = 15;

/// A packet socket bound to one interface.
#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
    ifindex: u32,
}

fn set_int_option(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `fd` is an open socket for the duration of the call; the option value points
    // to a live `c_int` and the length passed is exactly its size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(&value).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl PacketSocket {
    /// Opens a packet socket on interface `ifname` (needs CAP_NET_RAW).
    pub fn open(ifname: &str) -> io::Result<PacketSocket> {
        // Protocol 0: the socket receives nothing until it is bound below.
        let fd = rustix::net::socket_with(
            AddressFamily::PACKET,
            SocketType::RAW,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let ifindex = rustix1::net::netdevice::name_to_index(&fd, ifname)?;
        set_int_option(&fd, libc::SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)?;
        set_int_option(&fd, libc::SOL_PACKET, PACKET_VNET_HDR, 1)?;
        let protocol = (libc::ETH_P_ALL as u16).to_be();
        let addr = libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as libc::c_ushort,
            sll_protocol: protocol,
            sll_ifindex: ifindex as libc::c_int,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        // SAFETY: `fd` is an open AF_PACKET socket; `addr` is a fully initialised
        // `sockaddr_ll` that lives across the call, and the length passed is its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::from_ref(&addr).cast::<libc::sockaddr>(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(PacketSocket { fd, ifindex })
    }

    /// The index of the bound interface.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Bounds how long [`PacketSocket::recv`] waits for a frame.
    pub fn set_read_timeout(&self, timeout: Duration) -> io::Result<()> {
        rustix::net::sockopt::set_socket_timeout(
            &self.fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(timeout),
        )?;
        Ok(())
    }

    /// Asks for a larger receive buffer (bursts wait there while the plane is busy).
    pub fn set_recv_buffer(&self, bytes: usize) -> io::Result<()> {
        rustix::net::sockopt::set_socket_recv_buffer_size(&self.fd, bytes)?;
        Ok(())
    }

    /// Receives one frame (virtio header first) into `buf`; returns its length, or
    /// `Ok(None)` when the read timeout passed or a signal interrupted the wait.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match rustix::net::recv(&self.fd, buf, RecvFlags::TRUNC) {
            Ok(n) if n > buf.len() => Ok(None), // truncated: larger than any frame we take
            Ok(n) => Ok(Some(n)),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends one frame (virtio header first) out of the bound interface.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        rustix::net::send(&self.fd, frame, SendFlags::empty())?;
        Ok(())
    }
}

impl AsFd for PacketSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
