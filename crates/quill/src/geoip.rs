//! Country of a client address from a MaxMind DB file (`geoip_db FILE`), for the ACL rule
//! `acl N permit|deny country CC`.
//!
//! The whole file is read into memory at open (a database replaced on disk later does not
//! affect a running process; a reload opens the new one). A lookup allocates nothing: it
//! walks the search tree and borrows the two-letter code from the in-memory data.

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use maxminddb::{PathElement, Reader};
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

/// Why a GeoIP database could not be opened. Both variants name the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GeoIpError {
    #[error("cannot read GeoIP database {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is not a valid MaxMind DB file: {source}", path.display())]
    Invalid {
        path: PathBuf,
        source: maxminddb::MaxMindDbError,
    },
}

/// An open MaxMind DB (GeoIP2/GeoLite2 Country or City, DB-IP, ipinfo, ...).
pub struct GeoIp {
    path: PathBuf,
    reader: Reader<Vec<u8>>,
}

impl fmt::Debug for GeoIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GeoIp")
            .field("path", &self.path)
            .field("database_type", &self.database_type())
            .finish()
    }
}

/// Where the two-letter code may be, tried in this order: `country` (GeoIP2's map with an
/// `iso_code`, or ipinfo's plain string), then `registered_country` (GeoIP2 addresses with
/// no located country).
const PATHS: [&[PathElement<'static>]; 2] = [
    &[PathElement::Key("country")],
    &[PathElement::Key("registered_country")],
];

/// A country entry: `{"iso_code": "SE", ...}` or `"SE"`, borrowed from the database.
struct Code<'a>(Option<&'a str>);

impl<'de> Deserialize<'de> for Code<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Code<'de>, D::Error> {
        d.deserialize_any(CodeVisitor)
    }
}

struct CodeVisitor;

impl<'de> Visitor<'de> for CodeVisitor {
    type Value = Code<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a country code or a map with an iso_code")
    }

    fn visit_borrowed_str<E: serde::de::Error>(self, s: &'de str) -> Result<Code<'de>, E> {
        Ok(Code(Some(s)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Code<'de>, A::Error> {
        let mut code = None;
        while let Some(key) = map.next_key::<&'de str>()? {
            if key == "iso_code" {
                code = Some(map.next_value::<&'de str>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(Code(code))
    }
}

impl GeoIp {
    /// Reads and checks the database file's metadata.
    pub fn open(path: impl AsRef<Path>) -> Result<GeoIp, GeoIpError> {
        let path = path.as_ref().to_path_buf();
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(source) => return Err(GeoIpError::Read { path, source }),
        };
        match Reader::from_source(bytes) {
            Ok(reader) => Ok(GeoIp { path, reader }),
            Err(source) => Err(GeoIpError::Invalid { path, source }),
        }
    }

    /// The file this database was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The database's own name for its kind, e.g. `GeoLite2-Country`.
    pub fn database_type(&self) -> &str {
        &self.reader.metadata().database_type
    }

    /// The ISO 3166 two-letter code (upper case) of the country of `ip`, or `None` when the
    /// database does not know it. IPv4 clients seen on an IPv6 socket (`::ffff:a.b.c.d`) are
    /// looked up as IPv4. Never allocates.
    pub fn country(&self, ip: IpAddr) -> Option<[u8; 2]> {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            IpAddr::V4(_) => ip,
        };
        // An IPv6 address in an IPv4-only database is an error: not known.
        let found = self.reader.lookup(ip).ok()?;
        if !found.has_data() {
            return None;
        }
        PATHS.iter().find_map(|path| {
            let Code(code) = found.decode_path::<Code<'_>>(path).ok()??;
            parse_country(code?)
        })
    }
}

/// A two-letter country code in upper case, from `se`, `SE`, ...; `None` for anything else.
/// Use it to read the `CC` of `acl N permit country CC` so both sides compare equal.
pub fn parse_country(code: &str) -> Option<[u8; 2]> {
    match code.as_bytes() {
        &[a, b] if a.is_ascii_alphabetic() && b.is_ascii_alphabetic() => {
            Some([a.to_ascii_uppercase(), b.to_ascii_uppercase()])
        }
        _ => None,
    }
}

/// The code as text, for printing a rule back (`write`) or a log line.
pub fn country_str(code: &[u8; 2]) -> &str {
    std::str::from_utf8(code).unwrap_or("??")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn open(name: &str) -> GeoIp {
        match GeoIp::open(fixture(name)) {
            Ok(db) => db,
            Err(e) => panic!("{e}"),
        }
    }

    fn cc(db: &GeoIp, ip: &str) -> Option<String> {
        let ip: IpAddr = ip.parse().unwrap_or_else(|e| panic!("{ip}: {e}"));
        db.country(ip).map(|c| country_str(&c).to_owned())
    }

    #[test]
    fn looks_up_ipv4_ipv6_and_mapped_addresses() {
        let db = open("geoip-test.mmdb");
        assert_eq!(db.database_type(), "quill-test-Country");
        assert_eq!(cc(&db, "127.0.0.2").as_deref(), Some("SE"));
        assert_eq!(cc(&db, "127.0.0.3").as_deref(), Some("US"));
        assert_eq!(cc(&db, "::ffff:127.0.0.2").as_deref(), Some("SE"));
        assert_eq!(cc(&db, "::ffff:127.0.0.3").as_deref(), Some("US"));
        assert_eq!(cc(&db, "2001:db8::1").as_deref(), Some("DE"));
        assert_eq!(cc(&db, "2001:db8:ffff::42").as_deref(), Some("DE"));
    }

    #[test]
    fn unknown_addresses_have_no_country() {
        let db = open("geoip-test.mmdb");
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "::1",
            "2001:db9::1",
            "::ffff:127.0.0.1",
        ] {
            assert_eq!(cc(&db, ip), None, "{ip}");
        }
    }

    #[test]
    fn codes_are_checked_and_normalised() {
        let db = open("geoip-test.mmdb");
        assert_eq!(
            cc(&db, "127.0.0.4").as_deref(),
            Some("FR"),
            "registered_country"
        );
        assert_eq!(cc(&db, "127.0.0.5").as_deref(), Some("NO"), "lower case");
        assert_eq!(cc(&db, "127.0.0.6"), None, "three letters");
        assert_eq!(cc(&db, "127.0.0.7"), None, "no iso_code");
        assert_eq!(cc(&db, "127.0.0.8").as_deref(), Some("JP"), "ipinfo layout");
    }

    #[test]
    fn ipv4_only_database() {
        let db = open("geoip-test-v4.mmdb");
        assert_eq!(cc(&db, "127.0.0.2").as_deref(), Some("SE"));
        assert_eq!(cc(&db, "::ffff:127.0.0.2").as_deref(), Some("SE"));
        assert_eq!(cc(&db, "2001:db8::1"), None);
    }

    #[test]
    fn open_errors_name_the_file() {
        let missing = fixture("no-such.mmdb");
        let err = GeoIp::open(&missing).err().map(|e| e.to_string());
        let expected = format!("cannot read GeoIP database {}: ", missing.display());
        assert!(
            err.as_deref().is_some_and(|e| e.starts_with(&expected)),
            "{err:?}"
        );

        let not_a_db = fixture("make_geoip.py");
        let err = GeoIp::open(&not_a_db).err().map(|e| e.to_string());
        let expected = format!("{} is not a valid MaxMind DB file: ", not_a_db.display());
        assert!(
            err.as_deref().is_some_and(|e| e.starts_with(&expected)),
            "{err:?}"
        );
    }

    #[test]
    fn country_codes_from_rules() {
        assert_eq!(parse_country("se"), Some(*b"SE"));
        assert_eq!(parse_country("US"), Some(*b"US"));
        for bad in ["", "S", "SWE", "S1", "é", "ÅÄ"] {
            assert_eq!(parse_country(bad), None, "{bad}");
        }
        assert_eq!(country_str(b"DE"), "DE");
    }
}
