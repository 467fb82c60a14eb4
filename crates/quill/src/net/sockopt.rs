//! Socket options that none of the wrapper crates quill uses offers (socket2, rustix and nix
//! have no TCP_DEFER_ACCEPT): each is one `setsockopt`. This module's only `unsafe` is that
//! call; everything it is given is a borrowed, open descriptor and a plain integer.
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
