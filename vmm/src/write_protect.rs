//! Guest stores into window pages the backend made read-only wait until the pages are
//! writable again, instead of failing.
//!
//! While the backend moves a VRAM chunk (VRAM ↔ swap copy) it maps the chunk's aperture
//! read-only, copies, and maps the new copy writable. A guest store in between must not land
//! in the source after it was read (it would be lost), and must not kill the guest either.
//! In the KVM VMM the store makes `KVM_RUN` fail with EFAULT before the instruction runs; in
//! the loopback VM, whose guests are threads of this process, it raises SIGSEGV. Both wait
//! here and retry the store, which then lands in the new copy.
//!
//! Each window publishes its state in a fixed table of atomics, so the SIGSEGV handler can
//! read it without locks or allocation.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Windows one process can hold at once (one per loopback VM or device).
const SLOTS: usize = 256;
/// After the last change of a window's protection, a fault in it may still be a store that
/// raced the change (it faulted while the page was read-only): it is retried this long.
const RACE_GRACE_NS: u64 = 100_000_000;
/// A store that waits longer than this is given up on (the backend never made the page
/// writable again): the fault then takes its normal course.
pub const MAX_WAIT: Duration = Duration::from_secs(10);
/// Longest single sleep of a waiting store: a wake-up it missed (the change came between
/// its fault and its reading of the generation) costs at most this.
const WAIT_SLICE_NS: i64 = 1_000_000;

struct Slot {
    /// Window start address; 0 when the slot is free.
    base: AtomicUsize,
    len: AtomicUsize,
    /// Bytes of the window currently mapped read-only by the backend.
    read_only: AtomicU64,
    /// Bumped on every change of read-only bytes; waiting stores sleep on it (a futex).
    generation: AtomicU32,
    /// CLOCK_MONOTONIC ns of that change.
    changed_ns: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)] // Only used to initialise the table.
const FREE: Slot = Slot {
    base: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    read_only: AtomicU64::new(0),
    generation: AtomicU32::new(0),
    changed_ns: AtomicU64::new(0),
};
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// Faults in this process (SIGSEGV) handled by waiting, over its lifetime.
static STORES_WAITED: AtomicU64 = AtomicU64::new(0);

/// Stores by this process's threads into read-only window pages that waited and were
/// retried (the loopback VM's guests), over the process's lifetime.
pub fn stores_waited() -> u64 {
    STORES_WAITED.load(Ordering::Relaxed)
}

/// CLOCK_MONOTONIC in ns; async-signal-safe.
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Sleeps until `word` no longer holds `seen`, a wake-up, or one slice; async-signal-safe
/// (one futex system call).
fn futex_wait(word: &AtomicU32, seen: u32) {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: WAIT_SLICE_NS,
    };
    // SAFETY: `word` is a valid, aligned 32-bit atomic for the duration of the call (the
    // table is static); FUTEX_WAIT only reads it; `ts` is valid. EAGAIN/EINTR/ETIMEDOUT
    // all just end the wait.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every store waiting on `word`.
fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE touches no memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

/// One window's entry in the table; frees it when dropped.
#[derive(Debug)]
pub struct Registration {
    slot: Option<usize>,
}

impl Registration {
    /// Enters the window `[base, base+len)`. With the table full the window works as
    /// before, only without waiting stores (a read-only page then faults as usual).
    pub fn new(base: usize, len: usize) -> Self {
        install_fault_handler();
        for (i, s) in TABLE.iter().enumerate() {
            if s.base
                .compare_exchange(0, base, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                s.read_only.store(0, Ordering::Relaxed);
                s.changed_ns.store(0, Ordering::Relaxed);
                s.len.store(len, Ordering::Release);
                return Registration { slot: Some(i) };
            }
        }
        log::warn!("write-protect table full: stores into read-only window pages will fault");
        Registration { slot: None }
    }

    /// Publishes that `bytes` of the window are now mapped read-only.
    pub fn set_read_only_bytes(&self, bytes: u64) {
        if let Some(s) = self.slot.map(|i| &TABLE[i]) {
            s.read_only.store(bytes, Ordering::Release);
            s.changed_ns.store(now_ns(), Ordering::Release);
            s.generation.fetch_add(1, Ordering::AcqRel);
            futex_wake_all(&s.generation);
        }
    }

    /// After a store faulted in this window (KVM_RUN's EFAULT): waits while part of the
    /// window is read-only, until its protection changes (at most one 1 ms slice), and
    /// says whether to retry the store; `false` means the fault is not ours.
    pub fn wait_after_fault(&self) -> bool {
        self.slot.is_some_and(|i| wait_slice(&TABLE[i]))
    }

    /// The window's protection generation (bumped on every change).
    pub fn generation(&self) -> u32 {
        self.slot
            .map_or(0, |i| TABLE[i].generation.load(Ordering::Acquire))
    }

    /// Whether a store that faulted in this window just now should be retried: some of it
    /// is read-only, or its protection changed so recently that the store may have raced
    /// the change.
    pub fn store_may_wait(&self) -> bool {
        self.slot
            .is_some_and(|i| slot_may_wait(&TABLE[i], now_ns()))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(s) = self.slot.map(|i| &TABLE[i]) {
            s.len.store(0, Ordering::Release);
            s.read_only.store(0, Ordering::Release);
            s.base.store(0, Ordering::Release);
        }
    }
}

fn slot_may_wait(s: &Slot, now: u64) -> bool {
    s.read_only.load(Ordering::Acquire) > 0
        || now.saturating_sub(s.changed_ns.load(Ordering::Acquire)) < RACE_GRACE_NS
}

/// The slot whose window holds `addr`.
fn slot_of(addr: usize) -> Option<&'static Slot> {
    TABLE.iter().find(|s| {
        let base = s.base.load(Ordering::Acquire);
        base != 0 && addr >= base && addr - base < s.len.load(Ordering::Acquire)
    })
}

/// One wait of a store that faulted on window `s`: while part of it is read-only, until
/// its protection changes (at most one slice); says whether to retry the store (`false`:
/// the fault is not ours). Shared by the vCPU loop and the SIGSEGV handler.
fn wait_slice(s: &Slot) -> bool {
    let seen = s.generation.load(Ordering::Acquire);
    if s.read_only.load(Ordering::Acquire) > 0 {
        futex_wait(&s.generation, seen);
        return true;
    }
    // Nothing read-only: retry at once if the store may have raced a change.
    slot_may_wait(s, now_ns())
}

/// Waits (in a signal handler) for a store at `addr` to become possible: until the
/// window's protection changes, at most [`MAX_WAIT`]. Returns whether to retry the store;
/// `false` means the fault is not ours to handle.
fn wait_for_store(addr: usize) -> bool {
    let Some(s) = slot_of(addr) else {
        return false;
    };
    let t0 = now_ns();
    let gen0 = s.generation.load(Ordering::Acquire);
    let limit = u64::try_from(MAX_WAIT.as_nanos()).unwrap_or(u64::MAX);
    loop {
        if !wait_slice(s) {
            return false;
        }
        if s.read_only.load(Ordering::Acquire) == 0 || s.generation.load(Ordering::Acquire) != gen0
        {
            return true;
        }
        if now_ns().saturating_sub(t0) > limit {
            return false;
        }
    }
}

/// A vCPU's view of store faults on a window: `KVM_RUN` failing with EFAULT (or a
/// memory-fault exit) while the backend holds part of the window read-only. Linux 6.1's
/// KVM reports no address with the EFAULT, so any such fault is retried while the window
/// says a store may be waiting, for at most [`MAX_WAIT`] in a row.
#[derive(Debug, Default)]
pub struct StoreFaultWait {
    /// When the current wait began, and the window's protection generation then.
    since: Option<(std::time::Instant, u32)>,
    waits: u64,
}

impl StoreFaultWait {
    /// After a fault: whether to re-enter the guest. `generation` is the window's
    /// protection generation now, `wait` its [`Registration::wait_after_fault`] (both
    /// through `ShmWindow`). A guest usually runs on after a retried store without any
    /// exit, so a fault after the protection changed starts a new wait: only a store
    /// that waits through no change for [`MAX_WAIT`] is given up on.
    pub fn on_fault(&mut self, generation: u32, wait: impl FnOnce() -> bool) -> bool {
        let now = std::time::Instant::now();
        let (since, _) = match self.since {
            Some((t, g)) if g == generation => (t, g),
            _ => *self.since.insert((now, generation)),
        };
        if now.duration_since(since) > MAX_WAIT || !wait() {
            return false;
        }
        self.waits += 1;
        true
    }

    /// After any other exit: the guest made progress.
    pub fn on_progress(&mut self) {
        self.since = None;
    }

    /// Faults retried so far.
    pub fn waits(&self) -> u64 {
        self.waits
    }
}

/// The SIGSEGV disposition before ours, to hand faults that are not ours to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

extern "C" fn on_sigsegv(sig: libc::c_int, info: *mut libc::siginfo_t, uctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    if wait_for_store(addr) {
        STORES_WAITED.fetch_add(1, Ordering::Relaxed);
        return; // Retry the faulting instruction.
    }
    match PREVIOUS.get() {
        Some(prev) if prev.sa_flags & libc::SA_SIGINFO != 0 && prev.sa_sigaction > 1 => {
            // SAFETY: an SA_SIGINFO handler installed before ours has this signature.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(prev.sa_sigaction) };
            f(sig, info, uctx);
        }
        Some(prev) if prev.sa_sigaction > 1 => {
            // SAFETY: a plain handler installed before ours has this signature.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(prev.sa_sigaction) };
            f(sig);
        }
        _ => {
            // Default action: restore it; returning re-runs the access, which then kills
            // the process as it would have without us.
            // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask; sigaction is
            // async-signal-safe.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
            }
        }
    }
}

/// Installs the SIGSEGV handler once per process, keeping the previous one to chain to.
fn install_fault_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: sigaction with a valid new action and out-pointer; the handler only uses
        // async-signal-safe calls and lock-free atomics.
        unsafe {
            let mut prev: libc::sigaction = std::mem::zeroed();
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigsegv as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut act.sa_mask);
            if libc::sigaction(libc::SIGSEGV, &act, &mut prev) != 0 {
                log::warn!(
                    "cannot install the SIGSEGV handler: stores into read-only window pages will fault"
                );
                return;
            }
            let _ = PREVIOUS.set(prev);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_waits_while_read_only_and_shortly_after_a_change() {
        let r = Registration::new(0x1000_0000, 0x1000);
        let s = &TABLE[r.slot.unwrap()];
        assert!(!slot_may_wait(s, now_ns()), "never protected: a real fault");
        r.set_read_only_bytes(4096);
        assert!(r.store_may_wait());
        r.set_read_only_bytes(0);
        assert!(r.store_may_wait(), "a store may have raced the change");
        let later = now_ns() + RACE_GRACE_NS + 1;
        assert!(!slot_may_wait(s, later));
        assert!(slot_of(0x1000_0fff).is_some());
        assert!(slot_of(0x1000_1000).is_none());
        drop(r);
        assert!(slot_of(0x1000_0000).is_none());
    }

    #[test]
    fn a_vcpu_gives_up_only_on_a_store_that_waits_through_no_change() {
        let mut w = StoreFaultWait::default();
        assert!(w.on_fault(1, || true));
        assert!(!w.on_fault(1, || false), "not ours: give up");
        // Pretend the wait at generation 1 began long ago.
        w.since = Some((std::time::Instant::now() - MAX_WAIT * 2, 1));
        assert!(!w.on_fault(1, || true), "no change for MAX_WAIT: give up");
        // A change since: a new wait (the guest ran on without an exit in between).
        w.since = Some((std::time::Instant::now() - MAX_WAIT * 2, 1));
        assert!(w.on_fault(2, || true));
        assert_eq!(w.waits(), 2);
    }
}
