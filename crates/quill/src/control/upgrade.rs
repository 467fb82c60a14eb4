//! Binary upgrade without dropping a connection: a new quill takes over the listening
//! sockets of the running one through its Unix control socket (`SCM_RIGHTS`).
//!
//! Contract (docs/UPGRADE.md): the new process (`quill --takeover`, same `-C PATH`) has
//! already checked its whole configuration when it connects and sends `upgrade`. The old
//! one answers with an [`Offer`] line carrying, as ancillary data, a duplicate of each of
//! its listening sockets and of its control socket, and keeps accepting. The new one
//! serves them, then says `ready`; only then does the old one stop accepting and finish
//! its connections. If the new process fails at any point before `ready`, the old one
//! never stopped serving. The sockets are the same kernel objects, so no connection
//! waiting in an accept queue is lost (closing one of several SO_REUSEPORT sockets would
//! reset the connections queued on it).

use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::Path;
use std::time::Duration;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use super::Context;
use crate::net::{ListenAddr, Listener};

/// The first word of an offer, with the version of this protocol.
const MAGIC: &str = "quill-upgrade 1";
/// Most listening sockets one offer may carry (one per event loop, plus the control one).
pub const MAX_FDS: usize = 512;
/// Longest offer line accepted.
const MAX_OFFER: usize = 8192;
/// How long the old process waits for the new one to say `ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the new process waits for the old one's offer.
const OFFER_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a takeover failed; the running quill keeps serving in every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpgradeError {
    #[error(
        "--takeover needs a Unix control socket (-C /path/to/socket) shared with the running quill"
    )]
    NeedsUnixControl,
    #[error("--takeover of UDP listeners (-U) is not supported: restart instead")]
    Udp,
    #[error("cannot reach the running quill at {path}: {source}")]
    Connect { path: String, source: io::Error },
    #[error("the running quill refused the upgrade: {0}")]
    Refused(String),
    #[error("talking to the running quill: {0}")]
    Io(#[from] io::Error),
    #[error("not an upgrade offer: {0}")]
    BadOffer(String),
    #[error("the running quill listens on {old}, the new configuration on {new}; an upgrade keeps the sockets, so restart to move them")]
    AddressChanged { old: String, new: String },
}

/// Kind of the listening sockets offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tcp,
    Unix,
}

/// The line that comes with the descriptors: `quill-upgrade 1 tcp|unix COUNT ADDRESS`.
/// COUNT listeners follow as descriptors, then the control socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub kind: Kind,
    pub listeners: usize,
    /// The listening address as the old process prints it.
    pub addr: String,
}

impl std::fmt::Display for Offer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Tcp => "tcp",
            Kind::Unix => "unix",
        };
        write!(f, "{MAGIC} {kind} {} {}", self.listeners, self.addr)
    }
}

/// Parses an offer line (without its newline).
pub fn parse_offer(line: &str) -> Result<Offer, UpgradeError> {
    let bad = || UpgradeError::BadOffer(line.chars().take(200).collect());
    if let Some(reason) = line.strip_prefix("error: ") {
        return Err(UpgradeError::Refused(reason.to_string()));
    }
    let rest = line.strip_prefix(MAGIC).ok_or_else(bad)?;
    let rest = rest.strip_prefix(' ').ok_or_else(bad)?;
    let mut parts = rest.splitn(3, ' ');
    let kind = match parts.next() {
        Some("tcp") => Kind::Tcp,
        Some("unix") => Kind::Unix,
        _ => return Err(bad()),
    };
    let listeners: usize = parts
        .next()
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse().ok())
        .filter(|n| (1..MAX_FDS).contains(n))
        .ok_or_else(bad)?;
    let addr = parts.next().filter(|a| !a.is_empty()).ok_or_else(bad)?;
    Ok(Offer {
        kind,
        listeners,
        addr: addr.to_string(),
    })
}

// ---------------------------------------------------------------------------
// The running (old) process
// ---------------------------------------------------------------------------

/// Answers `upgrade` on the Unix control socket: sends the offer and the descriptors,
/// waits for `ready`, then asks the process to stop accepting and finish.
pub async fn offer(ctx: &Context, mut sock: UnixStream) {
    match send_offer(ctx, &sock).await {
        Ok(()) => {}
        Err(reason) => {
            tracing::warn!("upgrade refused: {reason}");
            let _ = sock
                .write_all(format!("error: {reason}\n").as_bytes())
                .await;
            return;
        }
    }
    tracing::warn!("upgrade: listening sockets handed to a new process; waiting for it");
    let mut buf = [0u8; 64];
    let mut got = Vec::new();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if got.contains(&b'\n') {
                        return got.starts_with(b"ready\n");
                    }
                    if got.len() > 64 {
                        return false;
                    }
                }
            }
        }
    })
    .await
    .unwrap_or(false);
    if ready {
        tracing::warn!(
            "upgrade: the new process serves; no longer accepting, finishing {} open connection(s)",
            ctx.state.active.load(std::sync::atomic::Ordering::Relaxed)
        );
        ctx.hand_off();
    } else {
        tracing::error!("upgrade abandoned: the new process did not become ready; still serving");
    }
}

async fn send_offer(ctx: &Context, sock: &UnixStream) -> Result<(), String> {
    let listeners = ctx.listener_dups().map_err(|e| e.to_string())?;
    if listeners.is_empty() {
        // UDP (-U) and DSR (dsr_if) have no listening TCP socket to pass on: those are
        // restarted instead (a DSR plane's XDP program goes with the old process, and the
        // new one attaches its own).
        return Err(
            "nothing to hand over (UDP and DSR have no listening socket to pass on: restart \
             them instead)"
                .into(),
        );
    }
    let control = ctx
        .control_fd
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .ok_or("no control socket to hand over")?
        .try_clone()
        .map_err(|e| e.to_string())?;
    let settings = ctx.state.settings();
    let addr = settings
        .listen
        .as_ref()
        .map(ToString::to_string)
        .ok_or("no listening address")?;
    let kind = match settings.listen {
        Some(ListenAddr::Unix(_)) => Kind::Unix,
        _ => Kind::Tcp,
    };
    let offer = Offer {
        kind,
        listeners: listeners.len(),
        addr,
    };
    let line = format!("{offer}\n");
    let mut fds: Vec<_> = listeners.iter().map(AsFd::as_fd).collect();
    fds.push(control.as_fd());
    let mut space = vec![0u8; rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut sent = 0;
    while sent == 0 {
        sock.writable().await.map_err(|e| e.to_string())?;
        let r = sock.try_io(Interest::WRITABLE, || {
            let mut anc = SendAncillaryBuffer::new(&mut space);
            if !anc.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(io::Error::other("too many descriptors for one message"));
            }
            sendmsg(
                sock,
                &[IoSlice::new(line.as_bytes())],
                &mut anc,
                SendFlags::empty(),
            )
            .map_err(io::Error::from)
        });
        match r {
            Ok(n) => sent = n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    // The descriptors went with the first byte; the rest of the line is plain data.
    let mut rest = line.as_bytes().get(sent..).unwrap_or_default();
    while !rest.is_empty() {
        sock.writable().await.map_err(|e| e.to_string())?;
        match sock.try_write(rest) {
            Ok(n) => rest = rest.get(n..).unwrap_or_default(),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The new process
// ---------------------------------------------------------------------------

/// What the new process got from the old one.
pub struct Takeover {
    /// The old process's listeners, one per event loop it ran.
    pub listeners: Vec<Listener>,
    /// The old process's control socket.
    pub control: StdUnixListener,
    /// The connection to the old process, to say `ready` on.
    pub handshake: Handshake,
}

/// The open connection to the old process during a takeover.
pub struct Handshake(StdUnixStream);

impl Handshake {
    /// Tells the old process that this one serves: it stops accepting and finishes.
    pub fn ready(mut self) -> io::Result<()> {
        self.0.write_all(b"ready\n")?;
        self.0.shutdown(std::net::Shutdown::Write)
    }
}

/// Asks the quill on `control` for its sockets. `listen` is where this process is
/// configured to listen: it must be where the old one listens.
pub fn take_over(control: &Path, listen: &ListenAddr) -> Result<Takeover, UpgradeError> {
    let mut conn = StdUnixStream::connect(control).map_err(|source| UpgradeError::Connect {
        path: control.display().to_string(),
        source,
    })?;
    conn.set_read_timeout(Some(OFFER_TIMEOUT))?;
    conn.write_all(b"upgrade\n")?;
    let mut line = Vec::new();
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut space = vec![0u8; rustix::cmsg_space!(ScmRights(MAX_FDS))];
    while !line.contains(&b'\n') {
        let mut buf = [0u8; 1024];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let got = recvmsg(
            &conn,
            &mut [IoSliceMut::new(&mut buf)],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        for msg in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = msg {
                fds.extend(received);
            }
        }
        // A truncated set of descriptors shows as a count that does not match the offer.
        if got.bytes == 0 {
            break;
        }
        line.extend_from_slice(buf.get(..got.bytes).unwrap_or_default());
        if line.len() > MAX_OFFER {
            return Err(UpgradeError::BadOffer("offer line too long".into()));
        }
    }
    let text = String::from_utf8_lossy(&line);
    let text = text
        .split('\n')
        .next()
        .unwrap_or_default()
        .trim_end_matches('\r');
    let offer = parse_offer(text)?;
    if offer.addr != listen.to_string() {
        return Err(UpgradeError::AddressChanged {
            old: offer.addr,
            new: listen.to_string(),
        });
    }
    if fds.len() != offer.listeners + 1 {
        return Err(UpgradeError::BadOffer(format!(
            "{} descriptors for {} listeners and the control socket",
            fds.len(),
            offer.listeners
        )));
    }
    let control_fd = fds
        .pop()
        .ok_or_else(|| UpgradeError::BadOffer("no control socket".into()))?;
    check_listening(&control_fd)?;
    let control = StdUnixListener::from(control_fd);
    control.set_nonblocking(true)?;
    let mut listeners = Vec::with_capacity(fds.len());
    for fd in fds {
        check_listening(&fd)?;
        let l = match offer.kind {
            Kind::Tcp => {
                let l = std::net::TcpListener::from(fd);
                l.set_nonblocking(true)?;
                Listener::Tcp(l)
            }
            Kind::Unix => {
                let l = StdUnixListener::from(fd);
                l.set_nonblocking(true)?;
                Listener::Unix(l)
            }
        };
        listeners.push(l);
    }
    conn.set_read_timeout(None)?;
    Ok(Takeover {
        listeners,
        control,
        handshake: Handshake(conn),
    })
}

fn check_listening(fd: &OwnedFd) -> Result<(), UpgradeError> {
    let sock = socket2::SockRef::from(fd);
    match (sock.r#type(), sock.is_listener()) {
        (Ok(socket2::Type::STREAM), Ok(true)) => Ok(()),
        _ => Err(UpgradeError::BadOffer(
            "a descriptor is not a listening stream socket".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offer_round_trip() {
        let o = Offer {
            kind: Kind::Unix,
            listeners: 2,
            addr: "/run/my quill.sock".into(),
        };
        assert_eq!(parse_offer(&o.to_string()).ok(), Some(o));
        let o = Offer {
            kind: Kind::Tcp,
            listeners: 4,
            addr: "[::]:8080".into(),
        };
        assert_eq!(parse_offer(&o.to_string()).ok(), Some(o));
    }

    #[test]
    fn bad_offers() {
        for line in [
            "",
            "quill-upgrade 2 tcp 1 x",
            "quill-upgrade 1 udp 1 x",
            "quill-upgrade 1 tcp 0 x",
            "quill-upgrade 1 tcp 99999 x",
            "quill-upgrade 1 tcp +1 x",
            "quill-upgrade 1 tcp 1",
            "quill-upgrade 1 tcp 1 ",
        ] {
            assert!(parse_offer(line).is_err(), "{line:?}");
        }
        assert!(matches!(
            parse_offer("error: nope"),
            Err(UpgradeError::Refused(r)) if r == "nope"
        ));
    }
}
