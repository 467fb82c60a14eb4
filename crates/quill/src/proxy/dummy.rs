//! `dummy`: quill answers HTTP/1.x requests itself with a small body naming its port.
//!
//! A tiny keep-alive web server for demos, tests and benchmarks, not a general one: it reads
//! request heads, skips `Content-Length` bodies, answers every request with 200 once its body is in (pipelined
//! requests are answered in order, in one write), and closes on `Connection: close`, on
//! HTTP/1.0 without keep-alive, on chunked request bodies (501) and on heads over 64 KiB.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest request head accepted.
const MAX_HEAD: usize = 64 * 1024;

/// What to do with one request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Bytes of the head, including the blank line.
    pub head_len: usize,
    /// `Content-Length` of the body (0 if absent or unreadable).
    pub body_len: usize,
    pub head_method: bool,
    /// The client asked to close after this request.
    pub close: bool,
    pub chunked: bool,
}

/// Frames the request head at the start of `buf`, or `None` while it is incomplete.
pub fn parse_head(buf: &[u8]) -> Option<Request> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = &buf[..end];
    let mut lines = head
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let request_line = lines.next().unwrap_or_default();
    let head_method = request_line.starts_with(b"HEAD ");
    let http10 = request_line.ends_with(b"HTTP/1.0");
    let (mut body_len, mut close, mut keep_alive, mut chunked) = (0usize, false, false, false);
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"content-length") {
            body_len = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
        } else if name.eq_ignore_ascii_case(b"connection") {
            close |= value.eq_ignore_ascii_case(b"close");
            keep_alive |= value.eq_ignore_ascii_case(b"keep-alive");
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            chunked |= value
                .to_ascii_lowercase()
                .windows(7)
                .any(|w| w == b"chunked");
        }
    }
    Some(Request {
        head_len: end,
        body_len,
        head_method,
        close: close || (http10 && !keep_alive),
        chunked,
    })
}

/// Serves HTTP requests on `sock` until the client closes or asks to close.
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(mut sock: S, port: u16) {
    let body = format!("quill dummy server on port {port}\n");
    let head = format!(
        "HTTP/1.1 200 OK\r\nServer: quill\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut buf: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    // Body bytes of the current request still to be skipped.
    let mut skip = 0usize;
    // The request whose body is being skipped: answered once it is.
    let mut due: Option<Request> = None;
    loop {
        let start = buf.len();
        buf.resize(start + 4096, 0);
        let n = match sock.read(&mut buf[start..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.truncate(start + n);
        let mut consumed = 0;
        let mut close = false;
        loop {
            if skip > 0 {
                let s = skip.min(buf.len() - consumed);
                skip -= s;
                consumed += s;
                if skip > 0 {
                    break;
                }
            }
            // A request is answered once its body is in, as servers that read the body
            // first do (a client that sends its body slowly holds the connection).
            if let Some(req) = due.take() {
                out.extend_from_slice(head.as_bytes());
                if !req.head_method {
                    out.extend_from_slice(body.as_bytes());
                }
                if req.close {
                    close = true;
                    break;
                }
            }
            let Some(req) = parse_head(&buf[consumed..]) else {
                break;
            };
            consumed += req.head_len;
            if req.chunked {
                out.extend_from_slice(b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                close = true;
                break;
            }
            skip = req.body_len;
            due = Some(req);
        }
        buf.drain(..consumed);
        if buf.len() > MAX_HEAD {
            out.extend_from_slice(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            close = true;
        }
        if !out.is_empty() {
            if sock.write_all(&out).await.is_err() {
                return;
            }
            out.clear();
        }
        if close {
            let _ = sock.shutdown().await;
            return;
        }
        if buf.is_empty() {
            // Keep nothing for an idle keep-alive connection.
            buf = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_framed() {
        let r = parse_head(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET").unwrap();
        assert_eq!((r.head_len, r.body_len, r.close), (38, 5, false));
        let r = parse_head(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(r.close);
        let r = parse_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
        assert!(r.close);
        assert!(parse_head(b"GET / HTTP/1.1\r\n").is_none());
    }

    #[tokio::test]
    async fn a_request_is_answered_once_its_body_is_in() {
        let (mut client, server) = tokio::io::duplex(4096);
        tokio::spawn(serve(server, 80));
        client
            .write_all(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhel")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let early =
            tokio::time::timeout(std::time::Duration::from_millis(50), client.read(&mut buf)).await;
        assert!(early.is_err(), "answered before the body was in");
        client.write_all(b"lo").await.unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert!(answer.ends_with(b"quill dummy server on port 80\n"));
    }
}
