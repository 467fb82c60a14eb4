//! Process life: build the settings from the command line and the configuration file, bind
//! the listeners and the control socket, become a daemon unless `-f`, run one event loop
//! per core, and react to signals until told to stop.
//!
//! Order matters: everything that can fail because of the user's input (commands, the
//! configuration file, address resolution, binding) happens before the process detaches or
//! starts a thread, so a bad start exits with a message and nothing is half started.
//! Signals: HUP reloads the configuration file and reopens the log; USR1 reports statistics
//! and rewrites the `web_stats` file; TERM and INT stop accepting, let open connections
//! finish for `shutdown_grace` (a second TERM/INT cuts that short), remove the pid file and
//! Unix sockets, and exit 0. After a binary upgrade (`--takeover` in the new process) the
//! old one stops the same way but leaves the files, which are the new process's.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Notify};

use crate::cli::{Invocation, Protocol};
use crate::command::Command;
use crate::config::{self, ConfigError};
use crate::control::upgrade::{self, UpgradeError};
use crate::control::{self, Context, ControlAddr, ControlListener};
use crate::logging;
use crate::net::{listen, ListenAddr};
use crate::privileges;
use crate::settings::{Action, Settings};
use crate::state::State;
use crate::systemd::{self, ActivationError};

/// Why the daemon could not start. Each variant carries what the user needs to fix it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A command (from a flag, `-O` or a server argument) was refused.
    #[error("'{arg}': {reason}")]
    Command { arg: String, reason: String },
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("no listening address: give [host:]port or a 'listen' command in the -F file")]
    NoListen,
    #[error(transparent)]
    Listen(#[from] listen::ListenError),
    #[error("control socket {addr}: {reason}")]
    Control { addr: String, reason: String },
    #[error(
        "refusing to open a control socket while running as root: drop privileges with \
         -u USER, or give -u root to insist"
    )]
    ControlAsRoot,
    #[error("pid file {path}: {source}")]
    PidFile { path: PathBuf, source: io::Error },
    #[error("cannot become a daemon: {0}")]
    Daemon(io::Error),
    #[error("cannot start an event loop: {0}")]
    Runtime(io::Error),
    #[error("{0} is not supported by this build of quill yet")]
    Unsupported(&'static str),
    #[error("{0}")]
    Privileges(String),
    #[error("{0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("{0}")]
    Metrics(String),
    #[error(transparent)]
    Dsr(#[from] crate::dsr::DsrError),
    #[error("udp_offload: {0}")]
    Offload(#[from] crate::proxy::offload::OffloadError),
    #[error(
        "transparent: cannot use IP_TRANSPARENT ({0}); quill needs CAP_NET_ADMIN for it \
         (run as root without -u, or grant the capability), plus the policy routing of \
         docs/TRANSPARENT.md"
    )]
    Transparent(io::Error),
    #[error("binary upgrade: {0}")]
    Upgrade(#[from] UpgradeError),
    #[error(transparent)]
    Activation(#[from] ActivationError),
}

impl StartError {
    /// Exit status: 2 for mistakes in the arguments or files, 1 for failures of the system.
    pub fn exit_code(&self) -> u8 {
        match self {
            StartError::Command { .. }
            | StartError::Config(_)
            | StartError::NoListen
            | StartError::ControlAsRoot
            | StartError::Privileges(_)
            | StartError::Tls(_)
            | StartError::Unsupported(_)
            | StartError::Upgrade(UpgradeError::NeedsUnixControl | UpgradeError::Udp)
            | StartError::Dsr(crate::dsr::DsrError::Listen { .. })
            | StartError::Dsr(crate::dsr::DsrError::Server { .. }) => 2,
            _ => 1,
        }
    }
}

/// Builds the settings from the invocation's commands and configuration file.
pub fn build_settings(inv: &Invocation) -> Result<(Settings, Vec<Action>), StartError> {
    let mut settings = Settings::default();
    let mut actions = Vec::new();
    for (arg, cmd) in &inv.commands {
        let applied = settings.apply(cmd).map_err(|e| StartError::Command {
            arg: arg.clone(),
            reason: e.to_string(),
        })?;
        actions.extend(applied.actions);
    }
    if let Some(file) = &inv.config {
        config::load(file, &mut settings, &mut actions)?;
    }
    settings.build_tls(None)?;
    Ok((settings, actions))
}

/// The control socket's address (`-C`), refused for a root process that keeps root.
pub fn control_address(inv: &Invocation) -> Result<Option<ControlAddr>, StartError> {
    let Some(c) = &inv.control else {
        return Ok(None);
    };
    if rustix::process::geteuid().is_root() && inv.user.is_none() {
        return Err(StartError::ControlAsRoot);
    }
    ControlAddr::parse(c)
        .map(Some)
        .map_err(|reason| StartError::Control {
            addr: c.clone(),
            reason,
        })
}

/// The number of event loops: the `workers` setting, or one per core we may run on.
fn worker_count(settings: &Settings) -> usize {
    if settings.workers > 0 {
        return settings.workers;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn chown(path: &std::path::Path, account: &privileges::Account) -> io::Result<()> {
    nix::unistd::chown(
        path,
        Some(nix::unistd::Uid::from_raw(account.uid)),
        Some(nix::unistd::Gid::from_raw(account.gid)),
    )
    .map_err(io::Error::from)
}

/// Removes the pid file and Unix sockets when the process ends normally.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            match std::fs::remove_file(p) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // After `-u` the user may not write to the file's directory (a root-owned
                // /run): nothing quill can do then, but the file it leaves is said, so that
                // a stale pid file or socket is no surprise.
                Err(e) => tracing::warn!("cannot remove {} at exit: {e}", p.display()),
            }
        }
    }
}

/// Runs the balancer until it is told to stop.
pub fn run(inv: Invocation) -> Result<(), StartError> {
    // Logging first: syslog's socket must be connected before a chroot hides /dev/log.
    logging::init(inv.foreground);
    // Look the account up (in the jail's user database), then enter the jail while still
    // root: from here on, start-up and every reload read the same files, the ones inside
    // the jail, as with Pen. The user is dropped to only after binding.
    let account = match inv.user.as_deref() {
        None => None,
        Some(user) => Some(
            privileges::lookup_account(inv.jail.as_deref(), user)
                .map_err(|e| StartError::Privileges(e.to_string()))?,
        ),
    };
    // A jail rarely has /dev/null: open it now for the daemon's standard streams.
    let dev_null = if inv.foreground {
        None
    } else {
        Some(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                .map_err(StartError::Daemon)?,
        )
    };
    if let Some(jail) = &inv.jail {
        privileges::enter_jail(jail).map_err(|e| StartError::Privileges(e.to_string()))?;
    }
    let (settings, actions) = build_settings(&inv)?;
    logging::set_level(settings.debug);
    let listen_addr = settings.listen.clone().ok_or(StartError::NoListen)?;
    let control_addr = control_address(&inv)?;

    let workers = worker_count(&settings);
    crate::proxy::pool::set_loops(workers);
    // DSR: no listening socket (the VIP is not ours); a packet socket on the interface,
    // opened now, while quill may still do so.
    let dsr = match &settings.dsr_if {
        None => None,
        Some(interface) => {
            let transport = match inv.protocol {
                Protocol::Tcp => crate::dsr::Transport::Tcp,
                Protocol::Udp => crate::dsr::Transport::Udp,
            };
            let config =
                crate::dsr::DsrConfig::new(interface.as_str(), &settings, &listen_addr, transport)?;
            Some(crate::dsr::open(config)?)
        }
    };
    // The listening sockets come from the running quill (binary upgrade), from systemd
    // (socket activation), or from our own bind, in that order of preference.
    let takeover = if inv.takeover {
        if inv.protocol == Protocol::Udp {
            return Err(UpgradeError::Udp.into());
        }
        let Some(ControlAddr::Unix(path)) = &control_addr else {
            return Err(UpgradeError::NeedsUnixControl.into());
        };
        Some(upgrade::take_over(path, &listen_addr)?)
    } else {
        None
    };
    let activated = match takeover {
        Some(_) => None,
        None => systemd::activated_listeners()?,
    };
    let (takeover_control, handshake, taken) = match takeover {
        Some(t) => (Some(t.control), Some(t.handshake), Some(t.listeners)),
        None => (None, None, None),
    };
    // Bound like the other listeners: before detaching and before dropping privileges;
    // and before the data listeners, so that whoever finds quill's port open finds its
    // metrics too (a scraper or a test started with it was refused in between).
    // In a binary upgrade the old process still holds it: it is bound once that one has
    // let go (see `rebind_metrics_after_upgrade`).
    let metrics_listener = match settings.metrics_listen {
        None => None,
        Some(addr) => {
            control::web::warn_if_control_open(&settings, addr);
            if inv.takeover {
                None
            } else {
                Some(control::web::bind(addr).map_err(|e| StartError::Metrics(e.to_string()))?)
            }
        }
    };
    // Removes what start-up created should it fail from here on, and all of it at exit.
    let mut cleanup = Cleanup(Vec::new());
    // The control socket too: whoever finds quill's port open (a script that runs
    // quillctl right after starting it) must find the control socket as well.
    let control_listener = match (&control_addr, takeover_control) {
        (_, Some(l)) => Some(ControlListener::Unix(l)),
        (None, None) => None,
        (Some(addr), None) => {
            let bound = addr.clone();
            let l = control::bind(&bound).map_err(|e| StartError::Control {
                addr: addr.to_string(),
                reason: e.to_string(),
            })?;
            if let ControlAddr::Unix(p) = &bound {
                cleanup.0.push(p.clone());
                if let Some(a) = &account {
                    // The socket belongs to the user quill runs as (and stays mode 0600).
                    chown(p, a).map_err(|e| StartError::Control {
                        addr: addr.to_string(),
                        reason: e.to_string(),
                    })?;
                }
            }
            Some(l)
        }
    };
    let (listeners, udp_listeners) = match (inv.protocol, taken, activated) {
        _ if dsr.is_some() => (Vec::new(), Vec::new()),
        (Protocol::Udp, _, Some(_)) => {
            return Err(StartError::Unsupported(
                "socket activation of UDP sockets (-U)",
            ))
        }
        (Protocol::Udp, _, None) => (Vec::new(), crate::net::udp::open(&listen_addr, workers)?),
        (Protocol::Tcp, Some(taken), _) => {
            if taken.len() != workers {
                tracing::info!(
                    "binary upgrade: {} event loop(s), one per listener handed over",
                    taken.len()
                );
            }
            (taken, Vec::new())
        }
        (Protocol::Tcp, None, Some(sockets)) => {
            tracing::info!(
                "socket activation: {} listener(s) from systemd",
                sockets.len()
            );
            (
                systemd::spread(sockets, workers).map_err(StartError::Runtime)?,
                Vec::new(),
            )
        }
        (Protocol::Tcp, None, None) => (
            listen::open(&listen_addr, workers, settings.backlog)?,
            Vec::new(),
        ),
    };
    // Kept for a later binary upgrade to hand over.
    let control_fd = match &control_listener {
        Some(ControlListener::Unix(l)) => {
            use std::os::fd::AsFd;
            Some(
                l.as_fd()
                    .try_clone_to_owned()
                    .map_err(StartError::Runtime)?,
            )
        }
        _ => None,
    };
    if let Some(null) = dev_null {
        // Detach before any thread exists: fork() keeps only the calling thread.
        nix::unistd::daemon(true, true).map_err(|e| StartError::Daemon(e.into()))?;
        rustix::stdio::dup2_stdin(&null).map_err(|e| StartError::Daemon(e.into()))?;
        rustix::stdio::dup2_stdout(&null).map_err(|e| StartError::Daemon(e.into()))?;
        rustix::stdio::dup2_stderr(&null).map_err(|e| StartError::Daemon(e.into()))?;
    }
    // The signal handlers exist before the pid file does: `kill -HUP $(cat pidfile)` must
    // never meet the default action, which would end the process.
    // Control commands run on its blocking pool (`control::off_thread`): a few threads
    // are plenty for them, and bound what clients stuck on a slow resolver can hold.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(CONTROL_THREADS)
        .build()
        .map_err(StartError::Runtime)?;
    let mut signals = rt
        .block_on(async { Signals::install() })
        .map_err(StartError::Runtime)?;
    if let Some(path) = &inv.pidfile {
        // With `-u`, written as root before the drop (so that it may be in a directory
        // only root writes to, such as /run) and left root's: a process that gave up root
        // must not be able to change the pid that root's scripts signal. Removing it at
        // exit needs write access to its directory for the user quill runs as (as with
        // Pen); else it is left, with a warning, naming a dead process.
        std::fs::write(path, format!("{}\n", std::process::id())).map_err(|source| {
            StartError::PidFile {
                path: path.clone(),
                source,
            }
        })?;
        cleanup.0.push(path.clone());
        if let Some(account) = &account {
            privileges::warn_if_pid_file_stays(account, path);
        }
    }
    // Loaded and attached with the privileges it needs, before they are dropped.
    let offload = match settings.udp_offload.as_ref() {
        Some(names) if inv.protocol == Protocol::Udp && dsr.is_none() => {
            let names: Vec<&str> = names.as_str().split(',').collect();
            let offload = crate::proxy::offload::Offload::start(&names)?;
            tracing::info!(
                "udp flows are carried in the kernel once answered (udp_offload on {})",
                names.join(", ")
            );
            Some(Arc::new(offload))
        }
        Some(_) => {
            tracing::warn!("udp_offload is for UDP mode (-U) without dsr_if: ignored");
            None
        }
        None => None,
    };
    if let Some(account) = &account {
        let dropped =
            privileges::become_user(account).map_err(|e| StartError::Privileges(e.to_string()))?;
        tracing::info!("{dropped}");
    }
    if settings.transparent && dsr.is_none() {
        // After dropping privileges: what counts is what the running process may do.
        crate::net::connect::check_transparent().map_err(StartError::Transparent)?;
    }
    if let ListenAddr::Unix(p) = &listen_addr {
        cleanup.0.push(p.clone());
    }
    if let (Some(ControlAddr::Unix(p)), true) = (&control_addr, inv.takeover) {
        // Handed over by the process this one replaces: ours to remove at exit now.
        cleanup.0.push(p.clone());
    }

    let state = State::new(settings, control_addr.is_some());
    let (stop_tx, stop_rx) = watch::channel(false);
    let (metrics_tx, metrics_rx) = mpsc::unbounded_channel();
    if metrics_listener.is_some() {
        let _ = metrics_tx.send(metrics_listener);
    }
    let (relisten, receivers): (Vec<_>, Vec<_>) = (0..listeners.len())
        .map(|_| mpsc::unbounded_channel())
        .unzip();
    let ctx = Arc::new(Context {
        state: Arc::clone(&state),
        control_addr: control_addr.as_ref().map(ToString::to_string),
        exit_enabled: inv.exit_enabled,
        config_file: inv.config.clone(),
        base_commands: inv
            .commands
            .iter()
            .map(|(_, c)| c.clone())
            .collect::<Vec<Command>>(),
        relisten,
        exit: Arc::new(Notify::new()),
        metrics: metrics_tx,
        listener_fds: std::sync::Mutex::new(Vec::new()),
        control_fd: std::sync::Mutex::new(control_fd),
        upgraded: std::sync::atomic::AtomicBool::new(false),
    });
    ctx.remember_listeners(&listeners);
    // Before the first connection is accepted: the log is open and the start-up actions
    // (e.g. `server N blacklist T` in the file) are carried out. The listeners were opened
    // above, so re-listen actions are dropped.
    let start_actions = actions
        .into_iter()
        .filter(|a| !matches!(a, Action::Relisten(_) | Action::MetricsListen(_)))
        .collect();
    ctx.carry_out(start_actions);
    ctx.reopen_log();

    // In the foreground the event loops never write to stderr themselves: a reader that
    // stalls (a paused pager, a blocked container log driver) would stop them. Start-up
    // (up to here) writes its lines at once, in order with an error `main` prints.
    let _stderr = if inv.foreground {
        Some(crate::logfile::StderrThread::start().map_err(StartError::Runtime)?)
    } else {
        None
    };
    let mut threads = Vec::with_capacity(listeners.len());
    for ((i, listener), rx) in listeners.into_iter().enumerate().zip(receivers) {
        let state = Arc::clone(&state);
        let stop = stop_rx.clone();
        let rt = crate::proxy::poll_before_sleep::event_loop_runtime(
            &state,
            crate::proxy::poll_before_sleep::Opens::AfterWork,
        )
        .map_err(StartError::Runtime)?;
        let lot = crate::proxy::park::EpollSet::new().map_err(StartError::Runtime)?;
        let thread = std::thread::Builder::new()
            .name(format!("quill-loop-{i}"))
            .spawn(move || {
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    // Under load the loop polls instead of sleeping (`proxy::polling`).
                    tokio::task::spawn_local(crate::proxy::polling::poll_while_busy());
                    // With `poll_before_sleep`, what keeps the loop polling for a while.
                    tokio::task::spawn_local(crate::proxy::poll_before_sleep::keeper());
                    // Connections waiting for their clients' next request close at stop;
                    // the watching ones (`signals::Watcher`) hear of stops, reloads and
                    // drains.
                    tokio::task::spawn_local(crate::proxy::signals::ring_on_change(Arc::clone(
                        &state,
                    )));
                    // The accept loop is a task of its own, not this future: the runtime
                    // polls the future given to `block_on` again at every wake-up of any
                    // task (a connection's included), and the accept loop's three waits
                    // polled each time cost ≈ 1.2 k of a relayed request's 5.8 k
                    // instructions (`bench/instructions --scenarios tcp`).
                    tokio::task::spawn_local(async move {
                        let served = crate::proxy::tcp::serve(state, listener, stop, rx, lot);
                        if let Err(e) = served.await {
                            tracing::error!("event loop {i}: {e}");
                        }
                    });
                    // Established connections of this loop finish after the accept loop
                    // ends (bounded by main).
                    std::future::pending::<()>().await;
                });
            })
            .map_err(StartError::Runtime)?;
        threads.push(thread);
    }
    let placer = offload
        .as_ref()
        .map(|o| crate::proxy::offload::placement::Placer::new(Arc::clone(&state), Arc::clone(o)));
    threads.extend(
        crate::proxy::udp::spawn_loops(&state, udp_listeners, &stop_rx, offload)
            .map_err(StartError::Runtime)?,
    );
    if let Some(dsr) = dsr {
        let running = dsr
            .spawn(Arc::clone(&state), stop_rx.clone())
            .map_err(StartError::Runtime)?;
        let _ = state.dsr.set(Arc::clone(&running.counters));
        threads.push(running.thread);
    }

    tracing::info!("listening on {listen_addr} with {workers} event loop(s)");
    warn_idle_without_http(&state.settings());

    let tasks = rt.block_on(async {
        // Health checks and the metrics listener live on this (control) runtime, never on
        // an event loop.
        let (withdraw_tx, withdraw_rx) = watch::channel(false);
        let (withdrawn_tx, withdrawn_rx) = tokio::sync::oneshot::channel();
        let (decided_tx, decided_rx) = tokio::sync::oneshot::channel();
        let mut tasks = vec![
            tokio::spawn(crate::health::supervise(Arc::clone(&state))),
            tokio::spawn(control::web::run(Arc::clone(&ctx), metrics_rx)),
            tokio::spawn(crate::announce::supervise(
                Arc::clone(&state),
                withdraw_rx,
                withdrawn_tx,
                decided_tx,
            )),
        ];
        if let Some(placer) = placer {
            tasks.push(tokio::spawn(placer.run()));
        }
        if let Some(l) = control_listener {
            let ctx = Arc::clone(&ctx);
            tasks.push(tokio::spawn(async move {
                if let Err(e) = control::serve(ctx, l).await {
                    tracing::error!("control socket: {e}");
                }
            }));
        }
        systemd::ready();
        if let Some(h) = handshake {
            // The old process's announced route vanishes with it: this one's must be in
            // the kernel (replacing it) before the old one is told to go.
            let _ = tokio::time::timeout(Duration::from_secs(2), decided_rx).await;
            // From here the old process stops accepting: this one serves alone.
            match h.ready() {
                Ok(()) => tracing::info!("binary upgrade: took over the listening sockets"),
                Err(e) => tracing::error!("binary upgrade: could not tell the old process: {e}"),
            }
            if let Some(addr) = ctx.state.settings().metrics_listen {
                tasks.push(tokio::spawn(rebind_metrics_after_upgrade(
                    Arc::clone(&ctx),
                    addr,
                )));
            }
        }
        handle_signals(&ctx, &mut signals).await;
        // After a binary upgrade the route is the new process's: it stays.
        if !ctx.upgraded.load(Relaxed) {
            withdraw_first(&state, &withdraw_tx, withdrawn_rx).await;
        }
        tasks
    });
    systemd::stopping();
    // No more control connections or health checks: after an upgrade, the control socket
    // is the new process's alone.
    for t in tasks {
        t.abort();
    }
    ctx.forget_sockets();
    if ctx.upgraded.load(Relaxed) {
        // The pid file and the sockets now belong to the new process.
        cleanup.0.clear();
    }

    // `shutdown_grace`: how long established connections may run on (0 = no limit).
    let grace = state.settings().shutdown_grace;
    let deadline = (grace > 0).then(|| Instant::now() + Duration::from_secs(grace));
    tracing::info!(
        "stopping: no new connections; waiting {} for {} open",
        if grace > 0 {
            format!("up to {grace} s")
        } else {
            "without limit".to_string()
        },
        state.active.load(Relaxed)
    );
    // Connections are told first, the listeners closed after: a client that sees the
    // listener gone and sends its next request on a kept-alive connection finds that
    // connection knowing of the stop, and its answer says `Connection: close`.
    state.stop();
    let _ = stop_tx.send(true);
    rt.block_on(async {
        let drained = async {
            while state.active.load(Relaxed) > 0
                && match deadline {
                    Some(d) => Instant::now() < d,
                    None => true,
                }
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        // A second TERM or INT ends the wait at once (the way out of an unlimited grace).
        tokio::select! {
            () = drained => match state.active.load(Relaxed) {
                0 => {}
                left => tracing::warn!("shutdown_grace ({grace} s) ran out: closing {left} open connection(s) now"),
            },
            _ = signals.term.recv() => tracing::warn!("second signal: closing {} open connection(s) now", state.active.load(Relaxed)),
            _ = signals.int.recv() => tracing::warn!("second signal: closing {} open connection(s) now", state.active.load(Relaxed)),
        }
    });
    // The logs' last lines: their writer threads write out what they hold once let go
    // (the lines of connections still open now, if the grace ran out, are lost with them).
    state.log.store(None);
    state.access_log.store(None);
    crate::logfile::finish(Duration::from_secs(2));
    drop(cleanup);
    // A control command or reload may still wait on a resolver on the blocking pool:
    // dropping the runtime would wait for it, so it is left behind with the process.
    rt.shutdown_background();
    Ok(())
}

/// Names the commands that do nothing because `http` is off (a reload too).
pub(crate) fn warn_idle_without_http(settings: &crate::settings::Settings) {
    let idle = settings.idle_without_http();
    if !idle.is_empty() {
        tracing::warn!("ignored without http (-H): {}", idle.join(", "));
    }
}

/// Stopping with an announced route: the route goes first, then quill serves on (accepting
/// too) for `announce_grace` seconds, so that the routers move new flows elsewhere before
/// the listeners close. Without a route, nothing waits.
async fn withdraw_first(
    state: &State,
    withdraw: &watch::Sender<bool>,
    withdrawn: tokio::sync::oneshot::Receiver<bool>,
) {
    let _ = withdraw.send(true);
    let had = tokio::time::timeout(Duration::from_secs(5), withdrawn)
        .await
        .is_ok_and(|r| r.unwrap_or(false));
    let grace = state.settings().announce_grace;
    if had && grace > 0 {
        tracing::info!("stopping: route withdrawn; serving on for {grace} s (announce_grace)");
        tokio::time::sleep(Duration::from_secs(grace)).await;
    }
}

/// After a binary upgrade: binds the metrics listener as soon as the old process has
/// closed it (it does when this one says `ready`), unless the address changed meanwhile.
async fn rebind_metrics_after_upgrade(ctx: Arc<Context>, addr: std::net::SocketAddr) {
    const PATIENCE: Duration = Duration::from_secs(30);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if ctx.state.settings().metrics_listen != Some(addr) {
            return;
        }
        match control::web::bind(addr) {
            Ok(l) => {
                ctx.hand_over_metrics(Some(l));
                return;
            }
            Err(e)
                if e.source.kind() == io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                // The old process is letting go: a short pause, then try again.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                tracing::error!("binary upgrade: {e}");
                return;
            }
        }
    }
}

/// The signals quill reacts to, registered once at start-up.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers (inside the runtime that will serve them).
    fn install() -> io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

/// Threads that run control commands and reloads at once (the control runtime's blocking
/// pool); more wait their turn.
const CONTROL_THREADS: usize = 8;

/// Serves signals until one says stop (TERM, INT, or the `exit` command).
async fn handle_signals(ctx: &Arc<Context>, signals: &mut Signals) {
    // A reload runs beside this loop rather than in it: a slow resolver must not hold a
    // stop. A HUP during a reload waits for it to end (the signal stream keeps one), then
    // reloads once more.
    let mut reload: Option<tokio::task::JoinHandle<Result<(), crate::config::ConfigError>>> = None;
    loop {
        tokio::select! {
            _ = signals.term.recv() => return,
            _ = signals.int.recv() => return,
            _ = ctx.exit.notified() => return,
            done = async {
                match reload.as_mut() {
                    Some(running) => running.await,
                    None => std::future::pending().await,
                }
            }, if reload.is_some() => {
                reload = None;
                match done {
                    Ok(Ok(())) => {
                        tracing::info!("configuration reloaded");
                        warn_idle_without_http(&ctx.state.settings());
                    }
                    Ok(Err(e)) => {
                        tracing::error!("reload failed, the running configuration stays: {e}")
                    }
                    Err(e) => tracing::error!("reload failed: {e}"),
                }
                systemd::ready();
            }
            _ = signals.hup.recv(), if reload.is_none() => {
                systemd::reloading();
                // Off the control thread, as a command: host names may be resolved.
                reload = Some(control::off_thread(ctx, Context::reload));
            }
            _ = signals.usr1.recv() => {
                let stats = control::report::servers(&ctx.state);
                tracing::warn!(
                    "statistics: {} connections open, {} accepted\n{stats}",
                    ctx.state.active.load(Relaxed),
                    ctx.state.counters.accepted.load(Relaxed)
                );
                ctx.write_web_stats();
            }
        }
    }
}
