//! What quill asks of its memory allocator: mimalloc, the global allocator (see main.rs).
//!
//! mimalloc gives pages freed by a thread back to the operating system only after a delay,
//! and only when that thread allocates or frees again. An event loop whose connections
//! have all parked (`idle_park`) goes quiet, so without a nudge it would keep the freed
//! tasks' pages for good. The nudge waits for the quiet: while connections keep parking
//! (clients that think for seconds between requests), the loop keeps allocating and mimalloc
//! reuses and purges on its own, and a forced collection would only hand back pages that
//! the next wake-up faults in again (clients with 2 s between requests paid 27–38 % more
//! of quill's CPU per request for it: bench/RESULTS.md). This is the module's only
//! `unsafe`: one FFI call.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::time::Duration;

use tokio::time::Instant;

/// How long an event loop parks nothing more before the memory it freed is handed back.
pub const QUIET: Duration = Duration::from_millis(100);

thread_local! {
    /// When a connection of this thread last parked, while a release is scheduled.
    static LAST_PARK: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// A connection of this event loop parked (its task's memory freed): the memory is handed
/// back once the loop has parked nothing more for [`QUIET`]. Must run on an event loop
/// (it may spawn a local task).
pub fn release_when_quiet() {
    let now = Instant::now();
    if LAST_PARK.with(|l| l.replace(Some(now))).is_some() {
        return;
    }
    tokio::task::spawn_local(async move {
        let mut last = now;
        loop {
            tokio::time::sleep_until(last + QUIET).await;
            match LAST_PARK.with(Cell::get) {
                Some(l) if l > last => last = l,
                _ => break,
            }
        }
        LAST_PARK.with(|l| l.set(None));
        release_freed();
    });
}

/// Hands the memory this thread has freed back to the operating system now. A no-op for
/// a program whose global allocator is not mimalloc (the library's unit tests).
pub fn release_freed() {
    // SAFETY: `mi_collect` takes no pointer and may be called at any time from any thread;
    // it only walks the calling thread's own heap.
    unsafe { libmimalloc_sys::mi_collect(true) }
}
