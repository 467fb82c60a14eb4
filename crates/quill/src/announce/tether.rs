//! The tether: a TUN device whose life is this process's. quill's announced route points
//! into it (`dev quill0`), and the kernel deletes a TUN device, with every route through
//! it, when the last descriptor of the device closes. So the route goes when quill dies in
//! any way — SIGKILL, a crash, the OOM killer — with nobody left to remove it, and BIRD,
//! which follows interfaces as well as routes, withdraws the announcement at once.
//!
//! Invariants: the device is never made persistent (TUNSETPERSIST), and its descriptor is
//! close-on-exec, so no other process (a binary upgrade's successor, a health script)
//! keeps it alive. Nothing reads from the device: nothing routes into it either, since
//! quill's table is one that only the routing daemon reads (no `ip rule` sends packets
//! there), and whatever did would be dropped when the device's small queue fills.
//!
//! One of the modules allowed `unsafe` (docs/SECURITY.md): creating a TUN device takes the
//! TUNSETIFF ioctl, which has no safe wrapper in rustix, nix or socket2.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// The name quill asks for: the kernel replaces `%d` by the first free number (`quill0`,
/// `quill1`... for several quills on one node).
const NAME_TEMPLATE: &[u8] = b"quill%d";

/// `struct ifreq` as TUNSETIFF reads it: the interface name, then (at the start of the
/// union) the flags, padded to the size of the whole structure (40 bytes on Linux).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _union_rest: [u8; 22],
}

/// The open TUN device; dropping it (or the process ending) deletes the device and its
/// routes.
#[derive(Debug)]
pub struct Tether {
    _device: File,
    name: String,
    index: u32,
}

impl Tether {
    /// Creates a new TUN device (CAP_NET_ADMIN); it is down until [`Tether::index`] is
    /// used to bring it up.
    pub fn create() -> io::Result<Tether> {
        // std opens files close-on-exec.
        let device = File::options()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| io::Error::new(e.kind(), format!("/dev/net/tun: {e}")))?;
        let mut request = IfReq {
            name: [0; libc::IFNAMSIZ],
            // IFF_NO_PI: no packet-information header (nothing reads anyway).
            flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
            _union_rest: [0; 22],
        };
        request.name[..NAME_TEMPLATE.len()].copy_from_slice(NAME_TEMPLATE);
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq` at the pointer, which is a
        // live, exclusively borrowed IfReq laid out as the kernel's (name, flags at the
        // union's start, padded to its full size); the descriptor stays open for the call.
        let rc = unsafe {
            libc::ioctl(
                device.as_raw_fd(),
                libc::TUNSETIFF,
                std::ptr::from_mut(&mut request),
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("cannot create a TUN device (needs CAP_NET_ADMIN): {e}"),
            ));
        }
        let len = request
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(libc::IFNAMSIZ);
        let name = String::from_utf8_lossy(&request.name[..len]).into_owned();
        let index = nix::net::if_::if_nametoindex(name.as_str()).map_err(io::Error::from)?;
        Ok(Tether {
            _device: device,
            name,
            index,
        })
    }

    /// The device's name (`quill0`...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's interface index, for routes through it.
    pub fn index(&self) -> u32 {
        self.index
    }
}
