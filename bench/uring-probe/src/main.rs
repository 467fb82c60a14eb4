//! A time-boxed probe for issue 16, not part of quill: the smallest io_uring TCP relay, to
//! measure what one kernel entry per wake-up saves against epoll relays (quill's byte pump,
//! HAProxy) at a paced load. One thread; a backend connection per client connection; one
//! receive outstanding per socket; each send is queued in the same `io_uring_enter` that
//! reaps the receive that filled it (`multishot.rs` adds what this leaves out).
//!
//! Usage: uring-probe LISTEN_ADDR BACKEND_ADDR [tuned|plain|multishot|udp]
//! (`tuned`: SINGLE_ISSUER + DEFER_TASKRUN + COOP_TASKRUN; `plain`: none of them;
//! `multishot`: the tuned ring with multishot receives, provided buffers and registered
//! descriptors, in `multishot.rs`; `udp`: a UDP relay with a flow per client, as quill's
//! `-U`, in `udp.rs`).
//!
//! Invariant: a connection (and so each buffer an operation points into) is freed only when
//! no operation of it is in flight.
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

mod multishot;
mod udp;

const BUF: usize = 16 * 1024;
const ACCEPT: u64 = u64::MAX;

/// One direction of a connection: what was read from `fd`, to be sent to the peer.
struct Side {
    fd: RawFd,
    buf: Box<[u8; BUF]>,
    len: usize,
    sent: usize,
}

struct Conn {
    /// Client, then backend.
    sides: [Side; 2],
    inflight: u32,
    closing: bool,
}

fn token(conn: usize, side: usize, is_send: bool) -> u64 {
    ((conn as u64) << 2) | ((side as u64) << 1) | is_send as u64
}

fn recv(conn: &mut Conn, idx: usize, side: usize) -> squeue::Entry {
    conn.inflight += 1;
    let s = &mut conn.sides[side];
    opcode::Recv::new(types::Fd(s.fd), s.buf.as_mut_ptr(), BUF as u32)
        .build()
        .user_data(token(idx, side, false))
}

fn send(conn: &mut Conn, idx: usize, side: usize) -> squeue::Entry {
    conn.inflight += 1;
    let peer = conn.sides[1 - side].fd;
    let s = &conn.sides[side];
    let rest = &s.buf[s.sent..s.len];
    opcode::Send::new(types::Fd(peer), rest.as_ptr(), rest.len() as u32)
        .build()
        .user_data(token(idx, side, true))
}

fn accept(lfd: RawFd) -> squeue::Entry {
    opcode::Accept::new(types::Fd(lfd), std::ptr::null_mut(), std::ptr::null_mut())
        .build()
        .user_data(ACCEPT)
}

fn set_nodelay(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: fd is an open TCP socket; the option value is a live c_int of the given size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: uring-probe LISTEN_ADDR BACKEND_ADDR [tuned|plain|multishot|udp]");
        std::process::exit(2);
    }
    let listen: SocketAddr = args[1].parse().map_err(std::io::Error::other)?;
    let backend: SocketAddr = args[2].parse().map_err(std::io::Error::other)?;
    match args.get(3).map(String::as_str) {
        Some("multishot") => return multishot::run(listen, backend),
        Some("udp") => return udp::run(listen, backend),
        _ => {}
    }
    let tuned = args.get(3).map(String::as_str) != Some("plain");
    let mut builder = IoUring::builder();
    if tuned {
        builder
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_coop_taskrun();
    }
    let mut ring = builder.build(4096)?;
    let listener = TcpListener::bind(listen)?;
    let lfd = listener.as_raw_fd();
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut pending = vec![accept(lfd)];
    eprintln!(
        "uring-probe on {listen} -> {backend} ({})",
        if tuned { "tuned" } else { "plain" }
    );
    loop {
        {
            let mut sq = ring.submission();
            for e in pending.drain(..) {
                // SAFETY: every buffer an entry points into lives in its connection, which is
                // freed only once none of its operations is in flight (the invariant above).
                if unsafe { sq.push(&e) }.is_err() {
                    return Err(std::io::Error::other("submission queue full"));
                }
            }
        }
        match ring.submit_and_wait(1) {
            // A signal (strace attaching, say) ends the wait; the queue is kept.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => other?,
        };
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c: cqueue::Entry| (c.user_data(), c.result()))
            .collect();
        for (data, res) in done {
            if data == ACCEPT {
                pending.push(accept(lfd));
                if res < 0 {
                    continue;
                }
                // A blocking connect: once per connection, outside what the keep-alive
                // load measures.
                let Ok(b) = TcpStream::connect(backend) else {
                    // SAFETY: res is the descriptor the accept just returned, owned here.
                    unsafe { libc::close(res) };
                    continue;
                };
                let _ = b.set_nodelay(true);
                set_nodelay(res);
                let side = |fd: RawFd| Side {
                    fd,
                    buf: Box::new([0; BUF]),
                    len: 0,
                    sent: 0,
                };
                let mut c = Conn {
                    sides: [side(res), side(b.into_raw_fd())],
                    inflight: 0,
                    closing: false,
                };
                let idx = free.pop().unwrap_or_else(|| {
                    conns.push(None);
                    conns.len() - 1
                });
                pending.push(recv(&mut c, idx, 0));
                pending.push(recv(&mut c, idx, 1));
                conns[idx] = Some(c);
                continue;
            }
            let idx = (data >> 2) as usize;
            let side = ((data >> 1) & 1) as usize;
            let Some(c) = conns[idx].as_mut() else {
                continue;
            };
            c.inflight -= 1;
            if c.closing || res <= 0 {
                // No half-close: either end closing ends the pair (enough for HTTP keep-alive).
                if !c.closing {
                    c.closing = true;
                    for s in &c.sides {
                        // SAFETY: the descriptors stay open until the close below.
                        unsafe { libc::shutdown(s.fd, libc::SHUT_RDWR) };
                    }
                }
                if c.inflight == 0 {
                    for s in &c.sides {
                        // SAFETY: no operation refers to them any more.
                        unsafe { libc::close(s.fd) };
                    }
                    conns[idx] = None;
                    free.push(idx);
                }
                continue;
            }
            let s = &mut c.sides[side];
            if data & 1 == 1 {
                s.sent += res as usize;
                if s.sent < s.len {
                    pending.push(send(c, idx, side));
                } else {
                    pending.push(recv(c, idx, side));
                }
            } else {
                s.len = res as usize;
                s.sent = 0;
                pending.push(send(c, idx, side));
            }
        }
    }
}
