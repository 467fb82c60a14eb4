//! The tarpit (`tarpit_acl N`): addresses nobody owns that answer every TCP SYN with a
//! SYN+ACK, so a port scan sees every port open, while a real request hangs.
//!
//! Invariants: no state is kept per connection or per address. The SYN+ACK's sequence
//! number is a keyed hash of the connection's addresses, ports and a coarse clock (like a
//! SYN cookie), so it cannot be predicted by the scanner and a retransmitted SYN gets the
//! same answer within one period. Anything else sent to a tarpitted address is dropped.

use std::hash::{BuildHasher, RandomState};
use std::net::Ipv4Addr;
use std::time::{SystemTime, UNIX_EPOCH};

use super::frame::{self, Mac, TcpSegment, TCP_ACK, TCP_SYN};

/// The advertised window: small, so that a client that does send data sends little.
pub const WINDOW: u16 = 1024;
/// Seconds during which the same SYN gets the same sequence number.
const COOKIE_PERIOD: u64 = 64;

/// Makes the SYN+ACKs of the tarpit.
#[derive(Debug, Clone, Default)]
pub struct Tarpit {
    /// A random key per process (SipHash, as std's hash maps).
    key: RandomState,
}

/// The fields of a SYN the answer needs.
#[derive(Debug, Clone, Copy)]
pub struct Syn {
    pub client_mac: Mac,
    pub client: Ipv4Addr,
    pub client_port: u16,
    pub addr: Ipv4Addr,
    pub port: u16,
    pub seq: u32,
}

impl Tarpit {
    /// The sequence number for a connection at `unix_secs`.
    pub fn isn(&self, syn: &Syn, unix_secs: u64) -> u32 {
        let h = self.key.hash_one((
            u32::from(syn.client),
            syn.client_port,
            u32::from(syn.addr),
            syn.port,
            unix_secs / COOKIE_PERIOD,
        ));
        (h >> 32) as u32 ^ h as u32
    }

    /// Writes the SYN+ACK answering `syn` into `buf`; returns the frame length.
    pub fn syn_ack(&self, buf: &mut [u8], our_mac: Mac, syn: &Syn) -> Option<usize> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        frame::build_tcp(
            buf,
            &TcpSegment {
                eth_dst: syn.client_mac,
                eth_src: our_mac,
                src: syn.addr,
                dst: syn.client,
                src_port: syn.port,
                dst_port: syn.client_port,
                seq: self.isn(syn, now),
                ack: syn.seq.wrapping_add(1),
                flags: TCP_SYN | TCP_ACK,
                window: WINDOW,
            },
        )
    }
}

/// Whether TCP `flags` are those of a connection's first segment (SYN without ACK/RST).
pub fn is_syn(flags: u8) -> bool {
    flags & (TCP_SYN | TCP_ACK | frame::TCP_RST) == TCP_SYN
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dsr::frame::{parse, Payload, L4};

    fn syn() -> Syn {
        Syn {
            client_mac: [2, 0, 0, 0, 0, 10],
            client: Ipv4Addr::new(10, 77, 0, 10),
            client_port: 40000,
            addr: Ipv4Addr::new(10, 77, 0, 201),
            port: 22,
            seq: u32::MAX,
        }
    }

    #[test]
    fn answer_is_a_valid_syn_ack() {
        let t = Tarpit::default();
        let mut buf = [0u8; 64];
        let n = t.syn_ack(&mut buf, [2, 0, 0, 0, 0, 2], &syn()).unwrap_or(0);
        assert!(frame::checksums_valid(&buf[..n]));
        let Ok(f) = parse(&buf[..n]) else {
            panic!("unparsable")
        };
        assert_eq!(f.dst, syn().client_mac);
        let Payload::Ipv4(ip) = f.payload else {
            panic!("not IPv4")
        };
        assert_eq!((ip.src, ip.dst), (syn().addr, syn().client));
        let L4::Tcp {
            src_port,
            dst_port,
            flags,
            ..
        } = ip.l4
        else {
            panic!("not TCP")
        };
        assert_eq!((src_port, dst_port, flags), (22, 40000, TCP_SYN | TCP_ACK));
        // ack = seq + 1, wrapping.
        assert_eq!(&buf[14 + 20 + 8..14 + 20 + 12], &0u32.to_be_bytes());
    }

    #[test]
    fn isn_is_stable_within_a_period_and_differs_per_connection() {
        let t = Tarpit::default();
        let s = syn();
        assert_eq!(t.isn(&s, 6400), t.isn(&s, 6463));
        let other = Syn {
            client_port: 40002,
            ..s
        };
        assert_ne!(t.isn(&s, 6400), t.isn(&other, 6400));
        assert_ne!(
            Tarpit::default().isn(&s, 6400),
            t.isn(&s, 6400),
            "keyed per process"
        );
    }

    #[test]
    fn only_a_bare_syn_is_answered() {
        assert!(is_syn(TCP_SYN));
        assert!(!is_syn(TCP_SYN | TCP_ACK));
        assert!(!is_syn(TCP_ACK));
        assert!(!is_syn(TCP_SYN | frame::TCP_RST));
    }
}
