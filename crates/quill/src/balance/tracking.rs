//! The client tracking table: which server each client address used last.
//!
//! Bounded by `clients_max`; when full, the least recently used client is evicted, in O(1).
//! The table is split into shards by a hash of the address so that the event loops on
//! different cores rarely wait for each other: one lookup is one short critical section of
//! one shard. Capacity is divided evenly between shards (rounded up), so the table holds
//! at least `clients_max` clients.
//!
//! Within a shard, addresses are hashed with SipHash under a random key (clients choose
//! their addresses; colliding ones must not be cheap to make). The shard itself is picked
//! with one multiply by a random key: steering addresses into one shard only makes that
//! shard forget its clients sooner, which filling the table with addresses does anyway.
//! A request costs two SipHashes (a lookup, then `record` in place), not five.

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::num::NonZeroUsize;
use std::sync::{Mutex, MutexGuard};

use lru::LruCache;

/// Shards used once the table is large enough for sharding to matter.
const SHARDS: usize = 16;

/// What the table remembers of one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientEntry {
    /// Server index the client was last sent to.
    pub server: usize,
    /// `clock::now_ms()` of the client's last connection.
    pub last_seen: u64,
    /// Connections made by this client (shown by `recent` in the control interface).
    pub connections: u64,
}

type Shard = LruCache<IpAddr, ClientEntry, std::hash::RandomState>;

/// A sharded LRU map from client address to [`ClientEntry`].
#[derive(Debug)]
pub struct ClientTable {
    shards: Box<[Mutex<Shard>]>,
    /// The random key of the shard choice.
    seed: u64,
}

fn per_shard(capacity: usize, shards: usize) -> NonZeroUsize {
    NonZeroUsize::new(capacity.div_ceil(shards)).unwrap_or(NonZeroUsize::MIN)
}

impl ClientTable {
    /// A table for `capacity` clients.
    pub fn new(capacity: usize) -> ClientTable {
        let shards = if capacity >= 1024 { SHARDS } else { 1 };
        let cap = per_shard(capacity, shards);
        ClientTable {
            shards: (0..shards)
                .map(|_| Mutex::new(LruCache::with_hasher(cap, Default::default())))
                .collect(),
            seed: std::hash::RandomState::new().hash_one(0u64) | 1,
        }
    }

    fn shard(&self, ip: &IpAddr) -> MutexGuard<'_, Shard> {
        let folded = match ip {
            IpAddr::V4(a) => u64::from(u32::from(*a)),
            IpAddr::V6(a) => {
                let v = u128::from(*a);
                (v as u64) ^ ((v >> 64) as u64)
            }
        };
        // The high half of the product depends on every bit of the address.
        let mixed = (folded ^ self.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let i = mixed as usize % self.shards.len();
        // A poisoned shard only means a panic elsewhere while holding it; the map itself is
        // still consistent (LruCache operations do not unwind half-way), so keep using it.
        match self.shards[i].lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The server `ip` used last, unless the entry is older than `tracking_ms` (0 = never
    /// expires). An expired entry is removed.
    pub fn lookup(&self, ip: IpAddr, now: u64, tracking_ms: u64) -> Option<usize> {
        let mut shard = self.shard(&ip);
        let entry = *shard.get(&ip)?;
        if tracking_ms != 0 && now.saturating_sub(entry.last_seen) > tracking_ms {
            shard.pop(&ip);
            return None;
        }
        Some(entry.server)
    }

    /// Records that `ip` was sent to `server` at `now`.
    pub fn record(&self, ip: IpAddr, server: usize, now: u64) {
        let mut shard = self.shard(&ip);
        // Known clients (every request after the first) are updated in place.
        if let Some(e) = shard.get_mut(&ip) {
            e.server = server;
            e.last_seen = now;
            e.connections += 1;
            return;
        }
        shard.put(
            ip,
            ClientEntry {
                server,
                last_seen: now,
                connections: 1,
            },
        );
    }

    /// Changes the capacity; when shrinking, the least recently used clients go first.
    pub fn resize(&self, capacity: usize) {
        let cap = per_shard(capacity, self.shards.len());
        for shard in self.shards.iter() {
            match shard.lock() {
                Ok(mut g) => g.resize(cap),
                Err(p) => p.into_inner().resize(cap),
            }
        }
    }

    /// Clients currently remembered.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map(|g| g.len()).unwrap_or(0))
            .sum()
    }

    /// Whether no client is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `limit` most recently used entries of each shard: a bounded copy for reports
    /// that show recent clients, holding each shard's lock for at most `limit` steps.
    pub fn most_recent(&self, limit: usize) -> Vec<(IpAddr, ClientEntry)> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            if let Ok(g) = shard.lock() {
                out.extend(g.iter().take(limit).map(|(ip, e)| (*ip, *e)));
            }
        }
        out
    }

    /// A copy of every entry, most recently used first within each shard (for `recent`).
    pub fn snapshot(&self) -> Vec<(IpAddr, ClientEntry)> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            if let Ok(g) = shard.lock() {
                out.extend(g.iter().map(|(ip, e)| (*ip, *e)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u32) -> IpAddr {
        IpAddr::V4(n.into())
    }

    #[test]
    fn remembers_the_last_server() {
        let t = ClientTable::new(8);
        t.record(ip(1), 3, 10);
        assert_eq!(t.lookup(ip(1), 20, 0), Some(3));
        assert_eq!(t.lookup(ip(2), 20, 0), None);
    }

    #[test]
    fn evicts_the_least_recently_used() {
        let t = ClientTable::new(2);
        t.record(ip(1), 0, 1);
        t.record(ip(2), 0, 2);
        assert_eq!(t.lookup(ip(1), 3, 0), Some(0)); // 1 is now more recent than 2
        t.record(ip(3), 0, 4);
        assert_eq!(t.lookup(ip(2), 5, 0), None);
        assert_eq!(t.lookup(ip(1), 5, 0), Some(0));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn recording_again_counts_and_refreshes_the_client() {
        let t = ClientTable::new(2);
        t.record(ip(1), 0, 1);
        t.record(ip(2), 0, 2);
        t.record(ip(1), 5, 3); // 1 moves to server 5 and is now more recent than 2
        t.record(ip(3), 0, 4);
        assert_eq!(t.lookup(ip(2), 5, 0), None);
        let recent = t.snapshot();
        let one = recent.iter().find(|(a, _)| *a == ip(1)).map(|(_, e)| *e);
        assert_eq!(
            one,
            Some(ClientEntry {
                server: 5,
                last_seen: 3,
                connections: 2
            })
        );
    }

    #[test]
    fn tracking_time_expires_entries() {
        let t = ClientTable::new(8);
        t.record(ip(1), 1, 1_000);
        assert_eq!(t.lookup(ip(1), 5_000, 10_000), Some(1));
        assert_eq!(t.lookup(ip(1), 20_000, 10_000), None);
        assert!(t.is_empty());
    }

    #[test]
    fn large_tables_hold_their_capacity() {
        let t = ClientTable::new(4096);
        for n in 0..4096 {
            t.record(ip(n), 0, 1);
        }
        assert!(t.len() >= 3800, "sharding lost too much: {}", t.len());
        let v6 = ClientTable::new(4096);
        for n in 0..4096u128 {
            v6.record(IpAddr::V6((0x2001_0db8_u128 << 96 | n).into()), 0, 1);
        }
        assert!(v6.len() >= 3800, "sharding lost too much: {}", v6.len());
        t.resize(100);
        assert!(t.len() <= 16 * 7);
    }
}
