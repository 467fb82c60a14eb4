//! Data planes that own connections. They read the settings snapshot and the shared tables,
//! never parse configuration text, and never block.

pub mod candidates;
pub mod coalesce;
pub mod dummy;
pub mod gateway;
pub mod grpc;
pub mod h1;
pub mod h1_client;
pub mod h1_pump;
pub mod h2;
pub mod h2_client;
pub mod http;
pub mod offload;
pub mod park;
pub mod poll_before_sleep;
pub mod polling;
pub mod pool;
pub mod pool_h2;
pub mod proxy_protocol;
pub mod pump;
pub mod quickack;
pub mod registry;
pub mod relay;
pub mod replay;
pub mod signals;
pub mod splice;
pub mod stream;
pub mod tcp;
pub mod udp;

/// Whether a warning whose last time is kept in `last` (`clock::now_ms()`, 0 = never) may
/// be said again at `now`: at most once every `every_ms`, whichever event loop asks, so
/// that a flood of the condition does not flood the log.
pub(crate) fn warn_again(last: &std::sync::atomic::AtomicU64, now: u64, every_ms: u64) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let was = last.load(Relaxed);
    (was == 0 || now.saturating_sub(was) >= every_ms)
        && last
            .compare_exchange(was, now.max(1), Relaxed, Relaxed)
            .is_ok()
}
