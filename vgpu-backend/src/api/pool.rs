//! The control API's connection slots: at most [`MAX_CONNECTIONS`] connections are served
//! at once. When every slot is taken, a connection that holds one without using it makes
//! room for a newcomer: the one idle longest (waiting for a request, at least
//! [`IDLE_GRACE`]) or, for a newcomer whose request has started, the one whose request
//! has been arriving longest (at least [`SLOW_GRACE`]). A connection handling a request is
//! never evicted. Eviction shuts the connection's reading side, which wakes its thread;
//! the thread answers 503 if a request had started and closes.

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::debug;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// Evicted connections whose threads have not ended yet, at most (they end as soon as
/// they have written their answer).
const MAX_EVICTED: usize = MAX_CONNECTIONS;
/// How long a connection may wait for a request before it may be evicted. Long enough
/// for a client to write the request it connected for.
pub const IDLE_GRACE: Duration = Duration::from_millis(250);
/// How long a request may take to arrive before its connection may be evicted for a
/// waiting request. A client on the socket sends a request in microseconds.
pub const SLOW_GRACE: Duration = Duration::from_millis(250);

/// What a connection is doing, as the slots see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for a request since then.
    Idle(Instant),
    /// Reading a request whose first byte came then.
    Reading(Instant),
    /// Handling a request or writing its answer.
    Busy,
}

/// Which connections a newcomer may evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evict {
    /// None: only a free slot.
    Nothing,
    /// Idle ones (for a newcomer not known to have a request).
    Idle,
    /// Idle ones, else slow ones (for a newcomer whose request has started).
    IdleOrSlow,
}

struct Slot {
    id: u64,
    phase: Phase,
    stream: Arc<UnixStream>,
    evicted: Arc<AtomicBool>,
}

#[derive(Default)]
struct Slots {
    slots: Vec<Slot>,
    evicted_threads: usize,
    next_id: u64,
}

/// The slots of one server.
#[derive(Default)]
pub struct Pool {
    inner: Mutex<Slots>,
}

/// A connection's hold on a slot; dropping it frees the slot.
pub struct Ticket {
    pool: Arc<Pool>,
    id: u64,
    evicted: Arc<AtomicBool>,
}

impl Pool {
    pub fn new() -> Arc<Self> {
        Arc::new(Pool::default())
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives `stream` a slot in `phase`, evicting another connection if `evict` allows
    /// and none is free. `None`: no slot for it now.
    pub fn admit(
        self: &Arc<Self>,
        stream: &Arc<UnixStream>,
        phase: Phase,
        evict: Evict,
    ) -> Option<Ticket> {
        let mut s = self.slots();
        if s.slots.len() >= MAX_CONNECTIONS {
            if s.evicted_threads >= MAX_EVICTED {
                return None;
            }
            let victim = pick_victim(&s.slots, evict, Instant::now())?;
            let v = s.slots.swap_remove(victim);
            s.evicted_threads += 1;
            v.evicted.store(true, Ordering::Release);
            debug!("control API: evicting connection {} ({:?})", v.id, v.phase);
            // Wakes its thread: a blocked read returns what was buffered, then EOF.
            let _ = v.stream.shutdown(Shutdown::Read);
        }
        let id = s.next_id;
        s.next_id += 1;
        let evicted = Arc::new(AtomicBool::new(false));
        s.slots.push(Slot {
            id,
            phase,
            stream: stream.clone(),
            evicted: evicted.clone(),
        });
        Some(Ticket {
            pool: self.clone(),
            id,
            evicted,
        })
    }
}

/// The slot to free for a newcomer: the longest idle (past [`IDLE_GRACE`]), else if
/// allowed the longest reading (past [`SLOW_GRACE`]).
fn pick_victim(slots: &[Slot], evict: Evict, now: Instant) -> Option<usize> {
    let oldest = |grace: Duration, pick: fn(Phase) -> Option<Instant>| {
        slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| pick(s.phase).map(|t| (t, i)))
            .filter(|(t, _)| now.saturating_duration_since(*t) >= grace)
            .min()
            .map(|(_, i)| i)
    };
    let idle = |p| match p {
        Phase::Idle(t) => Some(t),
        _ => None,
    };
    let reading = |p| match p {
        Phase::Reading(t) => Some(t),
        _ => None,
    };
    match evict {
        Evict::Nothing => None,
        Evict::Idle => oldest(IDLE_GRACE, idle),
        Evict::IdleOrSlow => oldest(IDLE_GRACE, idle).or_else(|| oldest(SLOW_GRACE, reading)),
    }
}

impl Ticket {
    /// Records what the connection does now; `false` once it was evicted.
    pub fn set(&self, phase: Phase) -> bool {
        let mut s = self.pool.slots();
        match s.slots.iter_mut().find(|s| s.id == self.id) {
            Some(slot) => {
                slot.phase = phase;
                true
            }
            None => false,
        }
    }

    /// Whether the connection was evicted.
    pub fn evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut s = self.pool.slots();
        match s.slots.iter().position(|s| s.id == self.id) {
            Some(i) => {
                s.slots.swap_remove(i);
            }
            None => s.evicted_threads = s.evicted_threads.saturating_sub(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> Arc<UnixStream> {
        Arc::new(UnixStream::pair().expect("pair").0)
    }

    #[test]
    fn full_slots_evict_the_longest_idle_then_the_slowest() {
        let pool = Pool::new();
        let long_ago = Instant::now() - Duration::from_secs(5);
        let mut tickets: Vec<Ticket> = (0..MAX_CONNECTIONS)
            .map(|_| {
                pool.admit(&conn(), Phase::Busy, Evict::Nothing)
                    .expect("free")
            })
            .collect();
        assert!(pool
            .admit(&conn(), Phase::Busy, Evict::IdleOrSlow)
            .is_none());
        // A fresh idle one is not evicted; one idle past the grace is.
        tickets[3].set(Phase::Idle(Instant::now()));
        assert!(pool.admit(&conn(), Phase::Busy, Evict::Idle).is_none());
        tickets[5].set(Phase::Reading(long_ago));
        tickets[7].set(Phase::Idle(long_ago + Duration::from_secs(1)));
        tickets[9].set(Phase::Idle(long_ago));
        let t = pool
            .admit(&conn(), Phase::Busy, Evict::Idle)
            .expect("evicts");
        assert!(tickets[9].evicted() && !tickets[9].set(Phase::Busy));
        tickets.push(t);
        let t = pool
            .admit(&conn(), Phase::Busy, Evict::Idle)
            .expect("evicts");
        assert!(tickets[7].evicted());
        tickets.push(t);
        // Only a newcomer with a request evicts a slow one.
        assert!(pool.admit(&conn(), Phase::Busy, Evict::Idle).is_none());
        let t = pool.admit(&conn(), Phase::Busy, Evict::IdleOrSlow);
        assert!(t.is_some() && tickets[5].evicted());
        assert!(!tickets[3].evicted());
        // Ending a connection frees its slot.
        drop(t);
        assert!(pool.admit(&conn(), Phase::Busy, Evict::Nothing).is_some());
    }
}
