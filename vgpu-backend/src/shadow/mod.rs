//! Shadow channels: taking a channel's GP_PUT out of the GPU's sight without trapping.
//!
//! Shadowing a channel maps a backend-owned *shadow page* (one 4 KiB page of a memfd the
//! backend creates, pooled per VM) over the channel's control-page slot in the VM's BAR
//! with SHMEM_MAP; from then on the guest's GP_PUT stores land in the shadow page, which
//! the GPU never reads. Unshadowing maps the real control page back. Between the two the
//! backend may release a bounded number of entries by writing a capped GP_PUT into the
//! real page (Fleig §4.3.2), and [`Shadows::mirror`] copies the GPU's progress (GP_GET,
//! REF, ERROR, NOTIFY_SEQ) into the shadow page so the guest still sees its work finish.
//!
//! # Why no submission is lost, duplicated or released early
//!
//! GP_PUT is a submission counter (wrapping, compared modulo 2^32 relative to GP_GET),
//! never an index, and the guest only ever stores larger values (program order). The remap
//! is not atomic with the copy of the page, so the backend reconciles after each switch,
//! always with a compare-and-swap that can only *raise* a GP_PUT:
//!
//! - **Shadow.** The real page's fields are copied into the shadow page, then the shadow
//!   page is mapped. A guest store that reached the real page before the switch is seen by
//!   the GPU (fine: it was submitted while unshadowed). Once the SHMEM_MAP is acked
//!   (REPLY_ACK: the frontend's `mmap(MAP_FIXED)` is done, so every later guest store goes
//!   to the shadow page), `shadow.GP_PUT` is raised to `real.GP_PUT` if the latter is
//!   later. The CAS fails only when the guest stored into the shadow meanwhile, and then
//!   its value is already at least `real.GP_PUT`, so the guest's own view never moves
//!   backwards.
//! - **Capped release.** `real.GP_PUT` is raised (CAS, never lowered) to the earlier of
//!   `shadow.GP_PUT` and `real.GP_GET + n`: at most `n` further entries run, and only
//!   entries the guest has submitted (whose ring slot and push buffer it wrote before its
//!   release store to the shadow page).
//! - **Unshadow.** The real page is mapped back; after the ack no guest store can reach the
//!   shadow page any more (the mapping that led to it is gone), so its GP_PUT is final.
//!   `real.GP_PUT` is then raised to it with a CAS. A guest store into the real page racing
//!   with the CAS carries a value at least as late as anything the guest stored into the
//!   shadow, so whichever wins, the larger counter stays.
//!
//! The GPU never sees a GP_PUT beyond what the guest stored (so nothing runs early), every
//! GP_PUT the guest stored ends up in the real page after the final unshadow (nothing is
//! lost), and since GP_PUT only grows and the GPU executes entry `get` once before moving
//! `get` on, nothing runs twice.
//!
//! What the guest *reads* back from GPU-written fields (GP_GET, REF, ...) in the shadow
//! page is a copy: always a value the GPU really reached (so ring slots are never reused
//! too early), refreshed right after each switch and by [`Shadows::mirror`]. One window
//! remains: between the pre-map copy and the post-ack refresh the GPU may advance the real
//! page, and a guest that read the newer value there just before the switch reads the
//! older copy from the shadow until the refresh. Closing it needs the GPU to hold a
//! channel's completion writes during the switch (a HAL pause), which the HAL lacks.

pub mod holds;

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use log::{debug, warn};
use thiserror::Error;
use vgpu_host_shim::{FdRange, HalError};
use vgpu_protocol::{ControlPage, PAGE_SIZE};

use crate::error::ShmError;
use crate::shmem::ShmMapper;
pub use holds::{Holder, Holders, OwnerHolds};

/// A channel's control page and where the VM's BAR shows it: what every switch needs.
#[derive(Debug, Clone, Copy)]
pub struct ShadowTarget {
    /// Guest channel id.
    pub ch: u32,
    /// The real control page.
    pub page: FdRange,
    /// The channel's slot in the BAR; `None` for a forwarded channel, which has no BAR
    /// view: its shadow then only takes the `SUBMIT`s (protocol.md §9).
    pub slot_off: Option<u64>,
}

/// Errors of shadow-channel operations.
#[derive(Debug, Error)]
pub enum ShadowError {
    #[error("no VM named {0:?}")]
    NoVm(String),
    #[error("no channel {0} in this VM")]
    NoChannel(u32),
    #[error("channel {0} is not shadowed")]
    NotShadowed(u32),
    #[error("channel {0} has no control page mapped in the BAR")]
    SlotNotMapped(u32),
    #[error("no frontend connected")]
    NotConnected,
    #[error("channel {0} is held by the operator's pause")]
    Paused(u32),
    #[error("SHMEM_MAP: {0}")]
    Shm(#[from] ShmError),
    #[error("GPU: {0}")]
    Gpu(#[from] HalError),
    #[error("shadow page: {0}")]
    Io(#[from] io::Error),
}

/// Counters of the shadow mechanism of one VM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShadowStats {
    /// Channels shadowed now.
    pub shadowed_now: u32,
    /// Pages in the VM's shadow-page pool (in use or free).
    pub pool_pages: u32,
    pub shadows: u64,
    pub unshadows: u64,
    /// Remaps that failed (SHMEM_MAP refused or the page could not be prepared).
    pub failures: u64,
    pub capped_releases: u64,
    /// Entries let through by capped releases.
    pub released_entries: u64,
    pub mirrors: u64,
    /// Shadow switches after which the shadow's GP_PUT had to be raised: the guest stored
    /// into the real page between the copy and the switch.
    pub raced_on_shadow: u64,
    /// Unshadows that raised the real GP_PUT (the guest submitted while shadowed).
    pub raised_on_unshadow: u64,
    /// Time of the switches (SHMEM_MAP round trip plus reconciliation), total and worst.
    pub shadow_ns_total: u64,
    pub shadow_ns_max: u64,
    pub unshadow_ns_total: u64,
    pub unshadow_ns_max: u64,
}

/// The outcome of a shadow or unshadow request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShadowSwitch {
    /// Whether a remap happened (false: the channel already was in the asked state).
    pub changed: bool,
    /// Time of the switch in ns (0 when nothing changed).
    pub ns: u64,
}

/// A channel's submission counters, read without trapping (see [`Shadows::peek`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChannelPeek {
    /// GP_GET of the real page (the GPU's progress).
    pub gp_get: u32,
    /// GP_PUT of the real page (what the GPU may run).
    pub real_put: u32,
    /// GP_PUT of the shadow page, while the channel is shadowed (what the guest submitted).
    pub shadow_put: Option<u32>,
}

impl ChannelPeek {
    /// Entries the guest submitted that have not run yet (released or held back).
    pub fn backlog(&self) -> u32 {
        let put = counter_later(
            self.gp_get,
            self.real_put,
            self.shadow_put.unwrap_or(self.real_put),
        );
        (put.wrapping_sub(self.gp_get) as i32).max(0) as u32
    }

    /// Whether the channel has work the GPU has not finished: its real or shadow GP_PUT is
    /// ahead of GP_GET.
    pub fn pending(&self) -> bool {
        self.backlog() > 0
    }
}

/// `a` is strictly after `b`, modulo 2^32 (the protocol's comparison).
pub use vgpu_protocol::counter_after;

/// The later of `a` and `b`, measured as signed distances from `base` (GP_GET): a counter
/// "behind" `base` loses against one at or after it.
pub fn counter_later(base: u32, a: u32, b: u32) -> u32 {
    let da = a.wrapping_sub(base) as i32;
    let db = b.wrapping_sub(base) as i32;
    if db > da {
        b
    } else {
        a
    }
}

/// A shared read/write mapping of one control page (real or shadow), accessed only
/// through atomics. Unmapped on drop.
#[derive(Debug)]
pub struct PageMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory owned by this object and only accessed through
// atomics, so it may move to and be shared between threads.
unsafe impl Send for PageMap {}
// SAFETY: see Send.
unsafe impl Sync for PageMap {}

impl PageMap {
    /// Maps `page` (at least [`ControlPage::USED_BYTES`] long, page-aligned offset).
    pub fn new(page: FdRange) -> io::Result<Self> {
        let len = usize::try_from(page.len).map_err(|_| io::ErrorKind::InvalidInput)?;
        let off = libc::off_t::try_from(page.offset).map_err(|_| io::ErrorKind::InvalidInput)?;
        if len < ControlPage::USED_BYTES || !page.offset.is_multiple_of(PAGE_SIZE) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh shared mapping of a range of a valid fd; the result is checked
        // for MAP_FAILED before use. Nothing else is placed at the returned address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                page.fd,
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(PageMap {
            ptr: ptr.cast(),
            len,
        })
    }

    fn word(&self, field: usize) -> Option<&AtomicU32> {
        if !field.is_multiple_of(4) || field + 4 > self.len {
            return None;
        }
        // SAFETY: `field` is 4-aligned and inside the mapping (checked above); the mapping
        // is page-aligned, so the word is naturally aligned for an AtomicU32, and the
        // memory lives as long as `self`.
        Some(unsafe { &*(self.ptr.add(field) as *const AtomicU32) })
    }

    fn dword(&self, field: usize) -> Option<&AtomicU64> {
        if !field.is_multiple_of(8) || field + 8 > self.len {
            return None;
        }
        // SAFETY: as in `word`, with 8-byte alignment checked.
        Some(unsafe { &*(self.ptr.add(field) as *const AtomicU64) })
    }

    /// Loads a field with acquire ordering (0 for an invalid offset).
    pub fn load(&self, field: usize) -> u32 {
        self.word(field).map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Stores a field with release ordering (ignored for an invalid offset).
    pub fn store(&self, field: usize, v: u32) {
        if let Some(w) = self.word(field) {
            w.store(v, Ordering::Release);
        }
    }

    pub fn load_u64(&self, field: usize) -> u64 {
        self.dword(field).map_or(0, |w| w.load(Ordering::Acquire))
    }

    pub fn store_u64(&self, field: usize, v: u64) {
        if let Some(w) = self.dword(field) {
            w.store(v, Ordering::Release);
        }
    }

    /// Raises the counter at `field` to `target` unless it already is at or after it
    /// (relative to `base`); never lowers it. Returns (value before, value after).
    pub fn raise(&self, field: usize, target: u32, base: u32) -> (u32, u32) {
        let Some(w) = self.word(field) else {
            return (0, 0);
        };
        let mut cur = w.load(Ordering::Acquire);
        loop {
            if counter_later(base, cur, target) == cur {
                return (cur, cur);
            }
            match w.compare_exchange_weak(cur, target, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return (cur, target),
                Err(now) => cur = now,
            }
        }
    }

    /// Zeroes the whole page (only while nobody else can reach it).
    fn zero(&self) {
        for off in (0..self.len).step_by(8) {
            if let Some(w) = self.dword(off) {
                w.store(0, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for PageMap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `new`, once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A VM's pool of shadow pages: one memfd, grown a page at a time, pages reused.
#[derive(Debug, Default)]
struct Pool {
    file: Option<File>,
    pages: Vec<PageMap>,
    free: Vec<usize>,
}

impl Pool {
    fn fd(&self) -> Option<RawFd> {
        self.file.as_ref().map(|f| f.as_raw_fd())
    }

    fn file(&mut self) -> io::Result<&File> {
        if self.file.is_none() {
            // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
            let fd = unsafe { libc::memfd_create(c"vgpu-shadow".as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            self.file = Some(unsafe { File::from_raw_fd(fd) });
        }
        self.file
            .as_ref()
            .ok_or_else(|| io::Error::other("shadow memfd missing"))
    }

    /// A zeroed page nobody maps.
    fn take(&mut self) -> io::Result<usize> {
        if let Some(i) = self.free.pop() {
            if let Some(p) = self.pages.get(i) {
                p.zero();
                return Ok(i);
            }
        }
        let i = self.pages.len();
        let end = (i as u64 + 1) * PAGE_SIZE;
        let file = self.file()?;
        file.set_len(end)?;
        let map = PageMap::new(FdRange {
            fd: file.as_raw_fd(),
            offset: i as u64 * PAGE_SIZE,
            len: PAGE_SIZE,
        })?;
        self.pages.push(map);
        Ok(i)
    }

    fn give(&mut self, i: usize) {
        if i < self.pages.len() && !self.free.contains(&i) {
            self.free.push(i);
        }
    }
}

/// A shadowed channel.
#[derive(Debug)]
struct Shadowed {
    page: usize,
}

/// The shadow state of one VM's channels (lives in its [`Session`], under the session
/// lock; the pool survives reconnects).
///
/// [`Session`]: crate::vm::session::Session
#[derive(Debug, Default)]
pub struct Shadows {
    pool: Pool,
    /// Keyed by guest channel id.
    shadowed: BTreeMap<u32, Shadowed>,
    /// The backend's mappings of real control pages, kept while the channel lives.
    real: BTreeMap<u32, PageMap>,
    stats: ShadowStats,
    /// Who holds each channel shadowed ([`holds`]); absent: nobody.
    holds: BTreeMap<u32, Holders>,
    /// GP_GET of each channel the last time [`Shadows::quiet`] found it idle.
    idle_get: BTreeMap<u32, u32>,
}

fn elapsed_ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Carries an armed fence waiter (`REF_WAKE`, then `REF_WAKE_ARMED`) from the page the
/// guest wrote to the page the GPU reads, and disarms the source; whether one was armed.
/// The GPU then wakes the waiter when REF reaches its value (a waiter whose arming sits
/// in a page the GPU does not read wakes only at its own re-check).
fn carry_fence_wake(from: &PageMap, to: &PageMap) -> bool {
    if from.load(ControlPage::REF_WAKE_ARMED) == 0 {
        return false;
    }
    to.store(ControlPage::REF_WAKE, from.load(ControlPage::REF_WAKE));
    to.store(ControlPage::REF_WAKE_ARMED, 1);
    from.store(ControlPage::REF_WAKE_ARMED, 0);
    true
}

/// Copies the GPU-written fields from `real` to `shadow` (ERROR_INFO before ERROR).
fn copy_gpu_fields(real: &PageMap, shadow: &PageMap) {
    shadow.store_u64(
        ControlPage::ERROR_INFO,
        real.load_u64(ControlPage::ERROR_INFO),
    );
    for f in [
        ControlPage::ERROR,
        ControlPage::NOTIFY_SEQ,
        ControlPage::REF,
        ControlPage::GP_GET,
    ] {
        shadow.store(f, real.load(f));
    }
}

impl Shadows {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_shadowed(&self, ch: u32) -> bool {
        self.shadowed.contains_key(&ch)
    }

    pub fn stats(&self) -> ShadowStats {
        ShadowStats {
            shadowed_now: self.shadowed.len() as u32,
            pool_pages: self.pool.pages.len() as u32,
            ..self.stats
        }
    }

    fn real_map(&mut self, ch: u32, page: FdRange) -> io::Result<&PageMap> {
        Ok(match self.real.entry(ch) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(PageMap::new(page)?),
        })
    }

    fn shadow_page(&self, s: &Shadowed) -> io::Result<&PageMap> {
        self.pool
            .pages
            .get(s.page)
            .ok_or_else(|| io::Error::other("shadow page missing"))
    }

    /// Who holds channel `ch` shadowed.
    pub fn holders(&self, ch: u32) -> Holders {
        self.holds.get(&ch).copied().unwrap_or_default()
    }

    fn set_holders(&mut self, ch: u32, h: Holders) {
        if h.is_empty() {
            self.holds.remove(&ch);
        } else {
            self.holds.insert(ch, h);
        }
    }

    /// The one way channels are shadowed and unshadowed: `who` takes (`on`) or drops its
    /// hold of `t.ch`. The channel is shadowed while anyone holds it and unshadowed when
    /// the last holder lets go. A failed shadow records no hold. A failed unshadow leaves
    /// the channel shadowed with the holds that remain ([`Shadows::orphans`] lists it
    /// when none do, for a retry).
    pub fn set_hold(
        &mut self,
        t: ShadowTarget,
        who: Holder,
        on: bool,
        shm: &dyn ShmMapper,
    ) -> Result<ShadowSwitch, ShadowError> {
        let before = self.holders(t.ch);
        if on {
            let r = self.switch_on(t, shm);
            if r.is_ok() {
                self.set_holders(t.ch, before.with(who));
            }
            return r;
        }
        let after = before.without(who);
        self.set_holders(t.ch, after);
        if !after.is_empty() {
            return Ok(ShadowSwitch::default());
        }
        self.switch_off(t, shm)
    }

    /// Shadowed channels that nobody holds any more (an unshadow failed): to unshadow.
    pub fn orphans(&self) -> Vec<u32> {
        self.shadowed
            .keys()
            .filter(|ch| self.holders(**ch).is_empty())
            .copied()
            .collect()
    }

    /// Unshadows `t.ch` if nobody holds it (the retry of a failed unshadow).
    pub fn unshadow_orphan(
        &mut self,
        t: ShadowTarget,
        shm: &dyn ShmMapper,
    ) -> Result<ShadowSwitch, ShadowError> {
        if !self.holders(t.ch).is_empty() {
            return Ok(ShadowSwitch::default());
        }
        self.switch_off(t, shm)
    }

    fn switch_on(
        &mut self,
        t: ShadowTarget,
        shm: &dyn ShmMapper,
    ) -> Result<ShadowSwitch, ShadowError> {
        if self.shadowed.contains_key(&t.ch) {
            return Ok(ShadowSwitch::default());
        }
        let r = self.shadow_inner(t, shm);
        if r.is_err() {
            self.stats.failures += 1;
        }
        r
    }

    fn shadow_inner(
        &mut self,
        t: ShadowTarget,
        shm: &dyn ShmMapper,
    ) -> Result<ShadowSwitch, ShadowError> {
        let ShadowTarget {
            ch,
            page: real_page,
            slot_off,
        } = t;
        self.real_map(ch, real_page)?;
        let idx = self.pool.take()?;
        let fd = self.pool.fd().ok_or(ShadowError::NotConnected)?;
        let (Some(real), Some(shadow)) = (self.real.get(&ch), self.pool.pages.get(idx)) else {
            self.pool.give(idx);
            return Err(io::Error::other("page mappings missing").into());
        };
        let t0 = Instant::now();
        // 1. Copy the page while nobody but us sees the shadow.
        shadow.store(ControlPage::VERSION, real.load(ControlPage::VERSION));
        shadow.store(ControlPage::GP_ENTRIES, real.load(ControlPage::GP_ENTRIES));
        copy_gpu_fields(real, shadow);
        shadow.store(ControlPage::GP_PUT, real.load(ControlPage::GP_PUT));
        // 2. Switch. With REPLY_ACK the frontend's mmap(MAP_FIXED) is done when this
        //    returns: every later guest store lands in the shadow page.
        let mapped = match slot_off {
            Some(off) => shm.map(off, fd, idx as u64 * PAGE_SIZE, PAGE_SIZE, true),
            None => Ok(()),
        };
        if let (Err(e), Some(slot_off)) = (mapped, slot_off) {
            // The frontend may have left the old page, or a hole: put the real page back.
            // Stores that reached the shadow (if it was mapped after all) are carried over.
            let back = shm.map(slot_off, real_page.fd, real_page.offset, PAGE_SIZE, true);
            match back {
                Ok(()) => {
                    let get = real.load(ControlPage::GP_GET);
                    real.raise(ControlPage::GP_PUT, shadow.load(ControlPage::GP_PUT), get);
                    self.pool.give(idx);
                }
                Err(e2) => {
                    // Unknown what the slot shows: keep the page reserved for the channel
                    // until its slot is unmapped, and treat it as shadowed.
                    warn!("channel {ch}: shadow map failed ({e}), map back failed: {e2}");
                    self.shadowed.insert(ch, Shadowed { page: idx });
                }
            }
            return Err(e.into());
        }
        // 3. Reconcile: the GPU's progress since the copy, then stores that reached the
        //    real page before the switch.
        copy_gpu_fields(real, shadow);
        let get = real.load(ControlPage::GP_GET);
        let (before, after) =
            shadow.raise(ControlPage::GP_PUT, real.load(ControlPage::GP_PUT), get);
        if before != after {
            self.stats.raced_on_shadow += 1;
        }
        // A waiter armed in the real page sleeps on: the GPU still reads that page.
        let ns = elapsed_ns(t0);
        self.shadowed.insert(ch, Shadowed { page: idx });
        self.stats.shadows += 1;
        self.stats.shadow_ns_total += ns;
        self.stats.shadow_ns_max = self.stats.shadow_ns_max.max(ns);
        debug!("channel {ch}: shadowed with page {idx} in {ns} ns");
        Ok(ShadowSwitch { changed: true, ns })
    }

    fn switch_off(
        &mut self,
        t: ShadowTarget,
        shm: &dyn ShmMapper,
    ) -> Result<ShadowSwitch, ShadowError> {
        let ShadowTarget {
            ch,
            page: real_page,
            slot_off,
        } = t;
        let Some(s) = self.shadowed.get(&ch) else {
            return Ok(ShadowSwitch::default());
        };
        let idx = s.page;
        let t0 = Instant::now();
        let mapped = match slot_off {
            Some(off) => shm.map(off, real_page.fd, real_page.offset, PAGE_SIZE, true),
            None => Ok(()),
        };
        if let Err(e) = mapped {
            // The slot may still show the shadow: the channel stays shadowed.
            self.stats.failures += 1;
            return Err(e.into());
        }
        // The shadow page is quiescent now: no guest mapping leads to it.
        let (Some(real), Some(shadow)) = (self.real.get(&ch), self.pool.pages.get(idx)) else {
            // Cannot happen (both are made when shadowing); the slot shows the real page.
            self.stats.failures += 1;
            self.shadowed.remove(&ch);
            self.pool.give(idx);
            return Err(io::Error::other("page mappings missing").into());
        };
        let get = real.load(ControlPage::GP_GET);
        let (before, after) =
            real.raise(ControlPage::GP_PUT, shadow.load(ControlPage::GP_PUT), get);
        if before != after {
            self.stats.raised_on_unshadow += 1;
        }
        carry_fence_wake(shadow, real);
        self.shadowed.remove(&ch);
        self.pool.give(idx);
        let ns = elapsed_ns(t0);
        self.stats.unshadows += 1;
        self.stats.unshadow_ns_total += ns;
        self.stats.unshadow_ns_max = self.stats.unshadow_ns_max.max(ns);
        debug!("channel {ch}: unshadowed in {ns} ns");
        Ok(ShadowSwitch { changed: true, ns })
    }

    /// Lets at most `n` more entries of shadowed channel `ch` run: raises the real GP_PUT
    /// to the earlier of the shadow's GP_PUT and GP_GET + `n`. Returns how many entries
    /// were newly released. Only the scheduler's holds are released so: a channel also
    /// held by the operator or the VRAM manager lets nothing through.
    pub fn release_capped(&mut self, ch: u32, n: u32) -> Result<u32, ShadowError> {
        let s = self.shadowed.get(&ch).ok_or(ShadowError::NotShadowed(ch))?;
        if !self.holders(ch).only(Holder::Scheduler) {
            return Ok(0);
        }
        let shadow = self.shadow_page(s)?;
        let real = self.real.get(&ch).ok_or(ShadowError::NotShadowed(ch))?;
        let get = real.load(ControlPage::GP_GET);
        let want = shadow.load(ControlPage::GP_PUT);
        // Distance from GP_GET, capped at n (a shadow GP_PUT behind GP_GET releases none).
        let ahead = (want.wrapping_sub(get) as i32).max(0) as u32;
        let target = get.wrapping_add(ahead.min(n));
        let (before, after) = real.raise(ControlPage::GP_PUT, target, get);
        let released = after.wrapping_sub(before);
        self.stats.capped_releases += 1;
        self.stats.released_entries += u64::from(released);
        Ok(released)
    }

    /// Copies the GPU's progress (GP_GET, REF, ERROR, ERROR_INFO, NOTIFY_SEQ) into the
    /// shadow page of every shadowed channel, and a fence waiter the guest armed there
    /// into the real page (the GPU wakes it); returns how many were refreshed.
    pub fn mirror(&mut self) -> usize {
        let mut n = 0;
        for (ch, s) in &self.shadowed {
            if let (Some(real), Some(shadow)) = (self.real.get(ch), self.pool.pages.get(s.page)) {
                copy_gpu_fields(real, shadow);
                carry_fence_wake(shadow, real);
                n += 1;
            }
        }
        self.stats.mirrors += 1;
        n
    }

    /// GP_GET and GP_PUT of channel `ch` as the GPU sees them (real page) and, while it is
    /// shadowed, the guest's GP_PUT in the shadow page. Maps the real page on first use.
    pub fn peek(&mut self, ch: u32, real_page: FdRange) -> io::Result<ChannelPeek> {
        self.real_map(ch, real_page)?;
        self.peek_mapped(ch)
            .ok_or_else(|| io::Error::other("real page mapping missing"))
    }

    /// [`Shadows::peek`] of a channel whose real page is mapped here already (a channel
    /// looked at before; forgotten when destroyed or its slot unmapped); `None` otherwise.
    pub fn peek_mapped(&self, ch: u32) -> Option<ChannelPeek> {
        let real = self.real.get(&ch)?;
        let (gp_get, real_put) = (
            real.load(ControlPage::GP_GET),
            real.load(ControlPage::GP_PUT),
        );
        let shadow_put = self
            .shadowed
            .get(&ch)
            .and_then(|s| self.pool.pages.get(s.page))
            .map(|p| p.load(ControlPage::GP_PUT));
        Some(ChannelPeek {
            gp_get,
            real_put,
            shadow_put,
        })
    }

    /// The guest's GP_PUT for a shadowed channel arrived by request (SUBMIT, the
    /// API-remoting path): it goes into the shadow page. False if `ch` is not shadowed.
    pub fn submit(&self, ch: u32, gp_put: u32) -> bool {
        match self
            .shadowed
            .get(&ch)
            .and_then(|s| self.pool.pages.get(s.page))
        {
            Some(shadow) => {
                shadow.store(ControlPage::GP_PUT, gp_put);
                true
            }
            None => false,
        }
    }

    /// The shadow page of a shadowed channel, as a file range.
    pub fn shadow_page_range(&self, ch: u32) -> Option<FdRange> {
        let s = self.shadowed.get(&ch)?;
        Some(FdRange {
            fd: self.pool.fd()?,
            offset: s.page as u64 * PAGE_SIZE,
            len: PAGE_SIZE,
        })
    }

    /// Raises a shadowed channel's shadow GP_PUT to `put` (compare-and-swap relative to
    /// the real GP_GET, never lowering it): submissions the guest made through another
    /// host's page (live migration). Returns whether the channel is shadowed.
    pub fn raise_shadow_put(&self, ch: u32, put: u32) -> bool {
        let (Some(real), Some(shadow)) = (
            self.real.get(&ch),
            self.shadowed
                .get(&ch)
                .and_then(|s| self.pool.pages.get(s.page)),
        ) else {
            return false;
        };
        shadow.raise(ControlPage::GP_PUT, put, real.load(ControlPage::GP_GET));
        true
    }

    /// Whether channel `ch` provably did nothing since the previous call: it is not
    /// shadowed, nobody holds it, its real page is mapped, GP_PUT equals GP_GET, and
    /// GP_GET is where the previous call found it idle. GPUs advance GP_GET when an entry
    /// completes and charge busy time only to entries between GP_GET and GP_PUT, so such a
    /// channel used no GPU time and has nothing to schedule: the scheduler skips it
    /// (issue 15). The first idle reading answers false, since work may have finished
    /// since the last look (that interval's busy time must still be charged).
    pub fn quiet(&mut self, ch: u32) -> bool {
        let idle = match self.real.get(&ch) {
            Some(real) if !self.shadowed.contains_key(&ch) && !self.holds.contains_key(&ch) => {
                let get = real.load(ControlPage::GP_GET);
                (real.load(ControlPage::GP_PUT) == get).then_some(get)
            }
            _ => None,
        };
        match idle {
            Some(get) => self.idle_get.insert(ch, get) == Some(get),
            None => {
                self.idle_get.remove(&ch);
                false
            }
        }
    }

    /// Whether channel `ch` is still as the last [`Shadows::quiet`] found it idle: not
    /// shadowed, not held, its real page mapped, and that call's idle reading kept — for
    /// a caller that knows from the GPU's activity count ([`vgpu_host_shim::ActivityCounter`])
    /// that the channel fetched and completed nothing since. Reads no page: a GP_PUT the
    /// guest wrote since, not yet fetched, is seen once the GPU fetches it (the count
    /// moves), before it can run.
    pub fn still_quiet(&self, ch: u32) -> bool {
        self.real.contains_key(&ch)
            && !self.shadowed.contains_key(&ch)
            && !self.holds.contains_key(&ch)
            && self.idle_get.contains_key(&ch)
    }

    /// Forgets channel `ch` (destroyed, or its slot unmapped): its shadow page goes back to
    /// the pool. Only call once no guest mapping leads to the shadow page.
    pub fn forget(&mut self, ch: u32) {
        if let Some(s) = self.shadowed.remove(&ch) {
            self.pool.give(s.page);
        }
        self.real.remove(&ch);
        self.holds.remove(&ch);
        self.idle_get.remove(&ch);
    }

    /// Forgets every channel (session teardown, after the BAR views are gone).
    pub fn clear(&mut self) {
        let pages: Vec<usize> = self.shadowed.values().map(|s| s.page).collect();
        for p in pages {
            self.pool.give(p);
        }
        self.shadowed.clear();
        self.real.clear();
        self.holds.clear();
        self.idle_get.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn counters_compare_modulo_2_32() {
        assert!(counter_after(1, 0));
        assert!(counter_after(0, u32::MAX));
        assert!(!counter_after(5, 5));
        assert_eq!(counter_later(10, 12, 15), 15);
        assert_eq!(counter_later(10, 15, 12), 15);
        assert_eq!(counter_later(u32::MAX - 1, 1, u32::MAX), 1);
        // A value behind the base loses.
        assert_eq!(counter_later(10, 9, 10), 10);
    }

    /// A fake frontend that maps pages into a local window with MAP_FIXED.
    struct FakeShm {
        base: *mut u8,
        maps: Mutex<u64>,
    }
    // SAFETY: the window is owned by the fake and only remapped under the mutex.
    unsafe impl Send for FakeShm {}
    // SAFETY: see Send.
    unsafe impl Sync for FakeShm {}

    impl ShmMapper for FakeShm {
        fn map(
            &self,
            off: u64,
            fd: RawFd,
            fd_off: u64,
            len: u64,
            _w: bool,
        ) -> Result<(), ShmError> {
            let _g = self.maps.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: `off + len` lies inside the fake's reserved window (tests use slot 0).
            let p = unsafe {
                libc::mmap(
                    self.base.add(off as usize).cast(),
                    len as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd,
                    fd_off as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(ShmError::Frontend("mmap".into()));
            }
            Ok(())
        }
        fn unmap(&self, _: u64, _: u64) -> Result<(), ShmError> {
            Ok(())
        }
    }

    /// A "real" control page (a page of a memfd of our own) and a one-page fake window
    /// with that page mapped at offset 0, as a guest would see it.
    struct Fixture {
        _file: File,
        page: FdRange,
        gpu_view: PageMap,
        shm: FakeShm,
        base: *mut libc::c_void,
    }

    impl Fixture {
        fn new() -> Self {
            // SAFETY: memfd_create with a valid name.
            let fd = unsafe { libc::memfd_create(c"real".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0);
            // SAFETY: fresh fd.
            let file = unsafe { File::from_raw_fd(fd) };
            file.set_len(PAGE_SIZE).unwrap();
            let page = FdRange {
                fd,
                offset: 0,
                len: PAGE_SIZE,
            };
            let gpu_view = PageMap::new(page).unwrap();
            // SAFETY: an anonymous private reservation for the window.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PAGE_SIZE as usize,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(base, libc::MAP_FAILED);
            let shm = FakeShm {
                base: base.cast(),
                maps: Mutex::new(0),
            };
            shm.map(0, fd, 0, PAGE_SIZE, true).unwrap();
            Fixture {
                _file: file,
                page,
                gpu_view,
                shm,
                base,
            }
        }

        /// 32-bit word `i` of the page through the window (the guest's view).
        fn guest_word(&self, i: usize) -> &AtomicU32 {
            assert!(i < PAGE_SIZE as usize / 4);
            // SAFETY: the window's page is mapped (in `new`), aligned, and stays mapped
            // for as long as `self` lives.
            unsafe { &*((self.base as *const AtomicU32).add(i)) }
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            // SAFETY: unmapping the reservation made in `new`; no reference from
            // `guest_word` outlives `self`.
            unsafe { libc::munmap(self.base, PAGE_SIZE as usize) };
        }
    }

    #[test]
    fn shadow_capped_release_and_unshadow_keep_every_submission() {
        let f = Fixture::new();
        let (gpu_view, shm) = (&f.gpu_view, &f.shm);
        let t = ShadowTarget {
            ch: 1,
            page: f.page,
            slot_off: Some(0),
        };
        gpu_view.store(ControlPage::GP_GET, 3);
        gpu_view.store(ControlPage::GP_PUT, 5);
        let guest = f.guest_word(0);

        let mut sh = Shadows::new();
        assert!(
            sh.set_hold(t, Holder::Scheduler, true, shm)
                .unwrap()
                .changed
        );
        assert_eq!(guest.load(Ordering::Acquire), 5, "guest sees its GP_PUT");
        guest.store(9, Ordering::Release);
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 5, "held back");
        assert_eq!(
            sh.release_capped(1, 2).unwrap(),
            0,
            "GP_GET + 2 = 5: nothing new"
        );
        gpu_view.store(ControlPage::GP_GET, 5);
        assert_eq!(sh.release_capped(1, 2).unwrap(), 2);
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 7);
        sh.mirror();
        let guest_get = f.guest_word(1);
        assert_eq!(guest_get.load(Ordering::Acquire), 5);
        assert!(
            sh.set_hold(t, Holder::Scheduler, false, shm)
                .unwrap()
                .changed
        );
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 9, "everything released");
        assert_eq!(guest.load(Ordering::Acquire), 9);
        assert_eq!(sh.stats().raised_on_unshadow, 1);
        assert_eq!(sh.stats().shadowed_now, 0);
    }

    /// A fence waiter the guest arms while its channel is shadowed lands in the shadow
    /// page, which the GPU does not read: the mirror carries it into the real page (and
    /// disarms the shadow's), and so does the unshadow.
    #[test]
    fn an_armed_fence_waiter_reaches_the_real_page() {
        let f = Fixture::new();
        let (gpu_view, shm) = (&f.gpu_view, &f.shm);
        let t = ShadowTarget {
            ch: 1,
            page: f.page,
            slot_off: Some(0),
        };
        let word = |field: usize| f.guest_word(field / 4);
        let mut sh = Shadows::new();
        sh.set_hold(t, Holder::Scheduler, true, shm).unwrap();
        word(ControlPage::REF_WAKE).store(7, Ordering::Relaxed);
        word(ControlPage::REF_WAKE_ARMED).store(1, Ordering::Release);
        assert_eq!(
            gpu_view.load(ControlPage::REF_WAKE_ARMED),
            0,
            "in the shadow"
        );
        sh.mirror();
        assert_eq!(gpu_view.load(ControlPage::REF_WAKE), 7);
        assert_eq!(gpu_view.load(ControlPage::REF_WAKE_ARMED), 1);
        assert_eq!(word(ControlPage::REF_WAKE_ARMED).load(Ordering::Acquire), 0);

        // The GPU woke and disarmed it; the guest arms again before the unshadow.
        gpu_view.store(ControlPage::REF_WAKE_ARMED, 0);
        word(ControlPage::REF_WAKE).store(9, Ordering::Relaxed);
        word(ControlPage::REF_WAKE_ARMED).store(1, Ordering::Release);
        sh.set_hold(t, Holder::Scheduler, false, shm).unwrap();
        assert_eq!(gpu_view.load(ControlPage::REF_WAKE), 9);
        assert_eq!(gpu_view.load(ControlPage::REF_WAKE_ARMED), 1);
        // Nothing armed: a mirror carries nothing.
        gpu_view.store(ControlPage::REF_WAKE_ARMED, 0);
        sh.set_hold(t, Holder::Scheduler, true, shm).unwrap();
        sh.mirror();
        assert_eq!(gpu_view.load(ControlPage::REF_WAKE_ARMED), 0);
    }

    #[test]
    fn vram_hold_outlasts_other_unshadows_and_blocks_capped_release() {
        let f = Fixture::new();
        let (gpu_view, shm) = (&f.gpu_view, &f.shm);
        let t = ShadowTarget {
            ch: 1,
            page: f.page,
            slot_off: Some(0),
        };
        let guest = f.guest_word(0);

        let mut sh = Shadows::new();
        // The scheduler shadows, the VRAM manager holds, the scheduler lets go: still held.
        assert!(
            sh.set_hold(t, Holder::Scheduler, true, shm)
                .unwrap()
                .changed
        );
        assert!(!sh.set_hold(t, Holder::Vram, true, shm).unwrap().changed);
        assert!(
            !sh.set_hold(t, Holder::Scheduler, false, shm)
                .unwrap()
                .changed
        );
        assert!(sh.is_shadowed(1));
        guest.store(4, Ordering::Release);
        assert_eq!(
            sh.release_capped(1, 8).unwrap(),
            0,
            "nothing runs while held"
        );
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 0);
        // The manager lets go: nobody else holds it, so it is unshadowed and released.
        assert!(sh.set_hold(t, Holder::Vram, false, shm).unwrap().changed);
        assert!(!sh.is_shadowed(1));
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 4);
        // Held by the manager first, then by the scheduler: the manager's release keeps it.
        sh.set_hold(t, Holder::Vram, true, shm).unwrap();
        sh.set_hold(t, Holder::Scheduler, true, shm).unwrap();
        assert!(!sh.set_hold(t, Holder::Vram, false, shm).unwrap().changed);
        assert!(sh.is_shadowed(1));
        assert!(
            sh.set_hold(t, Holder::Scheduler, false, shm)
                .unwrap()
                .changed
        );
        assert!(!sh.is_shadowed(1));
    }

    #[test]
    fn the_last_holder_unshadows_and_only_the_scheduler_releases_capped() {
        let f = Fixture::new();
        let (gpu_view, shm) = (&f.gpu_view, &f.shm);
        let t = ShadowTarget {
            ch: 1,
            page: f.page,
            slot_off: Some(0),
        };
        let guest = f.guest_word(0);
        let mut sh = Shadows::new();
        sh.set_hold(t, Holder::Operator, true, shm).unwrap();
        sh.set_hold(t, Holder::Scheduler, true, shm).unwrap();
        guest.store(3, Ordering::Release);
        assert_eq!(sh.release_capped(1, 8).unwrap(), 0, "paused: nothing runs");
        sh.set_hold(t, Holder::Operator, false, shm).unwrap();
        assert!(sh.holders(1).only(Holder::Scheduler));
        assert_eq!(sh.release_capped(1, 2).unwrap(), 2);
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 2);
        assert!(sh.orphans().is_empty());
        assert!(
            sh.set_hold(t, Holder::Scheduler, false, shm)
                .unwrap()
                .changed
        );
        assert_eq!(gpu_view.load(ControlPage::GP_PUT), 3);
        assert!(sh.holders(1).is_empty() && !sh.is_shadowed(1));
    }
}
