//! Socket options that none of the wrapper crates quill uses offers (socket2, rustix and nix
//! have neither TCP_DEFER_ACCEPT nor TCP_INFO): each is one `setsockopt` or `getsockopt`.
//! This module's only `unsafe` is those calls; everything they are given is a borrowed,
//! open descriptor and a plain integer or a `tcp_info` the kernel fills.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// Sets TCP_DEFER_ACCEPT on a listening TCP socket: a new connection stays in the kernel
/// until its client's first bytes arrive or about `seconds` have passed (the kernel counts
/// it in SYN-ACK retransmissions), so the listener's owner is woken once for both. 0 turns
/// it off. Applies to connections completed after the call.
pub fn set_defer_accept(listener: &impl AsFd, seconds: u32) -> io::Result<()> {
    let value = libc::c_int::try_from(seconds).unwrap_or(libc::c_int::MAX);
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the descriptor is borrowed from an open socket for the whole call; the kernel
    // reads exactly `len` bytes from `value`, a live `c_int` of that size, and keeps no
    // pointer to it after the call returns.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_fd().as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            std::ptr::from_ref(&value).cast(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The kernel's `TCP_LISTEN` state (include/net/tcp_states.h), which libc does not name.
const TCP_LISTEN: u8 = 10;

/// How many connections wait in a listening TCP socket's accept queue, established and not
/// yet accepted (TCP_INFO's `tcpi_unacked` of a socket in LISTEN; `ss -l` shows it as
/// Recv-Q). With SO_REUSEPORT each listener has its own queue.
pub fn accept_queue_len(listener: &impl AsFd) -> io::Result<u32> {
    // SAFETY: `tcp_info` is plain integers, for which all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::tcp_info>())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: the descriptor is borrowed from an open socket for the whole call; the kernel
    // writes at most `len` bytes (the size of `info`, a live `tcp_info`) and stores the
    // length written in `len`, a live `socklen_t`; it keeps neither pointer.
    let rc = unsafe {
        libc::getsockopt(
            listener.as_fd().as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if info.tcpi_state != TCP_LISTEN {
        // Any other state's `tcpi_unacked` counts segments, not connections.
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    Ok(info.tcpi_unacked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    /// Reads TCP_DEFER_ACCEPT back, as the kernel keeps it.
    fn defer_accept_of(listener: &TcpListener) -> u32 {
        let mut value: libc::c_int = -1;
        let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).expect("len");
        // SAFETY: as in `set_defer_accept`; the kernel writes at most `len` bytes to `value`.
        let rc = unsafe {
            libc::getsockopt(
                listener.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_DEFER_ACCEPT,
                std::ptr::from_mut(&mut value).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockopt: {}", io::Error::last_os_error());
        u32::try_from(value).expect("not negative")
    }

    #[test]
    fn the_accept_queue_counts_connections_not_yet_accepted() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        assert_eq!(accept_queue_len(&l).expect("tcp_info"), 0);
        let _clients: Vec<_> = (0..3)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        // The handshake completes in the kernel: each connect returns with its
        // connection queued.
        assert_eq!(accept_queue_len(&l).expect("tcp_info"), 3);
        drop(l.accept().expect("accept"));
        assert_eq!(accept_queue_len(&l).expect("tcp_info"), 2);
    }

    #[test]
    fn a_connected_socket_has_no_accept_queue() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        assert!(accept_queue_len(&c).is_err());
    }

    #[test]
    fn a_listener_takes_the_delay_and_gives_it_up() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        assert_eq!(defer_accept_of(&l), 0);
        set_defer_accept(&l, 1).expect("set");
        assert!(
            defer_accept_of(&l) >= 1,
            "the kernel rounds up to whole retransmissions"
        );
        set_defer_accept(&l, 0).expect("unset");
        assert_eq!(defer_accept_of(&l), 0);
    }

    #[test]
    fn a_client_that_speaks_is_accepted_with_its_bytes_and_a_silent_one_only_later() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        set_defer_accept(&l, 1).expect("set");
        l.set_nonblocking(true).expect("nonblocking");
        let addr = l.local_addr().expect("addr");

        let _silent = TcpStream::connect(addr).expect("connect");
        let mut speaking = TcpStream::connect(addr).expect("connect");
        speaking.write_all(b"hello").expect("write");
        let deadline = Instant::now() + Duration::from_secs(5);
        let (mut first, _) = loop {
            match l.accept() {
                Ok(c) => break c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("no connection accepted: {e}"),
            }
        };
        let mut got = [0u8; 5];
        first.read_exact(&mut got).expect("read");
        assert_eq!(
            &got, b"hello",
            "the speaking client comes first, bytes and all"
        );
        assert!(
            matches!(l.accept(), Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "the silent client is still held by the kernel"
        );
    }
}
