//! Process life: build the settings from the invocation, open the listeners, become a
//! daemon unless `-f`, run one event loop per core, and stop cleanly on SIGTERM/SIGINT.
//!
//! Order matters: everything that can fail because of the user's input (commands, address
//! resolution, binding) happens before the process detaches or starts a thread, so a bad
//! command line exits with a message and nothing is half started.

use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cli::{Invocation, Protocol};
use crate::net::listen;
use crate::settings::Settings;
use crate::state::State;

/// How long established connections may run on after SIGTERM/SIGINT.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Why the daemon could not start. Each variant carries what the user needs to fix it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A command (from a flag, `-O` or a server argument) was refused.
    #[error("'{arg}': {reason}")]
    Command { arg: String, reason: String },
    #[error(transparent)]
    Listen(#[from] listen::ListenError),
    #[error("cannot become a daemon: {0}")]
    Daemon(io::Error),
    #[error("cannot start an event loop: {0}")]
    Runtime(io::Error),
    #[error("{0} is not supported by this build of quill yet")]
    Unsupported(&'static str),
}

impl StartError {
    /// Exit status: 2 for mistakes in the arguments, 1 for failures of the system.
    pub fn exit_code(&self) -> u8 {
        match self {
            StartError::Command { .. } | StartError::Unsupported(_) => 2,
            _ => 1,
        }
    }
}

/// Builds the settings from the invocation's commands, carrying out their runtime actions
/// on the state once it exists.
pub fn build_settings(
    inv: &Invocation,
) -> Result<(Settings, Vec<crate::settings::Action>), StartError> {
    let mut settings = Settings::default();
    let mut actions = Vec::new();
    for (arg, cmd) in &inv.commands {
        let applied = settings.apply(cmd).map_err(|e| StartError::Command {
            arg: arg.clone(),
            reason: e.to_string(),
        })?;
        actions.extend(applied.actions);
    }
    Ok((settings, actions))
}

/// The number of event loops: the `workers` setting, or one per core we may run on.
fn worker_count(settings: &Settings) -> usize {
    if settings.workers > 0 {
        return settings.workers;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn init_logging(debug: u32) {
    let level = match debug {
        0 => tracing::Level::WARN,
        1 => tracing::Level::INFO,
        2 => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(io::stderr)
        .with_target(false)
        .try_init();
}

/// Runs the balancer until it is told to stop.
pub fn run(inv: Invocation) -> Result<(), StartError> {
    let (settings, actions) = build_settings(&inv)?;
    init_logging(settings.debug);
    let workers = worker_count(&settings);
    if inv.protocol == Protocol::Udp {
        return Err(StartError::Unsupported("UDP load balancing (-U)"));
    }
    let listeners = listen::open(&inv.listen, workers, settings.backlog)?;
    if !inv.foreground {
        // Detach before any thread exists: fork() keeps only the calling thread.
        nix::unistd::daemon(true, false).map_err(|e| StartError::Daemon(e.into()))?;
    }
    let state = State::new(settings);
    for action in actions {
        state.perform(action);
    }
    tracing::info!("listening on {} with {workers} event loop(s)", inv.listen);

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut threads = Vec::with_capacity(listeners.len());
    for (i, listener) in listeners.into_iter().enumerate() {
        let state = Arc::clone(&state);
        let stop = stop_rx.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(StartError::Runtime)?;
        let thread = std::thread::Builder::new()
            .name(format!("quill-loop-{i}"))
            .spawn(move || {
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    if let Err(e) = crate::proxy::tcp::serve(state, listener, stop).await {
                        tracing::error!("event loop {i}: {e}");
                    }
                    // Let established connections of this loop finish (bounded by main).
                    std::future::pending::<()>().await;
                });
            })
            .map_err(StartError::Runtime)?;
        threads.push(thread);
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    rt.block_on(wait_for_stop_signal())
        .map_err(StartError::Runtime)?;
    tracing::info!(
        "stopping: no new connections; waiting up to {:?} for {} open",
        SHUTDOWN_GRACE,
        state.active.load(Relaxed)
    );
    let _ = stop_tx.send(true);
    if let crate::net::ListenAddr::Unix(path) = &inv.listen {
        let _ = std::fs::remove_file(path);
    }
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    rt.block_on(async {
        while state.active.load(Relaxed) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    Ok(())
}

async fn wait_for_stop_signal() -> io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
