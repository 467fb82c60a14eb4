//! Active health checks: one small task per checked server on the control runtime (never
//! on an event loop), each checking every `check_interval` and turning `check_fall`
//! failures in a row into "down", `check_rise` successes into "up" again.
//!
//! The verdict is one atomic of the server's [`ServerState`](crate::balance::ServerState)
//! that the selector reads; passive blacklisting is separate and keeps working beside it.
//! A supervisor re-plans whenever settings are published: a server whose check (address,
//! kind, timings) changed gets a fresh task; one whose check is gone is marked unchecked.

pub mod grpc;
pub mod probe;

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::balance::clock;
use crate::balance::servers::Health;
use crate::settings::Settings;
use crate::state::State;
use probe::Target;

/// Everything that decides how one server is checked; a change restarts its task.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Plan {
    pub target: Target,
    pub interval: Duration,
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
}

/// The checks the settings ask for, by server number.
pub fn plans(settings: &Settings) -> HashMap<usize, Plan> {
    let c = &settings.check;
    settings
        .servers
        .iter()
        .enumerate()
        .filter_map(|(index, conf)| {
            let addr = conf.addr()?;
            let probe = settings.probe_of(index)?.clone();
            let conf_host = conf.host.clone();
            let name = conf.host.as_ref().map_or_else(
                || addr.ip().to_string(),
                |h| match h.ip() {
                    Some(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
                    _ => h.to_string(),
                },
            );
            let host = if conf.port == 80 {
                name
            } else {
                format!("{name}:{}", conf.port)
            };
            Some((
                index,
                Plan {
                    target: Target {
                        addr,
                        host,
                        source: settings.source,
                        probe,
                        tls: settings
                            .tls_built
                            .upstream
                            .as_ref()
                            .map(|conf| probe::ProbeTls {
                                conf: Arc::clone(conf),
                                host: conf_host.clone(),
                            }),
                    },
                    interval: c.interval.duration(),
                    timeout: c.timeout.duration(),
                    rise: c.rise,
                    fall: c.fall,
                },
            ))
        })
        .collect()
}

/// Runs the health checks for as long as the process lives. Spawn it on the control
/// runtime.
pub async fn supervise(state: Arc<State>) {
    let mut generation = state.generation.subscribe();
    let mut running: HashMap<usize, (Plan, JoinHandle<()>)> = HashMap::new();
    loop {
        let wanted = plans(&state.settings());
        running.retain(|index, (plan, task)| {
            if wanted.get(index) == Some(plan) {
                return true;
            }
            task.abort();
            if !wanted.contains_key(index) {
                if let Some(s) = state.servers.get(*index) {
                    let was_down = s.health() == Health::Down;
                    s.set_health(Health::Unchecked);
                    if was_down {
                        tracing::warn!("server {index}: health check removed, counted as up");
                        state.servers.changed.notify_waiters();
                    }
                }
            }
            false
        });
        for (index, plan) in wanted {
            if running.contains_key(&index) {
                continue;
            }
            let task = tokio::spawn(check_server(Arc::clone(&state), index, plan.clone()));
            running.insert(index, (plan, task));
        }
        if generation.changed().await.is_err() {
            return;
        }
    }
}

/// Checks one server forever (until its task is aborted by the supervisor).
async fn check_server(state: Arc<State>, index: usize, plan: Plan) {
    let Some(server) = state.servers.get(index) else {
        return;
    };
    let addr = plan.target.addr;
    let mut ticks = tokio::time::interval(plan.interval);
    // After a stall, check once and keep the rhythm; never a burst of checks.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut passed, mut failed) = (0u32, 0u32);
    loop {
        ticks.tick().await;
        match probe::check(&plan.target, plan.timeout).await {
            Ok(()) => {
                server.checks_passed.fetch_add(1, Relaxed);
                failed = 0;
                passed = passed.saturating_add(1);
                match server.health() {
                    // The first answer settles the state of a server nobody checked yet.
                    Health::Unchecked => server.set_health(Health::Up),
                    Health::Down if passed >= plan.rise => {
                        server.up_since.store(clock::now_ms(), Relaxed);
                        server.set_health(Health::Up);
                        state.servers.changed.notify_waiters();
                        tracing::warn!(
                            "server {index} ({addr}) is up: {passed} health check(s) passed"
                        );
                    }
                    _ => {}
                }
            }
            Err(e) => {
                server.checks_failed.fetch_add(1, Relaxed);
                passed = 0;
                failed = failed.saturating_add(1);
                tracing::debug!("server {index} ({addr}) health check failed: {e}");
                if server.health() != Health::Down && failed >= plan.fall {
                    server.set_health(Health::Down);
                    tracing::warn!(
                        "server {index} ({addr}) is down: {failed} health check(s) failed, last: {e}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;

    fn settings(lines: &[&str]) -> Settings {
        let mut s = Settings::default();
        for l in lines {
            let cmd: Command = l.parse().unwrap_or_else(|e| panic!("{l}: {e}"));
            s.apply(&cmd).unwrap_or_else(|e| panic!("{l}: {e}"));
        }
        s
    }

    #[test]
    fn plans_follow_global_and_server_checks() {
        let s = settings(&[
            "server 0 address 127.0.0.1 port 80",
            "server 1 address 127.0.0.1 port 81 check off",
            "server 2 address ::1 port 82 check http /ok 204",
        ]);
        let p = plans(&s);
        assert_eq!(p.len(), 1);
        assert_eq!(p[&2].target.host, "[::1]:82");
        let s = settings(&[
            "check http /health",
            "check_interval 250ms",
            "server 0 address 127.0.0.1 port 80",
            "server 1 address 127.0.0.1 port 81 check off",
        ]);
        let p = plans(&s);
        assert_eq!(p.keys().collect::<Vec<_>>(), [&0]);
        assert_eq!(p[&0].target.host, "127.0.0.1");
        assert_eq!(p[&0].interval, Duration::from_millis(250));
    }
}
