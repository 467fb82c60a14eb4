//! The access log of request-level proxying (`access_log FILE`, with `http`): one line per
//! request, written when its answer has ended:
//!
//! `CLIENT UNIX_TIME METHOD AUTHORITY TARGET PROTOCOL STATUS BYTES_IN BYTES_OUT MS SERVER`
//!
//! UNIX_TIME is when the request arrived (seconds, three decimals), BYTES_IN and BYTES_OUT
//! count body bytes (client to server, server to client), MS is the time until the answer
//! ended, SERVER is `ADDRESS:PORT` or `-` (quill answered itself); a missing AUTHORITY is
//! `-`. Fields a client sends are cut at the first space or control byte, so that every
//! line splits into exactly eleven fields. Like the connection log it is opened in append
//! mode, reopened on SIGHUP, and each line is written whole with one `write`.

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// An open access log.
#[derive(Debug)]
pub struct AccessLog {
    file: Mutex<File>,
}

impl AccessLog {
    /// Opens (creating if needed) `path` for appending.
    pub fn open(path: &Path) -> io::Result<AccessLog> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(AccessLog {
            file: Mutex::new(file),
        })
    }

    fn write_line(&self, line: &str) {
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = file.write_all(line.as_bytes()) {
            tracing::warn!("access log: {e}");
        }
    }
}

/// One request on its way: filled in as it goes, written when the last holder (the
/// response body, or the request's own handler for quill's answers; on the byte pump, the
/// request's relay at the answer's end) lets go.
pub struct Record {
    log: Arc<AccessLog>,
    client: IpAddr,
    unix: f64,
    started: Instant,
    method: String,
    authority: String,
    target: String,
    protocol: &'static str,
    pub status: Cell<u16>,
    pub bytes_in: Cell<u64>,
    pub bytes_out: Cell<u64>,
    pub server: Cell<Option<SocketAddr>>,
}

impl Record {
    pub fn new(
        log: Arc<AccessLog>,
        client: IpAddr,
        method: &str,
        authority: Option<&str>,
        target: &str,
        protocol: &'static str,
    ) -> Record {
        Record {
            log,
            client: client.to_canonical(),
            unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            started: Instant::now(),
            method: field(method),
            authority: authority.map_or_else(|| "-".to_string(), field),
            target: field(target),
            protocol,
            status: Cell::new(0),
            bytes_in: Cell::new(0),
            bytes_out: Cell::new(0),
            server: Cell::new(None),
        }
    }

    fn line(&self) -> String {
        let ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let server = self
            .server
            .get()
            .map_or_else(|| "-".to_string(), |s| s.to_string());
        format!(
            "{} {:.3} {} {} {} {} {} {} {} {:.3} {}\n",
            self.client,
            self.unix,
            self.method,
            self.authority,
            self.target,
            self.protocol,
            self.status.get(),
            self.bytes_in.get(),
            self.bytes_out.get(),
            ms,
            server
        )
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        self.log.write_line(&self.line());
    }
}

/// A client-supplied field as one log field: up to the first space or control byte, never
/// empty.
fn field(text: &str) -> String {
    let cut: String = text
        .chars()
        .take_while(|c| !c.is_whitespace() && !c.is_control())
        .take(2048)
        .collect();
    if cut.is_empty() {
        "-".to_string()
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_has_eleven_fields_whatever_the_client_sent() {
        let dir = std::env::temp_dir().join(format!("quill-accesslog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let log = Arc::new(AccessLog::open(&path).unwrap());
        {
            let r = Record::new(
                Arc::clone(&log),
                "::ffff:10.0.0.1".parse().unwrap(),
                "GET",
                Some("example.org"),
                "/a b\r\nforged line",
                "HTTP/2.0",
            );
            r.status.set(200);
            r.bytes_out.set(1024);
            r.server.set(Some("10.0.0.9:80".parse().unwrap()));
        }
        drop(Record::new(
            log,
            "10.0.0.2".parse().unwrap(),
            "",
            None,
            "",
            "HTTP/1.1",
        ));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines.iter().all(|f| f.len() == 11), "{text}");
        assert_eq!(lines[0][0], "10.0.0.1");
        assert_eq!(
            lines[0][2..9],
            ["GET", "example.org", "/a", "HTTP/2.0", "200", "0", "1024"]
        );
        assert_eq!(lines[0][10], "10.0.0.9:80");
        assert_eq!(lines[1][2..5], ["-", "-", "-"]);
        assert_eq!(lines[1][10], "-");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
