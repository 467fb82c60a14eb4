//! Pen's connection log (`-l FILE`, `log FILE`): one line per connection,
//! `CLIENT_IP UNIX_TIME SERVER_IP FIRST_LINE_OF_REQUEST`, the format `mergelogs` reads.
//!
//! The file is opened in append mode and reopened on SIGHUP, so `mv quill.log quill.log.1;
//! kill -HUP` rotates it. Lines are written whole, in batches, by the file's own thread
//! (`logfile`): an event loop never waits for the disk.

use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::logfile::LogFile;

/// Bytes of the request kept for the log line (Pen keeps "the first few bytes").
pub const REQUEST_BYTES: usize = 200;

/// An open connection log.
#[derive(Debug)]
pub struct ConnLog {
    file: LogFile,
}

impl ConnLog {
    /// Opens (creating if needed) `path` for appending.
    pub fn open(path: &Path) -> io::Result<ConnLog> {
        Ok(ConnLog {
            file: LogFile::open(path, "connection log")?,
        })
    }

    /// Writes one line for a connection started at `started` (Unix seconds).
    pub fn record(&self, client: IpAddr, started: u64, server: Option<IpAddr>, request: &[u8]) {
        let first = request
            .split(|&b| b == b'\r' || b == b'\n')
            .next()
            .unwrap_or_default();
        let first = String::from_utf8_lossy(first);
        let server = server.map_or_else(|| "-".to_string(), |ip| ip.to_string());
        let line = format!("{client} {started} {server} {first}\n");
        self.file.append(line.as_bytes());
    }
}

/// Unix time in seconds now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_have_pens_format() {
        let dir = std::env::temp_dir().join(format!("quill-connlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pen.log");
        let log = ConnLog::open(&path).unwrap();
        log.record(
            "10.0.0.1".parse().unwrap(),
            1700000000,
            Some("10.0.0.9".parse().unwrap()),
            b"GET /x HTTP/1.1\r\nHost: a\r\n",
        );
        log.record("10.0.0.2".parse().unwrap(), 1700000001, None, b"");
        drop(log);
        crate::logfile::finish(std::time::Duration::from_secs(5));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "10.0.0.1 1700000000 10.0.0.9 GET /x HTTP/1.1\n10.0.0.2 1700000001 - \n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
