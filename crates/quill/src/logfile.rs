//! A log file written by a thread of its own (the connection log and the access log): an
//! event loop hands a line over by copying it into a shared buffer, without a system call,
//! and never waits for the disk, a full pipe or a stalled log shipper.
//!
//! Invariants: lines reach the file whole and in the order they were handed over, in
//! writes of many lines, at most [`GATHER`] after the first of them (sooner when
//! [`FLUSH_AT`] bytes are waiting); what waits is bounded by [`MAX_PENDING`], beyond which
//! lines are dropped and counted ([`dropped`]) rather than held or waited for. Dropping a
//! `LogFile` writes out what it holds on its thread; [`finish`] waits for that at exit.
//!
//! In the foreground, quill's own log (stderr) goes the same way while the daemon runs
//! ([`StderrThread`]), without the gathering: a terminal or journald sees each line at
//! once, and a stalled reader of stderr costs lines, not a frozen event loop.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

/// How long the first line of a batch waits for others before the batch is written.
pub const GATHER: Duration = Duration::from_millis(100);

/// Bytes waiting that are written at once, without waiting out [`GATHER`].
pub const FLUSH_AT: usize = 64 * 1024;

/// The most bytes held for a file that is not taking them; later lines are dropped.
pub const MAX_PENDING: usize = 4 * 1024 * 1024;

/// Lines dropped because their file had [`MAX_PENDING`] bytes waiting, all files together.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Writer threads not yet known to have ended, for [`finish`].
static WRITERS: Mutex<Vec<Writer>> = Mutex::new(Vec::new());

/// A writer thread and what it writes out.
struct Writer {
    shared: Arc<Shared>,
    thread: JoinHandle<()>,
}

/// Lines dropped so far because a log file was not taking them.
pub fn dropped() -> u64 {
    DROPPED.load(Relaxed)
}

/// A log file opened for appending, written by its own thread.
#[derive(Debug)]
pub struct LogFile {
    shared: Arc<Shared>,
    /// The file's name (none for stderr), for [`LogFile::reopen`].
    path: Option<PathBuf>,
}

#[derive(Debug)]
struct Shared {
    /// How long the first line of a batch waits for others ([`GATHER`] for log files).
    gather: Duration,
    pending: Mutex<Pending>,
    /// Rung when the writer has something to do: the first line after an empty buffer,
    /// [`FLUSH_AT`] bytes, or the end.
    ring: Condvar,
}

#[derive(Debug, Default)]
struct Pending {
    lines: Vec<u8>,
    /// Set when the `LogFile` is dropped: write what is left, then end.
    closing: bool,
    /// Lines dropped since the writer last reported it.
    dropped: u64,
    /// Bytes the writer took and is writing (counted against [`MAX_PENDING`] too).
    writing: usize,
    /// The file reopened under the same name ([`LogFile::reopen`]), and how many bytes of
    /// `lines` were handed over before it: those go to the old file, the rest to it.
    reopened: Option<(File, usize)>,
}

impl LogFile {
    /// Opens (creating if needed) `path` for appending and starts its writer; `what` names
    /// the log in the writer's messages ("access log").
    pub fn open(path: &Path, what: &'static str) -> io::Result<LogFile> {
        let mut log = LogFile::start(open_for_appending(path)?, what, GATHER)?;
        log.path = Some(path.to_path_buf());
        Ok(log)
    }

    /// The file's name, if it has one (stderr has none).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Opens the file's name again (rotation: `mv`, then SIGHUP) and has the writer go on
    /// there: lines handed over until now go to the old file, later ones to the new, whoever
    /// holds this `LogFile` (connections that started before the rotation too, so no writer
    /// is left behind for them). On error the writer stays with the old file.
    pub fn reopen(&self) -> io::Result<()> {
        let path = self.path.as_deref().ok_or_else(|| {
            io::Error::new(io::ErrorKind::Unsupported, "stderr cannot be reopened")
        })?;
        let file = open_for_appending(path)?;
        let mut pending = lock(&self.shared.pending);
        let cut = match pending.reopened.take() {
            // Reopened twice before the writer got to it: the earlier cut stands.
            Some((_, cut)) => cut,
            None => pending.lines.len(),
        };
        pending.reopened = Some((file, cut));
        drop(pending);
        self.shared.ring.notify_one();
        Ok(())
    }

    /// Starts the writer of an open `file`, which gathers lines for `gather`.
    fn start(file: File, what: &'static str, gather: Duration) -> io::Result<LogFile> {
        let shared = Arc::new(Shared {
            gather,
            pending: Mutex::new(Pending::default()),
            ring: Condvar::new(),
        });
        let writer = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("quill-log".into())
            .spawn(move || writer.write_until_closed(file, what))?;
        let mut writers = lock(&WRITERS);
        writers.retain(|w| !w.thread.is_finished());
        writers.push(Writer {
            shared: Arc::clone(&shared),
            thread,
        });
        Ok(LogFile { shared, path: None })
    }

    /// Hands one whole line (with its newline) over to the writer.
    pub fn append(&self, line: &[u8]) {
        let mut pending = lock(&self.shared.pending);
        let before = pending.lines.len();
        if pending.writing + before + line.len() > MAX_PENDING {
            pending.dropped += 1;
            DROPPED.fetch_add(1, Relaxed);
            return;
        }
        pending.lines.extend_from_slice(line);
        let now = pending.lines.len();
        drop(pending);
        // The writer sleeps without a deadline while nothing waits, and gathers until
        // FLUSH_AT: ring only when one of those ends (one wake-up per batch at most).
        if before == 0 || (before < FLUSH_AT && now >= FLUSH_AT) {
            self.shared.ring.notify_one();
        }
    }
}

impl Drop for LogFile {
    fn drop(&mut self) {
        lock(&self.shared.pending).closing = true;
        self.shared.ring.notify_one();
    }
}

impl Shared {
    /// The writer thread: waits for lines, gathers them for up to [`GATHER`], writes them
    /// with one `write` (more only if the file takes part of it), until closed and empty.
    fn write_until_closed(&self, mut file: File, what: &str) {
        let mut batch = Vec::new();
        let mut failing = false;
        loop {
            let mut pending = lock(&self.pending);
            while pending.lines.is_empty() && !pending.closing && pending.reopened.is_none() {
                pending = self.ring.wait(pending).unwrap_or_else(|p| p.into_inner());
            }
            let due = Instant::now() + self.gather;
            while pending.lines.len() < FLUSH_AT && !pending.closing && pending.reopened.is_none() {
                let left = due.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                pending = self
                    .ring
                    .wait_timeout(pending, left)
                    .map_or_else(|p| p.into_inner().0, |(g, _)| g);
            }
            std::mem::swap(&mut batch, &mut pending.lines);
            pending.writing = batch.len();
            let dropped = std::mem::take(&mut pending.dropped);
            let closing = pending.closing;
            let reopened = pending.reopened.take();
            drop(pending);
            if dropped > 0 {
                tracing::warn!("{what}: {dropped} line(s) dropped: the file was not taking them");
            }
            let mut rest = &batch[..];
            if let Some((new, cut)) = reopened {
                let (old_lines, new_lines) = batch.split_at(cut.min(batch.len()));
                write_batch(&mut file, old_lines, what, &mut failing);
                file = new;
                rest = new_lines;
            }
            write_batch(&mut file, rest, what, &mut failing);
            batch.clear();
            lock(&self.pending).writing = 0;
            // A burst while the file stalled may have grown the buffer to MAX_PENDING.
            if batch.capacity() > 4 * FLUSH_AT {
                batch = Vec::new();
            }
            if closing && lock(&self.pending).lines.is_empty() {
                return;
            }
        }
    }
}

/// Writes `lines` to `file`; a failure is said once until a write works again (a full
/// disk must not flood the log).
fn write_batch(file: &mut File, lines: &[u8], what: &str, failing: &mut bool) {
    if lines.is_empty() {
        return;
    }
    match file.write_all(lines) {
        Ok(()) if *failing => {
            *failing = false;
            tracing::info!("{what}: writing again");
        }
        Ok(()) => {}
        Err(e) if !*failing => {
            *failing = true;
            tracing::warn!("{what}: {e}");
        }
        Err(_) => {}
    }
}

fn open_for_appending(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// Waits, up to `patience`, for every log file dropped so far to be written out (at exit,
/// after the logs were let go). Files still open are not waited for.
pub fn finish(patience: Duration) {
    let deadline = Instant::now() + patience;
    let closing: Vec<Writer> = {
        let mut writers = lock(&WRITERS);
        let (closing, open) = std::mem::take(&mut *writers)
            .into_iter()
            .partition(|w| lock(&w.shared.pending).closing);
        *writers = open;
        closing
    };
    for w in closing {
        while !w.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if w.thread.is_finished() {
            let _ = w.thread.join();
        }
    }
}

/// stderr's writer thread while the daemon runs in the foreground; `None` before (start-up
/// errors are written at once, in order with what `main` prints) and after.
static STDERR: ArcSwapOption<LogFile> = ArcSwapOption::const_empty();

/// While it lives, quill's log lines for stderr ([`StderrLines`]) are written by a thread
/// of their own; dropping it writes out what is left (up to 2 s) and goes back to writing
/// them directly, so every path out of the daemon leaves its last lines in order.
#[derive(Debug)]
#[must_use = "stderr goes back to direct writes when this is dropped"]
pub struct StderrThread(());

impl StderrThread {
    /// Starts the writer of a duplicate of stderr; lines are not gathered.
    pub fn start() -> io::Result<StderrThread> {
        let fd = io::stderr().as_fd().try_clone_to_owned()?;
        STDERR.store(Some(Arc::new(LogFile::start(
            File::from(fd),
            "stderr",
            Duration::ZERO,
        )?)));
        Ok(StderrThread(()))
    }
}

impl Drop for StderrThread {
    fn drop(&mut self) {
        drop(STDERR.swap(None));
        finish(Duration::from_secs(2));
    }
}

/// `tracing`'s writer for stderr: each event's formatted line goes to stderr's writer
/// thread while a [`StderrThread`] lives, straight to stderr otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct StderrLines;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for StderrLines {
    type Writer = StderrLine;

    fn make_writer(&'a self) -> StderrLine {
        StderrLine
    }
}

/// One event's writer (see [`StderrLines`]). The formatter hands it the whole line in one
/// `write_all`, which [`LogFile::append`] takes whole.
#[derive(Debug)]
pub struct StderrLine;

impl Write for StderrLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &*STDERR.load() {
            Some(file) => {
                file.append(buf);
                Ok(buf.len())
            }
            None => io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("quill-logfile-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("log")
    }

    fn wait_for(path: &Path, len: usize) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if text.len() >= len || Instant::now() > deadline {
                return text;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_reopened_file_gets_the_lines_handed_over_after_the_reopen() {
        let path = scratch("reopen");
        let rotated = path.with_extension("1");
        let log = LogFile::open(&path, "test log").unwrap();
        log.append(b"before\n");
        // Still waiting in the buffer when the file is moved and reopened: the old file's.
        std::fs::rename(&path, &rotated).unwrap();
        log.reopen().unwrap();
        log.append(b"after\n");
        assert_eq!(wait_for(&path, 6), "after\n");
        assert_eq!(wait_for(&rotated, 7), "before\n");
        // Twice in a row before the writer looked: the lines go to the newest file.
        log.reopen().unwrap();
        log.reopen().unwrap();
        log.append(b"again\n");
        assert_eq!(wait_for(&path, 12), "after\nagain\n");
        drop(log);
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn lines_reach_the_file_whole_and_in_order_soon_after() {
        let path = scratch("order");
        let log = LogFile::open(&path, "test log").unwrap();
        let mut expected = String::new();
        for i in 0..1000 {
            let line = format!("line {i}\n");
            log.append(line.as_bytes());
            expected.push_str(&line);
        }
        // Not dropped: the lines come within GATHER all the same.
        assert_eq!(wait_for(&path, expected.len()), expected);
        drop(log);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn what_a_dropped_log_file_held_is_written_out() {
        let path = scratch("dropped");
        let log = LogFile::open(&path, "test log").unwrap();
        log.append(b"last words\n");
        drop(log);
        finish(Duration::from_secs(5));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "last words\n");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_file_that_takes_nothing_costs_dropped_lines_not_a_wait() {
        // A FIFO whose reader reads nothing: its 64 KiB pipe fills, then every write
        // blocks (a log shipper that stalled).
        let path = scratch("fifo");
        let _ = std::fs::remove_file(&path);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
            .open(&path)
            .unwrap();
        let log = LogFile::open(&path, "test log").unwrap();
        let before = dropped();
        let line = [b'x'; 1023]
            .iter()
            .chain(b"\n")
            .copied()
            .collect::<Vec<_>>();
        let started = Instant::now();
        // Twice what is held (4 MiB) and the pipe (64 KiB) together.
        for _ in 0..(2 * MAX_PENDING / line.len()) {
            log.append(&line);
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "appending waited"
        );
        // What could not be held was dropped: half of it, less what the pipe took (64
        // lines of its 64 KiB); what is being written counts as held.
        let lines = (2 * MAX_PENDING / line.len()) as u64;
        let gone = dropped() - before;
        assert!(gone >= lines / 2 - 100, "{gone} of {lines} dropped");
        drop(reader);
        drop(log);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
