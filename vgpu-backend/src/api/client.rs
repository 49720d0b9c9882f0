//! A client of the control API over its unix socket: one request per connection
//! (`Connection: close`). Used by `vgpuctl`, the demo, the benchmarks and the tests.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

use crate::api::types::*;

/// Largest response the client reads.
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Errors of an API call.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("{path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed response: {0}")]
    Malformed(String),
    /// The server answered with an error.
    #[error("{status} {code}: {message}")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
}

/// A raw answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawResponse {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A client bound to an API socket.
#[derive(Debug, Clone)]
pub struct ApiClient {
    path: PathBuf,
    timeout: Duration,
}

/// Parses an HTTP/1.1 response read to EOF.
pub fn parse_response(data: &[u8]) -> Result<RawResponse, ClientError> {
    let bad = |m: &str| ClientError::Malformed(m.to_string());
    let end = data
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of head"))?;
    let head = std::str::from_utf8(&data[..end]).map_err(|_| bad("head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Err(bad("bad status line"));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = data[end + 4..].to_vec();
    if let Some(len) = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok())
    {
        if body.len() < len {
            return Err(bad("body shorter than Content-Length"));
        }
        body.truncate(len);
    }
    Ok(RawResponse {
        status,
        headers,
        body,
    })
}

impl ApiClient {
    pub fn new(path: impl AsRef<Path>) -> Self {
        ApiClient {
            path: path.as_ref().to_path_buf(),
            timeout: Duration::from_secs(90),
        }
    }

    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends one request and reads the whole answer, whatever its status.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<RawResponse, ClientError> {
        let mut s = UnixStream::connect(&self.path).map_err(|source| ClientError::Connect {
            path: self.path.clone(),
            source,
        })?;
        s.set_read_timeout(Some(self.timeout))?;
        s.set_write_timeout(Some(self.timeout))?;
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: vgpu\r\nConnection: close\r\n");
        if let Some(b) = body {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())?;
        if let Some(b) = body {
            s.write_all(b)?;
        }
        let mut data = Vec::new();
        (&mut s)
            .take(MAX_RESPONSE_BYTES as u64)
            .read_to_end(&mut data)?;
        parse_response(&data)
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<T, ClientError> {
        let r = self.raw(method, path, body)?;
        if r.status != 200 {
            return Err(match serde_json::from_slice::<ApiErrorBody>(&r.body) {
                Ok(e) => ClientError::Api {
                    status: r.status,
                    code: e.code,
                    message: e.message,
                },
                Err(_) => ClientError::Api {
                    status: r.status,
                    code: "unknown".into(),
                    message: String::from_utf8_lossy(&r.body).into_owned(),
                },
            });
        }
        serde_json::from_slice(&r.body).map_err(|e| ClientError::Malformed(e.to_string()))
    }

    /// PUTs `body` as JSON to `path` and decodes the answer.
    pub fn put_json<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let b = serde_json::to_vec(body).map_err(|e| ClientError::Malformed(e.to_string()))?;
        self.call("PUT", path, Some(&b))
    }

    pub fn info(&self) -> Result<InfoBody, ClientError> {
        self.call("GET", "/api/v1/info", None)
    }

    pub fn vms(&self) -> Result<VmListBody, ClientError> {
        self.call("GET", "/api/v1/vms", None)
    }

    pub fn vm(&self, name: &str) -> Result<VmDetail, ClientError> {
        self.call("GET", &format!("/api/v1/vms/{name}"), None)
    }

    pub fn vm_migration(&self, name: &str) -> Result<MigrationBody, ClientError> {
        self.call("GET", &format!("/api/v1/vms/{name}/migration"), None)
    }

    pub fn vm_stats(&self, name: &str) -> Result<VmStatsBody, ClientError> {
        self.call("GET", &format!("/api/v1/vms/{name}/stats"), None)
    }

    pub fn set_weight(&self, name: &str, weight: u32) -> Result<WeightBody, ClientError> {
        self.put_json(
            &format!("/api/v1/vms/{name}/weight"),
            &WeightBody { weight },
        )
    }

    pub fn set_vram_quota(&self, name: &str, bytes: u64) -> Result<QuotaBody, ClientError> {
        self.put_json(
            &format!("/api/v1/vms/{name}/vram-quota"),
            &QuotaBody { bytes },
        )
    }

    pub fn pause(&self, name: &str) -> Result<PauseBody, ClientError> {
        self.call("PUT", &format!("/api/v1/vms/{name}/pause"), None)
    }

    pub fn resume(&self, name: &str) -> Result<PauseBody, ClientError> {
        self.call("PUT", &format!("/api/v1/vms/{name}/resume"), None)
    }

    pub fn drain(&self, name: &str, timeout_ms: Option<u64>) -> Result<PauseBody, ClientError> {
        let path = format!("/api/v1/vms/{name}/drain");
        match timeout_ms {
            Some(t) => self.put_json(&path, &serde_json::json!({ "timeout_ms": t })),
            None => self.call("PUT", &path, None),
        }
    }

    pub fn scheduler(&self) -> Result<SchedulerBody, ClientError> {
        self.call("GET", "/api/v1/scheduler", None)
    }

    /// Changes the scheduler: `changes` is a JSON object of the fields to change.
    pub fn set_scheduler(&self, changes: &serde_json::Value) -> Result<SchedulerBody, ClientError> {
        self.put_json("/api/v1/scheduler", changes)
    }

    pub fn metrics(&self) -> Result<String, ClientError> {
        let r = self.raw("GET", "/metrics", None)?;
        if r.status != 200 {
            return Err(ClientError::Api {
                status: r.status,
                code: "metrics".into(),
                message: String::from_utf8_lossy(&r.body).into_owned(),
            });
        }
        String::from_utf8(r.body).map_err(|e| ClientError::Malformed(e.to_string()))
    }
}
