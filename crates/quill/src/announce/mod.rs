//! Route announcement for scale-out (`announce_table N`): while this node can serve its
//! listening address, a route for that address (`VIP/32` or `/128`, protocol [`PROTOCOL`],
//! through quill's own TUN device, [`tether`]) sits in kernel routing table N, where BIRD (`protocol kernel { kernel table
//! N; learn; }`) or FRR (`redistribute table N`) find it and announce it over BGP; when the
//! node cannot serve, the route goes and the routers stop sending it flows. quill speaks no
//! BGP itself. See docs/SCALE-OUT.md.
//!
//! Invariants: at most one route is quill's at a time, the one `Announcer::current` names;
//! a new table or address removes the old route before adding the new one. The route goes
//! through the tether, so it never outlives the process, however the process ends. When
//! quill stops, [`Announcer::withdraw`] removes the route before the listeners close (the
//! daemon then serves on for `announce_grace` seconds). After a binary upgrade the new
//! process's route replaces the old one's (same destination, table and metric), so the
//! announcement has no gap while the old process, and its device, go.

pub mod tether;

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
    #[error("no server is up (all down, blacklisted or draining; with DSR: none answers ARP)")]
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
    let up = state
        .servers_in_use(settings)
        .any(|(_, _, _, rt)| rt.condition(now) == Condition::Up);
    // In DSR mode a server is up for the plane only once it answers ARP: a node whose
    // servers all went silent cannot forward, whatever their health checks last said.
    let dsr_up = state.dsr.get().map_or(true, |c| {
        c.started.load(Relaxed) && c.backends_up.load(Relaxed) > 0
    });
    if up && dsr_up {
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
            "{}/{len} table {} proto {PROTOCOL}",
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
    /// The route quill has in the kernel (through the tether, so none at first).
    current: Option<Route>,
    /// The reason last logged for not announcing, so that it is logged once per change.
    last_reason: Option<String>,
    tether: tether::Tether,
}

impl Announcer {
    /// Opens the netlink connection (its task runs on the current tokio runtime), creates
    /// the tether and brings it up.
    pub async fn new() -> std::io::Result<Announcer> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        let tether = tether::Tether::create()?;
        handle
            .link()
            .set(
                rtnetlink::LinkUnspec::new_with_index(tether.index())
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| {
                std::io::Error::other(format!("cannot bring {} up: {e}", tether.name()))
            })?;
        tracing::info!(
            "announce: routes go through {}, which vanishes with this process",
            tether.name()
        );
        Ok(Announcer {
            handle,
            current: None,
            last_reason: None,
            tether,
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
        self.set(wanted, state).await;
    }

    /// Removes quill's route (on stop); returns whether there was one.
    pub async fn withdraw(&mut self, state: &State) -> bool {
        let had = self.current.is_some();
        self.set(None, state).await;
        had
    }

    async fn set(&mut self, wanted: Option<Route>, state: &State) {
        if self.current == wanted {
            return;
        }
        if let Some(old) = self.current.filter(|o| Some(*o) != wanted) {
            match self.delete(old).await {
                Ok(()) => tracing::info!("announce: withdrew {old}"),
                Err(e) => {
                    tracing::error!("announce: cannot remove {old}: {e}");
                    return;
                }
            }
        }
        if let Some(new) = wanted {
            if let Err(e) = self.add(new).await {
                tracing::error!("announce: cannot add {new}: {e}");
                self.current = None;
                state.announced.store(0, Relaxed);
                return;
            }
            tracing::info!("announce: announcing {new} dev {}", self.tether.name());
        }
        self.current = wanted;
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
            .output_interface(self.tether.index())
            .table_id(route.table)
            .protocol(RouteProtocol::Other(PROTOCOL))
            .build()
    }

    async fn add(&self, route: Route) -> Result<(), rtnetlink::Error> {
        // Replace: the route of the process this one upgraded is taken over, not an error.
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
/// route and reports whether there was one on `withdrawn`; `decided` hears when the first
/// decision is carried out (a binary upgrade waits for it). The netlink socket and the
/// tether are opened only once `announce_table` is set (at start-up or by a later reload or
/// command), so a quill that announces nothing needs neither AF_NETLINK nor a TUN device.
pub async fn supervise(
    state: Arc<State>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    withdrawn: tokio::sync::oneshot::Sender<bool>,
    decided: tokio::sync::oneshot::Sender<()>,
) {
    let mut decided = Some(decided);
    let mut announcer: Option<Announcer> = None;
    let mut failed = false;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut generation = state.generation.subscribe();
    loop {
        if announcer.is_none() && !failed && state.settings().announce_table.is_some() {
            match Announcer::new().await {
                Ok(a) => announcer = Some(a),
                Err(e) => {
                    tracing::error!("announce: cannot start: {e}");
                    failed = true;
                }
            }
        }
        if let Some(a) = &mut announcer {
            a.update(&state).await;
            // `no announce_table` withdrew the route: the tether and the netlink
            // connection go too, and the loop waits for settings again instead of
            // ticking for nothing (a later `announce_table` starts anew).
            if a.current.is_none() && state.settings().announce_table.is_none() {
                announcer = None;
            }
        }
        if let Some(d) = decided.take() {
            let _ = d.send(());
        }
        // Nothing to announce: wait for settings that may ask for it instead of waking
        // the process five times a second for nothing.
        if announcer.is_some() {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => break,
            }
        } else {
            tokio::select! {
                r = generation.changed() => if r.is_err() { break },
                _ = stop.changed() => break,
            }
        }
    }
    let had = match &mut announcer {
        Some(a) => a.withdraw(&state).await,
        None => false,
    };
    let _ = withdrawn.send(had);
}
