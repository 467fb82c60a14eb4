//! The servers one client connection (or, at layer 7, one request) tries, in Pen's order:
//! the selector's choice; after a failed connect the next one (failover), the failed
//! server blacklisted for `blacklist` seconds; when the table has none left, the last
//! resort: the emergency server for a permitted client, the abuse server for a denied one.
//! Shared by the raw relay (`tcp`), the byte pump's requests (`h1_pump`) and hyper's
//! (`gateway`), so that failover means the same on every path.
//!
//! With `queue_timeout`, a client whose servers are all at their `max` waits in their
//! queues until a connection or request to one of them ends and hands its place over
//! (a dropped `Place`; the longest-waiting client gets it), until the time is up;
//! only then comes the last resort.
//!
//! Invariants: a table server is offered until it is reported failed, then never again
//! (the selector does not retry one); the last resort is offered once, after the table.
//! A server is offered with its place taken (a `Place`, counted in `conns` in the same
//! step that checked its limit), so that event loops choosing at once never pass a `max`.
//! A waiting client counts in each full server's queue before it looks at their counts
//! again, so that a lease ending in between either sees it or is seen.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{fence, Ordering::Relaxed, Ordering::SeqCst};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::time::Instant;

use super::pool::Target;
use crate::balance::clock;
use crate::balance::select::{Choice, Selector};
use crate::balance::{Place, ServerState};
use crate::proxy::registry::ConnInfo;
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
    /// When waiting for room ends (`queue_timeout`), from the first wait.
    queue_until: Option<Instant>,
    /// Times the selector looked again for a place that came free (see [`MAX_LOOKS`]).
    looks: u32,
    /// A server (index) whose place a lease handed to this client while it waited.
    handed: Option<(usize, Place<'s>)>,
    /// The blacklisted server offered last, tried anyway ([`Candidates::despite_blacklist`]).
    despite: Option<usize>,
    /// The client's connection in the registry (with a control socket): a wait it drops
    /// after `close N` is quill's doing, not abandoned.
    conn: Option<&'a ConnInfo>,
}

/// Looks again after a place came free between the selector's look and the claim (or the
/// wait), before the client counts as having no server: each one means another client
/// took the place first, so this bounds the work of one client under contention.
const MAX_LOOKS: u32 = 64;

impl<'a, 's: 'a> Candidates<'a, 's> {
    /// Starts the search for a client at `peer`; `permitted`: the client ACL let it in;
    /// `conn`: its connection in the registry, if it is in one.
    pub(super) fn new(
        state: &'s State,
        settings: &'a Settings,
        peer: SocketAddr,
        permitted: bool,
        conn: Option<&'a ConnInfo>,
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
            queue_until: None,
            looks: 0,
            handed: None,
            despite: None,
            conn,
        }
    }

    /// The server to try now (after waiting for room, with `queue_timeout`), with its
    /// place taken; `None` when none is left. Pending only while the client waits for
    /// room: a caller that watches its client then (`tcp`, `h1_pump`) drops this when the
    /// client leaves, which gives back its place in the queue (`queue_abandoned`).
    pub(super) async fn next(&mut self) -> Option<(Candidate<'a, 's>, Place<'s>)> {
        loop {
            if let Some(c) = self.in_table() {
                return Some(c);
            }
            if !self.wait_for_room().await {
                break;
            }
        }
        if !std::mem::replace(&mut self.last_offered, true) {
            let (target, server, extra) = self.last_resort();
            if let Some(extra) = extra {
                let c = Candidate {
                    target,
                    index: None,
                    addr: extra.addr,
                    host: Some(&extra.name.host),
                    server,
                };
                return Some((c, Place::take(server)));
            }
        }
        self.despite_blacklist()
    }

    /// Servers a failed connect blacklisted, tried anyway when nothing else is left (see
    /// `Selector::despite_blacklist`), the one whose blacklist ends first first.
    fn despite_blacklist(&mut self) -> Option<(Candidate<'a, 's>, Place<'s>)> {
        loop {
            let index = self.selector.as_mut()?.despite_blacklist()?;
            let Some(c) = self.candidate(index) else {
                continue;
            };
            let limit = self.selector.as_ref()?.limit_of(index);
            if let Some(place) = Place::claim(c.server, limit) {
                self.despite = Some(index);
                return Some((c, place));
            }
        }
    }

    /// The table's server to try now, its place taken, if the selector has one.
    fn in_table(&mut self) -> Option<(Candidate<'a, 's>, Place<'s>)> {
        if let Some((index, place)) = self.handed.take() {
            // The place is this client's already: used if the server could still take it,
            // else (blacklisted, taken down or drained while it waited) given back.
            let now = clock::now_ms();
            let usable = self.selector.as_mut().is_some_and(|s| {
                s.set_now(now);
                s.could_take(index)
            });
            if let Some(c) = self.candidate(index).filter(|_| usable) {
                return Some((c, place));
            }
            drop(place);
            self.choice = self.selector.as_mut().map(|s| s.again(now));
        }
        // A place another event loop took between the selector's look and the claim makes
        // the selector look again; a few such races in a row, and the servers count as full.
        while let Some(Choice::Server(index)) = self.choice {
            let c = self.candidate(index);
            let selector = self.selector.as_mut()?;
            // Removed or without an address since the selector looked.
            let Some(c) = c else {
                self.choice = Some(selector.failover(index));
                continue;
            };
            match Place::claim(c.server, selector.limit_of(index)) {
                Some(place) => return Some((c, place)),
                None => self.choice = Some(selector.lost_race(clock::now_ms())),
            }
        }
        None
    }

    /// Table server `index` as a candidate, if it has an address.
    fn candidate(&self, index: usize) -> Option<Candidate<'a, 's>> {
        let spec = self.settings.servers.get(index)?;
        Some(Candidate {
            target: Target::Server(index),
            index: Some(index),
            addr: spec.addr()?,
            host: spec.host.as_ref(),
            server: self.state.servers.get(index)?,
        })
    }

    /// With `queue_timeout`, when servers this client may use are full: waits until one
    /// of them ends a connection or request, and chooses again (true); false when none is
    /// full (they are down, blacklisted or failed) or the time is up.
    async fn wait_for_room(&mut self) -> bool {
        let Some(selector) = self.selector.as_mut() else {
            return false; // a client the ACL denies goes to the abuse server only
        };
        if self.settings.queue_timeout == 0 || self.last_offered {
            return false;
        }
        let full: Vec<(usize, &'s ServerState)> = selector
            .full()
            .into_iter()
            .filter_map(|i| Some((i, self.state.servers.get(i)?)))
            .collect();
        if full.is_empty() {
            // None full: they are down, blacklisted or failed, or a place came free since
            // the selector looked (then it finds it, a bounded number of times).
            self.looks += 1;
            if self.looks > MAX_LOOKS {
                return false;
            }
            self.choice = Some(selector.again(clock::now_ms()));
            return matches!(self.choice, Some(Choice::Server(_)));
        }
        // A client's first wait joins the queue only below `queue_max` (one waiting
        // already and looking again stays in it).
        let max = match self.queue_until {
            None => self.settings.queue_max,
            Some(_) => 0,
        };
        if !may_join(self.state, max) {
            self.state.counters.queue_full.fetch_add(1, Relaxed);
            tracing::debug!(peer = %self.peer, "every server full and queue_max clients waiting");
            return false;
        }
        let until = *self.queue_until.get_or_insert_with(|| {
            Instant::now() + Duration::from_secs(self.settings.queue_timeout)
        });
        // Each full server's ring, and the table's for changes that may give room
        // elsewhere (a `max` raised, a server back).
        let mut rung: Vec<Pin<Box<Notified<'s>>>> = full
            .iter()
            .map(|(_, s)| Box::pin(s.freed.notified()))
            .chain([Box::pin(self.state.servers.changed.notified())])
            .collect();
        let mut waiting = Waiting::enter(self.state, full, self.conn);
        for r in &mut rung {
            r.as_mut().enable();
        }
        // Looked at again only now that a lease ending would hand its place over or ring:
        // none is missed.
        fence(SeqCst);
        let now = clock::now_ms();
        self.choice = Some(selector.again(now));
        if matches!(self.choice, Some(Choice::Server(_))) {
            waiting.over = true;
            return true;
        }
        // A blacklisted server's time running out rings nothing: look again then.
        let wake_at = selector.soonest_back().map_or(until, |back| {
            until.min(Instant::now() + Duration::from_millis(back.saturating_sub(now)))
        });
        let rung_or_back = std::future::poll_fn(|cx| {
            // Every one polled until one is ready, so that each has this task's waker.
            if rung.iter_mut().any(|r| r.as_mut().poll(cx).is_ready()) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        let _ = tokio::time::timeout_at(wake_at, rung_or_back).await;
        waiting.over = true;
        // A place handed over comes first, even one that came as the time ran out.
        if let Some(handed) = waiting.take_handed() {
            self.handed = Some(handed);
            return true;
        }
        if Instant::now() >= until {
            self.state.counters.queue_timeouts.fetch_add(1, Relaxed);
            tracing::debug!(peer = %self.peer, "no server had room within queue_timeout");
            return false;
        }
        // Rung without a place (a lease ended as this client began to wait, a change, a
        // server back): look again, and wait again at the back if nothing is free.
        self.choice = Some(selector.again(clock::now_ms()));
        true
    }

    /// `c` took the client: a tracked client goes back to it next time, and a blacklisted
    /// server tried anyway is back in use for every client.
    pub(super) fn served(&self, c: &Candidate<'_, '_>) {
        // Of clients lifting it at once, the one that found it blacklisted says so.
        if c.index.is_some() && c.index == self.despite && !c.server.blacklist(clock::now_ms(), 0) {
            tracing::warn!("{c} answers again: no longer blacklisted");
            self.state.servers.changed.notify_waiters();
        }
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
                self.state.server_failed(
                    index,
                    self.settings.blacklist,
                    format_args!("{c} failed: {e}"),
                );
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

/// A client counted as waiting, in the process's gauge and in each full server's queue
/// (their leases then hand their places over), until it takes a handed place or drops.
struct Waiting<'a, 's> {
    state: &'s State,
    /// The servers (index, state) it still waits for.
    servers: Vec<(usize, &'s ServerState)>,
    /// The wait ended (a place, a ring, the time up); dropped before, the client left,
    /// unless `close N` ended its connection.
    over: bool,
    conn: Option<&'a ConnInfo>,
}

/// Whether a client may join the queue: fewer than `max` wait (0: no limit). Checked
/// and counted in one step, so that event loops letting clients in at once stop at `max`;
/// the place in `queued` is then the client's [`Waiting`]'s to give back.
fn may_join(state: &State, max: u64) -> bool {
    state
        .counters
        .queued
        .fetch_update(Relaxed, Relaxed, |n| (max == 0 || n < max).then_some(n + 1))
        .is_ok()
}

impl<'a, 's> Waiting<'a, 's> {
    /// Counts the client as waiting for `servers` (its place in the process's count was
    /// taken by [`may_join`]).
    fn enter(
        state: &'s State,
        servers: Vec<(usize, &'s ServerState)>,
        conn: Option<&'a ConnInfo>,
    ) -> Waiting<'a, 's> {
        for (_, s) in &servers {
            s.start_waiting();
        }
        Waiting {
            state,
            servers,
            over: false,
            conn,
        }
    }

    /// The server (index) whose place was handed to this client, with the place, if one
    /// was: the client no longer waits there.
    fn take_handed(&mut self) -> Option<(usize, Place<'s>)> {
        let (at, place) = self
            .servers
            .iter()
            .enumerate()
            .find_map(|(at, (_, s))| Some((at, s.take_handed()?)))?;
        Some((self.servers.swap_remove(at).0, place))
    }
}

impl Drop for Waiting<'_, '_> {
    fn drop(&mut self) {
        for (_, s) in &self.servers {
            s.stop_waiting();
        }
        self.state.counters.queued.fetch_sub(1, Relaxed);
        if !self.over && !self.conn.is_some_and(ConnInfo::close_requested) {
            self.state.counters.queue_abandoned.fetch_add(1, Relaxed);
        }
    }
}

/// A server that failed after a request (or part of it) was sent to it: said in the log
/// (`-d`), and nothing more. It is not blacklisted, as Pen and HAProxy do not blacklist a
/// server for a connection that ends badly: a client can make a sound server fail its
/// request (NGINX's `return 444` closes without an answer, an upload given up leaves the
/// server unread bytes to reset over), and one such request took the server out of use for
/// every client for the blacklist time. A server that is down is blacklisted at the next
/// connect that fails; one that accepts and fails every request is for a health check.
pub(super) fn lost(c: &Candidate<'_, '_>, e: &io::Error) {
    tracing::info!("{c} failed during a request: {e}");
}
