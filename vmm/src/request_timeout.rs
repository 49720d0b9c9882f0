//! A deadline on vhost-user requests that wait for a reply.
//!
//! The `vhost` crate's frontend blocks in `recvmsg` until the backend answers and retries
//! `EAGAIN` forever, so a socket receive timeout cannot end the wait. Instead a watchdog
//! thread shuts the socket down when an armed deadline passes: the blocked call then
//! reads end-of-file and fails, and the caller treats the connection as dead (it is out
//! of step with the backend from then on and must be closed).

use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, warn};

#[derive(Debug, Default)]
struct State {
    /// When the request in flight must have been answered.
    deadline: Option<Instant>,
    /// The deadline passed and the socket was shut down.
    fired: bool,
    stop: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Shuts `socket` down when a request outlives its deadline (see the module docs).
#[derive(Debug)]
pub struct RequestWatchdog {
    timeout: Duration,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl RequestWatchdog {
    /// Watches `socket` (owned by the caller, who keeps it open while this lives), giving
    /// each request `timeout`.
    pub fn start(socket: RawFd, timeout: Duration) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vu-req-timeout".into())
            .spawn(move || {
                vgpu_sandbox::enter(vgpu_sandbox::Role::VmmIrq);
                watch(&s, socket)
            })?;
        Ok(RequestWatchdog {
            timeout,
            shared,
            thread: Some(thread),
        })
    }

    /// Arms the deadline for one request; disarmed when the guard drops.
    pub fn arm(&self) -> Armed<'_> {
        let mut st = self.shared.lock();
        st.deadline = Some(Instant::now() + self.timeout);
        drop(st);
        self.shared.cv.notify_all();
        Armed { dog: self }
    }

    /// Whether a deadline passed (the socket is shut down for good).
    pub fn fired(&self) -> bool {
        self.shared.lock().fired
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// A request's deadline; dropping it disarms the watchdog.
pub struct Armed<'a> {
    dog: &'a RequestWatchdog,
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.dog.shared.lock().deadline = None;
    }
}

fn watch(shared: &Shared, socket: RawFd) {
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        st = match st.deadline {
            None => shared.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    warn!("vhost-user: the backend did not answer in time; closing the connection");
                    // SAFETY: shutdown(2) on a socket the owner keeps open while this
                    // thread runs; it touches no memory.
                    if unsafe { libc::shutdown(socket, libc::SHUT_RDWR) } != 0 {
                        error!(
                            "vhost-user: shutdown after a timeout: {}",
                            std::io::Error::last_os_error()
                        );
                    }
                    st.fired = true;
                    st.deadline = None;
                    continue;
                }
                shared
                    .cv
                    .wait_timeout(st, d - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
}

impl Drop for RequestWatchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                error!("vhost-user request watchdog panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn an_unanswered_request_ends_with_the_socket_shut_down() {
        let (mut a, _b) = UnixStream::pair().expect("pair");
        let dog = RequestWatchdog::start(a.as_raw_fd(), Duration::from_millis(50)).expect("dog");
        let armed = dog.arm();
        let mut buf = [0u8; 1];
        // The peer never writes: only the watchdog's shutdown ends this read.
        assert_eq!(a.read(&mut buf).expect("read"), 0);
        drop(armed);
        assert!(dog.fired());
    }

    #[test]
    fn an_answered_request_leaves_the_socket_alone() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        let dog = RequestWatchdog::start(a.as_raw_fd(), Duration::from_secs(30)).expect("dog");
        {
            let _armed = dog.arm();
            std::io::Write::write_all(&mut b, b"x").expect("write");
            let mut buf = [0u8; 1];
            a.read_exact(&mut buf).expect("read");
        }
        assert!(!dog.fired());
        std::io::Write::write_all(&mut b, b"y").expect("write");
        let mut buf = [0u8; 1];
        a.read_exact(&mut buf).expect("socket still open");
    }
}
