//! The probe's `udp` mode: what an io_uring event loop would save quill's UDP plane (`-U`).
//! quill's loop sleeps in `epoll_wait` and then receives (six system calls a DNS query at
//! a paced load: two waits, two receives, two sends); dnsdist sleeps in a blocking receive
//! on each of its sockets (four). Here one thread sleeps in `io_uring_enter` with a receive
//! armed on the listener and on each flow's connected socket, and the sends a wake-up
//! makes go in with the next wait: about one kernel entry per wake-up.
//!
//! Like quill: a flow per client address, with its own socket connected to the backend;
//! answers go back from the listening socket. Not like quill: no expiry (the flow table only
//! grows), no failover (a receive error on a flow socket is re-armed at once), no
//! batching of several datagrams per system call, IPv4 only.
//!
//! Invariant: every buffer, `msghdr` and address an operation points into is owned by its
//! entry in `ops` until its completion is reaped.
use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use io_uring::{opcode, squeue, types, IoUring};
use slab::Slab;

const BUF: usize = 2048;
/// Marks a send's token.
const SEND: u64 = 1 << 63;

/// What one operation in flight owns, by its token (the index in `ops`).
enum Op {
    /// A receive on the listener: the datagram and where it came from.
    Query(Box<Msg>),
    /// A receive on flow `flow`'s socket: an answer.
    Answer { flow: usize, buf: Box<[u8; BUF]> },
    /// A send, to the backend or (with its address) to a client.
    Sent { _held: Box<Msg> },
}

/// A datagram with its peer's address and the `msghdr` that describes both.
struct Msg {
    buf: [u8; BUF],
    addr: libc::sockaddr_in,
    iov: libc::iovec,
    hdr: libc::msghdr,
}

impl Msg {
    fn new() -> Box<Msg> {
        // SAFETY: all-zero is a valid value of these plain C structs (null pointers, zero
        // lengths); the pointers are set below, once the box has its final address.
        let mut m: Box<Msg> = Box::new(unsafe { std::mem::zeroed() });
        m.iov.iov_base = m.buf.as_mut_ptr().cast();
        m.iov.iov_len = BUF;
        m.hdr.msg_iov = &mut m.iov;
        m.hdr.msg_iovlen = 1;
        m.hdr.msg_name = (&mut m.addr as *mut libc::sockaddr_in).cast();
        m.hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
        m
    }
}

struct Flow {
    sock: UdpSocket,
    client: libc::sockaddr_in,
}

fn recv_query(ops: &mut Slab<Op>, lfd: RawFd) -> squeue::Entry {
    let mut m = Msg::new();
    let hdr: *mut libc::msghdr = &mut m.hdr;
    opcode::RecvMsg::new(types::Fd(lfd), hdr)
        .build()
        .user_data(ops.insert(Op::Query(m)) as u64)
}

fn recv_answer(ops: &mut Slab<Op>, flow: usize, fd: RawFd) -> squeue::Entry {
    let mut buf = Box::new([0u8; BUF]);
    let ptr = buf.as_mut_ptr();
    opcode::Recv::new(types::Fd(fd), ptr, BUF as u32)
        .build()
        .user_data(ops.insert(Op::Answer { flow, buf }) as u64)
}

pub fn run(listen: SocketAddr, backend: SocketAddr) -> std::io::Result<()> {
    let mut ring: IoUring = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .build(4096)?;
    let listener = UdpSocket::bind(listen)?;
    let lfd = listener.as_raw_fd();
    let mut ops: Slab<Op> = Slab::new();
    let mut flows: Vec<Flow> = Vec::new();
    let mut by_client: HashMap<(u32, u16), usize> = HashMap::new();
    let mut pending = vec![recv_query(&mut ops, lfd)];
    eprintln!("uring-probe on {listen} -> {backend} (udp)");
    loop {
        // A send on a UDP socket completes inside the submitting call: waiting for one
        // completion more than the sends submitted sleeps until the next datagram instead
        // of returning at once for the sends' own completions (a second entry a wake-up).
        let sends = pending
            .iter()
            .filter(|e| e.get_user_data() & SEND != 0)
            .count();
        {
            let mut sq = ring.submission();
            for e in pending.drain(..) {
                // SAFETY: every pointer in `e` points into an entry of `ops`, which lives
                // until its completion is reaped below.
                while unsafe { sq.push(&e) }.is_err() {
                    drop(sq);
                    ring.submit()?;
                    sq = ring.submission();
                }
            }
        }
        match ring.submit_and_wait(sends + 1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(e),
        }
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (token, res) in done {
            match ops.try_remove((token & !SEND) as usize) {
                Some(Op::Query(mut m)) => {
                    pending.push(recv_query(&mut ops, lfd));
                    if res <= 0 {
                        continue;
                    }
                    let key = (m.addr.sin_addr.s_addr, m.addr.sin_port);
                    let flow = match by_client.get(&key) {
                        Some(&f) => f,
                        None => {
                            let sock = UdpSocket::bind("127.0.0.1:0")?;
                            sock.connect(backend)?;
                            let f = flows.len();
                            pending.push(recv_answer(&mut ops, f, sock.as_raw_fd()));
                            flows.push(Flow {
                                sock,
                                client: m.addr,
                            });
                            by_client.insert(key, f);
                            f
                        }
                    };
                    // The same message goes to the backend's connected socket: no address.
                    m.iov.iov_len = res as usize;
                    m.hdr.msg_name = std::ptr::null_mut();
                    m.hdr.msg_namelen = 0;
                    let hdr: *const libc::msghdr = &m.hdr;
                    let fd = flows[flow].sock.as_raw_fd();
                    pending.push(
                        opcode::SendMsg::new(types::Fd(fd), hdr)
                            .build()
                            .user_data(ops.insert(Op::Sent { _held: m }) as u64 | SEND),
                    );
                }
                Some(Op::Answer { flow, buf }) => {
                    pending.push(recv_answer(&mut ops, flow, flows[flow].sock.as_raw_fd()));
                    if res <= 0 {
                        continue;
                    }
                    let mut m = Msg::new();
                    m.buf[..res as usize].copy_from_slice(&buf[..res as usize]);
                    m.iov.iov_len = res as usize;
                    m.addr = flows[flow].client;
                    let hdr: *const libc::msghdr = &m.hdr;
                    pending.push(
                        opcode::SendMsg::new(types::Fd(lfd), hdr)
                            .build()
                            .user_data(ops.insert(Op::Sent { _held: m }) as u64 | SEND),
                    );
                }
                Some(Op::Sent { .. }) | None => {}
            }
        }
    }
}
