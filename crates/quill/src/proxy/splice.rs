//! Zero-copy forwarding for bulk transfers: splice(2) moves bytes from one socket into a
//! kernel pipe and from the pipe into the other socket, so they never visit user space.
//! The relay switches a direction to it once a read fills its whole scratch buffer (a bulk
//! transfer is under way) and back to plain reads when the source runs dry.
//!
//! Pipes are pooled per event loop: a direction holds one (two descriptors) only while bulk
//! data flows, so idle connections hold none. Invariant: a pipe in the pool is empty, and a
//! pipe that may still hold bytes is closed, never pooled.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::pipe::{PipeFlags, SpliceFlags};

/// What one splice asks to move; the pipe is grown to this size where the system allows.
pub const PIPE_SIZE: usize = 256 * 1024;

/// Empty pipes kept per event loop for the next bulk transfer.
const POOL_MAX: usize = 8;

thread_local! {
    static POOL: RefCell<Vec<KernelPipe>> = const { RefCell::new(Vec::new()) };
}

/// A non-blocking kernel pipe used as the buffer of one bulk direction.
#[derive(Debug)]
pub struct KernelPipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl KernelPipe {
    /// A pipe from the pool, or a new one. `None` when none can be made (out of
    /// descriptors, say): the relay then goes on copying, which needs no descriptor.
    pub fn take() -> Option<KernelPipe> {
        if let Some(pipe) = POOL.with(|pool| pool.borrow_mut().pop()) {
            return Some(pipe);
        }
        let (read, write) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)
            .map_err(|e| tracing::debug!("no pipe for splice: {e}"))
            .ok()?;
        // Fewer, larger splices; the default 64 KiB pipe works too, only with more calls.
        let _ = rustix::pipe::fcntl_setpipe_size(&write, PIPE_SIZE);
        Some(KernelPipe { read, write })
    }

    /// Returns a pipe known to be empty to the pool (or closes it when the pool is full).
    pub fn give_back(self) {
        // During thread teardown the pool may be gone already; the pipe is closed then.
        let _ = POOL.try_with(|pool| {
            let mut pool = pool.borrow_mut();
            if pool.len() < POOL_MAX {
                pool.push(self);
            }
        });
    }

    /// Moves up to `len` bytes from `src` into the pipe. 0 means `src` reached EOF.
    pub fn fill_from(&self, src: impl AsFd, len: usize) -> io::Result<usize> {
        rustix::pipe::splice(src, None, &self.write, None, len, flags()).map_err(io::Error::from)
    }

    /// Moves up to `len` bytes from the pipe into `dst`.
    pub fn drain_into(&self, dst: impl AsFd, len: usize) -> io::Result<usize> {
        rustix::pipe::splice(&self.read, None, dst, None, len, flags()).map_err(io::Error::from)
    }
}

fn flags() -> SpliceFlags {
    SpliceFlags::MOVE | SpliceFlags::NONBLOCK
}
