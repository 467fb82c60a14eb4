//! What quill asks of its memory allocator: mimalloc, the global allocator (see main.rs).
//!
//! mimalloc gives pages freed by a thread back to the operating system only after a delay,
//! and only when that thread allocates or frees again. An event loop whose connections
//! have all parked (`idle_park`) goes quiet, so without a nudge it would keep the freed
//! tasks' pages for good. This is the module's only `unsafe`: one FFI call.
#![allow(unsafe_code)]

/// Hands the memory this thread has freed back to the operating system now. A no-op for
/// a program whose global allocator is not mimalloc (the library's unit tests).
pub fn release_freed() {
    // SAFETY: `mi_collect` takes no pointer and may be called at any time from any thread;
    // it only walks the calling thread's own heap.
    unsafe { libmimalloc_sys::mi_collect(true) }
}
