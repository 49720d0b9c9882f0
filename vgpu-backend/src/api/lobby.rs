//! The control API's lobby: the accept thread's poll(2) loop. Every connection waits here,
//! read without blocking, until its request starts; it then gets a slot of the [`Pool`]
//! (and a thread) when one is free, or when an idle or slow connection can be evicted for
//! it. So connections that send nothing hold no slot and keep nobody out. A request still
//! waiting [`QUEUE_WAIT`] after its first byte is answered 503 with `Retry-After`; a
//! connection that sends nothing is closed after the idle timeout, or (the oldest first)
//! when [`MAX_LOBBY`] connections wait. Nothing that sent a request is closed without an
//! answer.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, warn};

use super::http::{MAX_BODY_BYTES, MAX_HEAD_BYTES};
use super::pool::{Evict, Phase, Pool, Ticket};

/// How long a request waits for a slot before it is answered 503.
pub const QUEUE_WAIT: Duration = Duration::from_secs(1);
/// Connections waiting at most; past that the oldest idle one is closed for a newcomer,
/// and with none idle new clients wait in the socket's backlog.
pub const MAX_LOBBY: usize = 512;
/// How often a request waiting for a slot looks for one.
const TICK: Duration = Duration::from_millis(5);
/// How long the loop sleeps at most with only idle connections (their idle timeout's
/// resolution).
const IDLE_TICK: Duration = Duration::from_millis(100);
/// What is read from a waiting connection at most: a whole request.
const MAX_BUFFERED: usize = MAX_HEAD_BYTES + 4 + MAX_BODY_BYTES;

/// A connection in the lobby.
struct Waiter {
    stream: Arc<UnixStream>,
    arrived: Instant,
    /// When its request's first byte came.
    first_byte: Option<Instant>,
    buf: Vec<u8>,
    /// The peer closed its side (or the connection failed).
    eof: bool,
}

/// A connection given a slot, with what it sent while it waited.
pub struct Admitted {
    pub stream: Arc<UnixStream>,
    pub ticket: Ticket,
    pub buffered: Vec<u8>,
    pub first_byte: Instant,
}

/// What the lobby does with connections.
pub trait Doorman {
    /// Serves an admitted connection.
    fn start(&self, conn: Admitted);
    /// Answers 503 (`shutting_down`: the server stops) and closes.
    fn refuse(&self, stream: &UnixStream, shutting_down: bool);
}

/// Accepts and seats connections until `stop`; then answers whoever waits with a request.
pub fn run(
    listener: &UnixListener,
    pool: &Arc<Pool>,
    door: &impl Doorman,
    stop: &AtomicBool,
    idle_timeout: Duration,
) {
    if let Err(e) = listener.set_nonblocking(true) {
        warn!("control API: cannot make the listener non-blocking: {e}");
        return;
    }
    let mut lobby: Vec<Waiter> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        let listen = make_room(&mut lobby);
        let readable = wait(listener, listen, &lobby);
        let now = Instant::now();
        for (w, _) in lobby
            .iter_mut()
            .zip(readable.iter().skip(1))
            .filter(|(_, r)| **r)
        {
            read_available(w, now);
        }
        if readable.first() == Some(&true) {
            accept_all(listener, &mut lobby);
        }
        let now = Instant::now();
        lobby.retain_mut(|w| seat(w, pool, door, now, idle_timeout));
    }
    for w in lobby {
        if w.first_byte.is_some() {
            door.refuse(&w.stream, true);
        }
    }
}

/// Closes the oldest idle connection if the lobby is full; whether there is room to accept.
fn make_room(lobby: &mut Vec<Waiter>) -> bool {
    if lobby.len() < MAX_LOBBY {
        return true;
    }
    match lobby.iter().position(|w| w.first_byte.is_none()) {
        Some(i) => {
            debug!("control API: lobby full, closing the oldest idle connection");
            lobby.remove(i);
            true
        }
        None => false,
    }
}

/// Decides a waiter's fate: `false` when it leaves the lobby (seated, answered or gone).
fn seat(
    w: &mut Waiter,
    pool: &Arc<Pool>,
    door: &impl Doorman,
    now: Instant,
    idle_timeout: Duration,
) -> bool {
    let Some(first_byte) = w.first_byte else {
        // Gone, or idle too long, without a request: nothing to answer.
        return !w.eof && now.saturating_duration_since(w.arrived) < idle_timeout;
    };
    if let Some(ticket) = pool.admit(&w.stream, Phase::Reading(first_byte), Evict::IdleOrSlow) {
        if let Err(e) = w.stream.set_nonblocking(false) {
            debug!("control API: {e}");
        }
        door.start(Admitted {
            stream: w.stream.clone(),
            ticket,
            buffered: std::mem::take(&mut w.buf),
            first_byte,
        });
        return false;
    }
    if now.saturating_duration_since(first_byte) >= QUEUE_WAIT {
        door.refuse(&w.stream, false);
        return false;
    }
    true
}

fn accept_all(listener: &UnixListener, lobby: &mut Vec<Waiter>) {
    while make_room(lobby) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of fds, say: the client stays in the backlog; try again soon.
                warn!("control API: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
                return;
            }
        };
        if let Err(e) = stream.set_nonblocking(true) {
            debug!("control API: {e}");
            continue;
        }
        let now = Instant::now();
        let mut w = Waiter {
            stream: Arc::new(stream),
            arrived: now,
            first_byte: None,
            buf: Vec::new(),
            eof: false,
        };
        // Its request is often there already.
        read_available(&mut w, now);
        lobby.push(w);
    }
}

/// Sleeps until the listener (if `listen`) or a waiter is readable, or a tick passed.
/// Returns which were: the listener first, then each waiter.
fn wait(listener: &UnixListener, listen: bool, lobby: &[Waiter]) -> Vec<bool> {
    // A negative fd is skipped: one that hung up would wake poll at once, every time.
    let fd = |fd, on: bool| libc::pollfd {
        fd: if on { fd } else { -1 },
        events: libc::POLLIN,
        revents: 0,
    };
    let mut fds: Vec<libc::pollfd> = std::iter::once(fd(listener.as_raw_fd(), listen))
        .chain(
            lobby
                .iter()
                .map(|w| fd(w.stream.as_raw_fd(), !w.eof && w.buf.len() < MAX_BUFFERED)),
        )
        .collect();
    let timeout = if lobby.iter().any(|w| w.first_byte.is_some()) {
        TICK.as_millis() as libc::c_int
    } else if !lobby.is_empty() || !listen {
        IDLE_TICK.as_millis() as libc::c_int
    } else {
        -1
    };
    // SAFETY: `fds` is a valid array of `fds.len()` pollfds that outlives the call; each
    // fd is held open by the listener or a `Waiter`.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if n < 0 {
        // EINTR: the next round polls again.
        debug!("control API: poll: {}", io::Error::last_os_error());
    }
    fds.iter().map(|p| p.revents != 0).collect()
}

/// Reads what `w` has sent so far, without blocking.
fn read_available(w: &mut Waiter, now: Instant) {
    let mut chunk = [0u8; 4096];
    while !w.eof && w.buf.len() < MAX_BUFFERED {
        let room = (MAX_BUFFERED - w.buf.len()).min(chunk.len());
        match (&*w.stream).read(&mut chunk[..room]) {
            Ok(0) => w.eof = true,
            Ok(n) => {
                w.buf.extend_from_slice(&chunk[..n]);
                w.first_byte.get_or_insert(now);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(_) => w.eof = true,
        }
    }
}
