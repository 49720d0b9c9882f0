//! A small HTTP/1.1 server side for the control API: request parsing with hard limits and
//! deadlines, and response writing. Only what the API needs: `Content-Length` bodies (no
//! chunked transfer), keep-alive, pipelining. Everything malformed becomes an
//! [`HttpError`] with the status to answer, never a panic.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use thiserror::Error;

/// Largest request head (request line and headers).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Largest number of header lines.
pub const MAX_HEADERS: usize = 64;
/// Largest request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Why a request could not be read.
#[derive(Debug, Error)]
pub enum HttpError {
    /// The peer closed the connection before a request started (not an error to answer).
    #[error("connection closed")]
    Closed,
    #[error("request timed out")]
    Timeout,
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    #[error("request head larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("request body larger than {MAX_BODY_BYTES} bytes")]
    BodyTooLarge,
    #[error("a body needs Content-Length")]
    LengthRequired,
    #[error("transfer encoding not supported")]
    TransferEncoding,
    #[error("HTTP version not supported")]
    Version,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl HttpError {
    /// The status and error code to answer with, if any answer makes sense.
    pub fn status(&self) -> Option<(u16, &'static str)> {
        match self {
            HttpError::Closed | HttpError::Io(_) => None,
            HttpError::Timeout => Some((408, "request_timeout")),
            HttpError::Malformed(_) => Some((400, "bad_request")),
            HttpError::HeadTooLarge => Some((431, "header_too_large")),
            HttpError::BodyTooLarge => Some((413, "payload_too_large")),
            HttpError::LengthRequired => Some((411, "length_required")),
            HttpError::TransferEncoding => Some((501, "not_implemented")),
            HttpError::Version => Some((505, "http_version_not_supported")),
        }
    }
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    pub query: Option<String>,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Whether the client wants the connection kept open.
    pub keep_alive: bool,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads requests from one connection, keeping bytes that arrived past a request.
pub struct RequestReader<S> {
    stream: S,
    buf: Vec<u8>,
}

/// A stream with a settable read timeout.
pub trait TimedRead: Read {
    fn set_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl TimedRead for std::os::unix::net::UnixStream {
    fn set_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)
    }
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

impl<S: TimedRead> RequestReader<S> {
    pub fn new(stream: S) -> Self {
        Self::with_buffered(stream, Vec::new())
    }

    /// A reader that starts with `buf`, bytes already read from `stream`.
    pub fn with_buffered(stream: S, buf: Vec<u8>) -> Self {
        RequestReader { stream, buf }
    }

    /// Reads more bytes, failing once `deadline` passed.
    fn fill(&mut self, deadline: Instant) -> Result<usize, HttpError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HttpError::Timeout);
        }
        self.stream.set_timeout(Some(left))?;
        let mut chunk = [0u8; 4096];
        match self.stream.read(&mut chunk) {
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(HttpError::Timeout)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(1),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits up to `idle` for the first byte of the next request (at once if one is
    /// buffered). [`HttpError::Closed`] if the peer closed the connection or sent nothing.
    pub fn wait_for_request(&mut self, idle: Duration) -> Result<(), HttpError> {
        if !self.buf.is_empty() {
            return Ok(());
        }
        match self.fill(Instant::now() + idle) {
            Ok(0) => Err(HttpError::Closed),
            Ok(_) => Ok(()),
            // An idle keep-alive connection is simply closed.
            Err(HttpError::Timeout) => Err(HttpError::Closed),
            Err(e) => Err(e),
        }
    }

    /// Reads the request whose first byte came at `started`: its head must be complete
    /// `head` after that and the whole request `total` after (slow clients are cut off).
    pub fn read_request(
        &mut self,
        started: Instant,
        head: Duration,
        total: Duration,
    ) -> Result<Request, HttpError> {
        let head_deadline = started + head.min(total);
        let head_end = loop {
            if let Some(i) = find_head_end(&self.buf) {
                break i;
            }
            if self.buf.len() > MAX_HEAD_BYTES {
                return Err(HttpError::HeadTooLarge);
            }
            if self.fill(head_deadline)? == 0 {
                return Err(HttpError::Malformed("connection closed inside the request"));
            }
        };
        if head_end > MAX_HEAD_BYTES {
            return Err(HttpError::HeadTooLarge);
        }
        let head = std::str::from_utf8(&self.buf[..head_end])
            .map_err(|_| HttpError::Malformed("request head is not UTF-8"))?;
        let mut req = parse_head(head)?;
        let body_start = head_end + 4;
        let len = body_length(&req)?;
        let deadline = started + total;
        while self.buf.len() < body_start + len {
            if self.fill(deadline)? == 0 {
                return Err(HttpError::Malformed("connection closed inside the body"));
            }
        }
        req.body = self.buf[body_start..body_start + len].to_vec();
        self.buf.drain(..body_start + len);
        Ok(req)
    }

    /// Reads the next request: [`Self::wait_for_request`] with `idle`, then
    /// [`Self::read_request`] with `total` for the head and the whole request.
    pub fn next(&mut self, idle: Duration, total: Duration) -> Result<Request, HttpError> {
        self.wait_for_request(idle)?;
        self.read_request(Instant::now(), total, total)
    }
}

fn body_length(req: &Request) -> Result<usize, HttpError> {
    if req.header("transfer-encoding").is_some() {
        return Err(HttpError::TransferEncoding);
    }
    let mut lens = req
        .headers
        .iter()
        .filter(|(n, _)| n == "content-length")
        .map(|(_, v)| v);
    let Some(v) = lens.next() else {
        return Ok(0);
    };
    if lens.next().is_some() {
        return Err(HttpError::Malformed("more than one Content-Length"));
    }
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HttpError::Malformed("bad Content-Length"));
    }
    let n: usize = v.parse().map_err(|_| HttpError::BodyTooLarge)?;
    if n > MAX_BODY_BYTES {
        return Err(HttpError::BodyTooLarge);
    }
    Ok(n)
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn parse_head(head: &str) -> Result<Request, HttpError> {
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed("bad request line"));
    };
    if !is_token(method) {
        return Err(HttpError::Malformed("bad method"));
    }
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        v if v.starts_with("HTTP/") => return Err(HttpError::Version),
        _ => return Err(HttpError::Malformed("bad HTTP version")),
    };
    if !target.starts_with('/') || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(HttpError::Malformed("bad request target"));
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (target.to_string(), None),
    };
    let mut headers = Vec::new();
    for l in lines {
        if headers.len() >= MAX_HEADERS {
            return Err(HttpError::HeadTooLarge);
        }
        let (name, value) = l
            .split_once(':')
            .ok_or(HttpError::Malformed("header without ':'"))?;
        if !is_token(name) {
            return Err(HttpError::Malformed("bad header name"));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    let conn = headers
        .iter()
        .find(|(n, _)| n == "connection")
        .map(|(_, v)| v.to_ascii_lowercase());
    let keep_alive = match conn.as_deref() {
        Some(v) if v.contains("close") => false,
        Some(v) if v.contains("keep-alive") => true,
        _ => http11,
    };
    Ok(Request {
        method: method.to_string(),
        path,
        query,
        headers,
        body: Vec::new(),
        keep_alive,
    })
}

/// A response to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    /// Extra headers (name, value).
    pub headers: Vec<(&'static str, String)>,
}

impl Response {
    pub fn json(status: u16, body: Vec<u8>) -> Self {
        Response {
            status,
            content_type: "application/json",
            body,
            headers: Vec::new(),
        }
    }

    pub fn text(status: u16, content_type: &'static str, body: String) -> Self {
        Response {
            status,
            content_type,
            body: body.into_bytes(),
            headers: Vec::new(),
        }
    }

    /// Writes the response; `head_only` leaves the body out (HEAD).
    pub fn write_to(&self, w: &mut impl Write, keep_alive: bool) -> io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len(),
            if keep_alive { "keep-alive" } else { "close" }
        );
        for (n, v) in &self.headers {
            head.push_str(&format!("{n}: {v}\r\n"));
        }
        head.push_str("\r\n");
        w.write_all(head.as_bytes())?;
        w.write_all(&self.body)?;
        w.flush()
    }
}

/// The reason phrase of a status.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    struct Mem(Cursor<Vec<u8>>);
    impl Read for Mem {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.0.read(b)
        }
    }
    impl TimedRead for Mem {
        fn set_timeout(&self, _: Option<Duration>) -> io::Result<()> {
            Ok(())
        }
    }

    fn read_all(data: &[u8]) -> Vec<Result<Request, HttpError>> {
        let mut r = RequestReader::new(Mem(Cursor::new(data.to_vec())));
        let mut out = Vec::new();
        loop {
            let x = r.next(Duration::from_secs(1), Duration::from_secs(1));
            let stop = x.is_err();
            out.push(x);
            if stop {
                return out;
            }
        }
    }

    #[test]
    fn pipelined_requests_with_bodies() {
        let out = read_all(
            b"PUT /a?x=1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET /b HTTP/1.0\r\nHost: x\r\n\r\n",
        );
        let a = out[0].as_ref().expect("first");
        assert_eq!((a.method.as_str(), a.path.as_str()), ("PUT", "/a"));
        assert_eq!(a.query.as_deref(), Some("x=1"));
        assert_eq!(a.body, b"{}");
        assert!(a.keep_alive);
        let b = out[1].as_ref().expect("second");
        assert_eq!(b.path, "/b");
        assert!(!b.keep_alive);
        assert!(matches!(out[2], Err(HttpError::Closed)));
    }

    #[test]
    fn bad_input_is_refused() {
        let cases: &[(&[u8], u16)] = &[
            (b"GET /\r\n\r\n", 400),
            (b"GET / HTTP/2.0\r\n\r\n", 505),
            (b"G(T / HTTP/1.1\r\n\r\n", 400),
            (b"GET x HTTP/1.1\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nbad header\r\n\r\n", 400),
            (b"PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (
                b"PUT / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
                400,
            ),
            (
                b"PUT / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                413,
            ),
            (b"PUT / HTTP/1.1\r\nContent-Length: 70000\r\n\r\n", 413),
            (b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
            (b"PUT / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab", 400),
        ];
        for (data, status) in cases {
            let out = read_all(data);
            let err = out[0].as_ref().expect_err("must fail");
            assert_eq!(
                err.status().map(|s| s.0),
                Some(*status),
                "{:?}",
                String::from_utf8_lossy(data)
            );
        }
        let mut big = b"GET / HTTP/1.1\r\n".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_HEAD_BYTES + 10));
        let out = read_all(&big);
        assert_eq!(
            out[0].as_ref().err().and_then(|e| e.status()).map(|s| s.0),
            Some(431)
        );
    }
}
