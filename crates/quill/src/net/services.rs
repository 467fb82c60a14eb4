//! Service names (`smtp`, `http`) as ports, from /etc/services, as Pen's getservbyname.

use std::sync::OnceLock;

static SERVICES: OnceLock<Vec<(String, u16)>> = OnceLock::new();

fn load() -> Vec<(String, u16)> {
    let Ok(text) = std::fs::read_to_string("/etc/services") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let mut words = line.split_whitespace();
        let (Some(name), Some(port_proto)) = (words.next(), words.next()) else {
            continue;
        };
        let Some((port, "tcp")) = port_proto.split_once('/') else {
            continue;
        };
        let Ok(port) = port.parse::<u16>() else {
            continue;
        };
        out.push((name.to_string(), port));
        out.extend(words.map(|alias| (alias.to_string(), port)));
    }
    out
}

/// The TCP port of a service name, if /etc/services knows it.
pub fn lookup(name: &str) -> Option<u16> {
    SERVICES
        .get_or_init(load)
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, p)| *p)
        .filter(|p| *p != 0)
}
