//! Route announcement for scale-out (`announce_table N`): while this node can serve its
//! listening address, a route for that address (`VIP/32` or `/128`, `dev lo`, protocol
//! [`PROTOCOL`]) sits in kernel routing table N, where BIRD (`protocol kernel { kernel table
//! N; learn; }`) or FRR (`redistribute table N`) find it and announce it over BGP; when the
//! node cannot serve, the route goes and the routers stop sending it flows. quill speaks no
//! BGP itself. See docs/SCALE-OUT.md.
//!
//! Invariants: at most one route is quill's at a time, the one `Announcer::current` names;
//! a new table or address removes the old route before adding the new one. The first
//! decision after start-up is always carried out, so a route left behind by a quill that was
//! killed is removed when this one cannot serve. When quill stops, [`Announcer::withdraw`]
//! removes the route before the listeners close (the daemon then serves on for
//! `announce_grace` seconds).

use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use rtnetlink::packet_route::route::RouteProtocol;
use rtnetlink::RouteMessageBuilder;

use crate::balance::clock;
use crate::balance::servers::Condition;
use crate::net::ListenAddr;
use crate::settings::Settings;
use crate::state::State;

/// The routing protocol number quill's routes carry (`ip route ... proto 250`), so that
/// they are told apart from an operator's: a number of the range iproute2 leaves unnamed.
pub const PROTOCOL: u8 = 250;

/// How often the announcer looks at the servers' states.
const TICK: Duration = Duration::from_millis(200);

/// Why this node cannot serve its listening address now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unservable {
    #[error("no server is up (all down, blacklisted or draining)")]
    NoServer,
    #[error("the node is draining (drain; 'drain 0' ends it)")]
    Draining,
    #[error("the listening address {0} is not one address (a wildcard or a Unix socket)")]
    NoAddress(String),
}

/// Whether this node can serve: it is not draining as a whole (`drain`), and at least one
/// server in use is up (its health check passes, it is not blacklisted, not draining).
pub fn can_serve(settings: &Settings, state: &State) -> Result<(), Unservable> {
    if state.node_draining.load(Relaxed) {
        return Err(Unservable::Draining);
    }
    let now = clock::now_ms();
    let up = crate::control::report::in_use(settings, state)
        .any(|(_, _, _, rt)| rt.condition(now) == Condition::Up);
    if up {
        Ok(())
    } else {
        Err(Unservable::NoServer)
    }
}

/// The address to announce: the listening address, when it is one address.
pub fn service_address(settings: &Settings) -> Result<IpAddr, Unservable> {
    match &settings.listen {
        Some(ListenAddr::Tcp(a)) if !a.ip().is_unspecified() => Ok(a.ip().to_canonical()),
        Some(other) => Err(Unservable::NoAddress(other.to_string())),
        None => Err(Unservable::NoAddress("(none)".to_string())),
    }
}

/// One route of quill's: the service address in a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub table: u32,
    pub address: IpAddr,
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = if self.address.is_ipv4() { 32 } else { 128 };
        write!(
            f,
            "{}/{len} dev lo table {} proto {PROTOCOL}",
            self.address, self.table
        )
    }
}

/// What the settings and the servers ask for now: the route to have, or none (and why).
pub fn wanted(settings: &Settings, state: &State) -> Result<Option<Route>, Unservable> {
    let Some(table) = settings.announce_table else {
        return Ok(None);
    };
    let address = service_address(settings)?;
    can_serve(settings, state)?;
    Ok(Some(Route { table, address }))
}

/// Keeps quill's route in the kernel in line with [`wanted`].
pub struct Announcer {
    handle: rtnetlink::Handle,
    /// The route quill has in the kernel; `None` before the first decision (unknown).
    current: Option<Option<Route>>,
    /// The reason last logged for not announcing, so that it is logged once per change.
    last_reason: Option<String>,
    loopback: u32,
}

impl Announcer {
    /// Opens the netlink connection (its task runs on the current tokio runtime).
    pub fn new() -> std::io::Result<Announcer> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        let loopback = nix::net::if_::if_nametoindex("lo").map_err(std::io::Error::from)?;
        Ok(Announcer {
            handle,
            current: None,
            last_reason: None,
            loopback,
        })
    }

    /// Brings the kernel in line with what `state` asks for now.
    pub async fn update(&mut self, state: &State) {
        let settings = state.settings();
        let wanted = match wanted(&settings, state) {
            Ok(w) => w,
            Err(why) => {
                let why = why.to_string();
                if settings.announce_table.is_some() && self.last_reason.as_ref() != Some(&why) {
                    tracing::warn!("announce: not announcing: {why}");
                    self.last_reason = Some(why);
                }
                None
            }
        };
        if wanted.is_some() {
            self.last_reason = None;
        }
        self.set(wanted, state, &settings).await;
    }

    /// Removes quill's route (on stop); returns whether there was one.
    pub async fn withdraw(&mut self, state: &State) -> bool {
        let settings = state.settings();
        let had = matches!(self.current, Some(Some(_)));
        self.set(None, state, &settings).await;
        had
    }

    async fn set(&mut self, wanted: Option<Route>, state: &State, settings: &Settings) {
        if self.current == Some(wanted) {
            return;
        }
        // Unknown (first decision): a route a killed quill left for the same table and
        // address is removed too.
        let old = match self.current {
            Some(old) => old,
            None => settings
                .announce_table
                .zip(service_address(settings).ok())
                .map(|(table, address)| Route { table, address }),
        };
        if let Some(old) = old.filter(|o| Some(*o) != wanted) {
            match self.delete(old).await {
                Ok(()) if self.current.is_some() => tracing::info!("announce: withdrew {old}"),
                Ok(()) => {}
                Err(e) => {
                    tracing::error!("announce: cannot remove {old}: {e}");
                    return;
                }
            }
        }
        if let Some(new) = wanted {
            if let Err(e) = self.add(new).await {
                tracing::error!("announce: cannot add {new}: {e}");
                self.current = Some(None);
                state.announced.store(0, Relaxed);
                return;
            }
            tracing::info!("announce: announcing {new}");
        }
        self.current = Some(wanted);
        state
            .announced
            .store(wanted.map_or(0, |r| r.table), Relaxed);
    }

    fn message(&self, route: Route) -> rtnetlink::packet_route::route::RouteMessage {
        let len = if route.address.is_ipv4() { 32 } else { 128 };
        let builder = RouteMessageBuilder::<IpAddr>::new();
        // The address and its length agree by construction: this cannot fail.
        let builder = match builder.clone().destination_prefix(route.address, len) {
            Ok(b) => b,
            Err(_) => builder,
        };
        builder
            .output_interface(self.loopback)
            .table_id(route.table)
            .protocol(RouteProtocol::Other(PROTOCOL))
            .build()
    }

    async fn add(&self, route: Route) -> Result<(), rtnetlink::Error> {
        // Replace: a route left by a quill that was killed is taken over, not an error.
        self.handle
            .route()
            .add(self.message(route))
            .replace()
            .execute()
            .await
    }

    async fn delete(&self, route: Route) -> Result<(), rtnetlink::Error> {
        match self.handle.route().del(self.message(route)).execute().await {
            Err(rtnetlink::Error::NetlinkError(m))
                if m.raw_code() == -libc::ESRCH || m.raw_code() == -libc::ENOENT =>
            {
                Ok(())
            }
            other => other,
        }
    }
}

/// Runs the announcer on the control runtime until `stop` says so, then withdraws the
/// route and reports whether there was one on `withdrawn`. The netlink socket is opened
/// only once `announce_table` is set (at start-up or by a later reload or command), so a
/// quill that announces nothing needs no AF_NETLINK.
pub async fn supervise(
    state: Arc<State>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    withdrawn: tokio::sync::oneshot::Sender<bool>,
) {
    let mut announcer: Option<Announcer> = None;
    let mut failed = false;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        if announcer.is_none() && !failed && state.settings().announce_table.is_some() {
            match Announcer::new() {
                Ok(a) => announcer = Some(a),
                Err(e) => {
                    tracing::error!("announce: cannot open a netlink socket: {e}");
                    failed = true;
                }
            }
        }
        if let Some(a) = &mut announcer {
            a.update(&state).await;
        }
    }
    let had = match &mut announcer {
        Some(a) => a.withdraw(&state).await,
        None => false,
    };
    let _ = withdrawn.send(had);
}
