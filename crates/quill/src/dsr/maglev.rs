//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a lookup table that maps a flow
//! hash to a backend, built so that when a backend joins or leaves, almost only the flows
//! of that backend move.
//!
//! Invariants: the table size [`TABLE_SIZE`] is prime, so every backend's `skip` (1..M-1)
//! is coprime with it and its preference list is a permutation of all slots; the table is
//! completely filled whenever there is at least one backend. A backend's preferences
//! depend only on its key (its address), never on its position or on the other backends,
//! so the same set of backends always gives the same table (in any process). The plane
//! always builds a fresh table for that reason: two nodes that saw different histories of
//! the same servers still agree on every flow; the flows a node already carries keep their
//! backend through its flow table ([`super::flows`]), not through the table's history.

/// Slots in the lookup table: prime, and at least 64 per backend for [`MAX_SERVERS`]
/// (the load of each backend is within a few per cent of an even share).
///
/// [`MAX_SERVERS`]: crate::command::MAX_SERVERS
pub const TABLE_SIZE: usize = 65_537;

/// A finished lookup table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Maglev {
    /// Slot -> position in `backends`; empty when there is no backend.
    table: Vec<u16>,
    /// The value given for each backend at build time (the server number).
    backends: Vec<usize>,
    /// The key of each backend, in the same order.
    keys: Vec<u64>,
}

/// A 64-bit mixing function (splitmix64's finaliser): every input bit affects every
/// output bit, so consecutive ports or addresses spread evenly (crc32 does not).
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Maglev {
    /// Builds the table for `backends`: `(value, key)` pairs, where `key` identifies the
    /// backend stably (e.g. its IPv4 address) and `value` is returned by [`Maglev::lookup`].
    /// Of backends with equal keys only one is used; at most `u16::MAX` backends are used.
    pub fn build(backends: &[(usize, u64)]) -> Maglev {
        // Filling takes turns in backend order: sort by key so that the table depends on
        // the set of backends only, not on the order they were given in.
        let mut sorted = backends.to_vec();
        sorted.sort_by_key(|&(_, key)| key);
        sorted.dedup_by_key(|b| b.1);
        sorted.truncate(usize::from(u16::MAX));
        let backends = &sorted[..];
        let n = backends.len();
        let m = TABLE_SIZE as u64;
        if n == 0 {
            return Maglev {
                table: Vec::new(),
                backends: Vec::new(),
                keys: Vec::new(),
            };
        }
        let perm: Vec<(u64, u64)> = backends
            .iter()
            .map(|&(_, key)| {
                let offset = mix64(key ^ 0x6f66_6673_6574) % m;
                let skip = mix64(key ^ 0x736b_6970) % (m - 1) + 1;
                (offset, skip)
            })
            .collect();
        let mut next = vec![0u64; n];
        let mut table = vec![u16::MAX; TABLE_SIZE];
        let mut filled = 0usize;
        'fill: loop {
            for (i, &(offset, skip)) in perm.iter().enumerate() {
                // Walk backend i's preference list to its next free slot. The list is a
                // permutation of all slots (M prime), so a free one is always found.
                loop {
                    let slot = ((offset + next[i] * skip) % m) as usize;
                    next[i] += 1;
                    if table[slot] == u16::MAX {
                        table[slot] = i as u16;
                        filled += 1;
                        break;
                    }
                }
                if filled == TABLE_SIZE {
                    break 'fill;
                }
            }
        }
        Maglev {
            table,
            backends: backends.iter().map(|&(v, _)| v).collect(),
            keys: backends.iter().map(|&(_, k)| k).collect(),
        }
    }

    /// The backend for a flow hash; `None` when there is no backend.
    pub fn lookup(&self, hash: u64) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        let slot = (hash % TABLE_SIZE as u64) as usize;
        let pos = usize::from(*self.table.get(slot)?);
        self.backends.get(pos).copied()
    }

    /// The backends in the table.
    pub fn backends(&self) -> &[usize] {
        &self.backends
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_prime(n: usize) -> bool {
        n >= 2 && (2..).take_while(|d| d * d <= n).all(|d| n % d != 0)
    }

    fn backends(keys: &[u64]) -> Vec<(usize, u64)> {
        keys.iter().map(|&k| (k as usize, k)).collect()
    }

    #[test]
    fn table_size_is_prime() {
        assert!(is_prime(TABLE_SIZE));
    }

    #[test]
    fn empty_table_has_no_backend() {
        assert_eq!(Maglev::build(&[]).lookup(42), None);
    }

    #[test]
    fn load_is_even() {
        let keys: Vec<u64> = (0..10).map(|i| 0x0a00_000b + i).collect();
        let t = Maglev::build(&backends(&keys));
        let mut counts = std::collections::HashMap::new();
        for slot in 0..TABLE_SIZE as u64 {
            *counts.entry(t.lookup(slot)).or_insert(0usize) += 1;
        }
        assert_eq!(counts.len(), 10);
        let share = TABLE_SIZE / 10;
        for (b, c) in counts {
            assert!(
                c.abs_diff(share) < share / 50,
                "backend {b:?} got {c} slots"
            );
        }
    }

    #[test]
    fn removing_a_backend_moves_almost_only_its_flows() {
        let keys: Vec<u64> = (0..10).map(|i| 0x0a00_000b + i).collect();
        let before = Maglev::build(&backends(&keys));
        let after = Maglev::build(&backends(&keys[1..]));
        let removed = keys[0] as usize;
        let mut moved_others = 0usize;
        for slot in 0..TABLE_SIZE as u64 {
            let (b, a) = (before.lookup(slot), after.lookup(slot));
            assert_ne!(a, Some(removed));
            if b != Some(removed) && a != b {
                moved_others += 1;
            }
        }
        // The paper's bound: a few per cent of the other backends' slots.
        assert!(
            moved_others < TABLE_SIZE / 20,
            "{moved_others} slots of other backends moved"
        );
        // Adding it back restores the exact table.
        assert_eq!(Maglev::build(&backends(&keys)), before);
    }

    #[test]
    fn two_backends_table_does_not_depend_on_order() {
        let a = Maglev::build(&[(0, 11), (1, 12)]);
        let b = Maglev::build(&[(1, 12), (0, 11)]);
        for slot in (0..TABLE_SIZE as u64).step_by(97) {
            assert_eq!(a.lookup(slot), b.lookup(slot));
        }
    }
}
