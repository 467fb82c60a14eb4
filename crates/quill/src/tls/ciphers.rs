//! OpenSSL cipher lists (`ssl_ciphers`) mapped onto the rustls suites quill can offer.
//!
//! The list is read the way OpenSSL reads it: `:`/`,`/space separated, names or class
//! keywords, `A+B` intersections, `!X` (remove for good), `-X` (remove), `+X` (move to the
//! end), `@STRENGTH`, `@SECLEVEL=N`. Invariant: a positive item that names something quill
//! cannot offer is an error, never silently skipped; excluding a class quill never offers
//! (`!aNULL`, `!RC4`, `!MD5`...) is accepted because it is already true.

use rustls::crypto::aws_lc_rs::cipher_suite as cs;
use rustls::SupportedCipherSuite;

use super::TlsError;

/// One suite with the OpenSSL name and the class keywords that select it.
struct Entry {
    openssl: &'static str,
    suite: SupportedCipherSuite,
    tls13: bool,
    /// Bits of the symmetric key, for `@STRENGTH`.
    bits: u16,
    classes: &'static [&'static str],
}

const COMMON12: &[&str] = &[
    "ALL", "DEFAULT", "HIGH", "FIPS", "ECDHE", "EECDH", "kECDHE", "kEECDH", "TLSv1.2", "AEAD",
];

/// The suites in rustls's default preference order (which is also quill's default).
fn table() -> [Entry; 9] {
    [
        Entry {
            openssl: "TLS_AES_256_GCM_SHA384",
            suite: cs::TLS13_AES_256_GCM_SHA384,
            tls13: true,
            bits: 256,
            classes: &[],
        },
        Entry {
            openssl: "TLS_AES_128_GCM_SHA256",
            suite: cs::TLS13_AES_128_GCM_SHA256,
            tls13: true,
            bits: 128,
            classes: &[],
        },
        Entry {
            openssl: "TLS_CHACHA20_POLY1305_SHA256",
            suite: cs::TLS13_CHACHA20_POLY1305_SHA256,
            tls13: true,
            bits: 256,
            classes: &[],
        },
        Entry {
            openssl: "ECDHE-ECDSA-AES256-GCM-SHA384",
            suite: cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            tls13: false,
            bits: 256,
            classes: &[
                "aECDSA",
                "ECDSA",
                "AESGCM",
                "AES",
                "AES256",
                "SHA384",
                "AESGCM256",
            ],
        },
        Entry {
            openssl: "ECDHE-ECDSA-AES128-GCM-SHA256",
            suite: cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            tls13: false,
            bits: 128,
            classes: &[
                "aECDSA",
                "ECDSA",
                "AESGCM",
                "AES",
                "AES128",
                "SHA256",
                "AESGCM128",
            ],
        },
        Entry {
            openssl: "ECDHE-ECDSA-CHACHA20-POLY1305",
            suite: cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            tls13: false,
            bits: 256,
            classes: &["aECDSA", "ECDSA", "CHACHA20", "SHA256"],
        },
        Entry {
            openssl: "ECDHE-RSA-AES256-GCM-SHA384",
            suite: cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            tls13: false,
            bits: 256,
            classes: &["aRSA", "AESGCM", "AES", "AES256", "SHA384", "AESGCM256"],
        },
        Entry {
            openssl: "ECDHE-RSA-AES128-GCM-SHA256",
            suite: cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            tls13: false,
            bits: 128,
            classes: &["aRSA", "AESGCM", "AES", "AES128", "SHA256", "AESGCM128"],
        },
        Entry {
            openssl: "ECDHE-RSA-CHACHA20-POLY1305",
            suite: cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
            tls13: false,
            bits: 256,
            classes: &["aRSA", "CHACHA20", "SHA256"],
        },
    ]
}

/// Classes of suites that quill never offers: excluding them is a no-op.
const NEVER_OFFERED: &[&str] = &[
    "aNULL",
    "eNULL",
    "NULL",
    "COMPLEMENTOFALL",
    "EXPORT",
    "EXP",
    "LOW",
    "MEDIUM",
    "RC4",
    "MD5",
    "DES",
    "3DES",
    "IDEA",
    "SEED",
    "CAMELLIA",
    "ARIA",
    "PSK",
    "SRP",
    "DSS",
    "aDSS",
    "DH",
    "DHE",
    "EDH",
    "kDHE",
    "kEDH",
    "ADH",
    "AECDH",
    "aECDH",
    "kECDH",
    "ECDH",
    "kRSA",
    "RSA",
    "SHA1",
    "SHA",
    "CBC",
    "AESCCM",
    "AESCCM8",
    "CCM",
    "CCM8",
    "kPSK",
    "aPSK",
    "kSRP",
    "SSLv3",
    "TLSv1",
    "TLSv1.0",
    "GOST",
    "kGOST",
    "aGOST",
    "ECDHEPSK",
    "DHEPSK",
    "RSAPSK",
    "SUITEB128",
    "SUITEB128ONLY",
    "SUITEB192",
    "COMPLEMENTOFDEFAULT",
    "RC2",
    "aSRP",
    "kDH",
    "kDHr",
    "kDHd",
    "AES128CCM",
    "AES256CCM",
];

/// What an `ssl_ciphers` list selects, in preference order.
#[derive(Debug, Clone)]
pub struct Selection {
    /// TLS 1.2 suites (`None`: the list names no TLS 1.2 suite at all).
    pub tls12: Vec<SupportedCipherSuite>,
    /// TLS 1.3 suites; `None` when the list names none, which leaves TLS 1.3 at its
    /// defaults (OpenSSL's cipher list does not govern TLS 1.3 either).
    pub tls13: Option<Vec<SupportedCipherSuite>>,
}

/// The names quill accepts, for error messages.
fn supported_names() -> String {
    table()
        .iter()
        .map(|e| e.openssl)
        .collect::<Vec<_>>()
        .join(", ")
}

fn unsupported(list: &str, item: &str) -> TlsError {
    TlsError::Cipher {
        list: list.to_string(),
        item: item.to_string(),
        supported: supported_names(),
    }
}

/// Indices of the table entries one item (`A` or `A+B+...`) selects; `None` when a part
/// is a class quill never offers; an error when a part is unknown.
fn matching(list: &str, item: &str, table: &[Entry]) -> Result<Option<Vec<usize>>, TlsError> {
    let mut selected: Vec<usize> = (0..table.len()).collect();
    for part in item.split('+') {
        let iana = table
            .iter()
            .position(|e| e.suite.suite().as_str() == Some(part));
        let exact = table.iter().position(|e| e.openssl == part).or(iana);
        if let Some(i) = exact {
            selected.retain(|&j| j == i);
            continue;
        }
        if table.iter().any(|e| e.classes.contains(&part)) || COMMON12.contains(&part) {
            selected.retain(|&j| {
                let e = &table[j];
                !e.tls13 && (e.classes.contains(&part) || COMMON12.contains(&part))
            });
            continue;
        }
        if NEVER_OFFERED.contains(&part) {
            return Ok(None);
        }
        return Err(unsupported(list, item));
    }
    Ok(Some(selected))
}

/// Parses an OpenSSL cipher list.
pub fn parse(list: &str) -> Result<Selection, TlsError> {
    let table = table();
    let mut order: Vec<usize> = Vec::new();
    let mut banned: Vec<usize> = Vec::new();
    for item in list.split([':', ',', ' ']).filter(|i| !i.is_empty()) {
        if item == "@STRENGTH" {
            order.sort_by_key(|&i| std::cmp::Reverse(table[i].bits));
            continue;
        }
        if item.starts_with("@SECLEVEL=") {
            // Every suite quill offers meets the highest security level.
            continue;
        }
        let (op, name) = match item.as_bytes()[0] {
            b'!' | b'-' | b'+' => (item.as_bytes()[0], &item[1..]),
            _ => (b' ', item),
        };
        if name.is_empty() {
            return Err(unsupported(list, item));
        }
        let found = matching(list, name, &table)?;
        match (op, found) {
            // Excluding or moving something never offered changes nothing.
            (b'!' | b'-' | b'+', None) => {}
            (_, None) => return Err(unsupported(list, item)),
            (b'!', Some(idx)) => {
                order.retain(|i| !idx.contains(i));
                banned.extend(idx);
            }
            (b'-', Some(idx)) => order.retain(|i| !idx.contains(i)),
            (b'+', Some(idx)) => {
                let (moved, kept): (Vec<usize>, Vec<usize>) =
                    order.iter().partition(|i| idx.contains(i));
                order = kept;
                order.extend(moved);
            }
            (_, Some(idx)) => {
                if idx.is_empty() {
                    return Err(unsupported(list, item));
                }
                for i in idx {
                    if !order.contains(&i) && !banned.contains(&i) {
                        order.push(i);
                    }
                }
            }
        }
    }
    let tls12: Vec<_> = order
        .iter()
        .filter(|&&i| !table[i].tls13)
        .map(|&i| table[i].suite)
        .collect();
    let tls13: Vec<_> = order
        .iter()
        .filter(|&&i| table[i].tls13)
        .map(|&i| table[i].suite)
        .collect();
    let names_tls13 = list.split([':', ',', ' ']).any(|i| {
        table
            .iter()
            .any(|e| e.tls13 && i.trim_start_matches(['!', '-', '+']) == e.openssl)
    });
    Ok(Selection {
        tls12,
        tls13: names_tls13.then_some(tls13),
    })
}

/// The suites of the defaults, TLS 1.3 first, in preference order.
pub fn defaults() -> Vec<SupportedCipherSuite> {
    table().iter().map(|e| e.suite).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[SupportedCipherSuite]) -> Vec<String> {
        v.iter()
            .map(|s| format!("{:?}", s.suite()))
            .collect::<Vec<_>>()
    }

    #[test]
    fn explicit_names_keep_their_order() {
        let s = parse("ECDHE-RSA-CHACHA20-POLY1305:ECDHE-ECDSA-AES128-GCM-SHA256")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            names(&s.tls12),
            [
                "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"
            ]
        );
        assert!(s.tls13.is_none(), "TLS 1.3 stays at its defaults");
    }

    #[test]
    fn classes_exclusions_and_strength() {
        let s = parse("HIGH:!aNULL:!MD5:!RC4:-aRSA").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.tls12.len(), 3, "{:?}", names(&s.tls12));
        let s = parse("ECDHE+AESGCM:@STRENGTH").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.tls12.len(), 4);
        assert!(names(&s.tls12)[0].contains("256"));
        let s = parse("!aRSA:ALL").unwrap_or_else(|e| panic!("{e}"));
        assert!(names(&s.tls12).iter().all(|n| n.contains("ECDSA")));
        let s = parse("TLS_CHACHA20_POLY1305_SHA256:ECDHE-ECDSA-AES256-GCM-SHA384")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.tls13.map(|v| v.len()), Some(1));
    }

    #[test]
    fn what_cannot_be_honoured_is_an_error_naming_it() {
        for list in [
            "AES128-SHA",
            "ECDHE-RSA-AES128-GCM-SHA256:DHE-RSA-AES128-GCM-SHA256",
            "NOSUCHCIPHER",
            "RC4",
            "!",
        ] {
            match parse(list) {
                Err(e) => {
                    let text = e.to_string();
                    assert!(text.contains("ECDHE-ECDSA-AES128-GCM-SHA256"), "{text}");
                }
                Ok(s) => panic!("{list} accepted: {:?}", names(&s.tls12)),
            }
        }
        assert!(parse("DHE-RSA-AES128-GCM-SHA256")
            .unwrap_err()
            .to_string()
            .contains("'DHE-RSA-AES128-GCM-SHA256'"));
    }
}
