//! The backends' MAC addresses, resolved by quill itself with ARP (sans I/O: the caller
//! sends the requests this table asks for and feeds it the replies it sees).
//!
//! Invariants: a backend is *up* only while its last ARP reply is younger than
//! [`DOWN_AFTER`]; a backend that stops answering is down (skipped by the DSR plane) and
//! comes back with its next reply. Every backend is asked again every [`REFRESH`], so a
//! changed MAC address is learnt within one refresh. Only replies (or requests) whose
//! sender is a configured backend are learnt: nobody else can insert entries.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use super::frame::Mac;

/// How often each backend is asked for its MAC address.
pub const REFRESH: Duration = Duration::from_secs(1);
/// A backend silent for this long (three refreshes missed) is down.
pub const DOWN_AFTER: Duration = Duration::from_millis(3_500);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Neighbour {
    ip: Ipv4Addr,
    mac: Option<Mac>,
    last_heard: Option<Instant>,
    last_asked: Option<Instant>,
}

/// The neighbour entries of the configured backends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArpTable {
    entries: Vec<Neighbour>,
}

impl ArpTable {
    /// Makes the table hold exactly `ips` (in any order), keeping what is known about
    /// addresses that stay.
    pub fn set_targets(&mut self, ips: &[Ipv4Addr]) {
        self.entries.retain(|n| ips.contains(&n.ip));
        for ip in ips {
            if !self.entries.iter().any(|n| n.ip == *ip) {
                self.entries.push(Neighbour {
                    ip: *ip,
                    mac: None,
                    last_heard: None,
                    last_asked: None,
                });
            }
        }
    }

    /// Addresses to send an ARP request for at `now`; each is then marked as asked.
    pub fn due(&mut self, now: Instant, out: &mut Vec<Ipv4Addr>) {
        for n in &mut self.entries {
            if n.last_asked
                .map_or(true, |t| now.saturating_duration_since(t) >= REFRESH)
            {
                n.last_asked = Some(now);
                out.push(n.ip);
            }
        }
    }

    /// Learns `ip` is at `mac` (from an ARP packet it sent). Returns whether `ip` is one of
    /// the backends.
    pub fn heard(&mut self, ip: Ipv4Addr, mac: Mac, now: Instant) -> bool {
        match self.entries.iter_mut().find(|n| n.ip == ip) {
            Some(n) => {
                n.mac = Some(mac);
                n.last_heard = Some(now);
                true
            }
            None => false,
        }
    }

    /// The MAC address of `ip` when it is up at `now`.
    pub fn lookup(&self, ip: Ipv4Addr, now: Instant) -> Option<Mac> {
        let n = self.entries.iter().find(|n| n.ip == ip)?;
        let heard = n.last_heard?;
        (now.saturating_duration_since(heard) < DOWN_AFTER)
            .then_some(n.mac)
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IP1: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 11);
    const IP2: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 12);
    const MAC1: Mac = [2, 0, 0, 0, 0, 0x11];

    #[test]
    fn asks_every_refresh_and_goes_down_when_silent() {
        let t0 = Instant::now();
        let mut t = ArpTable::default();
        t.set_targets(&[IP1, IP2]);
        let mut due = Vec::new();
        t.due(t0, &mut due);
        assert_eq!(due, vec![IP1, IP2]);
        due.clear();
        t.due(t0 + Duration::from_millis(500), &mut due);
        assert!(due.is_empty(), "asked again before the refresh time");
        t.due(t0 + REFRESH, &mut due);
        assert_eq!(due.len(), 2);

        assert_eq!(t.lookup(IP1, t0), None, "unknown before a reply");
        assert!(t.heard(IP1, MAC1, t0));
        assert!(
            !t.heard(Ipv4Addr::new(10, 0, 0, 99), MAC1, t0),
            "not a backend"
        );
        assert_eq!(t.lookup(IP1, t0 + Duration::from_secs(1)), Some(MAC1));
        assert_eq!(
            t.lookup(IP1, t0 + DOWN_AFTER),
            None,
            "silent too long: down"
        );
        assert!(t.heard(IP1, MAC1, t0 + DOWN_AFTER));
        assert_eq!(t.lookup(IP1, t0 + DOWN_AFTER), Some(MAC1), "back up");
    }

    #[test]
    fn retargeting_keeps_known_entries() {
        let t0 = Instant::now();
        let mut t = ArpTable::default();
        t.set_targets(&[IP1, IP2]);
        t.heard(IP1, MAC1, t0);
        t.set_targets(&[IP1]);
        assert_eq!(t.lookup(IP1, t0), Some(MAC1));
        assert!(!t.heard(IP2, MAC1, t0));
    }
}
