//! HTTP/2 from clients (`http` with ALPN `h2` on TLS listeners, or `h2c` prior knowledge on
//! plain ones): hyper serves the connection on the event loop, with quill's limits; every
//! stream is one request for `proxy::gateway`.

use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::Request;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

use super::coalesce;
use super::gateway::{self, Activity, Ended, Graceful, LocalExec, Peer, Timers};
use crate::state::State;

/// The first bytes of every HTTP/2 connection (RFC 9113 3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl<I, S, E> Graceful for hyper::server::conn::http2::Connection<I, S, E>
where
    Self: std::future::Future,
    S: hyper::service::HttpService<hyper::body::Incoming>,
    S::ResBody: hyper::body::Body + 'static,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, S::ResBody>,
{
    fn shut(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }

    fn recycle(self: Pin<&mut Self>, _: &Activity) -> bool {
        self.graceful_shutdown();
        true
    }
}

/// Serves one HTTP/2 client connection until it ends: GOAWAY when quill stops, when no
/// request came within `http_request_timeout`, or none for `idle_timeout` since the last.
pub(super) async fn serve<IO>(state: &'static State, io: IO, peer: Peer)
where
    IO: AsyncRead + AsyncWrite + Unpin + 'static,
{
    state.counters.h2_connections.fetch_add(1, Relaxed);
    let settings = state.settings();
    let mut builder = hyper::server::conn::http2::Builder::new(LocalExec);
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(settings.h2_max_streams)
        // WebSockets over HTTP/2 (RFC 8441), to servers as HTTP/1.1 upgrades.
        .enable_connect_protocol()
        .max_header_list_size(u32::try_from(settings.http_header_max).unwrap_or(u32::MAX))
        // Keep-alive PINGs find clients that vanished without a FIN.
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));
    let activity = Rc::new(Activity::default());
    let service = unprocessed_refused(gateway::service(state, peer, &activity));
    // The responses of one turn leave together (h2 alone flushes after every body).
    let (io, drain) = coalesce::gather(io);
    let conn = coalesce::Flushing::new(builder.serve_connection(TokioIo::new(io), service), drain);
    tokio::pin!(conn);
    // After `conn`: dropped first when the task is aborted.
    let quill_ends = gateway::QuillEnds::new(&activity);
    let timers = Timers {
        first: gateway::secs(settings.http_request_timeout),
        between: gateway::secs(settings.idle_timeout),
        between_is_head: false,
        stalled: gateway::secs(settings.idle_timeout),
        // An HTTP/2 connection is more than a socket and a buffer: never parked.
        park: None,
    };
    let never = |_| false;
    let ended = gateway::supervise(state, conn, &activity, timers, &never, &never).await;
    quill_ends.disarm();
    if let Ended::Closed(Some(t)) = ended {
        t.count(state);
    }
}

/// `service` for an HTTP/2 client: a request no server processed ([`gateway::Unprocessed`])
/// resets its stream with `REFUSED_STREAM` (hyper resets a stream whose service failed with
/// the reason of the `h2::Error` it failed with), rather than answering 502.
fn unprocessed_refused<S>(
    service: S,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = gateway::Reply,
    Error = h2::Error,
    Future = impl std::future::Future<Output = Result<gateway::Reply, h2::Error>>,
>
where
    S: hyper::service::Service<
        Request<Incoming>,
        Response = gateway::Reply,
        Error = std::convert::Infallible,
    >,
{
    hyper::service::service_fn(move |req| {
        let answering = service.call(req);
        async move {
            let reply = answering.await.unwrap_or_else(|never| match never {});
            if reply.extensions().get::<gateway::Unprocessed>().is_some() {
                Err(h2::Reason::REFUSED_STREAM.into())
            } else {
                Ok(reply)
            }
        }
    })
}

/// Reads the first bytes of a plain client until they either are the HTTP/2 preface or
/// cannot be: returns them, and whether they are. An HTTP/1.x request line differs from
/// the preface by its first or second byte, so this costs HTTP/1.x clients no wait.
pub async fn sniff_preface<IO: AsyncRead + Unpin>(io: &mut IO) -> std::io::Result<(Vec<u8>, bool)> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::with_capacity(PREFACE.len());
    let mut buf = [0u8; 24];
    loop {
        let want = PREFACE.len() - got.len();
        let n = io.read(&mut buf[..want]).await?;
        if n == 0 {
            return Ok((got, false));
        }
        got.extend_from_slice(&buf[..n]);
        if !PREFACE.starts_with(&got) {
            return Ok((got, false));
        }
        if got.len() == PREFACE.len() {
            return Ok((got, true));
        }
    }
}
