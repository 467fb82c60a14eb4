//! Logging to syslog as a daemon does (Pen: facility `user`): a `tracing_subscriber`
//! [`MakeWriter`] that sends each formatted event as one RFC 3164 datagram
//! (`<PRI>quill[pid]: message`) to the local socket `/dev/log`.
//!
//! It never blocks the caller: the socket is non-blocking and a message the kernel cannot
//! queue at once is dropped and counted ([`Syslog::dropped`]). When the syslog daemon
//! restarts, the next message reconnects; while the socket is absent, messages are dropped
//! silently (one connect attempt per second at most). Connect before a chroot: the connected
//! socket keeps working inside the jail, a reconnect there needs the jail's own `dev/log`.

use std::fmt;
use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing_subscriber::fmt::MakeWriter;

/// The local syslog socket.
pub const DEV_LOG: &str = "/dev/log";

/// Longest datagram sent; longer messages are cut (syslog daemons cut at 8 KiB anyway).
const MAX_DATAGRAM: usize = 8192;

/// How long to wait before trying to connect again to an absent syslog socket.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// Syslog facility (RFC 3164 §4.1.1). Pen logs with `User`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Facility {
    Kern = 0,
    User = 1,
    Mail = 2,
    Daemon = 3,
    Auth = 4,
    Syslog = 5,
    Lpr = 6,
    News = 7,
    Uucp = 8,
    Cron = 9,
    AuthPriv = 10,
    Ftp = 11,
    Local0 = 16,
    Local1 = 17,
    Local2 = 18,
    Local3 = 19,
    Local4 = 20,
    Local5 = 21,
    Local6 = 22,
    Local7 = 23,
}

const FACILITY_NAMES: [(&str, Facility); 20] = [
    ("kern", Facility::Kern),
    ("user", Facility::User),
    ("mail", Facility::Mail),
    ("daemon", Facility::Daemon),
    ("auth", Facility::Auth),
    ("syslog", Facility::Syslog),
    ("lpr", Facility::Lpr),
    ("news", Facility::News),
    ("uucp", Facility::Uucp),
    ("cron", Facility::Cron),
    ("authpriv", Facility::AuthPriv),
    ("ftp", Facility::Ftp),
    ("local0", Facility::Local0),
    ("local1", Facility::Local1),
    ("local2", Facility::Local2),
    ("local3", Facility::Local3),
    ("local4", Facility::Local4),
    ("local5", Facility::Local5),
    ("local6", Facility::Local6),
    ("local7", Facility::Local7),
];

impl FromStr for Facility {
    type Err = UnknownFacility;

    /// The names of syslog.conf(5), in any case: `user`, `daemon`, `local0` .. `local7`, ...
    fn from_str(s: &str) -> Result<Facility, UnknownFacility> {
        FACILITY_NAMES
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(s))
            .map(|&(_, f)| f)
            .ok_or_else(|| UnknownFacility(s.to_owned()))
    }
}

impl fmt::Display for Facility {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = FACILITY_NAMES
            .iter()
            .find(|(_, fac)| fac == self)
            .map_or("user", |(name, _)| name);
        f.write_str(name)
    }
}

/// A facility name that syslog does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown syslog facility '{0}' (expected user, daemon, local0 .. local7, ...)")]
pub struct UnknownFacility(pub String);

/// Syslog severity (RFC 3164 §4.1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    Emerg = 0,
    Alert = 1,
    Crit = 2,
    Err = 3,
    Warning = 4,
    Notice = 5,
    Info = 6,
    Debug = 7,
}

impl From<&tracing::Level> for Severity {
    fn from(level: &tracing::Level) -> Severity {
        match *level {
            tracing::Level::ERROR => Severity::Err,
            tracing::Level::WARN => Severity::Warning,
            tracing::Level::INFO => Severity::Info,
            _ => Severity::Debug,
        }
    }
}

/// A handle on the syslog socket; cheap to clone, shareable between threads.
#[derive(Clone)]
pub struct Syslog {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    facility: Facility,
    tag: String,
    conn: Mutex<Conn>,
    dropped: AtomicU64,
}

#[derive(Default)]
struct Conn {
    socket: Option<UnixDatagram>,
    /// No connect attempt before this instant (the socket was absent recently).
    retry_at: Option<Instant>,
}

impl fmt::Debug for Syslog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Syslog")
            .field("path", &self.inner.path)
            .field("facility", &self.inner.facility)
            .field("tag", &self.inner.tag)
            .field("dropped", &self.dropped())
            .finish()
    }
}

impl Syslog {
    /// Logs to `/dev/log` as `quill[pid]` with `facility`. Connects at once (so do this
    /// before a chroot); an absent socket is not an error.
    pub fn new(facility: Facility) -> Syslog {
        Syslog::with_path(DEV_LOG, facility, "quill")
    }

    /// Logs to the datagram socket at `path` with `facility`, tagging messages `tag[pid]`.
    pub fn with_path(path: impl AsRef<Path>, facility: Facility, tag: &str) -> Syslog {
        let syslog = Syslog {
            inner: Arc::new(Inner {
                path: path.as_ref().to_path_buf(),
                facility,
                tag: tag.to_owned(),
                conn: Mutex::new(Conn::default()),
                dropped: AtomicU64::new(0),
            }),
        };
        syslog.connect();
        syslog
    }

    /// True when the socket is connected now. Connects if it is not (and the last failed
    /// attempt is more than a second old).
    pub fn connect(&self) -> bool {
        let mut conn = self.lock();
        self.ensure_connected(&mut conn)
    }

    /// Messages lost so far: socket absent, kernel queue full, or another send error.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Relaxed)
    }

    /// Sends one message; true when the kernel took it. Never blocks for long (a mutex held
    /// only around a non-blocking send). Trailing newlines are removed; a message longer
    /// than 8 KiB with its header is cut.
    pub fn send(&self, severity: Severity, message: &str) -> bool {
        let datagram = self.format(severity, message);
        let mut conn = self.lock();
        if !self.ensure_connected(&mut conn) {
            return self.lost();
        }
        for attempt in 0..2 {
            let Some(socket) = conn.socket.as_ref() else {
                return self.lost();
            };
            match socket.send(&datagram) {
                Ok(_) => return true,
                Err(e) if attempt == 0 && is_disconnect(&e) => {
                    // The syslog daemon restarted (or went away): connect to its new socket.
                    conn.socket = None;
                    conn.retry_at = None;
                    if !self.ensure_connected(&mut conn) {
                        return self.lost();
                    }
                }
                // Would block (queue full), too big, or gone again: drop it.
                Err(_) => return self.lost(),
            }
        }
        self.lost()
    }

    fn lost(&self) -> bool {
        self.inner.dropped.fetch_add(1, Relaxed);
        false
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.inner
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn ensure_connected(&self, conn: &mut Conn) -> bool {
        if conn.socket.is_some() {
            return true;
        }
        if conn.retry_at.is_some_and(|at| Instant::now() < at) {
            return false;
        }
        match open(&self.inner.path) {
            Ok(socket) => {
                conn.socket = Some(socket);
                conn.retry_at = None;
                true
            }
            Err(_) => {
                conn.retry_at = Some(Instant::now() + RECONNECT_AFTER);
                false
            }
        }
    }

    /// `<PRI>tag[pid]: message`, cut to [`MAX_DATAGRAM`] bytes.
    ///
    /// The header has no TIMESTAMP: RFC 3164 §4.3.2 lets the receiving daemon stamp the
    /// message, which journald and rsyslog do on the local socket anyway (they ignore the
    /// sender's time), and a process in a jail has no time zone file to write local time.
    /// The pid is read per message: it changes when the process daemonizes.
    fn format(&self, severity: Severity, message: &str) -> Vec<u8> {
        let pri = (self.inner.facility as u8) * 8 + severity as u8;
        let mut out = format!("<{pri}>{}[{}]: ", self.inner.tag, std::process::id());
        let message = message.trim_end_matches(['\n', '\r']);
        let room = MAX_DATAGRAM.saturating_sub(out.len());
        let mut end = message.len().min(room);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        out.push_str(&message[..end]);
        out.into_bytes()
    }
}

fn open(path: &Path) -> io::Result<UnixDatagram> {
    let socket = UnixDatagram::unbound()?;
    socket.connect(path)?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// Errors after which a fresh connect may help: the peer socket was closed or replaced.
fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::NotConnected
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::NotFound
    )
}

/// Collects one event's formatted text and sends it as one datagram when dropped.
pub struct SyslogWriter<'a> {
    syslog: &'a Syslog,
    severity: Severity,
    buf: Vec<u8>,
}

impl io::Write for SyslogWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for SyslogWriter<'_> {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            let text = String::from_utf8_lossy(&self.buf);
            self.syslog.send(self.severity, &text);
        }
    }
}

impl<'a> MakeWriter<'a> for Syslog {
    type Writer = SyslogWriter<'a>;

    fn make_writer(&'a self) -> SyslogWriter<'a> {
        SyslogWriter {
            syslog: self,
            severity: Severity::Info,
            buf: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> SyslogWriter<'a> {
        SyslogWriter {
            syslog: self,
            severity: Severity::from(meta.level()),
            buf: Vec::new(),
        }
    }
}

/// A `fmt` layer that writes to `syslog`: no colours, no time (syslog stamps it), no level
/// or target words (the priority carries the level). Compose it with a level filter.
pub fn layer<S>(syslog: Syslog) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_writer(syslog)
        .with_ansi(false)
        .without_time()
        .with_level(false)
        .with_target(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    struct Sink {
        dir: PathBuf,
        path: PathBuf,
        socket: UnixDatagram,
    }

    impl Sink {
        fn new(name: &str) -> Sink {
            let dir =
                std::env::temp_dir().join(format!("quill-syslog-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            assert!(std::fs::create_dir_all(&dir).is_ok());
            let path = dir.join("log");
            let socket = Sink::bind(&path);
            Sink { dir, path, socket }
        }

        fn bind(path: &Path) -> UnixDatagram {
            match UnixDatagram::bind(path) {
                Ok(s) => {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    s
                }
                Err(e) => panic!("bind {}: {e}", path.display()),
            }
        }

        fn recv(&self) -> String {
            let mut buf = vec![0u8; 65536];
            match self.socket.recv(&mut buf) {
                Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
                Err(e) => panic!("nothing received: {e}"),
            }
        }
    }

    impl Drop for Sink {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn rfc3164_header_and_message() {
        let sink = Sink::new("format");
        let log = Syslog::with_path(&sink.path, Facility::User, "quill");
        let text = log.format(Severity::Warning, "hello\r\n");
        let expected = format!("<12>quill[{}]: hello", std::process::id());
        assert_eq!(String::from_utf8_lossy(&text), expected);
        assert!(log.format(Severity::Debug, "x").starts_with(b"<15>quill["));
        let daemon = Syslog::with_path(&sink.path, Facility::Daemon, "pen");
        assert!(daemon.format(Severity::Err, "").starts_with(b"<27>pen["));
        let local7 = Syslog::with_path(&sink.path, Facility::Local7, "quill");
        assert!(local7.format(Severity::Info, "").starts_with(b"<190>"));
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let sink = Sink::new("long");
        let log = Syslog::with_path(&sink.path, Facility::User, "quill");
        let long = "é".repeat(MAX_DATAGRAM);
        let text = log.format(Severity::Info, &long);
        assert!(text.len() <= MAX_DATAGRAM && text.len() > MAX_DATAGRAM - 40);
        assert!(String::from_utf8(text).is_ok());
    }

    #[test]
    fn tracing_events_arrive_as_datagrams_with_their_priority() {
        let sink = Sink::new("layer");
        let log = Syslog::with_path(&sink.path, Facility::User, "quill");
        let subscriber = tracing_subscriber::registry().with(layer(log.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(server = 2, "server blacklisted");
            tracing::info!("listening on 8080");
            tracing::error!("cannot connect");
        });
        let pid = std::process::id();
        let first = sink.recv();
        assert_eq!(
            first,
            format!("<12>quill[{pid}]: server blacklisted server=2")
        );
        let second = sink.recv();
        assert!(
            second.starts_with("<14>") && second.ends_with("]: listening on 8080"),
            "{second}"
        );
        let third = sink.recv();
        assert!(
            third.starts_with("<11>") && third.ends_with("]: cannot connect"),
            "{third}"
        );
        assert_eq!(log.dropped(), 0);
    }

    #[test]
    fn absent_socket_drops_silently_and_counts() {
        let dir = std::env::temp_dir().join(format!("quill-syslog-absent-{}", std::process::id()));
        let log = Syslog::with_path(dir.join("no-such-socket"), Facility::User, "quill");
        assert!(!log.connect());
        assert!(!log.send(Severity::Info, "lost"));
        assert!(!log.send(Severity::Info, "lost too"));
        assert_eq!(log.dropped(), 2);
    }

    #[test]
    fn reconnects_when_the_syslog_daemon_restarts() {
        let mut sink = Sink::new("restart");
        let log = Syslog::with_path(&sink.path, Facility::User, "quill");
        assert!(log.send(Severity::Info, "before"));
        assert!(sink.recv().ends_with("before"));
        // The daemon restarts: its socket is closed and removed, a new one bound at the path.
        assert!(std::fs::remove_file(&sink.path).is_ok());
        sink.socket = Sink::bind(&sink.path);
        assert!(log.send(Severity::Info, "after"));
        assert!(sink.recv().ends_with("after"));
        assert_eq!(log.dropped(), 0);
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let sink = Sink::new("full");
        let log = Syslog::with_path(&sink.path, Facility::User, "quill");
        let started = Instant::now();
        let sent = (0..5000)
            .filter(|i| log.send(Severity::Info, &format!("message {i}")))
            .count();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(sent > 0);
        assert_eq!(log.dropped(), 5000 - sent as u64);
        assert!(
            log.dropped() > 0,
            "the receiver never read, so some were dropped"
        );
        // The first message is the first that arrives.
        assert!(sink.recv().ends_with("message 0"));
    }

    #[test]
    fn facility_names() {
        assert_eq!("user".parse(), Ok(Facility::User));
        assert_eq!("DAEMON".parse(), Ok(Facility::Daemon));
        assert_eq!("local7".parse(), Ok(Facility::Local7));
        assert!("local8".parse::<Facility>().is_err());
        assert_eq!(Facility::Local3.to_string(), "local3");
    }
}
