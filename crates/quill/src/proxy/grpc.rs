//! quill's own answers (no server, a bad gateway, a request it cannot forward) in gRPC's
//! terms, for the gRPC calls among HTTP/2 requests.
//!
//! A gRPC client reads a call's outcome from the `grpc-status` field, not the HTTP status:
//! to a plain `503` it can only say "unexpected HTTP status", and logs the `text/plain`
//! body as a malformed message. So a call quill answers itself gets what a gRPC server
//! would send for it: a "trailers-only" answer (one HEADERS frame that ends the stream),
//! HTTP status 200, and the gRPC code the HTTP status stands for by gRPC's own table
//! (`doc/http-grpc-status-mapping.md` of grpc/grpc; Envoy answers the same way), with
//! quill's words as `grpc-message`. Answers from servers pass untouched, but for one that
//! breaks off: it ends with trailers that say why ([`broken_off`]).

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Response, StatusCode, Version};

use super::gateway::Reply;

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// Whether a request is a gRPC call: HTTP/2 (gRPC is defined on nothing else) with a
/// `content-type` of `application/grpc`, alone or with a `+format` or parameters. gRPC-Web
/// (`application/grpc-web...`) frames its status otherwise and is left alone.
pub fn is_call(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_2
        && headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.as_bytes().strip_prefix(b"application/grpc"))
            .is_some_and(|rest| matches!(rest.first(), None | Some(b'+' | b';')))
}

/// The gRPC status code a client derives from an HTTP status that carries none.
pub fn code_for(status: StatusCode) -> u16 {
    match status.as_u16() {
        400 => 13,                   // INTERNAL
        401 => 16,                   // UNAUTHENTICATED
        403 => 7,                    // PERMISSION_DENIED
        404 => 12,                   // UNIMPLEMENTED
        429 | 502 | 503 | 504 => 14, // UNAVAILABLE
        _ => 2,                      // UNKNOWN
    }
}

/// quill's answer `status` with `text` as a gRPC call's trailers-only answer.
pub fn answer(status: StatusCode, text: &str) -> Reply {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::new())));
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(GRPC_STATUS, HeaderValue::from(code_for(status)));
    if let Ok(message) = HeaderValue::from_str(&percent_encoded(text.trim())) {
        headers.insert(GRPC_MESSAGE, message);
    }
    resp
}

/// The trailers that end a gRPC call whose server's answer broke off with `error`, where
/// the stream to the client would otherwise be reset (hyper resets it with
/// `INTERNAL_ERROR`, which a client reads as INTERNAL: a server's fault, never retried).
/// A stream the server (or quill, for the server's protocol error) reset ends with the
/// code gRPC's table gives its reason; a connection to the server that was lost ends with
/// UNAVAILABLE, what a client's own transport reports for a connection it lost, and the
/// code gRPC's retry policies retry.
pub fn broken_off(error: &(dyn std::error::Error + 'static)) -> HeaderMap {
    let reset = std::iter::successors(Some(error), |e| e.source())
        .find_map(|e| e.downcast_ref::<h2::Error>())
        .filter(|e| !e.is_go_away())
        .and_then(h2::Error::reason);
    let (code, text) = match reset {
        Some(reason) => (
            code_for_reset(reason),
            format!("the server's answer broke off: its stream was reset ({reason:?})"),
        ),
        None => (
            14,
            "the server's answer broke off: its connection was lost".to_string(),
        ),
    };
    let mut trailers = HeaderMap::new();
    trailers.insert(GRPC_STATUS, HeaderValue::from(code));
    if let Ok(message) = HeaderValue::from_str(&percent_encoded(&text)) {
        trailers.insert(GRPC_MESSAGE, message);
    }
    trailers
}

/// The gRPC status code of a stream reset with `reason` (gRPC's `PROTOCOL-HTTP2.md`,
/// "Errors").
fn code_for_reset(reason: h2::Reason) -> u16 {
    match reason {
        h2::Reason::REFUSED_STREAM => 14, // UNAVAILABLE: not processed, safe to retry
        h2::Reason::CANCEL => 1,          // CANCELLED
        h2::Reason::ENHANCE_YOUR_CALM => 8, // RESOURCE_EXHAUSTED
        h2::Reason::INADEQUATE_SECURITY => 7, // PERMISSION_DENIED
        _ => 13,                          // INTERNAL
    }
}

/// `grpc-message`'s encoding: bytes outside printable ASCII, and `%`, as `%XX`.
fn percent_encoded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(v: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
        h
    }

    #[test]
    fn a_call_is_http2_with_a_grpc_content_type() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;x=1",
        ] {
            assert!(is_call(Version::HTTP_2, &typed(yes)), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
        ] {
            assert!(!is_call(Version::HTTP_2, &typed(no)), "{no}");
        }
        assert!(!is_call(Version::HTTP_11, &typed("application/grpc")));
        assert!(!is_call(Version::HTTP_2, &HeaderMap::new()));
    }

    #[test]
    fn statuses_map_as_grpcs_table_says() {
        assert_eq!(code_for(StatusCode::SERVICE_UNAVAILABLE), 14);
        assert_eq!(code_for(StatusCode::BAD_GATEWAY), 14);
        assert_eq!(code_for(StatusCode::FORBIDDEN), 7);
        assert_eq!(code_for(StatusCode::BAD_REQUEST), 13);
        assert_eq!(code_for(StatusCode::NOT_IMPLEMENTED), 2);
    }

    #[test]
    fn an_answer_broken_off_ends_by_its_cause() {
        let reset = |reason| broken_off(&h2::Error::from(reason));
        let code = |t: HeaderMap| t["grpc-status"].to_str().unwrap().to_string();
        assert_eq!(code(reset(h2::Reason::CANCEL)), "1");
        assert_eq!(code(reset(h2::Reason::REFUSED_STREAM)), "14");
        assert_eq!(code(reset(h2::Reason::ENHANCE_YOUR_CALM)), "8");
        assert_eq!(code(reset(h2::Reason::INTERNAL_ERROR)), "13");
        assert_eq!(
            reset(h2::Reason::CANCEL)["grpc-message"],
            "the server's answer broke off: its stream was reset (CANCEL)"
        );
        let lost = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(code(broken_off(&lost)), "14");
        assert_eq!(code(broken_off(&std::fmt::Error)), "14");
    }

    #[test]
    fn the_answer_is_trailers_only() {
        let resp = answer(StatusCode::SERVICE_UNAVAILABLE, "No server: 100%\n");
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["grpc-status"], "14");
        assert_eq!(resp.headers()["grpc-message"], "No server: 100%25");
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/grpc");
        assert!(hyper::body::Body::is_end_stream(resp.body()));
    }
}
