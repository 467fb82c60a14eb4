//! The access log of request-level proxying (`access_log FILE`, with `http`): one line per
//! request, written when its answer has ended:
//!
//! `CLIENT UNIX_TIME METHOD AUTHORITY TARGET PROTOCOL STATUS BYTES_IN BYTES_OUT MS SERVER`
//!
//! UNIX_TIME is when the request arrived (seconds, three decimals), BYTES_IN and BYTES_OUT
//! count body bytes (client to server, server to client), MS is the time until the answer
//! ended, SERVER is `ADDRESS:PORT` or `-` (quill answered itself); a missing AUTHORITY is
//! `-`. STATUS is the final answer's; [`CLIENT_CLOSED_REQUEST`] (499) when the client left
//! before an answer's head reached it; 0 when the connection ended otherwise without an
//! answer (quill's idle timeout). An answer the client cut short in its body keeps its
//! status (BYTES_OUT tells how much of it went). Fields a client sends are cut at the
//! first space or control byte, so that every line splits into exactly eleven fields. Like
//! the connection log it is opened in append mode, reopened on SIGHUP, and its lines are
//! written whole, in batches, by the file's own thread (`logfile`): an event loop never
//! waits for the disk.

use std::cell::Cell;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::logfile::LogFile;
use crate::net::text;

/// The status logged for a request whose client left before an answer's head reached it
/// (NGINX's, which log tools already know).
pub const CLIENT_CLOSED_REQUEST: u16 = 499;

/// An open access log.
#[derive(Debug)]
pub struct AccessLog {
    file: LogFile,
}

impl AccessLog {
    /// Opens (creating if needed) `path` for appending.
    pub fn open(path: &Path) -> io::Result<AccessLog> {
        Ok(AccessLog {
            file: LogFile::open(path, "access log")?,
        })
    }

    /// The file it writes.
    pub fn file(&self) -> &LogFile {
        &self.file
    }

    fn write_line(&self, line: &[u8]) {
        self.file.append(line);
    }
}

/// When a request arrived: the wall clock for its line, the monotonic clock for its
/// duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// Since the Unix epoch.
    unix: Duration,
    at: Instant,
}

impl Arrival {
    pub fn now() -> Arrival {
        Arrival {
            unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default(),
            at: Instant::now(),
        }
    }
}

/// One request on its way: filled in as it goes, written when the last holder (the
/// response body, or the request's own handler for quill's answers; on the byte pump, the
/// request's relay at the answer's end) lets go.
pub struct Record {
    log: Arc<AccessLog>,
    client: IpAddr,
    arrived: Arrival,
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
        Record::from_owned(
            log,
            client,
            Arrival::now(),
            method.to_owned(),
            authority.map(str::to_owned),
            target.to_owned(),
            protocol,
        )
    }

    /// [`Record::new`] with the client's fields handed over (cut in place, not copied),
    /// for a request that arrived at `arrived`.
    pub fn from_owned(
        log: Arc<AccessLog>,
        client: IpAddr,
        arrived: Arrival,
        method: String,
        authority: Option<String>,
        target: String,
        protocol: &'static str,
    ) -> Record {
        Record {
            log,
            client: client.to_canonical(),
            arrived,
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

    /// The line, written by hand: through `format!` (addresses, floats) it cost about
    /// 8,000 instructions, a quarter of what the byte pump spends on a whole request.
    fn line(&self) -> Vec<u8> {
        let elapsed = self.arrived.at.elapsed();
        let mut out =
            Vec::with_capacity(96 + self.method.len() + self.authority.len() + self.target.len());
        let mut n = itoa::Buffer::new();
        text::push_ip(&mut out, self.client);
        out.push(b' ');
        out.extend_from_slice(n.format(self.arrived.unix.as_secs()).as_bytes());
        push_thousandths(&mut out, self.arrived.unix.subsec_millis());
        for word in [
            self.method.as_str(),
            &self.authority,
            &self.target,
            self.protocol,
        ] {
            out.push(b' ');
            out.extend_from_slice(word.as_bytes());
        }
        for count in [
            u64::from(self.status.get()),
            self.bytes_in.get(),
            self.bytes_out.get(),
        ] {
            out.push(b' ');
            out.extend_from_slice(n.format(count).as_bytes());
        }
        out.push(b' ');
        let micros = elapsed.as_micros();
        out.extend_from_slice(n.format(micros / 1000).as_bytes());
        push_thousandths(&mut out, (micros % 1000) as u32);
        out.push(b' ');
        match self.server.get() {
            Some(s) => text::push_socket_addr(&mut out, s),
            None => out.push(b'-'),
        }
        out.push(b'\n');
        out
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        self.log.write_line(&self.line());
    }
}

/// Appends `.NNN`: `n` (below 1,000) as three decimals.
fn push_thousandths(out: &mut Vec<u8>, n: u32) {
    let n = n.min(999);
    out.extend_from_slice(&[
        b'.',
        b'0' + (n / 100) as u8,
        b'0' + (n / 10 % 10) as u8,
        b'0' + (n % 10) as u8,
    ]);
}

/// A client-supplied field as one log field: up to the first space or control byte (at
/// most 2,048 characters), never empty.
fn field(mut text: String) -> String {
    text.truncate(field_len(&text));
    if text.is_empty() {
        "-".to_string()
    } else {
        text
    }
}

/// How many bytes of `text` make its log field.
fn field_len(text: &str) -> usize {
    // The usual field is printable ASCII: cut it as bytes. Anything else (a UTF-8
    // character, which may be a space of its own) takes the character by character way.
    let end = text
        .bytes()
        .position(|b| !b.is_ascii_graphic())
        .unwrap_or(text.len());
    if end <= 2048 && text.as_bytes().get(end).map_or(true, u8::is_ascii) {
        return end;
    }
    text.char_indices()
        .take_while(|(_, c)| !c.is_whitespace() && !c.is_control())
        .take(2048)
        .last()
        .map_or(0, |(i, c)| i + c.len_utf8())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_ends_at_the_first_space_or_control_character() {
        assert_eq!(field("/a?b=c".into()), "/a?b=c");
        assert_eq!(field("/a b".into()), "/a");
        assert_eq!(field("/a\x7fb".into()), "/a");
        assert_eq!(
            field("/é\u{2003}x".into()),
            "/é",
            "a Unicode space ends it too"
        );
        assert_eq!(field("\tx".into()), "-");
        assert_eq!(field("".into()), "-");
        assert_eq!(field("x".repeat(3000)).len(), 2048);
        assert_eq!(field("é".repeat(3000)).chars().count(), 2048);
    }

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
        crate::logfile::finish(std::time::Duration::from_secs(5));
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
        // Seconds and milliseconds with three decimals.
        for f in [lines[0][1], lines[0][9]] {
            let (whole, frac) = f.split_once('.').unwrap();
            assert!(whole.parse::<u64>().is_ok() && frac.len() == 3, "{f}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
