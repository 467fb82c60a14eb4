//! Access control lists: ten numbered lists of permit/deny rules matched against a client.
//!
//! Semantics (Pen's): the first rule that matches decides. When no rule matches, the answer
//! is the opposite of the last rule's action, so a list of `deny` rules permits everybody
//! else and a list of `permit` rules denies everybody else. An empty list permits all.
//! IPv4 clients that arrive on a dual-stack IPv6 socket (`::ffff:a.b.c.d`) are matched as
//! IPv4, so one rule covers both kinds of listener.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Arc;

use crate::geoip::GeoIp;

/// Number of access lists (`acl 0` .. `acl 9`).
pub const ACL_LISTS: usize = 10;

/// The number of one access list, 0..=9.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct AclId(u8);

impl AclId {
    /// `Some` when `n` names one of the ten lists.
    pub fn new(n: u8) -> Option<AclId> {
        (usize::from(n) < ACL_LISTS).then_some(AclId(n))
    }

    /// Index into the table of lists.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl FromStr for AclId {
    type Err = ();

    fn from_str(s: &str) -> Result<AclId, ()> {
        if s.len() != 1 {
            return Err(());
        }
        s.parse::<u8>().ok().and_then(AclId::new).ok_or(())
    }
}

impl fmt::Display for AclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a matching rule decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AclAction {
    Permit,
    Deny,
}

/// What a rule matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AclMatch {
    /// `addr & mask == client & mask` (any mask, as Pen; not only prefixes).
    V4 { addr: Ipv4Addr, mask: Ipv4Addr },
    /// The first `prefix` bits are equal.
    V6 { addr: Ipv6Addr, prefix: u8 },
    /// A GeoIP country code (needs a GeoIP database; never matches without one).
    Country([u8; 2]),
}

/// One rule of a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AclRule {
    pub action: AclAction,
    pub matcher: AclMatch,
}

impl fmt::Display for AclRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let action = match self.action {
            AclAction::Permit => "permit",
            AclAction::Deny => "deny",
        };
        match self.matcher {
            AclMatch::V4 { addr, mask } => write!(f, "{action} {addr} {mask}"),
            AclMatch::V6 { addr, prefix } => write!(f, "{action} {addr}/{prefix}"),
            AclMatch::Country([a, b]) => {
                write!(f, "{action} country {}{}", char::from(a), char::from(b))
            }
        }
    }
}

impl AclMatch {
    fn matches(&self, client: IpAddr) -> bool {
        match (self, client) {
            (AclMatch::V4 { addr, mask }, IpAddr::V4(c)) => {
                let m = u32::from(*mask);
                u32::from(*addr) & m == u32::from(c) & m
            }
            (AclMatch::V6 { addr, prefix }, IpAddr::V6(c)) => {
                let bits = u32::from(*prefix).min(128);
                if bits == 0 {
                    return true;
                }
                let mask = u128::MAX << (128 - bits);
                u128::from(*addr) & mask == u128::from(c) & mask
            }
            _ => false,
        }
    }
}

/// A shared, open GeoIP database. Two are equal when they come from the same file.
#[derive(Clone)]
pub struct GeoRef(pub Arc<GeoIp>);

impl PartialEq for GeoRef {
    fn eq(&self, other: &GeoRef) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.path() == other.0.path()
    }
}

impl Eq for GeoRef {}

impl fmt::Debug for GeoRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GeoRef({})", self.0.path().display())
    }
}

/// One access list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acl {
    rules: Vec<AclRule>,
    /// The database country rules are matched with (set by `geoip_db`).
    geo: Option<GeoRef>,
}

impl Acl {
    /// Appends a rule at the end of the list.
    pub fn push(&mut self, rule: AclRule) {
        self.rules.push(rule);
    }

    /// Removes every rule.
    pub fn clear(&mut self) {
        self.rules.clear();
    }

    /// Sets the GeoIP database used by country rules.
    pub fn set_geo(&mut self, geo: Option<GeoRef>) {
        self.geo = geo;
    }

    /// The rules in order.
    pub fn rules(&self) -> &[AclRule] {
        &self.rules
    }

    /// The action of the first rule that matches `addr`, if one does (no default: an empty
    /// list matches nothing). Used where a list selects addresses, as `tarpit_acl` does.
    pub fn first_match(&self, addr: IpAddr) -> Option<AclAction> {
        let addr = addr.to_canonical();
        self.rules.iter().find_map(|rule| {
            let matched = match rule.matcher {
                AclMatch::Country(cc) => {
                    self.geo.as_ref().and_then(|g| g.0.country(addr)) == Some(cc)
                }
                ref m => m.matches(addr),
            };
            matched.then_some(rule.action)
        })
    }

    /// Whether `client` is permitted by this list.
    pub fn permits(&self, client: IpAddr) -> bool {
        let client = client.to_canonical();
        for rule in &self.rules {
            let matched = match rule.matcher {
                // A country the database does not know matches no country rule.
                AclMatch::Country(cc) => {
                    self.geo.as_ref().and_then(|g| g.0.country(client)) == Some(cc)
                }
                ref m => m.matches(client),
            };
            if matched {
                return rule.action == AclAction::Permit;
            }
        }
        match self.rules.last() {
            None => true,
            Some(last) => last.action == AclAction::Deny,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(s: &str) -> AclRule {
        match format!("acl 0 {s}").parse() {
            Ok(crate::command::Command::Acl { rule, .. }) => rule,
            other => panic!("bad test rule {s}: {other:?}"),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }

    #[test]
    fn empty_list_permits_everyone() {
        assert!(Acl::default().permits(ip("10.1.1.1")));
    }

    #[test]
    fn deny_list_permits_everyone_else() {
        let mut acl = Acl::default();
        acl.push(rule("deny 10.0.0.0 255.0.0.0"));
        assert!(!acl.permits(ip("10.9.8.7")));
        assert!(acl.permits(ip("192.168.1.1")));
    }

    #[test]
    fn permit_list_denies_everyone_else() {
        let mut acl = Acl::default();
        acl.push(rule("permit 127.0.0.1"));
        assert!(acl.permits(ip("127.0.0.1")));
        assert!(!acl.permits(ip("127.0.0.3")));
    }

    #[test]
    fn first_match_decides() {
        let mut acl = Acl::default();
        acl.push(rule("permit 10.1.0.0 255.255.0.0"));
        acl.push(rule("deny 10.0.0.0 255.0.0.0"));
        assert!(acl.permits(ip("10.1.2.3")));
        assert!(!acl.permits(ip("10.2.2.3")));
        // Last rule is deny, so unmatched addresses are permitted.
        assert!(acl.permits(ip("11.0.0.1")));
    }

    #[test]
    fn ipv6_prefixes_and_mapped_ipv4() {
        let mut acl = Acl::default();
        acl.push(rule("deny 2001:db8::/32"));
        assert!(!acl.permits(ip("2001:db8:1::5")));
        assert!(acl.permits(ip("2001:db9::5")));
        let mut v4 = Acl::default();
        v4.push(rule("deny 127.0.0.2"));
        assert!(!v4.permits(ip("::ffff:127.0.0.2")));
        let mut all = Acl::default();
        all.push(rule("deny ::/0"));
        assert!(!all.permits(ip("::1")));
    }
}
