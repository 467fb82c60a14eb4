//! systemd integration: `sd_notify` states for `Type=notify` units and listeners passed by
//! socket activation (`LISTEN_FDS`/`LISTEN_PID`).
//!
//! Every function is a no-op outside systemd (no `NOTIFY_SOCKET`, no `LISTEN_FDS`), so
//! the same binary runs anywhere. A failed notification is logged, never fatal: the
//! balancer serving is worth more than systemd's view of it.

use std::io;

use sd_notify::NotifyState;

use crate::net::Listener;

fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!("sd_notify: {e}");
    }
}

/// Start-up is complete: listeners serve, the control socket answers. `MAINPID` tells
/// systemd which process this is (it changes after a binary upgrade).
pub fn ready() {
    send(&[
        NotifyState::Ready,
        NotifyState::MainPid(std::process::id()),
        NotifyState::Status("serving"),
    ]);
}

/// A reload (SIGHUP) begins. systemd ≥ 253 wants the monotonic time with it, to tell this
/// reload from an earlier one; `ready` ends it.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now]),
        Err(e) => {
            tracing::warn!("sd_notify: no monotonic clock: {e}");
            send(&[NotifyState::Reloading]);
        }
    }
}

/// The process is stopping (TERM, INT, `exit`, or a binary upgrade handed over).
pub fn stopping() {
    send(&[NotifyState::Stopping]);
}

/// A status line for `systemctl status`.
pub fn status(text: &str) {
    send(&[NotifyState::Status(text)]);
}

/// Why the sockets systemd passed cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("socket activation: descriptor {index} (fd {fd}): {reason}")]
pub struct ActivationError {
    pub index: usize,
    pub fd: usize,
    pub reason: String,
}

/// The listening stream sockets systemd passed (`LISTEN_FDS`, meant for this pid), in
/// order; `None` when the process was not socket-activated. Each is made non-blocking.
pub fn activated_listeners() -> Result<Option<Vec<Listener>>, ActivationError> {
    let mut fds = listenfd::ListenFd::from_env();
    if fds.len() == 0 {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(fds.len());
    for index in 0..fds.len() {
        let err = |reason: String| ActivationError {
            index,
            fd: index + 3,
            reason,
        };
        let listener = match fds.take_tcp_listener(index) {
            Ok(Some(l)) => Listener::Tcp(l),
            Ok(None) => return Err(err("already taken".into())),
            Err(tcp_err) => match fds.take_unix_listener(index) {
                Ok(Some(l)) => Listener::Unix(l),
                Ok(None) => return Err(err("already taken".into())),
                Err(_) => {
                    return Err(err(format!(
                        "not a listening TCP or Unix stream socket ({tcp_err})"
                    )))
                }
            },
        };
        nonblocking(&listener).map_err(|e| err(e.to_string()))?;
        out.push(listener);
    }
    Ok(Some(out))
}

fn nonblocking(l: &Listener) -> io::Result<()> {
    match l {
        Listener::Tcp(l) => l.set_nonblocking(true),
        Listener::Unix(l) => l.set_nonblocking(true),
    }
}

/// Spreads `sockets` over `loops` event loops: every socket is served by at least one
/// loop; a socket shared by several loops is shared through duplicated descriptors (one
/// accept queue, as with a Unix listener).
pub fn spread(sockets: Vec<Listener>, loops: usize) -> io::Result<Vec<Listener>> {
    let n = loops.max(sockets.len()).max(1);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let Some(s) = sockets.get(i % sockets.len().max(1)) else {
            break;
        };
        out.push(s.try_clone()?);
    }
    Ok(out)
}
