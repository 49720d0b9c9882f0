//! One GPU, many worker processes: the GPU turn.
//!
//! Each VM's GPU work runs in a process of its own with its own CUDA context. When two
//! contexts have work at once the GPU time-slices them, and a kernel that is switched out
//! still counts as running from its start mark to its end mark: both VMs are charged for
//! the same wall time, and the scheduler's shares go wrong (measured on the H100: 59.2 %
//! and 50.9 % for two VMs that should get 50 % each). The turn makes workers take the GPU
//! one at a time, so a worker's start-to-end marks measure GPU time it alone used, exactly
//! as in one process.
//!
//! The turn is a word in a page every worker of a backend maps: 0 when free, else the
//! holder's slot + 1. A worker with work takes it (compare-and-swap), issues, and gives it
//! back when its work on the GPU has drained and it has nothing more to issue, or, when
//! others wait, once it has held the turn for a quantum (it stops issuing then and gives
//! the turn back when what it issued has drained). A worker that gave the turn up for
//! others does not take it again before one of them did, so waiters are served in turn.
//! Fairness between VMs stays the scheduler's (it shadows over-users, whose pending work
//! the front end then never sees); the turn only keeps the books exact.
//!
//! Why no submission is lost, run twice or stalled for good:
//! - The turn gates only *issuing*; fetching decisions, retiring completions and REF/
//!   NOTIFY reports go on while a worker waits, and nothing issued is ever taken back.
//! - A worker gives the turn back only from its own front-end thread, and takes it only
//!   there, so "holding" is one thread's fact, with the page the arbiter between threads
//!   of different processes.
//! - The page is shared with processes that run guests' work and may be hostile: a worker
//!   that never gives the turn back (hung, killed, or writing the page at will) is taken
//!   from after [`MAX_WAIT_NS`], so the worst a broken worker can do is bring back the
//!   GPU's own time-slicing, never stop another VM's work. The backend also clears a dead
//!   worker's slot ([`GpuTurnPage::clear_slot`]).

use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::shared_mem::{SharedMem, SharedMemError};

/// Size of the turn page.
pub const TURN_PAGE_BYTES: u64 = 4096;
/// Slots (workers at once) one page serves.
pub const TURN_SLOTS: u32 = 1000;
/// A waiter takes the turn from a holder that kept it this long past its quantum.
pub const MAX_WAIT_NS: u64 = 200_000_000;
/// A worker that gave the turn up for others lets them take it first for at most this
/// long (a waiter polls every few microseconds; a waiting flag left by a dead or lying
/// worker must not stall the one that yielded for longer).
pub const YIELD_GRACE_NS: u64 = 200_000;
/// A holder whose quantum ran out gives the turn up after this long even if its work has
/// not drained (a kernel longer than this, or a semaphore wait that is never satisfied).
pub const MAX_DRAIN_NS: u64 = 100_000_000;

const HOLDER: u64 = 0;
/// How many times the turn was taken (moves on every take).
const TAKES: u64 = 4;
/// One u32 per slot: 1 while that slot's worker waits for the turn.
const WAITING: u64 = 64;

/// The backend's side: makes the page and clears the slots of workers that are gone.
pub struct GpuTurnPage {
    mem: SharedMem,
}

impl GpuTurnPage {
    pub fn new() -> Result<Self, SharedMemError> {
        Ok(GpuTurnPage {
            mem: SharedMem::new_sealed("vgpu-gpu-turn", TURN_PAGE_BYTES)?,
        })
    }

    /// The page's memfd, for a worker to map.
    pub fn fd(&self) -> RawFd {
        self.mem.fd()
    }

    /// Forgets `slot`'s worker (it is gone): not waiting, and not holding.
    pub fn clear_slot(&self, slot: u32) {
        let view = View { mem: &self.mem };
        if let Some(w) = view.waiting(slot) {
            w.store(0, Ordering::Release);
        }
        let _ =
            view.word(HOLDER)
                .compare_exchange(slot + 1, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Times the turn was taken, by anyone.
    pub fn takes(&self) -> u32 {
        View { mem: &self.mem }.word(TAKES).load(Ordering::Acquire)
    }
}

struct View<'a> {
    mem: &'a SharedMem,
}

impl View<'_> {
    fn word(&self, off: u64) -> &std::sync::atomic::AtomicU32 {
        // Offsets below are constants inside the page, 4-aligned.
        self.mem
            .atomic_u32(off)
            .expect("turn page words lie inside the page")
    }

    fn waiting(&self, slot: u32) -> Option<&std::sync::atomic::AtomicU32> {
        (slot < TURN_SLOTS).then(|| self.word(WAITING + u64::from(slot) * 4))
    }
}

/// A worker's handle on the turn page.
pub struct GpuTurn {
    mem: SharedMem,
    slot: u32,
    quantum_ns: u64,
}

impl std::fmt::Debug for GpuTurn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTurn")
            .field("slot", &self.slot)
            .field("quantum_ns", &self.quantum_ns)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    #[error("turn slot {0} out of range (0..{TURN_SLOTS})")]
    Slot(u32),
    #[error("turn quantum must be 100 µs ..= 100 ms, not {0} ns")]
    Quantum(u64),
    #[error("turn page: {0}")]
    Page(#[from] SharedMemError),
}

impl GpuTurn {
    /// Maps the page made by [`GpuTurnPage`] (its fd) as slot `slot`.
    pub fn open(fd: OwnedFd, slot: u32, quantum_ns: u64) -> Result<Arc<Self>, TurnError> {
        if slot >= TURN_SLOTS {
            return Err(TurnError::Slot(slot));
        }
        if !(100_000..=100_000_000).contains(&quantum_ns) {
            return Err(TurnError::Quantum(quantum_ns));
        }
        Ok(Arc::new(GpuTurn {
            mem: SharedMem::from_fd(fd, TURN_PAGE_BYTES)?,
            slot,
            quantum_ns,
        }))
    }

    fn view(&self) -> View<'_> {
        View { mem: &self.mem }
    }

    pub fn quantum_ns(&self) -> u64 {
        self.quantum_ns
    }

    fn me(&self) -> u32 {
        self.slot + 1
    }

    /// Takes the turn if it is free, or if its holder kept it [`MAX_WAIT_NS`] past a
    /// quantum while we waited (`waited_ns`).
    fn try_take(&self, waited_ns: u64) -> bool {
        let v = self.view();
        let holder = v.word(HOLDER).load(Ordering::Acquire);
        let expected = if holder == 0 || holder == self.me() {
            holder
        } else if waited_ns > self.quantum_ns + MAX_WAIT_NS {
            log::warn!(
                "gpu turn: slot {} held it {} ms while we waited; taking it",
                holder - 1,
                waited_ns / 1_000_000
            );
            holder
        } else {
            return false;
        };
        if v.word(HOLDER)
            .compare_exchange(expected, self.me(), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        v.word(TAKES).fetch_add(1, Ordering::AcqRel);
        true
    }

    fn release(&self) {
        let _ = self.view().word(HOLDER).compare_exchange(
            self.me(),
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn set_waiting(&self, on: bool) {
        if let Some(w) = self.view().waiting(self.slot) {
            w.store(u32::from(on), Ordering::Release);
        }
    }

    fn others_waiting(&self) -> bool {
        (0..TURN_SLOTS).filter(|s| *s != self.slot).any(|s| {
            self.view()
                .waiting(s)
                .is_some_and(|w| w.load(Ordering::Acquire) != 0)
        })
    }

    fn takes(&self) -> u32 {
        self.view().word(TAKES).load(Ordering::Acquire)
    }

    /// Whether the turn is ours right now (the page says so).
    fn held(&self) -> bool {
        self.view().word(HOLDER).load(Ordering::Acquire) == self.me()
    }
}

/// A front end's use of the turn: whether it holds it, since when, and whether it gave it
/// up for others.
#[derive(Debug)]
pub struct TurnUse {
    turn: Arc<GpuTurn>,
    holding: bool,
    since: u64,
    /// Waiting for the turn since (0: not waiting).
    wait_since: u64,
    /// The take count and the time when we last gave the turn up for others: we wait
    /// until the count moves or [`YIELD_GRACE_NS`] passed.
    yielded_at: Option<(u32, u64)>,
    /// Times this front end took the turn.
    pub takes: u64,
    /// Times it took the turn from a holder that kept it too long.
    pub forced: u64,
}

impl TurnUse {
    pub fn new(turn: Arc<GpuTurn>) -> Self {
        TurnUse {
            turn,
            holding: false,
            since: 0,
            wait_since: 0,
            yielded_at: None,
            takes: 0,
            forced: 0,
        }
    }

    pub fn quantum_ns(&self) -> u64 {
        self.turn.quantum_ns()
    }

    /// Whether the front end may issue new work now; takes and gives back the turn as
    /// the module's doc says. `pending`: some channel has GP entries it could issue;
    /// `drained`: whether everything issued has completed on the GPU, asked only when the
    /// answer matters (it costs a driver query per channel, on the submission path).
    pub fn may_issue(&mut self, now: u64, pending: bool, drained: impl FnOnce() -> bool) -> bool {
        if self.holding && !self.turn.held() {
            // Taken from us (we kept it too long): wait like anyone else.
            self.holding = false;
        }
        if self.holding {
            let held = now.saturating_sub(self.since);
            let expired = held >= self.turn.quantum_ns && self.turn.others_waiting();
            let stuck = expired && held >= self.turn.quantum_ns + MAX_DRAIN_NS;
            // Holding with work to issue and quantum left: keep it, whatever has drained.
            let drained = (stuck || !pending || expired) && drained();
            if (drained && (!pending || expired)) || stuck {
                if stuck && !drained {
                    log::debug!("gpu turn: given up undrained after {} ms", held / 1_000_000);
                }
                log::debug!(
                    "gpu turn: slot {} gives it back after {} us (drained {drained}, pending {pending}, expired {expired})",
                    self.turn.slot,
                    held / 1000,
                );
                self.turn.release();
                self.holding = false;
                self.yielded_at = expired.then(|| (self.turn.takes(), now));
                return false;
            }
            return !expired;
        }
        if !pending {
            self.stop_waiting();
            return false;
        }
        if self.wait_since == 0 {
            self.wait_since = now.max(1);
            self.turn.set_waiting(true);
        }
        let waited = now.saturating_sub(self.wait_since);
        if let Some((t, at)) = self.yielded_at {
            // Let one of those we gave way to go first.
            if self.turn.takes() == t
                && now.saturating_sub(at) < YIELD_GRACE_NS
                && self.turn.others_waiting()
            {
                return false;
            }
        }
        let forced = self.turn.view().word(HOLDER).load(Ordering::Acquire) != 0;
        if !self.turn.try_take(waited) {
            return false;
        }
        if forced {
            self.forced += 1;
        }
        log::debug!(
            "gpu turn: slot {} takes it after waiting {} us",
            self.turn.slot,
            waited / 1000
        );
        self.stop_waiting();
        self.holding = true;
        self.since = now;
        self.yielded_at = None;
        self.takes += 1;
        true
    }

    fn stop_waiting(&mut self) {
        if self.wait_since != 0 {
            self.wait_since = 0;
            self.turn.set_waiting(false);
        }
    }

    /// Gives the turn back (the front end stops).
    pub fn leave(&mut self) {
        self.stop_waiting();
        if self.holding {
            self.turn.release();
            self.holding = false;
        }
    }
}

impl Drop for TurnUse {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, BorrowedFd};

    fn open(page: &GpuTurnPage, slot: u32, quantum_ns: u64) -> TurnUse {
        // SAFETY: the page's fd is open for the duration of this call.
        let fd = unsafe { BorrowedFd::borrow_raw(page.fd()) }
            .try_clone_to_owned()
            .unwrap();
        TurnUse::new(GpuTurn::open(fd, slot, quantum_ns).unwrap())
    }

    const Q: u64 = 1_000_000;
    /// What the front end would answer: (work pending, everything issued drained).
    type State = (bool, bool);
    const IDLE: State = (false, true);
    const WORK: State = (true, false);
    const DRAINED_WORK: State = (true, true);

    fn ask(t: &mut TurnUse, now: u64, (pending, drained): State) -> bool {
        t.may_issue(now, pending, || drained)
    }

    #[test]
    fn a_holder_with_work_and_quantum_left_is_not_asked_whether_it_drained() {
        let page = GpuTurnPage::new().unwrap();
        let mut a = open(&page, 0, Q);
        let asked = std::cell::Cell::new(0);
        let drained = || {
            asked.set(asked.get() + 1);
            false
        };
        assert!(!a.may_issue(0, false, drained), "idle, not holding");
        assert!(a.may_issue(10, true, drained), "takes the turn");
        assert!(a.may_issue(20, true, drained), "keeps it");
        assert_eq!(asked.get(), 0, "no driver query on the submission path");
        assert!(
            a.may_issue(30, false, drained),
            "nothing pending: asks; undrained, keeps it"
        );
        assert_eq!(asked.get(), 1);
    }

    #[test]
    fn one_holder_at_a_time_and_given_back_when_idle() {
        let page = GpuTurnPage::new().unwrap();
        let (mut a, mut b) = (open(&page, 0, Q), open(&page, 1, Q));
        assert!(!ask(&mut a, 10, IDLE), "nothing to issue: no turn taken");
        assert!(ask(&mut a, 20, WORK));
        assert!(!ask(&mut b, 30, WORK), "b waits while a holds the turn");
        assert!(ask(&mut a, 40, WORK), "a's quantum has not run out");
        assert!(
            !ask(&mut a, 50, IDLE),
            "a drained with nothing pending: gives it back"
        );
        assert!(ask(&mut b, 60, WORK));
        assert_eq!(page.takes(), 2);
    }

    #[test]
    fn a_holder_yields_after_its_quantum_once_drained_and_waiters_go_first() {
        let page = GpuTurnPage::new().unwrap();
        let (mut a, mut b) = (open(&page, 0, Q), open(&page, 1, Q));
        assert!(ask(&mut a, 0, WORK));
        assert!(!ask(&mut b, 1, WORK));
        // Quantum over, b waits: a stops issuing but keeps the turn until drained.
        assert!(!ask(&mut a, Q + 1, WORK));
        assert!(!ask(&mut b, Q + 2, WORK));
        assert!(
            !ask(&mut a, Q + 3, DRAINED_WORK),
            "drained: a gives the turn up"
        );
        // a must not take it back before b did.
        assert!(!ask(&mut a, Q + 4, DRAINED_WORK));
        assert!(ask(&mut b, Q + 5, WORK));
        assert!(!ask(&mut a, Q + 6, DRAINED_WORK), "b holds it now");
        assert!(!ask(&mut b, 2 * Q + 7, IDLE));
        assert!(ask(&mut a, 2 * Q + 8, DRAINED_WORK));
    }

    #[test]
    fn without_waiters_a_holder_keeps_the_turn_past_its_quantum() {
        let page = GpuTurnPage::new().unwrap();
        let mut a = open(&page, 0, Q);
        assert!(ask(&mut a, 0, WORK));
        assert!(ask(&mut a, 10 * Q, WORK));
        assert!(ask(&mut a, 10 * Q, DRAINED_WORK));
        assert_eq!(page.takes(), 1);
    }

    #[test]
    fn an_undrained_holder_gives_up_after_max_drain() {
        let page = GpuTurnPage::new().unwrap();
        let (mut a, mut b) = (open(&page, 0, Q), open(&page, 1, Q));
        assert!(ask(&mut a, 0, WORK));
        assert!(!ask(&mut b, 1, WORK));
        assert!(!ask(&mut a, Q + MAX_DRAIN_NS - 1, WORK), "still draining");
        assert!(!ask(&mut b, Q + MAX_DRAIN_NS, WORK));
        assert!(
            !ask(&mut a, Q + MAX_DRAIN_NS + 1, WORK),
            "gives up undrained"
        );
        assert!(ask(&mut b, Q + MAX_DRAIN_NS + 2, WORK));
    }

    #[test]
    fn a_holder_that_never_comes_back_is_taken_from_and_a_dead_slot_is_cleared() {
        let page = GpuTurnPage::new().unwrap();
        let (mut a, mut b) = (open(&page, 0, Q), open(&page, 1, Q));
        assert!(ask(&mut a, 0, WORK));
        // a's front end stops calling (hung, or hostile and writing the page).
        assert!(!ask(&mut b, 1, WORK));
        assert!(!ask(&mut b, Q + MAX_WAIT_NS, WORK));
        assert!(
            ask(&mut b, Q + MAX_WAIT_NS + 2, WORK),
            "taken after the longest wait"
        );
        assert_eq!(b.forced, 1);
        assert!(
            !ask(&mut a, Q + MAX_WAIT_NS + 3, WORK),
            "a learns it lost the turn"
        );
        std::mem::forget(b);
        // b dies holding the turn: the backend clears its slot and a goes on.
        page.clear_slot(1);
        assert!(ask(&mut a, Q + MAX_WAIT_NS + 4, WORK));
    }

    #[test]
    fn a_stale_waiting_flag_costs_the_yielder_at_most_the_grace() {
        let page = GpuTurnPage::new().unwrap();
        let mut a = open(&page, 0, Q);
        let b = open(&page, 1, Q);
        b.turn.set_waiting(true);
        std::mem::forget(b); // dies waiting; nobody cleared its flag yet
        assert!(ask(&mut a, 0, WORK));
        assert!(
            !ask(&mut a, Q, DRAINED_WORK),
            "quantum over, a waiter: yield"
        );
        assert!(!ask(&mut a, Q + YIELD_GRACE_NS - 1, DRAINED_WORK));
        assert!(
            ask(&mut a, Q + YIELD_GRACE_NS, DRAINED_WORK),
            "nobody took it"
        );
        page.clear_slot(1);
        assert!(ask(&mut a, 10 * Q, WORK), "no waiter: keeps the turn");
    }

    #[test]
    fn bad_slots_and_quanta_are_refused() {
        let page = GpuTurnPage::new().unwrap();
        let dup = || {
            // SAFETY: the page's fd is open for the duration of this call.
            unsafe { BorrowedFd::borrow_raw(page.fd()) }
                .try_clone_to_owned()
                .unwrap()
        };
        assert!(GpuTurn::open(dup(), TURN_SLOTS, Q).is_err());
        assert!(GpuTurn::open(dup(), 0, 10).is_err());
        assert!(GpuTurn::open(dup(), 0, Q).is_ok());
        // The page cannot be shrunk by a worker.
        // SAFETY: ftruncate on our own fd; the seal must refuse it.
        assert_ne!(unsafe { libc::ftruncate(page.fd().as_raw_fd(), 0) }, 0);
    }
}
