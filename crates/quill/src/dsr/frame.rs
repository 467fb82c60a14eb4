//! Ethernet frames, sans I/O: parsing what the DSR plane needs (Ethernet, ARP, IPv4, the
//! TCP/UDP ports and TCP flags) and building the frames it sends (ARP requests and replies,
//! a tarpit SYN+ACK), with their checksums.
//!
//! Invariants: parsing never panics and never reads past the bytes it was given (every
//! length in a header is checked against the buffer); builders write into a buffer the
//! caller owns and return the length, so nothing is allocated per packet.

use std::net::Ipv4Addr;

/// A MAC address.
pub type Mac = [u8; 6];

/// The broadcast MAC address.
pub const BROADCAST: Mac = [0xff; 6];

/// Ethernet header length (no VLAN tag).
pub const ETH_LEN: usize = 14;
const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_ARP: u16 = 0x0806;
/// Length of an ARP packet for IPv4 over Ethernet.
const ARP_LEN: usize = 28;
/// Smallest Ethernet frame without its FCS; shorter frames are padded.
const MIN_FRAME: usize = 60;

/// IP protocol numbers the plane looks into.
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// TCP flags.
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// Why a frame could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame shorter than its headers")]
    Truncated,
    #[error("not an IPv4 header")]
    NotIpv4,
    #[error("ARP packet not for IPv4 over Ethernet")]
    ArpFormat,
}

/// An ARP packet for IPv4 over Ethernet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arp {
    /// 1 = request, 2 = reply.
    pub op: u16,
    pub sender_mac: Mac,
    pub sender_ip: Ipv4Addr,
    pub target_mac: Mac,
    pub target_ip: Ipv4Addr,
}

pub const ARP_REQUEST: u16 = 1;
pub const ARP_REPLY: u16 = 2;

/// The transport header of an IPv4 packet, as far as the plane needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4 {
    Tcp {
        src_port: u16,
        dst_port: u16,
        seq: u32,
        flags: u8,
    },
    Udp {
        src_port: u16,
        dst_port: u16,
    },
    /// A fragment other than the first: no transport header. `proto` is the IP protocol.
    Fragment {
        proto: u8,
    },
    /// Another protocol (ICMP, ...) or a transport header cut short.
    Other {
        proto: u8,
    },
}

/// An IPv4 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// More fragments follow, or this is not the first: the packet is part of a fragmented
    /// datagram (its transport ports, if any, are in the first fragment only).
    pub fragmented: bool,
    pub l4: L4,
}

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    Arp(Arp),
    Ipv4(Ipv4),
    /// Another ethertype (IPv6, VLAN-tagged, LLDP...).
    Other(u16),
}

/// A parsed Ethernet frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub dst: Mac,
    pub src: Mac,
    pub payload: Payload,
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(i)?, *b.get(i + 1)?]))
}

fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    let s = b.get(i..i + 4)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

fn mac_at(b: &[u8], i: usize) -> Option<Mac> {
    let s = b.get(i..i + 6)?;
    let mut m = [0u8; 6];
    m.copy_from_slice(s);
    Some(m)
}

fn ip_at(b: &[u8], i: usize) -> Option<Ipv4Addr> {
    u32_at(b, i).map(Ipv4Addr::from)
}

/// Parses an Ethernet frame (without FCS).
pub fn parse(frame: &[u8]) -> Result<Frame, FrameError> {
    let t = FrameError::Truncated;
    let dst = mac_at(frame, 0).ok_or(t)?;
    let src = mac_at(frame, 6).ok_or(t)?;
    let ethertype = u16_at(frame, 12).ok_or(t)?;
    let body = &frame[ETH_LEN..];
    let payload = match ethertype {
        ETHERTYPE_ARP => Payload::Arp(parse_arp(body)?),
        ETHERTYPE_IPV4 => Payload::Ipv4(parse_ipv4(body)?),
        other => Payload::Other(other),
    };
    Ok(Frame { dst, src, payload })
}

fn parse_arp(b: &[u8]) -> Result<Arp, FrameError> {
    let t = FrameError::Truncated;
    if b.len() < ARP_LEN {
        return Err(t);
    }
    // Hardware Ethernet (1), protocol IPv4, 6-byte and 4-byte addresses.
    if u16_at(b, 0) != Some(1) || u16_at(b, 2) != Some(ETHERTYPE_IPV4) || b[4] != 6 || b[5] != 4 {
        return Err(FrameError::ArpFormat);
    }
    Ok(Arp {
        op: u16_at(b, 6).ok_or(t)?,
        sender_mac: mac_at(b, 8).ok_or(t)?,
        sender_ip: ip_at(b, 14).ok_or(t)?,
        target_mac: mac_at(b, 18).ok_or(t)?,
        target_ip: ip_at(b, 24).ok_or(t)?,
    })
}

fn parse_ipv4(b: &[u8]) -> Result<Ipv4, FrameError> {
    let t = FrameError::Truncated;
    let first = *b.first().ok_or(t)?;
    if first >> 4 != 4 {
        return Err(FrameError::NotIpv4);
    }
    let ihl = usize::from(first & 0x0f) * 4;
    if ihl < 20 {
        return Err(FrameError::NotIpv4);
    }
    let total = usize::from(u16_at(b, 2).ok_or(t)?);
    // A frame may be longer than the packet (Ethernet padding); never shorter. GSO
    // super-frames (PACKET_VNET_HDR) may carry a total length of 0 or one segment's: take
    // the buffer as the packet then.
    let end = if total >= ihl && total <= b.len() {
        total
    } else {
        b.len()
    };
    if b.len() < ihl {
        return Err(t);
    }
    let frag = u16_at(b, 6).ok_or(t)?;
    let more_fragments = frag & 0x2000 != 0;
    let offset = frag & 0x1fff;
    let proto = b[9];
    let src = ip_at(b, 12).ok_or(t)?;
    let dst = ip_at(b, 16).ok_or(t)?;
    let l4b = &b[ihl..end];
    let l4 = if offset != 0 {
        L4::Fragment { proto }
    } else {
        match proto {
            PROTO_TCP if l4b.len() >= 20 => L4::Tcp {
                src_port: u16_at(l4b, 0).ok_or(t)?,
                dst_port: u16_at(l4b, 2).ok_or(t)?,
                seq: u32_at(l4b, 4).ok_or(t)?,
                flags: l4b[13],
            },
            PROTO_UDP if l4b.len() >= 8 => L4::Udp {
                src_port: u16_at(l4b, 0).ok_or(t)?,
                dst_port: u16_at(l4b, 2).ok_or(t)?,
            },
            proto => L4::Other { proto },
        }
    };
    Ok(Ipv4 {
        src,
        dst,
        fragmented: more_fragments || offset != 0,
        l4,
    })
}

/// Rewrites the MAC addresses of a frame in place (the DSR forwarding step). Frames shorter
/// than an Ethernet header are left alone and `false` is returned.
pub fn set_macs(frame: &mut [u8], dst: Mac, src: Mac) -> bool {
    match frame.get_mut(..12) {
        Some(h) => {
            h[..6].copy_from_slice(&dst);
            h[6..12].copy_from_slice(&src);
            true
        }
        None => false,
    }
}

fn put_eth(buf: &mut [u8], dst: Mac, src: Mac, ethertype: u16) {
    buf[..6].copy_from_slice(&dst);
    buf[6..12].copy_from_slice(&src);
    buf[12..14].copy_from_slice(&ethertype.to_be_bytes());
}

/// Writes an ARP frame (request or reply) into `buf`; returns its length (60, padded), or
/// `None` if `buf` is too small.
pub fn build_arp(buf: &mut [u8], eth_dst: Mac, our_mac: Mac, arp: &Arp) -> Option<usize> {
    let frame = buf.get_mut(..MIN_FRAME)?;
    frame.fill(0);
    put_eth(frame, eth_dst, our_mac, ETHERTYPE_ARP);
    let a = &mut frame[ETH_LEN..ETH_LEN + ARP_LEN];
    a[0..2].copy_from_slice(&1u16.to_be_bytes());
    a[2..4].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    a[4] = 6;
    a[5] = 4;
    a[6..8].copy_from_slice(&arp.op.to_be_bytes());
    a[8..14].copy_from_slice(&arp.sender_mac);
    a[14..18].copy_from_slice(&arp.sender_ip.octets());
    a[18..24].copy_from_slice(&arp.target_mac);
    a[24..28].copy_from_slice(&arp.target_ip.octets());
    Some(MIN_FRAME)
}

/// The Internet checksum (RFC 1071) of `data`, continuing from the partial sum `sum`.
pub fn checksum_add(mut sum: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum = sum.wrapping_add(u32::from(u16::from_be_bytes([c[0], c[1]])));
    }
    if let [last] = chunks.remainder() {
        sum = sum.wrapping_add(u32::from(*last) << 8);
    }
    sum
}

/// Folds a partial sum into the final one's-complement checksum.
pub fn checksum_fold(mut sum: u32) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The TCP/UDP pseudo-header sum.
fn pseudo_sum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: u16) -> u32 {
    let mut s = checksum_add(0, &src.octets());
    s = checksum_add(s, &dst.octets());
    s + u32::from(proto) + u32::from(len)
}

/// A TCP segment to build: addresses, ports, sequence numbers, flags, window.
#[derive(Debug, Clone, Copy)]
pub struct TcpSegment {
    pub eth_dst: Mac,
    pub eth_src: Mac,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub src_port: u16,
    pub dst_port: u16,
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    pub window: u16,
}

/// Writes an option-less, data-less TCP segment with valid IPv4 and TCP checksums into
/// `buf`; returns the frame length (60, padded), or `None` if `buf` is too small.
pub fn build_tcp(buf: &mut [u8], s: &TcpSegment) -> Option<usize> {
    let frame = buf.get_mut(..MIN_FRAME)?;
    frame.fill(0);
    put_eth(frame, s.eth_dst, s.eth_src, ETHERTYPE_IPV4);
    let ip = &mut frame[ETH_LEN..ETH_LEN + 40];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&40u16.to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64; // TTL
    ip[9] = PROTO_TCP;
    ip[12..16].copy_from_slice(&s.src.octets());
    ip[16..20].copy_from_slice(&s.dst.octets());
    let ip_sum = checksum_fold(checksum_add(0, &ip[..20]));
    ip[10..12].copy_from_slice(&ip_sum.to_be_bytes());
    let tcp = &mut ip[20..40];
    tcp[0..2].copy_from_slice(&s.src_port.to_be_bytes());
    tcp[2..4].copy_from_slice(&s.dst_port.to_be_bytes());
    tcp[4..8].copy_from_slice(&s.seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&s.ack.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = s.flags;
    tcp[14..16].copy_from_slice(&s.window.to_be_bytes());
    let sum = checksum_add(pseudo_sum(s.src, s.dst, PROTO_TCP, 20), tcp);
    tcp[16..18].copy_from_slice(&checksum_fold(sum).to_be_bytes());
    Some(MIN_FRAME)
}

/// Whether the IPv4 header checksum and the TCP/UDP checksum of `frame` are valid (a UDP
/// checksum of 0 means "none"). For tests and diagnostics.
pub fn checksums_valid(frame: &[u8]) -> bool {
    let Some(ip) = frame.get(ETH_LEN..) else {
        return false;
    };
    let Some(&first) = ip.first() else {
        return false;
    };
    let ihl = usize::from(first & 0x0f) * 4;
    let Some(total) = u16_at(ip, 2).map(usize::from) else {
        return false;
    };
    if ihl < 20 || total < ihl || total > ip.len() {
        return false;
    }
    if checksum_fold(checksum_add(0, &ip[..ihl])) != 0 {
        return false;
    }
    let (Some(src), Some(dst)) = (ip_at(ip, 12), ip_at(ip, 16)) else {
        return false;
    };
    let proto = ip[9];
    let l4 = &ip[ihl..total];
    if proto == PROTO_UDP && u16_at(l4, 6) == Some(0) {
        return true;
    }
    let Ok(len) = u16::try_from(l4.len()) else {
        return false;
    };
    checksum_fold(checksum_add(pseudo_sum(src, dst, proto, len), l4)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Mac = [2, 0, 0, 0, 0, 1];
    const B: Mac = [2, 0, 0, 0, 0, 2];

    #[test]
    fn arp_round_trip() {
        let mut buf = [0u8; 64];
        let arp = Arp {
            op: ARP_REQUEST,
            sender_mac: A,
            sender_ip: Ipv4Addr::new(10, 0, 0, 2),
            target_mac: [0; 6],
            target_ip: Ipv4Addr::new(10, 0, 0, 11),
        };
        let n = build_arp(&mut buf, BROADCAST, A, &arp);
        assert_eq!(n, Some(60));
        let f = parse(&buf[..60]);
        assert_eq!(
            f,
            Ok(Frame {
                dst: BROADCAST,
                src: A,
                payload: Payload::Arp(arp)
            })
        );
        assert_eq!(build_arp(&mut buf[..59], BROADCAST, A, &arp), None);
    }

    #[test]
    fn tcp_segment_round_trip_with_valid_checksums() {
        let mut buf = [0u8; 64];
        let seg = TcpSegment {
            eth_dst: B,
            eth_src: A,
            src: Ipv4Addr::new(10, 77, 0, 201),
            dst: Ipv4Addr::new(10, 77, 0, 10),
            src_port: 80,
            dst_port: 40000,
            seq: 0xdead_beef,
            ack: 12346,
            flags: TCP_SYN | TCP_ACK,
            window: 1024,
        };
        let n = build_tcp(&mut buf, &seg).unwrap_or(0);
        assert_eq!(n, 60);
        assert!(checksums_valid(&buf[..n]));
        let f = parse(&buf[..n]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((f.dst, f.src), (B, A));
        assert_eq!(
            f.payload,
            Payload::Ipv4(Ipv4 {
                src: seg.src,
                dst: seg.dst,
                fragmented: false,
                l4: L4::Tcp {
                    src_port: 80,
                    dst_port: 40000,
                    seq: 0xdead_beef,
                    flags: TCP_SYN | TCP_ACK
                }
            })
        );
        // One flipped bit breaks the checksum.
        buf[ETH_LEN + 20 + 5] ^= 1;
        assert!(!checksums_valid(&buf[..n]));
    }

    #[test]
    fn known_ip_header_checksum() {
        // The classic example header (Wikipedia, "IPv4 header checksum"): sum is 0xb861.
        let h: [u8; 20] = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum_fold(checksum_add(0, &h)), 0xb861);
    }

    #[test]
    fn udp_and_fragments() {
        let mut f = [0u8; 14 + 28];
        f[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        let ip = &mut f[14..];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&28u16.to_be_bytes());
        ip[9] = PROTO_UDP;
        ip[20..22].copy_from_slice(&5353u16.to_be_bytes());
        ip[22..24].copy_from_slice(&53u16.to_be_bytes());
        let Ok(Frame {
            payload: Payload::Ipv4(p),
            ..
        }) = parse(&f)
        else {
            panic!("not parsed")
        };
        assert_eq!(
            p.l4,
            L4::Udp {
                src_port: 5353,
                dst_port: 53
            }
        );
        assert!(!p.fragmented);
        // A later fragment: no ports.
        f[14 + 6..14 + 8].copy_from_slice(&0x0010u16.to_be_bytes());
        let Ok(Frame {
            payload: Payload::Ipv4(p),
            ..
        }) = parse(&f)
        else {
            panic!("not parsed")
        };
        assert_eq!(p.l4, L4::Fragment { proto: PROTO_UDP });
        assert!(p.fragmented);
    }

    #[test]
    fn short_and_odd_frames_are_errors_not_panics() {
        for n in 0..60 {
            let mut f = vec![0u8; n];
            if n >= 14 {
                f[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
            }
            if n > 14 {
                f[14] = 0x4f; // IHL 60 bytes
            }
            let _ = parse(&f);
        }
        assert_eq!(parse(&[0u8; 13]), Err(FrameError::Truncated));
        let mut arp = [0u8; 42];
        arp[12..14].copy_from_slice(&ETHERTYPE_ARP.to_be_bytes());
        assert_eq!(parse(&arp), Err(FrameError::ArpFormat));
        let mut short = [0u8; 20];
        assert!(!set_macs(&mut short[..11], A, B));
        assert!(set_macs(&mut short, A, B));
        assert_eq!(&short[..12], &[A, B].concat()[..]);
    }
}
