//! The GPU's contexts and channels, shared by the VMs a backend serves.
//!
//! Each served VM has a **reserve** (`VmLimits::reserved_contexts`, `reserved_channels`):
//! a guaranteed minimum that no other VM can take. A VM is admitted (`serve_vm`) only if
//! its reserve fits beside the reserves of the VMs already served; the reserves together
//! never exceed what the GPU has. Above its reserve a VM borrows from what no reserve
//! covers, first come first served, up to its own per-VM limits. So however greedy the
//! others are, an admitted VM always gets at least its reserve.
//!
//! The book counts a VM's objects as the VM's session has them (the session tells it
//! after every change); a VM's claim is the larger of what it uses and its reserve, and
//! the claims together never exceed the GPU's totals.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use thiserror::Error;

/// The two counted resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Contexts,
    Channels,
}

impl Resource {
    fn name(self) -> &'static str {
        match self {
            Resource::Contexts => "contexts",
            Resource::Channels => "channels",
        }
    }
}

/// A number of contexts and of channels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub contexts: u32,
    pub channels: u32,
}

impl Counts {
    fn get(&self, r: Resource) -> u32 {
        match r {
            Resource::Contexts => self.contexts,
            Resource::Channels => self.channels,
        }
    }

    fn get_mut(&mut self, r: Resource) -> &mut u32 {
        match r {
            Resource::Contexts => &mut self.contexts,
            Resource::Channels => &mut self.channels,
        }
    }
}

/// What `gpu` has of both resources.
pub fn gpu_totals(gpu: &dyn vgpu_host_shim::Gpu) -> Counts {
    let info = gpu.info();
    Counts {
        contexts: info.max_contexts,
        channels: info.max_channels,
    }
}

/// One resource's headroom on the GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Headroom {
    /// What the GPU has.
    pub total: u32,
    /// What the VMs' objects use.
    pub used: u32,
    /// The VMs' reserves together (used or not).
    pub reserved: u32,
    /// What a VM beyond its reserve may still take: the total less every VM's claim (the
    /// larger of its use and its reserve).
    pub free: u32,
}

/// The GPU's headroom of both resources.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapacityStats {
    pub contexts: Headroom,
    pub channels: Headroom,
}

/// Why a VM cannot be admitted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CapacityError {
    #[error(
        "a reserve of {asked} {what} does not fit: the GPU has {total}, \
         the VMs already served reserve {reserved}"
    )]
    ReserveTooLarge {
        what: &'static str,
        asked: u32,
        total: u32,
        reserved: u32,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    reserve: Counts,
    used: Counts,
}

/// The book of one GPU's contexts and channels.
#[derive(Debug)]
pub struct Capacity {
    total: Counts,
    book: Mutex<BTreeMap<u64, Entry>>,
    next_key: AtomicU64,
}

/// The sum over the book of each VM's claim on `r` (the larger of use and reserve),
/// leaving out the VM `except`.
fn claims(book: &BTreeMap<u64, Entry>, r: Resource, except: Option<u64>) -> u64 {
    book.iter()
        .filter(|(k, _)| Some(**k) != except)
        .map(|(_, e)| u64::from(e.used.get(r).max(e.reserve.get(r))))
        .sum()
}

impl Capacity {
    /// A book for a GPU with `total` contexts and channels.
    pub fn new(total: Counts) -> Arc<Self> {
        Arc::new(Capacity {
            total,
            book: Mutex::new(BTreeMap::new()),
            next_key: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a VM with `reserve`, if it fits beside the reserves already given and what
    /// VMs borrowed above theirs.
    pub fn admit(self: &Arc<Self>, reserve: Counts) -> Result<VmCapacity, CapacityError> {
        let mut book = self.lock();
        for r in [Resource::Contexts, Resource::Channels] {
            let taken = claims(&book, r, None);
            if taken + u64::from(reserve.get(r)) > u64::from(self.total.get(r)) {
                return Err(CapacityError::ReserveTooLarge {
                    what: r.name(),
                    asked: reserve.get(r),
                    total: self.total.get(r),
                    reserved: book.values().map(|e| e.reserve.get(r)).sum(),
                });
            }
        }
        Ok(self.enter(&mut book, reserve))
    }

    /// Puts a VM with `reserve` in the book (checked by the caller).
    fn enter(self: &Arc<Self>, book: &mut BTreeMap<u64, Entry>, reserve: Counts) -> VmCapacity {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        book.insert(
            key,
            Entry {
                reserve,
                used: Counts::default(),
            },
        );
        VmCapacity {
            pool: self.clone(),
            key,
            reserve,
        }
    }

    /// The headroom of both resources now.
    pub fn stats(&self) -> CapacityStats {
        let book = self.lock();
        let one = |r: Resource| {
            let total = self.total.get(r);
            let taken = claims(&book, r, None).min(u64::from(total)) as u32;
            Headroom {
                total,
                used: book.values().map(|e| e.used.get(r)).sum(),
                reserved: book.values().map(|e| e.reserve.get(r)).sum(),
                free: total - taken,
            }
        };
        CapacityStats {
            contexts: one(Resource::Contexts),
            channels: one(Resource::Channels),
        }
    }
}

/// One admitted VM's place in the book; dropping it gives its reserve back.
#[derive(Debug)]
pub struct VmCapacity {
    pool: Arc<Capacity>,
    key: u64,
    reserve: Counts,
}

impl VmCapacity {
    /// A book of its own for a session outside a backend (tests, tools): no reserve,
    /// everything of the GPU to borrow.
    pub fn standalone(total: Counts) -> Self {
        let pool = Capacity::new(total);
        let mut book = pool.lock();
        pool.enter(&mut book, Counts::default())
    }

    /// The VM's reserve.
    pub fn reserve(&self) -> Counts {
        self.reserve
    }

    /// Takes one more of `r` for a VM that has `used_now` of them: within its reserve
    /// always, above it if the GPU has some that no other VM's claim covers. Returns
    /// whether it may create the object; the book then counts it (a failed creation is
    /// corrected by the next [`VmCapacity::set_used`]).
    pub fn take_one(&self, r: Resource, used_now: u32) -> bool {
        let mut book = self.pool.lock();
        let others = claims(&book, r, Some(self.key));
        let Some(e) = book.get_mut(&self.key) else {
            return false;
        };
        let want = used_now.saturating_add(1);
        let claim = u64::from(want.max(e.reserve.get(r)));
        if others + claim > u64::from(self.pool.total.get(r)) {
            return false;
        }
        *e.used.get_mut(r) = want;
        true
    }

    /// Records what the VM's session has now.
    pub fn set_used(&self, used: Counts) {
        if let Some(e) = self.pool.lock().get_mut(&self.key) {
            e.used = used;
        }
    }
}

impl Drop for VmCapacity {
    fn drop(&mut self) {
        self.pool.lock().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: Counts = Counts {
        contexts: 8,
        channels: 16,
    };

    fn reserve(contexts: u32, channels: u32) -> Counts {
        Counts { contexts, channels }
    }

    #[test]
    fn reserves_must_fit_the_gpu() {
        let pool = Capacity::new(GPU);
        let a = pool.admit(reserve(4, 8)).expect("a");
        let _b = pool.admit(reserve(4, 8)).expect("b");
        let e = pool
            .admit(reserve(1, 0))
            .expect_err("no context left to reserve");
        assert!(e.to_string().contains("contexts"), "{e}");
        drop(a);
        pool.admit(reserve(4, 0)).expect("a's reserve came back");
    }

    #[test]
    fn a_greedy_vm_cannot_take_another_vms_reserve() {
        let pool = Capacity::new(GPU);
        let greedy = pool.admit(reserve(1, 2)).expect("greedy");
        let late = pool.admit(reserve(2, 4)).expect("late");
        let mut n = 0;
        while greedy.take_one(Resource::Channels, n) {
            n += 1;
        }
        assert_eq!(n, GPU.channels - 4, "all but the late VM's reserve");
        for i in 0..4 {
            assert!(late.take_one(Resource::Channels, i), "reserve channel {i}");
        }
        assert!(
            !late.take_one(Resource::Channels, 4),
            "nothing left to borrow"
        );
        let s = pool.stats().channels;
        assert_eq!((s.total, s.used, s.reserved, s.free), (16, 16, 6, 0));
        // The greedy VM lets go of some: the late VM may borrow them.
        greedy.set_used(reserve(0, n - 3));
        assert_eq!(pool.stats().channels.free, 3);
        assert!(late.take_one(Resource::Channels, 4));
    }

    #[test]
    fn unused_reserves_are_not_free() {
        let pool = Capacity::new(GPU);
        let a = pool.admit(reserve(3, 0)).expect("a");
        let _b = pool.admit(reserve(2, 0)).expect("b");
        assert_eq!(pool.stats().contexts.free, 3);
        for i in 0..6 {
            assert!(a.take_one(Resource::Contexts, i), "context {i}");
        }
        assert!(!a.take_one(Resource::Contexts, 6));
        let s = pool.stats().contexts;
        assert_eq!((s.used, s.reserved, s.free), (6, 5, 0));
    }

    #[test]
    fn a_standalone_book_lends_the_whole_gpu() {
        let c = VmCapacity::standalone(GPU);
        assert!(c.take_one(Resource::Contexts, 7));
        assert!(!c.take_one(Resource::Contexts, 8));
    }
}
