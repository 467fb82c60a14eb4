//! The AF_PACKET socket of the DSR plane: raw Ethernet frames in and out of one interface.
//!
//! This is the only module of quill allowed to use `unsafe` (CI checks that no other file
//! allows it): binding a packet socket to an interface and setting the SOL_PACKET options
//! have no safe wrapper in rustix, nix or socket2. Everything else (socket creation,
//! receive, send, timeouts) goes through rustix's safe calls.
//!
//! Frames are read either one per `recv` or, faster, from a TPACKET_V3 receive ring
//! ([`RxRing`]): blocks of frames the kernel fills in memory shared with quill, handed over
//! whole (one `poll` per block instead of one system call and one copy per frame).
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
const PACKET_VERSION: libc::c_int = 10;
const PACKET_RX_RING: libc::c_int = 5;
const TPACKET_V2: libc::c_int = 1;
const TPACKET_V3: libc::c_int = 2;
/// Frame status bit: the frame was cut to the ring's frame size.
const TP_STATUS_COPY: u32 = 1 << 1;

/// `struct tpacket_req` of `<linux/if_packet.h>` (TPACKET_V2 rings).
#[repr(C)]
struct TpacketReq {
    tp_block_size: u32,
    tp_block_nr: u32,
    tp_frame_size: u32,
    tp_frame_nr: u32,
}

// Offsets in `struct tpacket2_hdr`.
const V2_STATUS: usize = 0;
const V2_LEN: usize = 4;
const V2_SNAPLEN: usize = 8;
const V2_MAC: usize = 12;
/// Size of `struct tpacket2_hdr`.
const V2_HDR_LEN: usize = 32;
/// Block status: owned by the kernel / handed to user space.
const TP_STATUS_KERNEL: u32 = 0;
const TP_STATUS_USER: u32 = 1;

/// `struct tpacket_req3` of `<linux/if_packet.h>`.
#[repr(C)]
struct TpacketReq3 {
    tp_block_size: u32,
    tp_block_nr: u32,
    tp_frame_size: u32,
    tp_frame_nr: u32,
    tp_retire_blk_tov: u32,
    tp_sizeof_priv: u32,
    tp_feature_req_word: u32,
}

// Offsets in `struct tpacket_block_desc` (version, offset_to_priv, then tpacket_hdr_v1).
const BLOCK_STATUS: usize = 8;
const BLOCK_NUM_PKTS: usize = 12;
const BLOCK_FIRST_PKT: usize = 16;
// Offsets in `struct tpacket3_hdr`.
const PKT_NEXT: usize = 0;
const PKT_SNAPLEN: usize = 12;
const PKT_MAC: usize = 24;
/// Size of `struct tpacket3_hdr` (the frame data starts after it).
const PKT_HDR_LEN: usize = 48;

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

/// A TPACKET_V3 receive ring mapped into this process.
#[derive(Debug)]
pub struct RxRing {
    map: std::ptr::NonNull<u8>,
    block_size: usize,
    block_nr: usize,
    /// The next block to look at (the kernel fills them in order).
    current: usize,
}

// SAFETY: the mapping is owned by the ring alone (no other Rust value points into it), and
// the ring is used by one thread at a time (&mut self for every access).
unsafe impl Send for RxRing {}

fn read_u32(block: &[u8], at: usize) -> Option<u32> {
    let b = block.get(at..at + 4)?;
    Some(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

fn read_u16(block: &[u8], at: usize) -> Option<u16> {
    let b = block.get(at..at + 2)?;
    Some(u16::from_ne_bytes([b[0], b[1]]))
}

impl PacketSocket {
    /// Switches the socket to TPACKET_V3 and maps a receive ring of `block_nr` blocks of
    /// `block_size` bytes (a power of two, multiple of the page size, larger than any frame
    /// taken). A block is handed over when full or `retire` after its first frame.
    pub fn rx_ring(
        &self,
        block_size: usize,
        block_nr: usize,
        retire: Duration,
    ) -> io::Result<RxRing> {
        const FRAME_SIZE: usize = 2048;
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        if !block_size.is_power_of_two() || block_size < FRAME_SIZE || block_nr == 0 {
            return Err(invalid());
        }
        set_int_option(&self.fd, libc::SOL_PACKET, PACKET_VERSION, TPACKET_V3)?;
        let req = TpacketReq3 {
            tp_block_size: u32::try_from(block_size).map_err(|_| invalid())?,
            tp_block_nr: u32::try_from(block_nr).map_err(|_| invalid())?,
            tp_frame_size: FRAME_SIZE as u32,
            tp_frame_nr: u32::try_from(block_size / FRAME_SIZE * block_nr)
                .map_err(|_| invalid())?,
            tp_retire_blk_tov: u32::try_from(retire.as_millis().max(1)).map_err(|_| invalid())?,
            tp_sizeof_priv: 0,
            tp_feature_req_word: 0,
        };
        // SAFETY: `fd` is an open packet socket; `req` is a live, fully initialised
        // `tpacket_req3` and the length passed is its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_RX_RING,
                std::ptr::from_ref(&req).cast::<libc::c_void>(),
                std::mem::size_of::<TpacketReq3>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let len = block_size * block_nr;
        // SAFETY: mapping the ring the kernel just allocated for this socket: a fresh
        // shared mapping at an address the kernel chooses, aliasing no Rust object.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                self.fd.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = std::ptr::NonNull::new(map.cast::<u8>()).ok_or_else(invalid)?;
        Ok(RxRing {
            map,
            block_size,
            block_nr,
            current: 0,
        })
    }
}

impl RxRing {
    /// The status word of block `i`, shared with the kernel.
    fn status(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: block `i` (< block_nr) starts inside the mapping, at a page boundary, so
        // the u32 at offset 8 is in bounds and aligned; the kernel and this process access
        // it only atomically (the kernel with barriers around its store).
        unsafe {
            &*self
                .map
                .as_ptr()
                .add(i * self.block_size + BLOCK_STATUS)
                .cast::<std::sync::atomic::AtomicU32>()
        }
    }

    /// Waits up to `timeout` for the next block, calls `f` on each of its frames (the
    /// virtio header first, writable so a frame can be rewritten in place and sent), then
    /// hands the block back to the kernel. Returns the number of frames (0 on timeout).
    pub fn next_block(
        &mut self,
        sock: &PacketSocket,
        timeout: Duration,
        mut f: impl FnMut(&mut [u8]),
    ) -> io::Result<usize> {
        use std::sync::atomic::Ordering::{Acquire, Release};
        let i = self.current;
        if self.status(i).load(Acquire) & TP_STATUS_USER == 0 {
            let mut fds = [rustix::event::PollFd::new(
                &sock.fd,
                rustix::event::PollFlags::IN,
            )];
            let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
            match rustix::event::poll(&mut fds, ms) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            if self.status(i).load(Acquire) & TP_STATUS_USER == 0 {
                return Ok(0);
            }
        }
        // SAFETY: block `i` lies inside the mapping; its status is TP_STATUS_USER, so the
        // kernel does not touch it until the status is set back to TP_STATUS_KERNEL below,
        // and this is the only reference into it (`&mut self`) for the slice's lifetime.
        let block = unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_ptr().add(i * self.block_size),
                self.block_size,
            )
        };
        let count = read_u32(block, BLOCK_NUM_PKTS).unwrap_or(0) as usize;
        let mut at = read_u32(block, BLOCK_FIRST_PKT).unwrap_or(0) as usize;
        let mut seen = 0;
        while seen < count {
            let (Some(next), Some(snaplen), Some(mac)) = (
                read_u32(block, at + PKT_NEXT),
                read_u32(block, at + PKT_SNAPLEN),
                read_u16(block, at + PKT_MAC),
            ) else {
                break;
            };
            // The kernel writes the virtio header just before the Ethernet header.
            let mac = at + usize::from(mac);
            let start = mac.saturating_sub(VNET_HDR_LEN);
            let end = mac + snaplen as usize;
            if start >= at + PKT_HDR_LEN && end <= block.len() {
                f(&mut block[start..end]);
            }
            seen += 1;
            if next == 0 {
                break;
            }
            at += next as usize;
        }
        self.status(i).store(TP_STATUS_KERNEL, Release);
        self.current = (i + 1) % self.block_nr;
        Ok(seen)
    }
}

/// A TPACKET_V2 receive ring: fixed-size frame slots, each handed over on its own (no
/// block timer, so no added latency), read in batches of whatever is ready.
#[derive(Debug)]
pub struct FrameRing {
    map: std::ptr::NonNull<u8>,
    frame_size: usize,
    frame_nr: usize,
    current: usize,
}

// SAFETY: as for `RxRing`: the mapping is owned by this value alone and used through
// `&mut self` by one thread at a time.
unsafe impl Send for FrameRing {}

impl PacketSocket {
    /// Switches the socket to TPACKET_V2 and maps a ring of `frame_nr` slots of
    /// `frame_size` bytes (a multiple of the page size; frames longer than a slot are cut
    /// and dropped, so it must hold the largest frame, GSO super-frames included).
    pub fn frame_ring(&self, frame_size: usize, frame_nr: usize) -> io::Result<FrameRing> {
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        if frame_size % 4096 != 0 || frame_nr == 0 {
            return Err(invalid());
        }
        set_int_option(&self.fd, libc::SOL_PACKET, PACKET_VERSION, TPACKET_V2)?;
        let size = u32::try_from(frame_size).map_err(|_| invalid())?;
        let req = TpacketReq {
            // One frame per block: blocks must be whole pages, frames need not be powers of two.
            tp_block_size: size,
            tp_block_nr: u32::try_from(frame_nr).map_err(|_| invalid())?,
            tp_frame_size: size,
            tp_frame_nr: u32::try_from(frame_nr).map_err(|_| invalid())?,
        };
        // SAFETY: `fd` is an open packet socket; `req` is a live, fully initialised
        // `tpacket_req` and the length passed is its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_RX_RING,
                std::ptr::from_ref(&req).cast::<libc::c_void>(),
                std::mem::size_of::<TpacketReq>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let len = frame_size * frame_nr;
        // SAFETY: mapping the ring the kernel just allocated for this socket: a fresh
        // shared mapping at an address the kernel chooses, aliasing no Rust object. Not
        // populated: a slot's pages are touched only as far as its frames reach.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let map = std::ptr::NonNull::new(map.cast::<u8>()).ok_or_else(invalid)?;
        Ok(FrameRing {
            map,
            frame_size,
            frame_nr,
            current: 0,
        })
    }
}

impl FrameRing {
    /// The status word of slot `i`, shared with the kernel.
    fn status(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: slot `i` (< frame_nr) starts inside the mapping at a page boundary, so
        // the u32 at its start is in bounds and aligned; both sides access it atomically.
        unsafe {
            &*self
                .map
                .as_ptr()
                .add(i * self.frame_size + V2_STATUS)
                .cast::<std::sync::atomic::AtomicU32>()
        }
    }

    /// Waits up to `timeout` for a frame, then calls `f` on every frame ready (up to
    /// `max`; the virtio header first, writable for in-place rewriting) and hands each slot
    /// back to the kernel after `f` returns. Returns the number of frames (0 on timeout).
    pub fn next_batch(
        &mut self,
        sock: &PacketSocket,
        timeout: Duration,
        max: usize,
        mut f: impl FnMut(&mut [u8]),
    ) -> io::Result<usize> {
        use std::sync::atomic::Ordering::{Acquire, Release};
        if self.status(self.current).load(Acquire) & TP_STATUS_USER == 0 {
            let mut fds = [rustix::event::PollFd::new(
                &sock.fd,
                rustix::event::PollFlags::IN,
            )];
            let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
            match rustix::event::poll(&mut fds, ms) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let mut n = 0;
        while n < max {
            let i = self.current;
            let status = self.status(i).load(Acquire);
            if status & TP_STATUS_USER == 0 {
                break;
            }
            // SAFETY: slot `i` lies inside the mapping; its status says user space owns
            // it, so the kernel leaves it alone until the status is reset below, and this
            // is the only reference into it (`&mut self`) while `f` runs.
            let slot = unsafe {
                std::slice::from_raw_parts_mut(
                    self.map.as_ptr().add(i * self.frame_size),
                    self.frame_size,
                )
            };
            if let (Some(len), Some(snaplen), Some(mac)) = (
                read_u32(slot, V2_LEN),
                read_u32(slot, V2_SNAPLEN),
                read_u16(slot, V2_MAC),
            ) {
                let mac = usize::from(mac);
                let start = mac.saturating_sub(VNET_HDR_LEN);
                let end = mac + snaplen as usize;
                // A frame cut to the slot size is useless to forward: dropped.
                let whole = status & TP_STATUS_COPY == 0 && snaplen == len;
                if whole && start >= V2_HDR_LEN && end <= slot.len() {
                    f(&mut slot[start..end]);
                }
            }
            self.status(i).store(TP_STATUS_KERNEL, Release);
            self.current = (i + 1) % self.frame_nr;
            n += 1;
        }
        Ok(n)
    }
}

impl Drop for FrameRing {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `frame_ring`, which nothing refers
        // to any more.
        unsafe {
            libc::munmap(
                self.map.as_ptr().cast::<libc::c_void>(),
                self.frame_size * self.frame_nr,
            );
        }
    }
}

impl Drop for RxRing {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `rx_ring`, which nothing refers to
        // any more (the ring is being dropped and lends its memory only within a call).
        unsafe {
            libc::munmap(
                self.map.as_ptr().cast::<libc::c_void>(),
                self.block_size * self.block_nr,
            );
        }
    }
}

impl AsFd for PacketSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
