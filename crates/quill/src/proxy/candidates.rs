//! The servers one client connection (or, at layer 7, one request) tries, in Pen's order:
//! the selector's choice; after a failed connect the next one (failover), the failed
//! server blacklisted for `blacklist` seconds; when the table has none left, the last
//! resort: the emergency server for a permitted client, the abuse server for a denied one.
//! Shared by the raw relay (`tcp`), the byte pump's requests (`h1_pump`) and hyper's
//! (`gateway`), so that failover means the same on every path.
//!
//! Invariants: a table server is offered until it is reported failed, then never again
//! (the selector does not retry one); the last resort is offered once, after the table.

use std::io;
use std::net::SocketAddr;

use super::pool::Target;
use crate::balance::clock;
use crate::balance::select::{Choice, Selector};
use crate::balance::ServerState;
use crate::settings::Settings;
use crate::state::State;

/// One server to try.
#[derive(Clone, Copy)]
pub(super) struct Candidate<'a, 's> {
    pub target: Target,
    /// The server's index in the table (none for the emergency and abuse servers).
    pub index: Option<usize>,
    pub addr: SocketAddr,
    /// The name it was configured with, if any (TLS's server name to it).
    pub host: Option<&'a crate::command::Host>,
    pub server: &'s ServerState,
}

/// "server 2 (10.0.0.2:80)", "Emergency server (10.0.0.9:80)": for log lines.
impl std::fmt::Display for Candidate<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(index) => write!(f, "server {index} ({})", self.addr),
            None => write!(f, "{:?} server ({})", self.target, self.addr),
        }
    }
}

/// The search for a server, for one client connection or request.
pub(super) struct Candidates<'a, 's> {
    state: &'s State,
    settings: &'a Settings,
    peer: SocketAddr,
    /// `None` for a client the ACL denies: it goes to the abuse server only.
    selector: Option<Selector<'a>>,
    choice: Option<Choice>,
    /// The last resort has been offered.
    last_offered: bool,
}

impl<'a, 's: 'a> Candidates<'a, 's> {
    /// Starts the search for a client at `peer`; `permitted`: the client ACL let it in.
    pub(super) fn new(
        state: &'s State,
        settings: &'a Settings,
        peer: SocketAddr,
        permitted: bool,
    ) -> Self {
        let mut selector = permitted.then(|| {
            Selector::new(
                settings,
                &state.servers,
                &state.clients,
                &state.cursor,
                peer,
                clock::now_ms(),
            )
        });
        let choice = selector.as_mut().map(|s| s.initial());
        Candidates {
            state,
            settings,
            peer,
            selector,
            choice,
            last_offered: false,
        }
    }

    /// The server to try now; `None` when none is left.
    pub(super) fn next(&mut self) -> Option<Candidate<'a, 's>> {
        while let Some(Choice::Server(index)) = self.choice {
            let spec = self.settings.servers.get(index);
            match (spec.and_then(|s| s.addr()), self.state.servers.get(index)) {
                (Some(addr), Some(server)) => {
                    return Some(Candidate {
                        target: Target::Server(index),
                        index: Some(index),
                        addr,
                        host: spec.and_then(|s| s.host.as_ref()),
                        server,
                    })
                }
                // Removed or without an address since the selector looked.
                _ => self.choice = self.selector.as_mut().map(|s| s.failover(index)),
            }
        }
        if std::mem::replace(&mut self.last_offered, true) {
            return None;
        }
        let (target, server, extra) = self.last_resort();
        let extra = extra?;
        Some(Candidate {
            target,
            index: None,
            addr: extra.addr,
            host: Some(&extra.name.host),
            server,
        })
    }

    /// `c` took the client: a tracked client goes back to it next time.
    pub(super) fn served(&self, c: &Candidate<'_, '_>) {
        if let Some(index) = c.index {
            if self.selector.as_ref().is_some_and(|s| s.tracks()) {
                self.state
                    .clients
                    .record(self.peer.ip().to_canonical(), index, clock::now_ms());
            }
        }
    }

    /// Connecting to `c` failed with `e` (a failure of this host's own, such as running
    /// out of descriptors, is not the server's: see `is_local_failure`, and stop there): a
    /// table server is blacklisted, and the next call offers another one.
    pub(super) fn failed(&mut self, c: &Candidate<'_, '_>, e: &io::Error) {
        match c.index {
            Some(index) => {
                tracing::info!(
                    "{c} failed: {e}; blacklisted for {} s",
                    self.settings.blacklist
                );
                self.state.server_failed(index, self.settings.blacklist);
                self.choice = self.selector.as_mut().map(|s| s.failover(index));
            }
            None => {
                if let (_, _, Some(extra)) = self.last_resort() {
                    tracing::warn!(peer = %self.peer, "{:?} server {} failed: {e}", c.target, extra.name);
                }
            }
        }
    }

    /// The last resort's kind, state and configuration (if there is one): the emergency
    /// server's for a permitted client, the abuse server's for a denied one.
    fn last_resort(
        &self,
    ) -> (
        Target,
        &'s ServerState,
        Option<&'a crate::settings::Upstream>,
    ) {
        if self.selector.is_some() {
            (
                Target::Emergency,
                &self.state.emergency,
                self.settings.emergency.as_ref(),
            )
        } else {
            (
                Target::Abuse,
                &self.state.abuse,
                self.settings.abuse.as_ref(),
            )
        }
    }
}

/// A server that failed after a request (or part of it) was sent to it: a table server is
/// blacklisted as if it had refused the connection; the request is not sent elsewhere.
pub(super) fn lost(state: &State, blacklist: u64, c: &Candidate<'_, '_>, e: &io::Error) {
    match c.index {
        Some(index) => {
            tracing::info!("{c} failed during a request: {e}; blacklisted for {blacklist} s");
            state.server_failed(index, blacklist);
        }
        None => tracing::warn!("{c} failed during a request: {e}"),
    }
}
