//! Executes one control command and turns the outcome into the reply text, once.
//!
//! Configuration commands go to [`State::execute`](crate::state::State::execute); the
//! operations (`servers`, `close N`, `write`, ...) are carried out here.

use std::path::Path;

use super::{report, write_atomically, Context};
use crate::balance::clock;
use crate::command::{Command, StatusFormat};
use crate::config;
use crate::settings::Reply;

/// Parses and executes `line`; the reply always ends with a newline unless it is empty.
pub fn execute_line(ctx: &Context, line: &str) -> String {
    let reply = line
        .parse::<Command>()
        .map_err(|e| e.to_string())
        .and_then(|cmd| execute(ctx, &cmd));
    match reply {
        Ok(text) if text.is_empty() || text.ends_with('\n') => text,
        Ok(text) => text + "\n",
        Err(reason) => {
            tracing::info!("control command '{line}' refused: {reason}");
            format!("error: {reason}\n")
        }
    }
}

/// Executes one command.
pub fn execute(ctx: &Context, cmd: &Command) -> Result<String, String> {
    let state = &ctx.state;
    match cmd {
        Command::Servers => Ok(report::servers(state)),
        Command::Status(StatusFormat::Html) => {
            ctx.write_web_stats();
            Ok(report::html(ctx))
        }
        Command::Status(StatusFormat::Json) => Ok(report::json(ctx)),
        Command::Mode => Ok(report::mode(&state.settings())),
        Command::Recent(seconds) => Ok(report::recent(state, seconds.unwrap_or(300))),
        Command::Connection(id) => {
            let registry = state
                .registry
                .as_ref()
                .ok_or("connections are not tracked")?;
            let c = registry
                .get(*id)
                .ok_or_else(|| format!("no connection {id}"))?;
            Ok(report::connection(&c, clock::now_ms()))
        }
        Command::Connections(limit) => {
            let registry = state
                .registry
                .as_ref()
                .ok_or("connections are not tracked")?;
            let limit = limit.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
            Ok(report::connections(registry, limit))
        }
        Command::Close(id) => {
            let registry = state
                .registry
                .as_ref()
                .ok_or("connections are not tracked")?;
            if registry.close(*id) {
                Ok(String::new())
            } else {
                Err(format!("no connection {id}"))
            }
        }
        Command::Control => Ok(ctx.control_addr.clone().unwrap_or_default()),
        Command::Pid => Ok(std::process::id().to_string()),
        // An error reply when this node cannot serve: quillctl then exits 1, which is what
        // keepalived's track_script (or any probe) reads.
        Command::NodeDrain(on) => {
            let was = state
                .node_draining
                .swap(*on, std::sync::atomic::Ordering::Relaxed);
            if *on && !was {
                state.recycle();
            }
            if was != *on {
                tracing::warn!(
                    "{}",
                    if *on {
                        "node draining: out of the service (route withdrawn, health failing), still serving"
                    } else {
                        "node back in the service"
                    }
                );
            }
            Ok(String::new())
        }
        Command::Health => crate::announce::can_serve(&state.settings(), state)
            .map(|()| "ok".to_string())
            .map_err(|why| format!("cannot serve: {why}")),
        Command::Include(file) => ctx
            .include(Path::new(file.as_str()))
            .map(|()| String::new())
            .map_err(|e| e.to_string()),
        Command::Write(file) => {
            let path = match (file, &ctx.config_file) {
                (Some(f), _) => Path::new(f.as_str()).to_path_buf(),
                (None, Some(f)) => f.clone(),
                (None, None) => {
                    return Err("no file given and quill was started without -F".to_string())
                }
            };
            let text = config::render(&state.settings());
            write_atomically(&path, text.as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(String::new())
        }
        Command::Listen(Some(word)) => {
            // Bind first: an address that cannot be bound changes nothing.
            let addr = crate::net::ListenAddr::parse(word.as_str()).map_err(|e| e.to_string())?;
            if state.settings().listen.as_ref() == Some(&addr) {
                return Ok(String::new());
            }
            let listeners = ctx.open_listeners(&addr).map_err(|e| e.to_string())?;
            let (_, actions) = state.execute(cmd).map_err(|e| e.to_string())?;
            ctx.hand_over(listeners);
            let rest = actions
                .into_iter()
                .filter(|a| !matches!(a, crate::settings::Action::Relisten(_)))
                .collect();
            ctx.carry_out(rest);
            tracing::info!("now listening on {addr}");
            Ok(String::new())
        }
        Command::MetricsListen(Some(_)) | Command::NoMetricsListen => {
            // As with `listen`: bind first, so an address that cannot be bound changes
            // nothing; then publish, then hand the socket to the metrics server.
            let addr = match cmd {
                Command::MetricsListen(Some(word)) => {
                    Some(crate::settings::metrics_addr(word.as_str()).map_err(|e| e.to_string())?)
                }
                _ => None,
            };
            if state.settings().metrics_listen == addr {
                return Ok(String::new());
            }
            let listener = ctx.bind_metrics(addr).map_err(|e| e.to_string())?;
            let (_, actions) = state.execute(cmd).map_err(|e| e.to_string())?;
            if let Some(addr) = addr {
                super::web::warn_if_control_open(&state.settings(), addr);
            }
            ctx.hand_over_metrics(listener);
            let rest = actions
                .into_iter()
                .filter(|a| !matches!(a, crate::settings::Action::MetricsListen(_)))
                .collect();
            ctx.carry_out(rest);
            Ok(String::new())
        }
        Command::Transparent(_) | Command::DsrIf(_) | Command::UdpOffload(_) => {
            let mut next = crate::settings::Settings::clone(&state.settings());
            next.apply(cmd).map_err(|e| e.to_string())?;
            super::taken_up_at_runtime(&state.settings(), &next)?;
            publish(ctx, cmd)
        }
        Command::Exit if ctx.exit_enabled => {
            ctx.exit.notify_one();
            Ok(String::new())
        }
        Command::Exit => Err("exit is disabled (start quill with -X to allow it)".to_string()),
        cmd => publish(ctx, cmd),
    }
}

/// A command that changes the settings (or reads them): published, then its actions.
fn publish(ctx: &Context, cmd: &Command) -> Result<String, String> {
    let (reply, actions) = ctx.state.execute(cmd).map_err(|e| e.to_string())?;
    if let Command::Debug(Some(level)) = cmd {
        crate::logging::set_level(*level);
    }
    ctx.carry_out(actions);
    Ok(match reply {
        Reply::Done => String::new(),
        Reply::Value(v) => v,
    })
}
