//! The PROXY protocol v1/v2 parser (`accept_proxy`): never panics; a header found lies within
//! the input and the size bound; every shorter prefix of it asks for more bytes; and the
//! addresses it names encode back (v1 and v2) to headers that parse to the same addresses,
//! except that a pair of IPv4-mapped IPv6 addresses is sent as the IPv4 pair it stands for
//! (what `encode` promises; found by the fuzzer, kept as a regression input).
#![no_main]

use std::net::{IpAddr, SocketAddr};

use libfuzzer_sys::fuzz_target;
use quill::command::ProxyVersion;
use quill::proxy::proxy_protocol::{encode, parse, MAX_HEADER};

/// The addresses as `encode` announces them: IPv4 when both are (or map to) IPv4.
fn announced(addrs: Option<(SocketAddr, SocketAddr)>) -> Option<(SocketAddr, SocketAddr)> {
    addrs.map(
        |(s, d)| match (s.ip().to_canonical(), d.ip().to_canonical()) {
            (si @ IpAddr::V4(_), di @ IpAddr::V4(_)) => {
                (SocketAddr::new(si, s.port()), SocketAddr::new(di, d.port()))
            }
            _ => (s, d),
        },
    )
}

fuzz_target!(|data: &[u8]| {
    let Ok(Some((header, len))) = parse(data) else {
        return;
    };
    assert!(len <= data.len() && len <= MAX_HEADER);
    for cut in 0..len {
        assert_eq!(parse(&data[..cut]), Ok(None), "prefix of {cut} bytes");
    }
    for version in [ProxyVersion::V1, ProxyVersion::V2] {
        let again = encode(version, header.addrs);
        let parsed = parse(&again).ok().flatten().map(|(h, n)| (h.addrs, n));
        assert_eq!(parsed, Some((announced(header.addrs), again.len())));
    }
});
