//! A monotonic millisecond clock shared by the tables, so deadlines fit in one atomic word.

use std::sync::OnceLock;
use std::time::Instant;

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the first call in this process (monotonic, never 0 after start).
pub fn now_ms() -> u64 {
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}
