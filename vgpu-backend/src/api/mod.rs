//! The operator control API: HTTP/1.1 + JSON on a unix socket, in the style of Cloud
//! Hypervisor's and Firecracker's (versioned paths under `/api/v1/`, JSON errors
//! `{"code", "message"}`, an OpenAPI document in `docs/api/openapi.yaml`), plus a
//! Prometheus text endpoint `GET /metrics`.
//!
//! - [`http`]: request parsing with limits and deadlines, response writing;
//! - [`routes`]: the route table and the handlers;
//! - [`share`]: the busy-time samples behind the GPU shares over recent windows;
//! - [`metrics`]: the Prometheus exposition;
//! - [`client`]: a client over the socket (used by `vgpuctl`, the demo and the tests);
//! - [`types`]: the JSON bodies.
//!
//! One thread accepts connections, a thread serves each connection (at most
//! [`MAX_CONNECTIONS`] at once; more are answered 503 and closed), and a sampler thread
//! records busy time every [`share::SAMPLE_PERIOD`]. A slow client is cut off when a
//! request is not complete [`ApiOptions::request_timeout`] after its first byte (408); an
//! idle keep-alive connection is closed after [`ApiOptions::idle_timeout`]. The socket
//! file is created with mode 0600: whoever can connect controls every VM.

pub mod client;
pub mod http;
pub mod metrics;
pub mod routes;
pub mod share;
pub mod types;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use thiserror::Error;

use crate::VgpuBackend;
use http::{RequestReader, Response};
use routes::ApiState;
use share::ShareBook;

/// Index of the accept thread in [`ApiServer::threads`] (the sampler is 0).
const ACCEPT_THREAD: usize = 1;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;

/// Errors of starting the API server.
#[derive(Debug, Error)]
pub enum ApiError {
    #[error("API socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    #[error("cannot start an API thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Timeouts of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiOptions {
    /// From a request's first byte to its last.
    pub request_timeout: Duration,
    /// How long an idle keep-alive connection stays open.
    pub idle_timeout: Duration,
    /// For writing a response.
    pub write_timeout: Duration,
}

impl Default for ApiOptions {
    fn default() -> Self {
        ApiOptions {
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(5),
        }
    }
}

/// A running API server. Dropping it stops it.
pub struct ApiServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    state: Arc<ApiState>,
}

impl ApiServer {
    /// Serves the API of `backend` on the unix socket `path` (a stale socket file there
    /// is replaced; any other file is an error).
    pub fn start(
        backend: &Arc<VgpuBackend>,
        path: &Path,
        opts: ApiOptions,
    ) -> Result<Self, ApiError> {
        let sock_err = |source| ApiError::Socket {
            path: path.to_path_buf(),
            source,
        };
        match std::fs::symlink_metadata(path) {
            Ok(md) if md.file_type().is_socket() => std::fs::remove_file(path).map_err(sock_err)?,
            Ok(_) => return Err(ApiError::NotASocket(path.to_path_buf())),
            Err(_) => {}
        }
        let listener = UnixListener::bind(path).map_err(sock_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(sock_err)?;
        let shares = ShareBook::new();
        let state = Arc::new(ApiState::new(Arc::downgrade(backend), shares.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let (weak, stop2) = (Arc::downgrade(backend), stop.clone());
        threads.push(
            std::thread::Builder::new()
                .name("vgpu-api-sampler".into())
                .spawn(move || sampler_loop(weak, shares, stop2))
                .map_err(ApiError::Thread)?,
        );
        let (state2, stop2) = (state.clone(), stop.clone());
        let accept = std::thread::Builder::new()
            .name("vgpu-api".into())
            .spawn(move || accept_loop(listener, state2, stop2, opts));
        let accept = match accept {
            Ok(h) => h,
            Err(e) => {
                stop.store(true, Ordering::Release);
                return Err(ApiError::Thread(e));
            }
        };
        threads.push(accept);
        info!("control API listening on {}", path.display());
        Ok(ApiServer {
            path: path.to_path_buf(),
            stop,
            threads,
            state,
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// API requests answered so far, by HTTP status.
    pub fn requests_by_status(&self) -> Vec<(u16, u64)> {
        self.state.requests_by_status()
    }

    /// Stops accepting, waits for the accept and sampler threads, removes the socket.
    /// Connections being served finish their current request.
    pub fn shutdown(&mut self) {
        if self.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the accept loop. If that fails (the socket file was removed), the accept
        // thread is left blocked rather than waited for.
        let woke = UnixStream::connect(&self.path).is_ok();
        for (i, t) in self.threads.drain(..).enumerate() {
            if i == ACCEPT_THREAD && !woke {
                warn!("control API: cannot wake the accept thread; leaving it");
                continue;
            }
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        info!("control API stopped");
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn sampler_loop(be: Weak<VgpuBackend>, shares: Arc<ShareBook>, stop: Arc<AtomicBool>) {
    vgpu_sandbox::enter(vgpu_sandbox::Role::Api);
    let mut next = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let Some(backend) = be.upgrade() else {
            return;
        };
        shares.sample(&backend);
        backend.mirror_paused();
        drop(backend);
        next += share::SAMPLE_PERIOD;
        let now = Instant::now();
        if next < now {
            next = now;
        }
        // Sleep in slices so that shutdown is quick.
        while !stop.load(Ordering::Acquire) && Instant::now() < next {
            std::thread::sleep(
                next.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(20)),
            );
        }
    }
}

fn accept_loop(
    listener: UnixListener,
    state: Arc<ApiState>,
    stop: Arc<AtomicBool>,
    opts: ApiOptions,
) {
    // The connection and reject threads inherit the filters.
    vgpu_sandbox::enter(vgpu_sandbox::Role::Api);
    let active = Arc::new(AtomicUsize::new(0));
    // Connections over the limit are answered 503 by one thread, after it read their
    // request (closing a unix socket with unread data resets it for the peer).
    let (reject_tx, reject_rx) = std::sync::mpsc::sync_channel::<UnixStream>(MAX_CONNECTIONS);
    let state_r = state.clone();
    let rejecter = std::thread::Builder::new()
        .name("vgpu-api-reject".into())
        .spawn(move || {
            for stream in reject_rx {
                reject(stream, opts);
                state_r.count(503);
            }
        });
    if let Err(e) = &rejecter {
        warn!("control API: cannot start the reject thread: {e}");
    }
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                warn!("control API: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            // A full queue drops the connection.
            let _ = reject_tx.try_send(stream);
            continue;
        }
        let (state, stop, active2) = (state.clone(), stop.clone(), active.clone());
        let spawned = std::thread::Builder::new()
            .name("vgpu-api-conn".into())
            .spawn(move || {
                serve_connection(stream, &state, &stop, opts);
                active2.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::AcqRel);
            warn!("control API: cannot start a connection thread: {e}");
        }
    }
}

/// Reads (briefly) and discards a request, then answers 503.
fn reject(stream: UnixStream, opts: ApiOptions) {
    let _ = stream.set_write_timeout(Some(opts.write_timeout));
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let mut s = &stream;
    while head.len() < http::MAX_HEAD_BYTES && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match std::io::Read::read(&mut s, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let _ = routes::error_response(503, "too_many_connections", "too many connections")
        .write_to(&mut s, false);
}

fn serve_connection(stream: UnixStream, state: &ApiState, stop: &AtomicBool, opts: ApiOptions) {
    if let Err(e) = stream.set_write_timeout(Some(opts.write_timeout)) {
        debug!("control API: {e}");
        return;
    }
    let mut out = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            debug!("control API: {e}");
            return;
        }
    };
    let mut reader = RequestReader::new(stream);
    while !stop.load(Ordering::Acquire) {
        let (resp, keep_alive): (Response, bool) =
            match reader.next(opts.idle_timeout, opts.request_timeout) {
                Ok(req) => {
                    let resp = state.handle(&req);
                    (resp, req.keep_alive)
                }
                Err(e) => match e.status() {
                    Some((status, code)) => {
                        debug!("control API: {e}");
                        (routes::error_response(status, code, &e.to_string()), false)
                    }
                    None => return,
                },
            };
        state.count(resp.status);
        if resp.write_to(&mut out, keep_alive).is_err() || !keep_alive {
            return;
        }
    }
}
