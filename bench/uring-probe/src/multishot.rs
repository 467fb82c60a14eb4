//! The probe's `multishot` mode: what the plain probe leaves out. Each socket has one
//! multishot receive armed for its life (re-armed only when the kernel ends it), drawing
//! from one ring of provided buffers shared by every connection (memory does not grow
//! with connections), sockets are registered descriptors (no file lookup per operation),
//! and the ring runs with SINGLE_ISSUER + DEFER_TASKRUN + COOP_TASKRUN.
//!
//! Invariants: a provided buffer goes back to the ring only once the send of its bytes has
//! completed; a connection's descriptors are closed (and their registered slots cleared)
//! only when none of its operations is in flight.
use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

/// Provided buffers: a power of two (the ring's index is masked).
const NBUF: u16 = 1024;
const BUF: usize = 4096;
const GROUP: u16 = 7;
/// Registered descriptor slots: two per connection.
const MAX_CONNS: usize = 4096;
const ACCEPT: u64 = u64::MAX;
const ENOBUFS: i32 = -libc::ENOBUFS;

/// The provided-buffer ring and the buffers it hands out.
struct Buffers {
    ring: *mut types::BufRingEntry,
    memory: Vec<u8>,
    tail: u16,
}

impl Buffers {
    fn new() -> Buffers {
        let layout =
            std::alloc::Layout::from_size_align(NBUF as usize * 16, 4096).expect("a valid layout");
        // SAFETY: the layout has a non-zero size; the memory is never freed (the probe runs
        // until it is killed), so it outlives the ring's registration.
        let ring = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<types::BufRingEntry>();
        assert!(!ring.is_null(), "out of memory");
        let mut b = Buffers {
            ring,
            memory: vec![0; NBUF as usize * BUF],
            tail: 0,
        };
        for bid in 0..NBUF {
            b.put(bid);
        }
        b
    }

    /// Hands buffer `bid` back to the kernel.
    fn put(&mut self, bid: u16) {
        let addr = self.memory.as_ptr() as u64 + bid as u64 * BUF as u64;
        // SAFETY: the index is masked into the ring's NBUF entries.
        let entry = unsafe { &mut *self.ring.add((self.tail & (NBUF - 1)) as usize) };
        entry.set_addr(addr);
        entry.set_len(BUF as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the ring's base is page-aligned and initialised; its tail field is a u16
        // the kernel reads, published with release ordering after the entry is written.
        unsafe {
            let tail = types::BufRingEntry::tail(self.ring).cast_mut();
            (*(tail as *const AtomicU16)).store(self.tail, Ordering::Release);
        }
    }

    fn bytes(&self, bid: u16, from: usize, to: usize) -> &[u8] {
        &self.memory[bid as usize * BUF + from..bid as usize * BUF + to]
    }
}

/// One direction of a connection: the buffers received from this side, to be sent to the
/// peer in order (buffer id, length, bytes sent so far).
#[derive(Default)]
struct Side {
    queue: VecDeque<(u16, usize, usize)>,
    sending: bool,
    /// The side has ended its stream: the pair closes once its queue is sent.
    ended: bool,
}

struct Conn {
    fds: [RawFd; 2],
    sides: [Side; 2],
    inflight: u32,
    closing: bool,
}

fn token(conn: usize, side: usize, is_send: bool) -> u64 {
    ((conn as u64) << 2) | ((side as u64) << 1) | is_send as u64
}

fn slot(conn: usize, side: usize) -> u32 {
    (conn * 2 + side) as u32
}

fn recv(conn: &mut Conn, idx: usize, side: usize) -> squeue::Entry {
    conn.inflight += 1;
    opcode::RecvMulti::new(types::Fixed(slot(idx, side)), GROUP)
        .build()
        .user_data(token(idx, side, false))
}

/// The send of the oldest buffer received from `side`, to the other side.
fn send(conn: &mut Conn, buffers: &Buffers, idx: usize, side: usize) -> squeue::Entry {
    conn.inflight += 1;
    let s = &mut conn.sides[side];
    s.sending = true;
    let (bid, len, sent) = s.queue[0];
    let rest = buffers.bytes(bid, sent, len);
    opcode::Send::new(
        types::Fixed(slot(idx, 1 - side)),
        rest.as_ptr(),
        rest.len() as u32,
    )
    .build()
    .user_data(token(idx, side, true))
}

pub fn run(listen: SocketAddr, backend: SocketAddr) -> std::io::Result<()> {
    let mut ring = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_coop_taskrun()
        .build(4096)?;
    let mut buffers = Buffers::new();
    // SAFETY: the ring memory lives for the rest of the process (see Buffers::new).
    unsafe {
        ring.submitter()
            .register_buf_ring_with_flags(buffers.ring as u64, NBUF, GROUP, 0)?
    };
    ring.submitter()
        .register_files_sparse((MAX_CONNS * 2) as u32)?;
    let listener = TcpListener::bind(listen)?;
    let lfd = listener.as_raw_fd();
    let accept = || {
        opcode::Accept::new(types::Fd(lfd), std::ptr::null_mut(), std::ptr::null_mut())
            .build()
            .user_data(ACCEPT)
    };
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut pending = vec![accept()];
    eprintln!("uring-probe on {listen} -> {backend} (multishot)");
    loop {
        {
            let mut sq = ring.submission();
            for e in pending.drain(..) {
                // SAFETY: every buffer an entry points into is a provided buffer that stays
                // out of the ring until its send completes (the invariant above).
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
        let done: Vec<(u64, i32, u32)> = ring
            .completion()
            .map(|c: cqueue::Entry| (c.user_data(), c.result(), c.flags()))
            .collect();
        for (data, res, flags) in done {
            if data == ACCEPT {
                pending.push(accept());
                if res < 0 {
                    continue;
                }
                let Ok(b) = TcpStream::connect(backend) else {
                    // SAFETY: res is the descriptor the accept just returned, owned here.
                    unsafe { libc::close(res) };
                    continue;
                };
                let _ = b.set_nodelay(true);
                crate::set_nodelay(res);
                let idx = free.pop().unwrap_or_else(|| {
                    conns.push(None);
                    conns.len() - 1
                });
                if idx >= MAX_CONNS {
                    return Err(std::io::Error::other("too many connections"));
                }
                let fds = [res, b.into_raw_fd()];
                ring.submitter().register_files_update(slot(idx, 0), &fds)?;
                let mut c = Conn {
                    fds,
                    sides: Default::default(),
                    inflight: 0,
                    closing: false,
                };
                pending.push(recv(&mut c, idx, 0));
                pending.push(recv(&mut c, idx, 1));
                conns[idx] = Some(c);
                continue;
            }
            let idx = (data >> 2) as usize;
            let side = ((data >> 1) & 1) as usize;
            let is_send = data & 1 == 1;
            let Some(c) = conns[idx].as_mut() else {
                continue;
            };
            // A multishot receive stays in flight while the kernel says there is more.
            if is_send || !cqueue::more(flags) {
                c.inflight -= 1;
            }
            if !is_send {
                if let Some(bid) = cqueue::buffer_select(flags) {
                    if res > 0 && !c.closing {
                        c.sides[side].queue.push_back((bid, res as usize, 0));
                        if !c.sides[side].sending {
                            pending.push(send(c, &buffers, idx, side));
                        }
                    } else {
                        buffers.put(bid);
                    }
                }
                // ENOBUFS: every buffer is queued for sending; arm again, sends return some.
                if !c.closing && (res > 0 || res == ENOBUFS) {
                    if !cqueue::more(flags) {
                        pending.push(recv(c, idx, side));
                    }
                    continue;
                }
                if res == 0 && !c.closing && c.sides[side].sending {
                    // What the side sent before it ended still goes to the peer first.
                    c.sides[side].ended = true;
                    continue;
                }
            } else if res > 0 && !c.closing {
                let s = &mut c.sides[side];
                s.queue[0].2 += res as usize;
                let (bid, len, sent) = s.queue[0];
                if sent < len {
                    pending.push(send(c, &buffers, idx, side));
                    continue;
                }
                s.queue.pop_front();
                buffers.put(bid);
                if !s.queue.is_empty() {
                    pending.push(send(c, &buffers, idx, side));
                    continue;
                }
                s.sending = false;
                if !s.ended {
                    continue;
                }
            }
            // End of stream or an error on either side ends the pair (no half-close, as in
            // the plain probe: enough for HTTP keep-alive).
            if !c.closing {
                c.closing = true;
                for fd in c.fds {
                    // SAFETY: the descriptors stay open until the close below.
                    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                }
            }
            if c.inflight == 0 {
                for s in &mut c.sides {
                    for (bid, _, _) in s.queue.drain(..) {
                        buffers.put(bid);
                    }
                }
                ring.submitter()
                    .register_files_update(slot(idx, 0), &[-1, -1])?;
                for fd in c.fds {
                    // SAFETY: no operation refers to them any more.
                    unsafe { libc::close(fd) };
                }
                conns[idx] = None;
                free.push(idx);
            }
        }
    }
}
