//! Runtime state of each server slot: live connection count, blacklist deadline, totals.
//!
//! The table has a fixed size ([`MAX_SERVERS`]) and lives beside the settings snapshot, so a
//! reload never resets a counter and the data plane never sees the table move. Every field
//! is an atomic: the per-connection path takes no lock. Each slot is cache-line aligned so
//! two cores updating neighbouring servers do not contend.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use crate::command::MAX_SERVERS;

/// Live state of one server (or of the emergency / abuse server).
#[derive(Debug, Default)]
#[repr(align(64))]
pub struct ServerState {
    /// Connections currently open to this server.
    pub conns: AtomicU32,
    /// `clock::now_ms()` until which the server is blacklisted; 0 = not blacklisted.
    pub blacklisted_until: AtomicU64,
    /// Connections ever made to this server.
    pub total: AtomicU64,
    /// Failed connection attempts.
    pub failures: AtomicU64,
    /// Bytes relayed from clients to this server.
    pub bytes_to: AtomicU64,
    /// Bytes relayed from this server to clients.
    pub bytes_from: AtomicU64,
}

impl ServerState {
    /// Whether the server is blacklisted at `now` (milliseconds of [`super::clock`]).
    pub fn is_blacklisted(&self, now: u64) -> bool {
        self.blacklisted_until.load(Relaxed) > now
    }

    /// Avoid this server for `seconds` from `now`; 0 whitelists it.
    pub fn blacklist(&self, now: u64, seconds: u64) {
        let until = if seconds == 0 {
            0
        } else {
            now.saturating_add(seconds.saturating_mul(1000))
        };
        self.blacklisted_until.store(until, Relaxed);
    }

    /// Seconds of blacklist left at `now` (0 when not blacklisted).
    pub fn blacklist_left(&self, now: u64) -> u64 {
        self.blacklisted_until
            .load(Relaxed)
            .saturating_sub(now)
            .div_ceil(1000)
    }
}

/// The fixed table of server states, indexed by server number.
#[derive(Debug)]
pub struct ServerTable {
    slots: Box<[ServerState]>,
}

impl Default for ServerTable {
    fn default() -> ServerTable {
        ServerTable {
            slots: (0..MAX_SERVERS).map(|_| ServerState::default()).collect(),
        }
    }
}

impl ServerTable {
    /// State of server `index`; indexes come from settings, which the parser bounds.
    pub fn get(&self, index: usize) -> Option<&ServerState> {
        self.slots.get(index)
    }
}
