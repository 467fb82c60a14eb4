//! The AF_PACKET socket of the DSR plane: raw Ethernet frames in and out of one interface.
//!
//! This is the only module of quill allowed to use `unsafe` (CI checks that no other file
//! allows it): binding a packet socket to an interface, setting the SOL_PACKET options and
//! mapping its rings have no safe wrapper in rustix, nix or socket2; and the batched send
//! (`sendmmsg`) is called raw so that its message headers, kept allocated in the ring, can
//! point into ring slots without a per-batch allocation (rustix's `MMsgHdr` borrows).
//! Everything else (socket creation, receive, single sends, timeouts) goes through rustix.
//!
//! Frames are read either one per `recv` or, faster, from a memory-mapped receive ring: a
//! TPACKET_V2 ring of frame slots ([`FrameRing`], the default) or a TPACKET_V3 ring of
//! blocks ([`RxRing`]). A ring's reader rewrites frames in place and sends the ones it
//! forwards either one `send` each or all of a batch with one `sendmmsg` ([`TxMode`]),
//! giving a slot (block) back to the kernel only after the send that reads it.
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
const PACKET_QDISC_BYPASS: libc::c_int = 20;
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

    /// Sends frames straight to the interface's driver, skipping the queueing discipline
    /// (`PACKET_QDISC_BYPASS`, Linux 3.14): no traffic shaping or qdisc statistics, one
    /// lock less per frame.
    pub fn set_qdisc_bypass(&self, on: bool) -> io::Result<()> {
        set_int_option(
            &self.fd,
            libc::SOL_PACKET,
            PACKET_QDISC_BYPASS,
            i32::from(on),
        )
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

/// Most frames sent with one `sendmmsg`.
const TX_BATCH: usize = 64;

/// How the frames a ring's reader forwards are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxMode {
    /// One `send` per frame, as soon as it is rewritten.
    Single,
    /// The frames of one batch (one wake-up) with one `sendmmsg`, straight from the
    /// receive ring, before their slots go back to the kernel.
    Batch,
}

/// What one batch did: frames read, frames sent, sends refused (with the first error).
#[derive(Debug, Default)]
pub struct BatchReport {
    pub frames: usize,
    pub sent: usize,
    pub failed: usize,
    pub error: Option<io::Error>,
}

impl BatchReport {
    fn sent(&mut self, r: io::Result<()>) {
        match r {
            Ok(()) => self.sent += 1,
            Err(e) => self.failed(e),
        }
    }

    fn failed(&mut self, e: io::Error) {
        self.failed += 1;
        self.error.get_or_insert(e);
    }
}

/// The message headers of one `sendmmsg`, allocated once. Between [`TxBatch::push`] and
/// the end of [`TxBatch::flush`] they point into a receive ring's frames, which the caller
/// keeps owned by user space (status not given back to the kernel) until the flush returns.
#[derive(Debug)]
struct TxBatch {
    iov: Vec<libc::iovec>,
    hdr: Vec<libc::mmsghdr>,
    len: usize,
}

impl TxBatch {
    fn new(capacity: usize) -> TxBatch {
        let capacity = capacity.max(1);
        TxBatch {
            iov: vec![
                libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                };
                capacity
            ],
            // SAFETY: `mmsghdr` is a plain C struct of integers and pointers, for which
            // all-zero bytes are a valid value (null pointers, zero lengths).
            hdr: (0..capacity)
                .map(|_| unsafe { std::mem::zeroed::<libc::mmsghdr>() })
                .collect(),
            len: 0,
        }
    }

    fn is_full(&self) -> bool {
        self.len == self.iov.len()
    }

    /// Adds a frame to the batch. The caller guarantees that `frame` stays valid and
    /// unchanged until the next [`TxBatch::flush`] returns (it lies in a ring slot that
    /// user space owns until then).
    fn push(&mut self, frame: &[u8]) {
        if let Some(iov) = self.iov.get_mut(self.len) {
            iov.iov_base = frame.as_ptr().cast_mut().cast::<libc::c_void>();
            iov.iov_len = frame.len();
            self.len += 1;
        }
    }

    /// Sends every frame pushed, in order, with as few `sendmmsg` calls as the kernel
    /// allows; a frame the kernel refuses is counted and skipped.
    fn flush(&mut self, sock: &PacketSocket, report: &mut BatchReport) {
        let n = self.len;
        self.len = 0;
        for (hdr, iov) in self.hdr.iter_mut().zip(self.iov.iter_mut()).take(n) {
            hdr.msg_hdr.msg_iov = std::ptr::from_mut(iov);
            hdr.msg_hdr.msg_iovlen = 1;
            hdr.msg_len = 0;
        }
        let mut at = 0;
        while at < n {
            let rest = &mut self.hdr[at..n];
            // SAFETY: `fd` is an open packet socket; `rest` is a live array of `rest.len()`
            // initialised `mmsghdr`s, each pointing to one `iovec` of `self.iov` that
            // points to a frame the caller keeps valid until this function returns (see
            // `push`); no name and no control data. The kernel only reads the frames.
            let rc = unsafe {
                libc::sendmmsg(
                    sock.fd.as_raw_fd(),
                    rest.as_mut_ptr(),
                    u32::try_from(rest.len()).unwrap_or(u32::MAX),
                    0,
                )
            };
            match usize::try_from(rc) {
                Ok(0) => {
                    report.failed(io::ErrorKind::WriteZero.into());
                    at += 1;
                }
                Ok(sent) => {
                    report.sent += sent;
                    at += sent;
                }
                Err(_) => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        // The first frame of the rest was refused: skip it, send the others.
                        report.failed(e);
                        at += 1;
                    }
                }
            }
        }
        for iov in self.iov.iter_mut().take(n) {
            iov.iov_base = std::ptr::null_mut();
        }
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
    tx_mode: TxMode,
    tx: TxBatch,
}

// SAFETY: the mapping is owned by the ring alone (no other Rust value points into it), and
// the ring is used by one thread at a time (&mut self for every access). The send batch's
// pointers point into that mapping only between a push and the flush that ends the same
// `&mut self` call, so nothing is shared when the ring moves to another thread.
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
        tx_mode: TxMode,
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
            tx_mode,
            tx: TxBatch::new(TX_BATCH),
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
    /// virtio header first, writable so a frame can be rewritten in place), sends the
    /// frames for which `f` returned true (as rewritten, by the ring's [`TxMode`]), then
    /// hands the block back to the kernel. `report.frames` is 0 on timeout.
    pub fn next_block(
        &mut self,
        sock: &PacketSocket,
        timeout: Duration,
        mut f: impl FnMut(&mut [u8]) -> bool,
    ) -> io::Result<BatchReport> {
        use std::sync::atomic::Ordering::{Acquire, Release};
        let mut report = BatchReport::default();
        let i = self.current;
        if self.status(i).load(Acquire) & TP_STATUS_USER == 0 {
            wait_readable(sock, timeout)?;
            if self.status(i).load(Acquire) & TP_STATUS_USER == 0 {
                return Ok(report);
            }
        }
        // SAFETY: block `i` lies inside the mapping; its status is TP_STATUS_USER, so the
        // kernel does not touch it until the status is set back to TP_STATUS_KERNEL below,
        // after the last send that reads it.
        let base = unsafe { self.map.as_ptr().add(i * self.block_size) };
        let size = self.block_size;
        // SAFETY (for every `mapped` call below): `base..base + size` is block `i`, owned
        // by user space until its status is reset, and the byte ranges taken (descriptor,
        // packet headers, frames) never overlap, so no two live slices alias.
        let desc = unsafe { mapped(base, size, 0, BLOCK_FIRST_PKT + 4) };
        let (count, mut at) = desc.map_or((0, 0), |d| {
            (
                read_u32(d, BLOCK_NUM_PKTS).unwrap_or(0) as usize,
                read_u32(d, BLOCK_FIRST_PKT).unwrap_or(0) as usize,
            )
        });
        while report.frames < count {
            // SAFETY: see above.
            let Some(hdr) = (unsafe { mapped(base, size, at, PKT_HDR_LEN) }) else {
                break;
            };
            let (Some(next), Some(snaplen), Some(mac)) = (
                read_u32(hdr, PKT_NEXT),
                read_u32(hdr, PKT_SNAPLEN),
                read_u16(hdr, PKT_MAC),
            ) else {
                break;
            };
            // The kernel writes the virtio header just before the Ethernet header.
            let mac = at + usize::from(mac);
            let start = mac.saturating_sub(VNET_HDR_LEN);
            let len = (mac + snaplen as usize).saturating_sub(start);
            if start >= at + PKT_HDR_LEN {
                // SAFETY: see above.
                if let Some(frame) = unsafe { mapped(base, size, start, len) } {
                    if f(frame) {
                        self.send(sock, frame, &mut report);
                    }
                }
            }
            report.frames += 1;
            if next == 0 {
                break;
            }
            at += next as usize;
        }
        self.tx.flush(sock, &mut report);
        self.status(i).store(TP_STATUS_KERNEL, Release);
        self.current = (i + 1) % self.block_nr;
        Ok(report)
    }

    /// Sends `frame` now, or adds it to the batch (flushed when full; the block stays ours).
    fn send(&mut self, sock: &PacketSocket, frame: &[u8], report: &mut BatchReport) {
        match self.tx_mode {
            TxMode::Single => report.sent(sock.send(frame)),
            TxMode::Batch => {
                self.tx.push(frame);
                if self.tx.is_full() {
                    self.tx.flush(sock, report);
                }
            }
        }
    }
}

/// Waits up to `timeout` for the socket to be readable (a signal ends the wait early).
fn wait_readable(sock: &PacketSocket, timeout: Duration) -> io::Result<()> {
    let mut fds = [rustix::event::PollFd::new(
        &sock.fd,
        rustix::event::PollFlags::IN,
    )];
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    match rustix::event::poll(&mut fds, ms) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The `len` bytes at `offset` of the `size` bytes at `base`, or None if out of bounds.
///
/// # Safety
/// `base..base + size` must be mapped, readable and writable, and owned by this thread
/// (the kernel leaves it alone) for the returned lifetime, and no other live reference may
/// cover the bytes returned.
unsafe fn mapped<'a>(
    base: *mut u8,
    size: usize,
    offset: usize,
    len: usize,
) -> Option<&'a mut [u8]> {
    let end = offset.checked_add(len)?;
    if end > size {
        return None;
    }
    // SAFETY: in bounds (checked above); ownership and aliasing are the caller's promise.
    Some(unsafe { std::slice::from_raw_parts_mut(base.add(offset), len) })
}

/// A TPACKET_V2 receive ring: fixed-size frame slots, each handed over on its own (no
/// block timer, so no added latency), read in batches of whatever is ready.
#[derive(Debug)]
pub struct FrameRing {
    map: std::ptr::NonNull<u8>,
    frame_size: usize,
    frame_nr: usize,
    current: usize,
    tx_mode: TxMode,
    tx: TxBatch,
}

// SAFETY: as for `RxRing`: the mapping is owned by this value alone and used through
// `&mut self` by one thread at a time, and the send batch points into it only within one
// such call.
unsafe impl Send for FrameRing {}

impl PacketSocket {
    /// Switches the socket to TPACKET_V2 and maps a ring of `frame_nr` slots of
    /// `frame_size` bytes (a multiple of the page size; frames longer than a slot are cut
    /// and dropped, so it must hold the largest frame, GSO super-frames included).
    pub fn frame_ring(
        &self,
        frame_size: usize,
        frame_nr: usize,
        tx_mode: TxMode,
    ) -> io::Result<FrameRing> {
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
            tx_mode,
            // Never more than a quarter of the ring held back for one send.
            tx: TxBatch::new(TX_BATCH.min(frame_nr / 4).max(1)),
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
    /// `max`; the virtio header first, writable for in-place rewriting), sends the frames
    /// for which `f` returned true (as rewritten, by the ring's [`TxMode`]) and hands each
    /// slot back to the kernel once its frame is sent. `report.frames` is 0 on timeout.
    pub fn next_batch(
        &mut self,
        sock: &PacketSocket,
        timeout: Duration,
        max: usize,
        mut f: impl FnMut(&mut [u8]) -> bool,
    ) -> io::Result<BatchReport> {
        use std::sync::atomic::Ordering::Acquire;
        let mut report = BatchReport::default();
        if self.status(self.current).load(Acquire) & TP_STATUS_USER == 0 {
            wait_readable(sock, timeout)?;
        }
        // Slots read but not yet given back (their frames may be in the pending batch).
        let mut held = 0;
        while report.frames < max {
            let i = self.current;
            let status = self.status(i).load(Acquire);
            if status & TP_STATUS_USER == 0 {
                break;
            }
            // SAFETY: slot `i` lies inside the mapping; its status says user space owns
            // it, so the kernel leaves it alone until the status is reset (after the
            // send that reads its frame, in `release`).
            let base = unsafe { self.map.as_ptr().add(i * self.frame_size) };
            let size = self.frame_size;
            // SAFETY (both `mapped` calls): `base..base + size` is slot `i`, owned by user
            // space; the header and the frame (which starts after the header) do not overlap.
            let header = unsafe { mapped(base, size, 0, V2_HDR_LEN) };
            let found = header.and_then(|h| {
                Some((
                    read_u32(h, V2_LEN)?,
                    read_u32(h, V2_SNAPLEN)?,
                    read_u16(h, V2_MAC)?,
                ))
            });
            if let Some((len, snaplen, mac)) = found {
                let mac = usize::from(mac);
                let start = mac.saturating_sub(VNET_HDR_LEN);
                let frame_len = (mac + snaplen as usize).saturating_sub(start);
                // A frame cut to the slot size is useless to forward: dropped.
                let whole = status & TP_STATUS_COPY == 0 && snaplen == len;
                if whole && start >= V2_HDR_LEN {
                    // SAFETY: see above.
                    if let Some(frame) = unsafe { mapped(base, size, start, frame_len) } {
                        if f(frame) {
                            match self.tx_mode {
                                TxMode::Single => report.sent(sock.send(frame)),
                                TxMode::Batch => self.tx.push(frame),
                            }
                        }
                    }
                }
            }
            self.current = (i + 1) % self.frame_nr;
            held += 1;
            report.frames += 1;
            if self.tx.is_full() {
                self.tx.flush(sock, &mut report);
                self.release(held);
                held = 0;
            }
        }
        self.tx.flush(sock, &mut report);
        self.release(held);
        Ok(report)
    }

    /// Gives the `n` slots before `current` back to the kernel, oldest first.
    fn release(&self, n: usize) {
        use std::sync::atomic::Ordering::Release;
        for k in (1..=n).rev() {
            let i = (self.current + self.frame_nr - k) % self.frame_nr;
            self.status(i).store(TP_STATUS_KERNEL, Release);
        }
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
