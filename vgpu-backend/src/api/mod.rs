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
//! - [`lobby`]: the accept loop, where connections wait until their request starts;
//! - [`pool`]: the connection slots, and evicting idle and slow connections when full.
//!
//! One thread accepts connections and holds them in the [`lobby`] until their request
//! starts; a thread then serves each connection (at most [`MAX_CONNECTIONS`] at once), and
//! a sampler thread records busy time every [`share::SAMPLE_PERIOD`]. Idle and slow
//! clients cannot keep the operator out: a connection that sends nothing holds no slot;
//! when every slot is taken, a newcomer's request evicts the connection idle longest
//! between keep-alive requests, else the one whose request has been arriving longest; a
//! request that finds no slot within [`lobby::QUEUE_WAIT`] is answered 503 with
//! `Retry-After`. A slow client is cut off (408) when a request's head is not complete
//! [`ApiOptions::head_timeout`], or the whole request [`ApiOptions::request_timeout`],
//! after its first byte; an idle connection is closed after [`ApiOptions::idle_timeout`].
//! Every connection that sent a request gets an answer. The socket file is created with
//! mode 0600: whoever can connect controls every VM.

pub mod client;
pub mod http;
pub mod lobby;
pub mod metrics;
pub mod pool;
pub mod routes;
pub mod share;
pub mod types;

use std::io::Read;
use std::net::Shutdown;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use thiserror::Error;

use crate::VgpuBackend;
use http::{RequestReader, Response, TimedRead};
use lobby::{Admitted, Doorman};
use pool::{Phase, Pool};
use routes::ApiState;
use share::ShareBook;

pub use pool::MAX_CONNECTIONS;

/// Index of the accept thread in [`ApiServer::threads`] (the sampler is 0).
const ACCEPT_THREAD: usize = 1;

/// The `Retry-After` of a 503 for lack of room, in seconds.
pub const RETRY_AFTER_S: u32 = 1;
/// Unread bytes discarded when closing a connection, at most.
const MAX_DRAIN_BYTES: usize = 1 << 20;

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
    /// From a request's first byte to the end of its head (slow-loris clients).
    pub head_timeout: Duration,
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
            head_timeout: Duration::from_secs(2),
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

/// What the accept thread and the connection threads share.
struct Server {
    state: Arc<ApiState>,
    stop: Arc<AtomicBool>,
    opts: ApiOptions,
    pool: Arc<Pool>,
}

impl Doorman for Server {
    fn start(&self, conn: Admitted) {
        let stream = conn.stream.clone();
        let (state, stop, opts) = (self.state.clone(), self.stop.clone(), self.opts);
        let spawned = std::thread::Builder::new()
            .name("vgpu-api-conn".into())
            .spawn(move || serve_connection(conn, &state, &stop, opts));
        if let Err(e) = spawned {
            warn!("control API: cannot start a connection thread: {e}");
            self.refuse(&stream, false);
        }
    }

    fn refuse(&self, stream: &UnixStream, shutting_down: bool) {
        let resp = if shutting_down {
            routes::error_response(503, "shutting_down", "the API is stopping")
        } else {
            busy_response()
        };
        let _ = stream.set_write_timeout(Some(self.opts.write_timeout));
        let _ = resp.write_to(&mut &*stream, false);
        self.state.count(resp.status);
        close_gently(stream);
    }
}

/// The answer to a connection there is no room for: try again in a second.
fn busy_response() -> Response {
    let mut resp = routes::error_response(503, "too_many_connections", "too many connections");
    resp.headers
        .push(("Retry-After", RETRY_AFTER_S.to_string()));
    resp
}

/// Closes a connection without resetting it for the peer: closing a unix socket with
/// unread data makes the peer's read fail after our answer. Shutting our reading side
/// stops the peer from sending more, so the drain ends at once.
fn close_gently(stream: &UnixStream) {
    let _ = stream.shutdown(Shutdown::Read);
    let mut buf = [0u8; 4096];
    let mut drained = 0usize;
    while drained < MAX_DRAIN_BYTES {
        match (&mut &*stream).read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

fn accept_loop(
    listener: UnixListener,
    state: Arc<ApiState>,
    stop: Arc<AtomicBool>,
    opts: ApiOptions,
) {
    // The connection threads inherit the filters.
    vgpu_sandbox::enter(vgpu_sandbox::Role::Api);
    let server = Server {
        state,
        stop: stop.clone(),
        opts,
        pool: Pool::new(),
    };
    lobby::run(&listener, &server.pool, &server, &stop, opts.idle_timeout);
}

/// `Read` and read timeouts on a connection shared with its slot.
struct SharedStream(Arc<UnixStream>);

impl Read for SharedStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl TimedRead for SharedStream {
    fn set_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.0.set_read_timeout(t)
    }
}

fn serve_connection(conn: Admitted, state: &ApiState, stop: &AtomicBool, opts: ApiOptions) {
    let Admitted {
        stream,
        ticket,
        buffered,
        first_byte,
    } = conn;
    let mut first_byte = Some(first_byte);
    if let Err(e) = stream.set_write_timeout(Some(opts.write_timeout)) {
        debug!("control API: {e}");
        close_gently(&stream);
        return;
    }
    let mut reader = RequestReader::with_buffered(SharedStream(stream.clone()), buffered);
    let mut out: &UnixStream = &stream;
    while !stop.load(Ordering::Acquire) {
        let started = match first_byte.take() {
            Some(t) => t,
            None => {
                if !ticket.set(Phase::Idle(Instant::now())) {
                    break;
                }
                // Also ends when the connection is evicted while idle.
                match reader.wait_for_request(opts.idle_timeout) {
                    Ok(()) => Instant::now(),
                    Err(e) => {
                        debug!("control API: {e}");
                        break;
                    }
                }
            }
        };
        let read = ticket
            .set(Phase::Reading(started))
            .then(|| reader.read_request(started, opts.head_timeout, opts.request_timeout));
        let (resp, keep_alive): (Response, bool) = match (read, ticket.set(Phase::Busy)) {
            (Some(Ok(req)), true) => {
                let resp = state.handle(&req);
                (resp, req.keep_alive)
            }
            (Some(Err(e)), true) => match e.status() {
                Some((status, code)) => {
                    debug!("control API: {e}");
                    (routes::error_response(status, code, &e.to_string()), false)
                }
                None => break,
            },
            // Evicted while its request arrived: it may retry.
            _ => (busy_response(), false),
        };
        state.count(resp.status);
        if resp.write_to(&mut out, keep_alive).is_err() || !keep_alive {
            break;
        }
    }
    close_gently(&stream);
    drop(ticket);
}
