//! The gRPC health-checking protocol (`grpc.health.v1.Health/Check`) as bytes: the request
//! a `check grpc` sends and the reading of the server's answer. Sans-IO: [`super::probe`]
//! moves the bytes over HTTP/2.
//!
//! The answer is untrusted: it must be one length-prefixed, uncompressed gRPC message
//! holding a protobuf `HealthCheckResponse`; fields this version does not know are skipped
//! as protobuf requires, and every malformation is an error value. Written by hand: two
//! messages of one field each do not earn a protobuf code generator and its build step.

use std::fmt;

/// The method a check calls.
pub const PATH: &str = "/grpc.health.v1.Health/Check";

/// The most bytes of an answer read: a `HealthCheckResponse` is 2 bytes; a server may add
/// fields, not kilobytes of them.
pub const MAX_ANSWER: usize = 16 * 1024;

/// `HealthCheckResponse.ServingStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServingStatus {
    Unknown,
    Serving,
    NotServing,
    /// The server does not know the service asked about.
    ServiceUnknown,
    /// A value this version of the protocol does not name.
    Other(u64),
}

impl fmt::Display for ServingStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServingStatus::Unknown => f.write_str("UNKNOWN"),
            ServingStatus::Serving => f.write_str("SERVING"),
            ServingStatus::NotServing => f.write_str("NOT_SERVING"),
            ServingStatus::ServiceUnknown => f.write_str("SERVICE_UNKNOWN"),
            ServingStatus::Other(n) => write!(f, "{n}"),
        }
    }
}

/// Why an answer's body is not a health check response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AnswerError {
    #[error("no message in the answer")]
    Empty,
    #[error("a message cut short ({got} of {want} bytes)")]
    Truncated { got: usize, want: usize },
    #[error("a compressed message (quill asks for none)")]
    Compressed,
    #[error("{0} bytes after the message")]
    Trailing(usize),
    #[error("an answer over {MAX_ANSWER} bytes")]
    TooLong,
    #[error("not a HealthCheckResponse: {0}")]
    Protobuf(&'static str),
}

/// The request body: one gRPC message (uncompressed flag, 4-byte big-endian length)
/// holding `HealthCheckRequest { service }`; the empty service asks about the server as a
/// whole.
pub fn request(service: &str) -> Vec<u8> {
    let mut msg = Vec::with_capacity(service.len() + 11);
    if !service.is_empty() {
        // Field 1, wire type 2 (length-delimited).
        msg.push(0x0a);
        put_varint(&mut msg, service.len() as u64);
        msg.extend_from_slice(service.as_bytes());
    }
    let mut body = Vec::with_capacity(5 + msg.len());
    body.push(0);
    // A service name is a config word, far below 4 GiB.
    body.extend_from_slice(&u32::try_from(msg.len()).unwrap_or(u32::MAX).to_be_bytes());
    body.extend_from_slice(&msg);
    body
}

/// The serving status in an answer's body (its DATA frames joined).
pub fn serving_status(body: &[u8]) -> Result<ServingStatus, AnswerError> {
    let Some((&flag, rest)) = body.split_first() else {
        return Err(AnswerError::Empty);
    };
    if flag != 0 {
        return Err(AnswerError::Compressed);
    }
    let Some((len, msg)) = rest.split_first_chunk::<4>() else {
        return Err(AnswerError::Truncated {
            got: body.len(),
            want: 5,
        });
    };
    let want = u32::from_be_bytes(*len) as usize;
    if msg.len() < want {
        return Err(AnswerError::Truncated {
            got: msg.len(),
            want,
        });
    }
    if msg.len() > want {
        return Err(AnswerError::Trailing(msg.len() - want));
    }
    let mut status = 0;
    let mut r = msg;
    while !r.is_empty() {
        let key = varint(&mut r)?;
        let (field, wire) = (key >> 3, key & 7);
        if field == 0 {
            return Err(AnswerError::Protobuf("field number 0"));
        }
        match wire {
            0 => {
                let v = varint(&mut r)?;
                // Field 1, the status; the last one written wins, as protobuf reads it.
                if field == 1 {
                    status = v;
                }
            }
            1 => skip(&mut r, 8)?,
            2 => {
                let n = varint(&mut r)?;
                skip(&mut r, usize::try_from(n).unwrap_or(usize::MAX))?;
            }
            5 => skip(&mut r, 4)?,
            _ => return Err(AnswerError::Protobuf("unknown wire type")),
        }
    }
    Ok(match status {
        0 => ServingStatus::Unknown,
        1 => ServingStatus::Serving,
        2 => ServingStatus::NotServing,
        3 => ServingStatus::ServiceUnknown,
        n => ServingStatus::Other(n),
    })
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Takes a varint (at most ten bytes) off the front of `r`.
fn varint(r: &mut &[u8]) -> Result<u64, AnswerError> {
    let mut v = 0u64;
    for i in 0..10 {
        let Some((&b, rest)) = r.split_first() else {
            return Err(AnswerError::Protobuf("a varint cut short"));
        };
        *r = rest;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Ok(v);
        }
    }
    Err(AnswerError::Protobuf("a varint longer than ten bytes"))
}

fn skip(r: &mut &[u8], n: usize) -> Result<(), AnswerError> {
    match r.get(n..) {
        Some(rest) => {
            *r = rest;
            Ok(())
        }
        None => Err(AnswerError::Protobuf("a field cut short")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        m.extend_from_slice(payload);
        m
    }

    #[test]
    fn the_request_names_the_service_or_nothing() {
        assert_eq!(request(""), [0, 0, 0, 0, 0]);
        assert_eq!(request("a.B"), [0, 0, 0, 0, 5, 0x0a, 3, b'a', b'.', b'B']);
        let long = "s".repeat(200);
        // A length of 200 takes two varint bytes: 0xc8 0x01.
        assert_eq!(request(&long)[5..8], [0x0a, 0xc8, 0x01]);
        assert_eq!(request(&long).len(), 5 + 3 + 200);
    }

    #[test]
    fn each_serving_status_is_read() {
        assert_eq!(
            serving_status(&message(&[0x08, 1])),
            Ok(ServingStatus::Serving)
        );
        assert_eq!(
            serving_status(&message(&[0x08, 2])),
            Ok(ServingStatus::NotServing)
        );
        assert_eq!(
            serving_status(&message(&[0x08, 3])),
            Ok(ServingStatus::ServiceUnknown)
        );
        // Absent is the default, UNKNOWN (what a server sends for status 0).
        assert_eq!(serving_status(&message(&[])), Ok(ServingStatus::Unknown));
        assert_eq!(
            serving_status(&message(&[0x08, 0x96, 0x01])),
            Ok(ServingStatus::Other(150))
        );
    }

    #[test]
    fn unknown_fields_are_skipped_and_the_last_status_wins() {
        let payload = [
            0x10, 0x05, // field 2 varint
            0x19, 1, 2, 3, 4, 5, 6, 7, 8, // field 3 fixed64
            0x22, 2, b'h', b'i', // field 4 bytes
            0x2d, 1, 2, 3, 4, // field 5 fixed32
            0x08, 2, 0x08, 1, // status twice
        ];
        assert_eq!(
            serving_status(&message(&payload)),
            Ok(ServingStatus::Serving)
        );
    }

    #[test]
    fn malformed_answers_are_errors() {
        assert_eq!(serving_status(&[]), Err(AnswerError::Empty));
        assert_eq!(
            serving_status(&[1, 0, 0, 0, 2, 0x08, 1]),
            Err(AnswerError::Compressed)
        );
        assert!(matches!(
            serving_status(&[0, 0, 0]),
            Err(AnswerError::Truncated { .. })
        ));
        assert!(matches!(
            serving_status(&[0, 0, 0, 0, 3, 0x08, 1]),
            Err(AnswerError::Truncated { got: 2, want: 3 })
        ));
        assert_eq!(
            serving_status(&[0, 0, 0, 0, 2, 0x08, 1, 0]),
            Err(AnswerError::Trailing(1))
        );
        for bad in [
            &[0x08][..],      // a varint missing
            &[0x00, 1],       // field 0
            &[0x0b],          // wire type 3 (a group)
            &[0x22, 5, b'x'], // bytes cut short
            &[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
        ] {
            assert!(
                matches!(serving_status(&message(bad)), Err(AnswerError::Protobuf(_))),
                "{bad:?}"
            );
        }
    }
}
