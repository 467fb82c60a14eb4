//! The control plane: the control socket (`-C`), the operations behind its commands, and
//! the process actions shared with signal handling (reload, re-listen, reopen the log).
//!
//! Wire protocol (Pen's, so penctl and quillctl both work): the client sends one command
//! line, quill answers and closes. A malformed or refused command gets a one-line
//! `error: ...` reply and changes nothing. The control plane never touches a data-plane
//! socket: it publishes settings, sends new listeners to the event loops through their
//! channels, and aborts a connection's task through the handle the registry keeps.

pub mod dispatch;
pub mod metrics;
pub mod report;
pub mod upgrade;
pub mod web;

use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, Notify};

use crate::command::Command;
use crate::config::{self, ConfigError};
use crate::connlog::ConnLog;
use crate::net::{listen, ListenAddr, Listener};
use crate::settings::{Action, Settings};
use crate::state::State;

/// Longest command line accepted on the control socket.
pub const MAX_LINE: usize = 64 * 1024;

/// How long a control client may take to send its line.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after its last bytes a command without a newline (`printf servers | nc`,
/// which keeps its side open) is taken as it came: Pen takes what one read brings.
const UNTERMINATED: Duration = Duration::from_millis(200);

/// After a refused line, how much more input is read and dropped before closing (so the
/// client can read the error instead of meeting a reset), for how long at most, and how
/// long a pause in the client's sending ends it sooner.
const DRAIN_MAX: usize = 4 * 1024 * 1024;
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
const DRAIN_IDLE: Duration = Duration::from_millis(300);

/// What the control plane needs of the process.
pub struct Context {
    pub state: Arc<State>,
    /// Where the control socket listens (answer of `control`).
    pub control_addr: Option<String>,
    /// `-X`: the `exit` command is allowed.
    pub exit_enabled: bool,
    /// `-F`: the configuration file, re-read on reload, default target of `write`.
    pub config_file: Option<PathBuf>,
    /// The commands of the command line, applied before the file on every reload.
    pub base_commands: Vec<Command>,
    /// One channel per event loop, to hand it a new listener.
    pub relisten: Vec<mpsc::UnboundedSender<Listener>>,
    /// Notified by `exit`, and when a binary upgrade has handed the sockets over.
    pub exit: Arc<Notify>,
    /// Duplicates of the current listening sockets, for a binary upgrade to hand over.
    pub listener_fds: Mutex<Vec<OwnedFd>>,
    /// A duplicate of the Unix control socket, for a binary upgrade to hand over.
    pub control_fd: Mutex<Option<OwnedFd>>,
    /// A new process took the sockets over: stop, and leave its files in place.
    pub upgraded: AtomicBool,
    /// Hands the metrics listener [`web::run`] serves a new socket (`None`: close it).
    pub metrics: mpsc::UnboundedSender<Option<std::net::TcpListener>>,
}

impl Context {
    /// Builds settings from scratch: defaults, the command line, then the config file.
    pub fn build_settings(&self) -> Result<(Settings, Vec<Action>), ConfigError> {
        let mut settings = Settings::default();
        let mut actions = Vec::new();
        for cmd in &self.base_commands {
            let applied = settings.apply(cmd).map_err(|e| ConfigError {
                file: PathBuf::from("(command line)"),
                line: 0,
                reason: format!("'{cmd}': {e}"),
            })?;
            actions.extend(applied.actions);
        }
        if let Some(file) = &self.config_file {
            config::load(file, &mut settings, &mut actions)?;
        }
        // Certificates are re-read on every reload (that is how renewed ones are picked
        // up); a broken one fails the reload and the running configuration stays.
        settings
            .build_tls(Some(&self.state.settings().tls_built))
            .map_err(|e| self.tls_error(e))?;
        Ok((settings, actions))
    }

    fn tls_error(&self, e: crate::tls::TlsError) -> ConfigError {
        ConfigError {
            file: self
                .config_file
                .clone()
                .unwrap_or_else(|| PathBuf::from("(command line)")),
            line: 0,
            reason: e.to_string(),
        }
    }

    /// Reload (SIGHUP): rebuild everything from the command line and the file; on any
    /// error the running configuration stays and the error is returned. The log files are
    /// reopened either way.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let reloaded = self.rebuild();
        if reloaded.is_err() {
            // Log rotation (`mv log log.1; kill -HUP`) must not hang on the configuration
            // being good: a bad line, or a file the `-u` user cannot read, would leave
            // quill writing to the rotated file for good. Pen reopens its log before it
            // even reads its file. The running settings name the files to reopen; a good
            // reload reopens them as one of its actions (`Action::ReopenLog`).
            self.reopen_log();
        }
        reloaded
    }

    /// The reload proper: everything built, then published, or nothing changed.
    fn rebuild(&self) -> Result<(), ConfigError> {
        let (settings, mut actions) = self.build_settings()?;
        taken_up_at_runtime(&self.state.settings(), &settings).map_err(|reason| ConfigError {
            file: self.config_file.clone().unwrap_or_default(),
            line: 0,
            reason,
        })?;
        // Rebuilding from scratch always "sets" the listening address; only a real change
        // means a new socket. It is bound before anything is published, so an address
        // that cannot be bound fails the reload as a whole.
        actions.retain(|a| !matches!(a, Action::Relisten(_) | Action::MetricsListen(_)));
        let old = self.state.settings();
        let new_listeners = match &settings.listen {
            Some(addr) if settings.listen != old.listen => {
                Some(self.open_listeners(addr).map_err(|e| ConfigError {
                    file: self.config_file.clone().unwrap_or_default(),
                    line: 0,
                    reason: e.to_string(),
                })?)
            }
            _ => None,
        };
        let new_metrics = if settings.metrics_listen == old.metrics_listen {
            None
        } else {
            Some(
                self.bind_metrics(settings.metrics_listen)
                    .map_err(|e| ConfigError {
                        file: self.config_file.clone().unwrap_or_default(),
                        line: 0,
                        reason: e.to_string(),
                    })?,
            )
        };
        actions.push(Action::ReopenLog);
        crate::logging::set_level(settings.debug);
        let rest = self.state.replace(settings, actions);
        self.state.recycle();
        if let Some(listeners) = new_listeners {
            self.hand_over(listeners);
        }
        if let Some(metrics) = new_metrics {
            self.hand_over_metrics(metrics);
        }
        self.carry_out(rest);
        Ok(())
    }

    /// Binds the metrics listener for `addr` (nothing to bind for `None`).
    pub fn bind_metrics(
        &self,
        addr: Option<SocketAddr>,
    ) -> Result<Option<std::net::TcpListener>, web::BindError> {
        addr.map(web::bind).transpose()
    }

    /// Gives the metrics server its new listener (`None`: stop listening).
    pub fn hand_over_metrics(&self, listener: Option<std::net::TcpListener>) {
        let _ = self.metrics.send(listener);
    }

    /// Binds the sockets for a new listening address, one per event loop.
    pub fn open_listeners(&self, addr: &ListenAddr) -> Result<Vec<Listener>, listen::ListenError> {
        let backlog = self.state.settings().backlog;
        listen::open(addr, self.relisten.len(), backlog)
    }

    /// Gives each event loop its new listener; the old ones close, connections stay.
    pub fn hand_over(&self, listeners: Vec<Listener>) {
        self.remember_listeners(&listeners);
        for (tx, l) in self.relisten.iter().zip(listeners) {
            let _ = tx.send(l);
        }
    }

    /// Keeps duplicates of the listeners that serve now, for a binary upgrade.
    pub fn remember_listeners(&self, listeners: &[Listener]) {
        let dups: Result<Vec<OwnedFd>, io::Error> =
            listeners.iter().map(Listener::dup_fd).collect();
        match dups {
            Ok(d) => *self.listener_fds.lock().unwrap_or_else(|p| p.into_inner()) = d,
            Err(e) => tracing::warn!("cannot keep the listeners for a binary upgrade: {e}"),
        }
    }

    /// Duplicates of the listeners that serve now.
    pub fn listener_dups(&self) -> io::Result<Vec<OwnedFd>> {
        self.listener_fds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(OwnedFd::try_clone)
            .collect()
    }

    /// Closes the duplicates kept for an upgrade, so that once the event loops and the
    /// control task have let go of the sockets, they really close (or live on only in the
    /// process that took them over).
    pub fn forget_sockets(&self) {
        self.listener_fds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        *self.control_fd.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// A new process serves the sockets now: this one stops accepting and finishes.
    pub fn hand_off(&self) {
        self.upgraded.store(true, Ordering::SeqCst);
        self.exit.notify_one();
    }

    /// Applies a file on top of the running configuration (`include`), all or nothing.
    pub fn include(&self, file: &Path) -> Result<(), ConfigError> {
        let mut settings = Settings::clone(&self.state.settings());
        let mut actions = Vec::new();
        config::load(file, &mut settings, &mut actions)?;
        taken_up_at_runtime(&self.state.settings(), &settings).map_err(|reason| ConfigError {
            file: file.to_path_buf(),
            line: 0,
            reason,
        })?;
        let previous = self.state.settings().tls_built.clone();
        settings
            .build_tls(Some(&previous))
            .map_err(|e| ConfigError {
                file: file.to_path_buf(),
                line: 0,
                reason: e.to_string(),
            })?;
        let rest = self.state.replace(settings, actions);
        self.carry_out(rest);
        Ok(())
    }

    /// Carries out actions that need the process: new listeners, the log file.
    pub fn carry_out(&self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Relisten(addr) => {
                    if let Err(e) = self.relisten_to(&addr) {
                        tracing::error!("listen {addr}: {e}");
                    }
                }
                Action::ReopenLog => self.reopen_log(),
                Action::MetricsListen(addr) => match self.bind_metrics(addr) {
                    Ok(l) => self.hand_over_metrics(l),
                    Err(e) => tracing::error!("{e}"),
                },
                other => {
                    let _ = self.state.perform(other);
                }
            }
        }
    }

    /// Opens listeners on `addr` and hands one to each event loop; the old ones close,
    /// established connections stay.
    pub fn relisten_to(&self, addr: &ListenAddr) -> Result<(), listen::ListenError> {
        let listeners = self.open_listeners(addr)?;
        self.hand_over(listeners);
        tracing::info!("now listening on {addr}");
        Ok(())
    }

    /// (Re)opens the connection log and the access log named in the settings, or closes
    /// them. A log file already open under the same name is reopened in place (rotation):
    /// its writer goes on in the new file for every connection, old ones included.
    pub fn reopen_log(&self) {
        let settings = self.state.settings();
        reopen(
            &self.state.log,
            settings.log.as_ref().map(|w| w.as_str()),
            "log file",
            ConnLog::file,
            ConnLog::open,
        );
        reopen(
            &self.state.access_log,
            settings.access_log.as_ref().map(|w| w.as_str()),
            "access log",
            |log| Some(log.file()),
            |name| crate::accesslog::AccessLog::open(Path::new(name)),
        );
    }

    /// Writes the HTML status report to the `web_stats` file, if one is configured.
    pub fn write_web_stats(&self) {
        if let Some(file) = &self.state.settings().web_stats {
            if let Err(e) =
                write_atomically(Path::new(file.as_str()), report::html(self).as_bytes())
            {
                tracing::error!("cannot write status file {file}: {e}");
            }
        }
    }
}

/// Points `slot` at the log named `name` (none: closes it): the file open there already
/// under that name is reopened in place (`file_of` tells it), anything else is opened
/// anew (`open`); a failure is logged and leaves the slot as it was.
fn reopen<L>(
    slot: &arc_swap::ArcSwapOption<L>,
    name: Option<&str>,
    what: &str,
    file_of: impl Fn(&L) -> Option<&crate::logfile::LogFile>,
    open: impl Fn(&str) -> io::Result<L>,
) {
    let Some(name) = name else {
        slot.store(None);
        return;
    };
    let current = slot.load();
    let same = current
        .as_ref()
        .and_then(|log| file_of(log))
        .filter(|f| f.path() == Some(Path::new(name)));
    if let Some(file) = same {
        if let Err(e) = file.reopen() {
            tracing::error!("cannot reopen {what} {name}: {e}");
        }
        return;
    }
    match open(name) {
        Ok(log) => slot.store(Some(Arc::new(log))),
        Err(e) => tracing::error!("cannot open {what} {name}: {e}"),
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so readers never see
/// a half-written file; where the directory refuses that, rewrites the file in place.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // The temporary file and the rename need write permission on the directory, which
    // quill after `-u` often lacks where it owns the file itself (`write` to its `-F` file,
    // the `-w` status page, in a root-owned directory). Pen always writes in place (open,
    // truncate, write): so does quill then, rather than fail where Pen works. A reader may
    // then see the file half-written, as with Pen.
    match std::fs::write(&tmp, bytes) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            return write_in_place(path, bytes)
        }
        Err(e) => return Err(e),
    }
    match std::fs::rename(&tmp, path) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            // A sticky directory (such as /tmp) refuses to replace another user's file.
            if e.kind() == io::ErrorKind::PermissionDenied {
                write_in_place(path, bytes)
            } else {
                Err(e)
            }
        }
    }
}

/// Pen's way: the file opened (created if need be), truncated and written.
fn write_in_place(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    file.write_all(bytes)?;
    file.flush()
}

/// Where the control socket listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl ControlAddr {
    /// Parses `[host:]port` (a bare port means 127.0.0.1, as a safe default) or a path.
    pub fn parse(s: &str) -> Result<ControlAddr, String> {
        if s.contains('/') {
            return Ok(ControlAddr::Unix(PathBuf::from(s)));
        }
        let spec = if s.bytes().all(|b| b.is_ascii_digit()) {
            format!("127.0.0.1:{s}")
        } else {
            s.to_string()
        };
        match ListenAddr::parse(&spec) {
            Ok(ListenAddr::Tcp(a)) => Ok(ControlAddr::Tcp(a)),
            Ok(ListenAddr::Unix(p)) => Ok(ControlAddr::Unix(p)),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl std::fmt::Display for ControlAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlAddr::Tcp(a) => write!(f, "{a}"),
            ControlAddr::Unix(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A bound control socket.
pub enum ControlListener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

/// Binds the control socket. A Unix socket gets mode 0600 (only its owner may use it).
pub fn bind(addr: &ControlAddr) -> io::Result<ControlListener> {
    match addr {
        ControlAddr::Tcp(a) => {
            let l = std::net::TcpListener::bind(a)?;
            l.set_nonblocking(true)?;
            Ok(ControlListener::Tcp(l))
        }
        ControlAddr::Unix(path) => {
            use std::os::unix::fs::PermissionsExt;
            if std::fs::symlink_metadata(path).is_ok()
                && std::os::unix::net::UnixStream::connect(path).is_err()
            {
                std::fs::remove_file(path)?;
            }
            let l = std::os::unix::net::UnixListener::bind(path)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            l.set_nonblocking(true)?;
            Ok(ControlListener::Unix(l))
        }
    }
}

/// Serves the control socket until the process ends.
pub async fn serve(ctx: Arc<Context>, listener: ControlListener) -> io::Result<()> {
    match listener {
        ControlListener::Tcp(l) => {
            let l = TcpListener::from_std(l)?;
            loop {
                let (sock, peer) = match l.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!("control accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let ctx = Arc::clone(&ctx);
                tokio::spawn(async move {
                    let settings = ctx.state.settings();
                    let permitted = settings.acls[settings.control_acl.index()].permits(peer.ip());
                    drop(settings);
                    if !permitted {
                        tracing::warn!(%peer, "control connection refused by control_acl");
                        refuse(sock, "error: access denied by control_acl\n").await;
                        return;
                    }
                    answer(&ctx, sock).await;
                });
            }
        }
        ControlListener::Unix(l) => {
            let l = UnixListener::from_std(l)?;
            loop {
                let sock = match l.accept().await {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!("control accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let ctx = Arc::clone(&ctx);
                tokio::spawn(async move { answer_unix(&ctx, sock).await });
            }
        }
    }
}

/// Reads one command line, executes it, writes the reply and closes. Public so that the
/// fuzz target drives exactly this path (framing and dispatch) over an in-memory stream.
pub async fn answer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    ctx: &Arc<Context>,
    mut sock: S,
) {
    let line = tokio::time::timeout(READ_TIMEOUT, read_line(&mut sock)).await;
    reply(ctx, sock, line).await;
}

/// As [`answer`], and on a Unix socket `upgrade` hands the sockets to a new process.
async fn answer_unix(ctx: &Arc<Context>, mut sock: tokio::net::UnixStream) {
    let line = tokio::time::timeout(READ_TIMEOUT, read_line(&mut sock)).await;
    if matches!(&line, Ok(Ok(l)) if l == "upgrade") {
        upgrade::offer(ctx, sock).await;
        return;
    }
    reply(ctx, sock, line).await;
}

/// Writes the reply to a framed line (or the error of one that could not be framed).
async fn reply<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    ctx: &Arc<Context>,
    mut sock: S,
    line: Result<Result<String, String>, tokio::time::error::Elapsed>,
) {
    let reply = match line {
        Err(_) => "error: no command received in time\n".to_string(),
        Ok(Err(reason)) => format!("error: {reason}\n"),
        Ok(Ok(line)) => {
            let reply = off_thread(ctx, move |ctx| dispatch::execute_line(ctx, &line))
                .await
                .unwrap_or_else(|e| format!("error: {e}\n"));
            let _ = sock.write_all(reply.as_bytes()).await;
            let _ = sock.shutdown().await;
            return;
        }
    };
    refuse(sock, &reply).await;
}

/// Runs `work` (a command, a reload) on a thread of the blocking pool; await the handle:
/// a command may resolve a host name (`server N address HOST`, `-l HOST:PORT`) or read
/// files, and a slow resolver must not stall what shares the control thread (other
/// commands, the metrics listener, health checks). Settings changes stay ordered:
/// `State::execute` takes the writer's lock. The daemon's control runtime has a few such
/// threads (`daemon::CONTROL_THREADS`); work beyond them waits.
pub fn off_thread<T: Send + 'static>(
    ctx: &Arc<Context>,
    work: impl FnOnce(&Context) -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    let ctx = Arc::clone(ctx);
    tokio::task::spawn_blocking(move || work(&ctx))
}

/// Whether a running quill can take `new` up in place of `old` (a control command, a
/// reload, an include): the settings checked or opened only at start-up are refused here
/// before anything is published, as they would be at start-up.
pub(crate) fn taken_up_at_runtime(old: &Settings, new: &Settings) -> Result<(), String> {
    // Without CAP_NET_ADMIN (quill runs as its `-u` user by now) every connect would fail
    // and blacklist every server.
    if new.transparent && !old.transparent {
        crate::net::connect::check_transparent().map_err(|e| {
            format!("transparent: cannot use IP_TRANSPARENT ({e}): it needs CAP_NET_ADMIN")
        })?;
    }
    // The packet socket is opened at start-up, before privileges are dropped: a change
    // would do nothing now, and `write` would record it for the next start to meet.
    if new.dsr_if != old.dsr_if {
        return Err(
            "dsr_if takes effect only at start-up (-o, -O or the -F file): restart quill"
                .to_string(),
        );
    }
    // The same for the kernel path's program, attached before the drop (CAP_BPF).
    if new.udp_offload != old.udp_offload {
        return Err(
            "udp_offload takes effect only at start-up (-o, -O or the -F file): restart quill"
                .to_string(),
        );
    }
    Ok(())
}

/// Sends an error and closes, with the client possibly still sending. Closing with unread
/// input makes the kernel send a reset, which can destroy the reply before the client has
/// read it: what the client still sends is read and dropped first, a bounded amount for a
/// bounded time, so that it sees the error rather than a reset.
async fn refuse<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut sock: S, reply: &str) {
    let _ = sock.write_all(reply.as_bytes()).await;
    let _ = sock.shutdown().await;
    let drain = async {
        let mut chunk = [0u8; 4096];
        let mut left = DRAIN_MAX;
        while left > 0 {
            match tokio::time::timeout(DRAIN_IDLE, sock.read(&mut chunk)).await {
                Ok(Ok(0) | Err(_)) | Err(_) => break,
                Ok(Ok(n)) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain).await;
}

/// Reads up to the first newline (excluded, as is a trailing CR). Refuses more than
/// [`MAX_LINE`] bytes without a newline, and bytes that are not UTF-8.
async fn read_line<S: tokio::io::AsyncRead + Unpin>(sock: &mut S) -> Result<String, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = if buf.is_empty() {
            sock.read(&mut chunk).await
        } else {
            match tokio::time::timeout(UNTERMINATED, sock.read(&mut chunk)).await {
                Ok(read) => read,
                Err(_) => break,
            }
        };
        let n = n.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        // Only the new bytes can hold the first newline: no rescan of what came before.
        if let Some(end) = chunk[..n].iter().position(|&b| b == b'\n') {
            buf.extend_from_slice(&chunk[..end]);
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_LINE {
            return Err(format!("command longer than {MAX_LINE} bytes"));
        }
    }
    if buf.len() > MAX_LINE {
        return Err(format!("command longer than {MAX_LINE} bytes"));
    }
    let line = String::from_utf8(buf).map_err(|_| "command is not valid UTF-8".to_string())?;
    Ok(line.trim_end_matches('\r').to_string())
}
