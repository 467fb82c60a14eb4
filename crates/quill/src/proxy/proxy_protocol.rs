//! The PROXY protocol (HAProxy's specification, versions 1 and 2): the header quill sends
//! first on a backend connection (`proxy_protocol`) and the one it reads from clients
//! behind another balancer (`accept_proxy`).
//!
//! Sans-IO: [`parse`] looks at the bytes received so far and says "need more", "here is a
//! header of N bytes" or "not a valid header"; [`encode`] builds a header. The parser never
//! reads past [`MAX_HEADER`] bytes and never panics on any input.

use std::future::poll_fn;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::relay::Stream;
use crate::command::ProxyVersion;

/// The version 2 signature.
const SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// Longest version 1 line, CRLF included (the specification's limit).
const V1_MAX: usize = 107;
/// Largest version 2 header accepted (the addresses plus TLVs quill ignores).
pub const MAX_HEADER: usize = 4096;

/// What a received header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The original client (source) and the address it connected to (destination).
    /// `None` for `LOCAL` (v2), `UNKNOWN` (v1) and address families other than TCP over
    /// IPv4/IPv6: the connection's own addresses apply.
    pub addrs: Option<(SocketAddr, SocketAddr)>,
}

/// Why a header was refused; the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    #[error("not a PROXY protocol header")]
    Signature,
    #[error("malformed PROXY protocol v1 header: {0}")]
    V1(&'static str),
    #[error("malformed PROXY protocol v2 header: {0}")]
    V2(&'static str),
    #[error("PROXY protocol header larger than {MAX_HEADER} bytes")]
    TooLarge,
}

/// Why `accept_proxy` gave up on a client.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error(transparent)]
    Header(#[from] ProxyError),
    #[error("connection closed before a complete PROXY protocol header")]
    Closed,
    #[error("reading the PROXY protocol header: {0}")]
    Io(#[from] io::Error),
}

/// Reads exactly one header from `sock` (peeking until it is complete, then consuming only
/// its bytes, so the proxied stream starts untouched). The caller bounds the time.
pub async fn read_header<S: Stream + ?Sized>(sock: &S) -> Result<Header, AcceptError> {
    let mut buf = vec![0u8; MAX_HEADER];
    loop {
        poll_fn(|cx| sock.poll_read_ready(cx)).await?;
        let peeked = match sock.try_peek(&mut buf, &mut |b| matches!(parse(b), Ok(None))) {
            Ok(0) => return Err(AcceptError::Closed),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        };
        let Some((header, len)) = parse(&buf[..peeked])? else {
            if peeked == buf.len() {
                return Err(ProxyError::TooLarge.into());
            }
            continue;
        };
        // The bytes are in the receive queue already: these reads do not block.
        let mut done = 0;
        while done < len {
            match sock.read_now(&mut buf[done..len]) {
                Ok(0) => return Err(AcceptError::Closed),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(header);
    }
}

/// Parses a header at the start of `buf`: `Ok(None)` while it is incomplete, else the
/// header and its length in bytes (what follows belongs to the proxied stream).
pub fn parse(buf: &[u8]) -> Result<Option<(Header, usize)>, ProxyError> {
    let n = buf.len().min(SIGNATURE.len());
    if buf[..n] == SIGNATURE[..n] {
        return if n < SIGNATURE.len() {
            Ok(None)
        } else {
            parse_v2(buf)
        };
    }
    let n = buf.len().min(6);
    if buf[..n] == b"PROXY "[..n] {
        return if n < 6 { Ok(None) } else { parse_v1(buf) };
    }
    Err(ProxyError::Signature)
}

fn parse_v1(buf: &[u8]) -> Result<Option<(Header, usize)>, ProxyError> {
    let window = &buf[..buf.len().min(V1_MAX)];
    let Some(cr) = window.iter().position(|&b| b == b'\r') else {
        if window.len() >= V1_MAX {
            return Err(ProxyError::V1("no CRLF within 107 bytes"));
        }
        if window.contains(&b'\n') {
            return Err(ProxyError::V1("line ends without CR"));
        }
        return Ok(None);
    };
    // An LF before the CR fails the line whether or not the CR has arrived yet, so that a
    // header and every prefix of it get the same verdict.
    if window[..cr].contains(&b'\n') {
        return Err(ProxyError::V1("line ends without CR"));
    }
    match buf.get(cr + 1) {
        None => return Ok(None),
        Some(b'\n') => {}
        Some(_) => return Err(ProxyError::V1("CR without LF")),
    }
    let line = std::str::from_utf8(&buf[6..cr]).map_err(|_| ProxyError::V1("not ASCII"))?;
    let len = cr + 2;
    let mut fields = line.split(' ');
    let family = fields.next().unwrap_or_default();
    if family == "UNKNOWN" {
        // The rest of the line is to be ignored.
        return Ok(Some((Header { addrs: None }, len)));
    }
    let v6 = match family {
        "TCP4" => false,
        "TCP6" => true,
        _ => return Err(ProxyError::V1("unknown protocol")),
    };
    let ip = |s: Option<&str>| -> Result<IpAddr, ProxyError> {
        let s = s.ok_or(ProxyError::V1("missing address"))?;
        let ip = if v6 {
            s.parse::<Ipv6Addr>().map(IpAddr::V6)
        } else {
            s.parse::<Ipv4Addr>().map(IpAddr::V4)
        };
        ip.map_err(|_| ProxyError::V1("bad address"))
    };
    let port = |s: Option<&str>| -> Result<u16, ProxyError> {
        let s = s.ok_or(ProxyError::V1("missing port"))?;
        let leading_zero = s.len() > 1 && s.starts_with('0');
        if s.is_empty() || leading_zero || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ProxyError::V1("bad port"));
        }
        s.parse().map_err(|_| ProxyError::V1("bad port"))
    };
    let (src, dst) = (ip(fields.next())?, ip(fields.next())?);
    let (sport, dport) = (port(fields.next())?, port(fields.next())?);
    if fields.next().is_some() {
        return Err(ProxyError::V1("extra fields"));
    }
    Ok(Some((
        Header {
            addrs: Some((SocketAddr::new(src, sport), SocketAddr::new(dst, dport))),
        },
        len,
    )))
}

fn parse_v2(buf: &[u8]) -> Result<Option<(Header, usize)>, ProxyError> {
    let Some(fixed) = buf.get(..16) else {
        return Ok(None);
    };
    let (ver_cmd, fam, len) = (
        fixed[12],
        fixed[13],
        u16::from_be_bytes([fixed[14], fixed[15]]),
    );
    if ver_cmd >> 4 != 2 {
        return Err(ProxyError::V2("version is not 2"));
    }
    let local = match ver_cmd & 0x0f {
        0 => true,
        1 => false,
        _ => return Err(ProxyError::V2("unknown command")),
    };
    let total = 16 + usize::from(len);
    if total > MAX_HEADER {
        return Err(ProxyError::TooLarge);
    }
    let Some(body) = buf.get(16..total) else {
        return Ok(None);
    };
    if local {
        // Health checks from the proxy itself: the connection's own addresses apply.
        return Ok(Some((Header { addrs: None }, total)));
    }
    let stream = fam & 0x0f == 1;
    let addrs = match fam >> 4 {
        1 => {
            let a = body
                .get(..12)
                .ok_or(ProxyError::V2("address block too short"))?;
            let ip = |o: usize| IpAddr::V4(Ipv4Addr::new(a[o], a[o + 1], a[o + 2], a[o + 3]));
            let port = |o: usize| u16::from_be_bytes([a[o], a[o + 1]]);
            Some((
                SocketAddr::new(ip(0), port(8)),
                SocketAddr::new(ip(4), port(10)),
            ))
        }
        2 => {
            let a = body
                .get(..36)
                .ok_or(ProxyError::V2("address block too short"))?;
            let ip = |o: usize| {
                let mut b = [0u8; 16];
                b.copy_from_slice(&a[o..o + 16]);
                IpAddr::V6(Ipv6Addr::from(b))
            };
            let port = |o: usize| u16::from_be_bytes([a[o], a[o + 1]]);
            Some((
                SocketAddr::new(ip(0), port(32)),
                SocketAddr::new(ip(16), port(34)),
            ))
        }
        0 | 3 => None,
        _ => return Err(ProxyError::V2("unknown address family")),
    };
    // Only a TCP connection's addresses describe a client of this TCP balancer.
    let addrs = addrs.filter(|_| stream);
    Ok(Some((Header { addrs }, total)))
}

/// Builds the header announcing a connection from `source` to `destination`; `None` (a
/// Unix-socket client) gives `UNKNOWN` (v1) / `LOCAL` (v2). When one side is IPv4 and the
/// other IPv6, both are sent as IPv6 (IPv4-mapped).
pub fn encode(version: ProxyVersion, addrs: Option<(SocketAddr, SocketAddr)>) -> Vec<u8> {
    let addrs = addrs.map(|(s, d)| same_family(s, d));
    match version {
        ProxyVersion::V1 => match addrs {
            Some((SocketAddr::V4(s), SocketAddr::V4(d))) => format!(
                "PROXY TCP4 {} {} {} {}\r\n",
                s.ip(),
                d.ip(),
                s.port(),
                d.port()
            )
            .into_bytes(),
            Some((s, d)) => format!(
                "PROXY TCP6 {} {} {} {}\r\n",
                s.ip(),
                d.ip(),
                s.port(),
                d.port()
            )
            .into_bytes(),
            None => b"PROXY UNKNOWN\r\n".to_vec(),
        },
        ProxyVersion::V2 => {
            let mut out = Vec::with_capacity(52);
            out.extend_from_slice(SIGNATURE);
            match addrs {
                Some((SocketAddr::V4(s), SocketAddr::V4(d))) => {
                    out.extend_from_slice(&[0x21, 0x11, 0, 12]);
                    out.extend_from_slice(&s.ip().octets());
                    out.extend_from_slice(&d.ip().octets());
                    out.extend_from_slice(&s.port().to_be_bytes());
                    out.extend_from_slice(&d.port().to_be_bytes());
                }
                Some((s, d)) => {
                    out.extend_from_slice(&[0x21, 0x21, 0, 36]);
                    out.extend_from_slice(&v6(s.ip()).octets());
                    out.extend_from_slice(&v6(d.ip()).octets());
                    out.extend_from_slice(&s.port().to_be_bytes());
                    out.extend_from_slice(&d.port().to_be_bytes());
                }
                None => out.extend_from_slice(&[0x20, 0x00, 0, 0]),
            }
            out
        }
    }
}

/// Both addresses in one family: IPv4 when both are (or map to) IPv4, else IPv6.
fn same_family(s: SocketAddr, d: SocketAddr) -> (SocketAddr, SocketAddr) {
    let (si, di) = (s.ip().to_canonical(), d.ip().to_canonical());
    match (si, di) {
        (IpAddr::V4(_), IpAddr::V4(_)) => {
            (SocketAddr::new(si, s.port()), SocketAddr::new(di, d.port()))
        }
        _ => (
            SocketAddr::new(IpAddr::V6(v6(si)), s.port()),
            SocketAddr::new(IpAddr::V6(v6(di)), d.port()),
        ),
    }
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn v1_round_trip_and_prefixes() {
        let addrs = Some((sa("127.0.0.9:5555"), sa("10.0.0.1:80")));
        let h = encode(ProxyVersion::V1, addrs);
        assert_eq!(h, b"PROXY TCP4 127.0.0.9 10.0.0.1 5555 80\r\n");
        for cut in 0..h.len() {
            assert_eq!(parse(&h[..cut]), Ok(None), "prefix of {cut} bytes");
        }
        let mut more = h.clone();
        more.extend_from_slice(b"GET / HTTP/1.1\r\n");
        assert_eq!(parse(&more), Ok(Some((Header { addrs }, h.len()))));
        let h6 = encode(
            ProxyVersion::V1,
            Some((sa("[2001:db8::1]:1"), sa("[::1]:2"))),
        );
        assert_eq!(h6, b"PROXY TCP6 2001:db8::1 ::1 1 2\r\n");
        assert_eq!(
            parse(b"PROXY UNKNOWN whatever\r\n"),
            Ok(Some((Header { addrs: None }, 24)))
        );
        assert_eq!(encode(ProxyVersion::V1, None), b"PROXY UNKNOWN\r\n");
    }

    #[test]
    fn v1_refuses_malformed() {
        for bad in [
            &b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\n"[..],
            b"PROXY TCP4 1.2.3.4 ::1 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 65536\r\n",
            b"PROXY TCP5 1.2.3.4 5.6.7.8 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\rX",
            b"PROXY  TCP4 1.2.3.4 5.6.7.8 1 2\r\n",
            b"GET / HTTP/1.1\r\n",
            &[b'P'; 2],
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let long = [b"PROXY UNKNOWN ".as_slice(), &[b'x'; 200]].concat();
        assert_eq!(
            parse(&long),
            Err(ProxyError::V1("no CRLF within 107 bytes"))
        );
    }

    #[test]
    fn v2_round_trip_and_prefixes() {
        for addrs in [
            Some((sa("127.0.0.9:5555"), sa("10.0.0.1:80"))),
            Some((sa("[2001:db8::9]:5555"), sa("[::1]:443"))),
            None,
        ] {
            let h = encode(ProxyVersion::V2, addrs);
            for cut in 0..h.len() {
                assert_eq!(parse(&h[..cut]), Ok(None), "prefix of {cut} bytes");
            }
            assert_eq!(parse(&h), Ok(Some((Header { addrs }, h.len()))));
        }
        // Mixed families become IPv6.
        let h = encode(ProxyVersion::V2, Some((sa("127.0.0.9:1"), sa("[::1]:2"))));
        let (hdr, _) = parse(&h).unwrap().unwrap();
        assert_eq!(hdr.addrs, Some((sa("[::ffff:127.0.0.9]:1"), sa("[::1]:2"))));
    }

    #[test]
    fn v2_tlvs_are_skipped_and_limits_hold() {
        let mut h = encode(ProxyVersion::V2, Some((sa("1.2.3.4:1"), sa("5.6.7.8:2"))));
        h[15] += 5;
        h.extend_from_slice(&[0x04, 0, 2, b'o', b'k']);
        h.extend_from_slice(b"payload");
        let (hdr, len) = parse(&h).unwrap().unwrap();
        assert_eq!(len, 16 + 12 + 5);
        assert!(hdr.addrs.is_some());
        let mut big = SIGNATURE.to_vec();
        big.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        assert_eq!(parse(&big), Err(ProxyError::TooLarge));
        let mut v3 = SIGNATURE.to_vec();
        v3.extend_from_slice(&[0x31, 0x11, 0, 12]);
        assert!(parse(&v3).is_err());
        let mut short = SIGNATURE.to_vec();
        short.extend_from_slice(&[0x21, 0x11, 0, 4, 1, 2, 3, 4]);
        assert!(parse(&short).is_err());
        // A UDP (DGRAM) source is not a client of a TCP balancer.
        let mut udp = encode(ProxyVersion::V2, Some((sa("1.2.3.4:1"), sa("5.6.7.8:2"))));
        udp[13] = 0x12;
        assert_eq!(parse(&udp).unwrap().unwrap().0.addrs, None);
    }

    #[test]
    fn a_pair_of_ipv4_mapped_addresses_is_announced_as_ipv4() {
        // Found by the fuzzer (a v2 TCP6 header naming ::ffff:a.b.c.d on both sides): quill
        // announces such a client as the IPv4 client it is, in both versions.
        let mapped = Some((sa("[::ffff:1.2.3.4]:5555"), sa("[::ffff:10.0.0.1]:80")));
        let v4 = Some((sa("1.2.3.4:5555"), sa("10.0.0.1:80")));
        assert_eq!(
            encode(ProxyVersion::V1, mapped),
            b"PROXY TCP4 1.2.3.4 10.0.0.1 5555 80\r\n"
        );
        let v2 = encode(ProxyVersion::V2, mapped);
        assert_eq!(parse(&v2), Ok(Some((Header { addrs: v4 }, v2.len()))));
        // One side genuinely IPv6: both stay IPv6.
        let mixed = Some((sa("[::ffff:1.2.3.4]:5555"), sa("[2001:db8::1]:80")));
        let v1 = encode(ProxyVersion::V1, mixed);
        assert_eq!(parse(&v1), Ok(Some((Header { addrs: mixed }, v1.len()))));
    }

    #[test]
    fn an_lf_inside_a_v1_line_fails_it_with_or_without_its_cr() {
        // Found by the fuzzer: the whole header was accepted, its prefixes refused.
        let input = b"PROXY UNKNOWN 20:88::1Y T15\x01!!!!!!\n\r\n";
        assert!(parse(input).is_err());
        for cut in 7..input.len() {
            assert!(
                !matches!(parse(&input[..cut]), Ok(Some(_))),
                "prefix of {cut}"
            );
        }
    }
}
