//! A split-virtqueue *driver* (the guest side of virtio 1.x split rings): descriptor
//! table, available ring and used ring live in guest RAM; the driver adds buffer chains
//! and harvests used entries. Optional `VIRTIO_RING_F_EVENT_IDX` notification suppression
//! the way Linux's `virtio_ring` does it (see [`SplitQueue::set_event_idx`]); no indirect
//! descriptors (not negotiated).

use std::sync::atomic::{fence, AtomicU16, Ordering};

use thiserror::Error;

use crate::guest_memory::{GuestRam, PageAllocator, PAGE_SIZE};

pub const VIRTQ_DESC_F_NEXT: u16 = 1;
pub const VIRTQ_DESC_F_WRITE: u16 = 2;

const DESC_SIZE: u64 = 16;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum VirtqError {
    #[error("queue size {0} is not a power of two in 1..=32768")]
    BadSize(u16),
    #[error("no guest memory for the rings")]
    NoMemory,
    #[error("chain of {0} buffers does not fit ({1} descriptors free)")]
    Full(usize, usize),
    #[error("empty chain")]
    EmptyChain,
    #[error("buffer length {0:#x} does not fit a descriptor")]
    BadLength(u64),
    #[error("device returned bad used id {0}")]
    BadUsedId(u32),
}

/// One buffer of a chain.
#[derive(Debug, Clone, Copy)]
pub struct Buffer {
    pub gpa: u64,
    pub len: u64,
    /// Device-writable (else device-readable).
    pub write: bool,
}

/// A used-ring entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    /// Head descriptor of the completed chain.
    pub id: u16,
    /// Bytes the device wrote.
    pub len: u32,
}

/// The driver state of one split virtqueue.
#[derive(Debug)]
pub struct SplitQueue {
    size: u16,
    desc_gpa: u64,
    avail_gpa: u64,
    used_gpa: u64,
    desc: *mut u8,
    avail: *mut u8,
    used: *mut u8,
    free: Vec<u16>,
    /// Shadow of the `next` links and chain lengths, indexed by descriptor (the device
    /// could scribble on the table; we never trust it when freeing).
    next: Vec<u16>,
    chain_len: Vec<u16>,
    in_flight: Vec<bool>,
    avail_idx: u16,
    last_used: u16,
    /// `VIRTIO_RING_F_EVENT_IDX` was negotiated: `used_event` and `avail_event` are live.
    event_idx: bool,
    /// The avail index at the last kick decision ([`Self::kick_prepare`]).
    kicked_idx: u16,
}

/// Whether a notification is due: the other side asked for one at `event` and the index
/// moved from `old` past it to `new` (virtio 1.x 2.7.10, Linux's `vring_need_event`).
pub fn vring_need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

// SAFETY: the pointers address guest RAM that outlives the queue (owned by whoever owns
// both); all accesses go through `&mut self` or atomics.
unsafe impl Send for SplitQueue {}

impl SplitQueue {
    /// Allocates and zeroes the rings for a queue of `size` entries in guest RAM.
    pub fn new(size: u16, ram: &GuestRam, alloc: &mut PageAllocator) -> Result<Self, VirtqError> {
        if size == 0 || !size.is_power_of_two() || size > 32768 {
            return Err(VirtqError::BadSize(size));
        }
        let n = size as u64;
        let desc_len = DESC_SIZE * n;
        let avail_len = 6 + 2 * n;
        let used_len = 6 + 8 * n;
        // desc | avail, then the used ring on its own page (virtio 1 needs 16/2/4-byte
        // alignment; page alignment also suits legacy layouts).
        let used_off = (desc_len + avail_len).next_multiple_of(PAGE_SIZE);
        let total = used_off + used_len;
        let (gpa, len) = alloc
            .alloc(total, PAGE_SIZE)
            .map_err(|_| VirtqError::NoMemory)?;
        let base = ram.host_ptr(gpa, len).ok_or(VirtqError::NoMemory)?;
        // SAFETY: `base` addresses `len` bytes of guest RAM just allocated to us.
        unsafe { std::ptr::write_bytes(base, 0, len as usize) };
        // SAFETY: the offset is < `total` <= `len`, inside the allocation.
        let avail = unsafe { base.add(desc_len as usize) };
        // SAFETY: the offset is < `total` <= `len`, inside the allocation.
        let used = unsafe { base.add(used_off as usize) };
        Ok(SplitQueue {
            size,
            desc_gpa: gpa,
            avail_gpa: gpa + desc_len,
            used_gpa: gpa + used_off,
            desc: base,
            avail,
            used,
            free: (0..size).rev().collect(),
            next: vec![0; size as usize],
            chain_len: vec![0; size as usize],
            in_flight: vec![false; size as usize],
            avail_idx: 0,
            last_used: 0,
            event_idx: false,
            kicked_idx: 0,
        })
    }

    /// Turns `VIRTIO_RING_F_EVENT_IDX` on or off (as negotiated with the device; set before
    /// the device uses the rings). With it, [`Self::pop_used`] and
    /// [`Self::enable_interrupts`] publish `used_event` (the device interrupts once it
    /// passes it) and [`Self::kick_prepare`] reads `avail_event` (kick only when the device
    /// asked); without it every used entry may interrupt and every add is kicked.
    pub fn set_event_idx(&mut self, on: bool) {
        self.event_idx = on;
    }

    pub fn event_idx(&self) -> bool {
        self.event_idx
    }

    pub fn size(&self) -> u16 {
        self.size
    }
    pub fn desc_gpa(&self) -> u64 {
        self.desc_gpa
    }
    pub fn avail_gpa(&self) -> u64 {
        self.avail_gpa
    }
    pub fn used_gpa(&self) -> u64 {
        self.used_gpa
    }
    /// Host (this process) addresses of the descriptor table, avail and used rings.
    pub fn host_addrs(&self) -> (u64, u64, u64) {
        (self.desc as u64, self.avail as u64, self.used as u64)
    }
    pub fn free_descriptors(&self) -> usize {
        self.free.len()
    }
    /// The driver's avail index (chains published so far, mod 2^16).
    pub fn avail_idx(&self) -> u16 {
        self.avail_idx
    }

    fn avail_idx_ref(&self) -> &AtomicU16 {
        // SAFETY: `avail + 2` is 2-aligned (the table is page aligned and 16*size bytes
        // long) and inside the ring; AtomicU16 has u16's layout.
        unsafe { &*(self.avail.add(2) as *const AtomicU16) }
    }

    fn used_idx_ref(&self) -> &AtomicU16 {
        // SAFETY: `used + 2` is 2-aligned (page-aligned ring) and inside the ring.
        unsafe { &*(self.used.add(2) as *const AtomicU16) }
    }

    /// `used_event`: the u16 after the avail ring's entries (driver-written).
    fn used_event_ref(&self) -> &AtomicU16 {
        // SAFETY: `avail + 4 + 2*size` is 2-aligned and inside the avail ring, which is
        // 6 + 2*size bytes long (allocated in `new`).
        unsafe { &*(self.avail.add(4 + 2 * usize::from(self.size)) as *const AtomicU16) }
    }

    /// `avail_event`: the u16 after the used ring's entries (device-written).
    fn avail_event_ref(&self) -> &AtomicU16 {
        // SAFETY: `used + 4 + 8*size` is 2-aligned and inside the used ring, which is
        // 6 + 8*size bytes long (allocated in `new`).
        unsafe { &*(self.used.add(4 + 8 * usize::from(self.size)) as *const AtomicU16) }
    }

    /// Tells the device to interrupt for the next used entry (`used_event` = the last
    /// one seen), then a full fence before the caller's next read of the used index
    /// (Linux's `virtio_store_mb`).
    fn publish_used_event(&self) {
        self.used_event_ref()
            .store(self.last_used, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Whether to kick the device for the chains added since the last call (Linux's
    /// `virtqueue_kick_prepare`); call it under the same lock as `add`. With EVENT_IDX
    /// only when the device's `avail_event` lies in what was added; without, always.
    pub fn kick_prepare(&mut self) -> bool {
        let old = self.kicked_idx;
        let new = self.avail_idx;
        self.kicked_idx = new;
        if !self.event_idx {
            return true;
        }
        // `add` ended with a full fence after the avail index store: the device either
        // sees the new index or has published the avail_event we read here.
        fence(Ordering::SeqCst);
        let event = self.avail_event_ref().load(Ordering::SeqCst);
        vring_need_event(event, new, old)
    }

    /// Re-arms interrupts after a harvest (Linux's `virtqueue_enable_cb_prepare` then
    /// `virtqueue_poll`): with EVENT_IDX publishes `used_event` and re-checks. Returns
    /// false if used entries arrived meanwhile (the device may not interrupt for them:
    /// harvest again). Without EVENT_IDX nothing to arm: true.
    pub fn enable_interrupts(&self) -> bool {
        if !self.event_idx {
            return true;
        }
        self.publish_used_event();
        !self.has_used()
    }

    /// Adds a chain and publishes it in the avail ring. Returns the head id. The caller
    /// kicks the device.
    pub fn add(&mut self, bufs: &[Buffer]) -> Result<u16, VirtqError> {
        if bufs.is_empty() {
            return Err(VirtqError::EmptyChain);
        }
        if bufs.len() > self.free.len() {
            return Err(VirtqError::Full(bufs.len(), self.free.len()));
        }
        if let Some(b) = bufs.iter().find(|b| b.len > u32::MAX as u64) {
            return Err(VirtqError::BadLength(b.len));
        }
        let ids: Vec<u16> = (0..bufs.len()).filter_map(|_| self.free.pop()).collect();
        for (i, (b, &id)) in bufs.iter().zip(&ids).enumerate() {
            let next = ids.get(i + 1).copied();
            let mut flags = if b.write { VIRTQ_DESC_F_WRITE } else { 0 };
            if next.is_some() {
                flags |= VIRTQ_DESC_F_NEXT;
            }
            let mut d = [0u8; DESC_SIZE as usize];
            d[0..8].copy_from_slice(&b.gpa.to_le_bytes());
            d[8..12].copy_from_slice(&(b.len as u32).to_le_bytes());
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&next.unwrap_or(0).to_le_bytes());
            // SAFETY: `id` < size, so the 16 bytes lie inside the descriptor table.
            unsafe {
                let p = self.desc.add(id as usize * DESC_SIZE as usize) as *mut [u8; 16];
                p.write_volatile(d);
            }
            self.next[id as usize] = next.unwrap_or(0);
        }
        let head = ids[0];
        self.chain_len[head as usize] = ids.len() as u16;
        self.in_flight[head as usize] = true;
        let slot = (self.avail_idx % self.size) as usize;
        // SAFETY: ring[slot] at avail+4+2*slot lies inside the avail ring (slot < size).
        unsafe {
            (self.avail.add(4 + 2 * slot) as *mut u16).write_volatile(head.to_le());
        }
        self.avail_idx = self.avail_idx.wrapping_add(1);
        // Descriptors and ring entry before the index (Release), index before the kick.
        self.avail_idx_ref()
            .store(self.avail_idx, Ordering::Release);
        fence(Ordering::SeqCst);
        Ok(head)
    }

    /// Back to the state of a new queue (rings zeroed, every descriptor free), for a
    /// device that starts over: a reconnected backend begins at index 0.
    pub fn reset(&mut self) {
        let n = usize::from(self.size);
        // SAFETY: `desc` and `avail` are contiguous (desc table then avail ring, as
        // allocated in `new`), `used` is its own ring of 6 + 8n bytes; all guest RAM
        // owned by this queue, and the device no longer uses them.
        unsafe {
            std::ptr::write_bytes(self.desc, 0, DESC_SIZE as usize * n + 6 + 2 * n);
            std::ptr::write_bytes(self.used, 0, 6 + 8 * n);
        }
        self.free = (0..self.size).rev().collect();
        self.next.fill(0);
        self.chain_len.fill(0);
        self.in_flight.fill(false);
        self.avail_idx = 0;
        self.last_used = 0;
        self.kicked_idx = 0;
    }

    /// Whether the device has published used entries we have not harvested.
    pub fn has_used(&self) -> bool {
        self.used_idx_ref().load(Ordering::Acquire) != self.last_used
    }

    /// Takes the next used entry, freeing its chain.
    pub fn pop_used(&mut self) -> Result<Option<Used>, VirtqError> {
        let idx = self.used_idx_ref().load(Ordering::Acquire);
        if idx == self.last_used {
            return Ok(None);
        }
        let slot = (self.last_used % self.size) as usize;
        // SAFETY: the element at used+4+8*slot lies inside the used ring (slot < size);
        // the Acquire load of the index orders this read after the device's write.
        let e = unsafe { (self.used.add(4 + 8 * slot) as *const [u8; 8]).read_volatile() };
        self.last_used = self.last_used.wrapping_add(1);
        let id = u32::from_le_bytes([e[0], e[1], e[2], e[3]]);
        let len = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        if id >= self.size as u32 || !self.in_flight[id as usize] {
            return Err(VirtqError::BadUsedId(id));
        }
        if self.event_idx {
            // As Linux's `virtqueue_get_buf`: ask for an interrupt at the next entry.
            self.publish_used_event();
        }
        let head = id as u16;
        self.in_flight[head as usize] = false;
        let mut d = head;
        for _ in 0..self.chain_len[head as usize] {
            self.free.push(d);
            d = self.next[d as usize];
        }
        Ok(Some(Used { id: head, len }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_and_harvest() {
        let ram = GuestRam::new(&[(0, 1 << 20)]).unwrap();
        let mut a = PageAllocator::new(0, 1 << 20);
        let mut q = SplitQueue::new(8, &ram, &mut a).unwrap();
        let h = q
            .add(&[
                Buffer {
                    gpa: 0x8000,
                    len: 10,
                    write: false,
                },
                Buffer {
                    gpa: 0x9000,
                    len: 20,
                    write: true,
                },
            ])
            .unwrap();
        assert_eq!(q.free_descriptors(), 6);
        let (desc, avail, used) = q.host_addrs();
        // SAFETY: test; reading/writing the rings we just set up.
        unsafe {
            let d = (desc as *const u8).add(h as usize * 16);
            assert_eq!((d as *const u64).read(), 0x8000);
            assert_eq!((d.add(12) as *const u16).read(), VIRTQ_DESC_F_NEXT);
            let next = (d.add(14) as *const u16).read();
            let d2 = (desc as *const u8).add(next as usize * 16);
            assert_eq!((d2.add(12) as *const u16).read(), VIRTQ_DESC_F_WRITE);
            assert_eq!(((avail + 2) as *const u16).read(), 1);
            assert_eq!(((avail + 4) as *const u16).read(), h);
            // Play device: complete the chain.
            assert!(!q.has_used());
            ((used + 4) as *mut u32).write(h as u32);
            ((used + 8) as *mut u32).write(5);
            ((used + 2) as *mut u16).write(1);
        }
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: h, len: 5 }));
        assert_eq!(q.pop_used().unwrap(), None);
        assert_eq!(q.free_descriptors(), 8);
        let nine = [Buffer {
            gpa: 0,
            len: 1,
            write: true,
        }; 9];
        assert_eq!(q.add(&nine), Err(VirtqError::Full(9, 8)));
        q.add(&nine[..3]).unwrap();
        q.reset();
        assert_eq!(q.free_descriptors(), 8);
        assert!(!q.has_used());
        // SAFETY: test; the avail index lies in the ring just reset.
        assert_eq!(unsafe { ((avail + 2) as *const u16).read() }, 0);
    }

    #[test]
    fn need_event_wraps() {
        // The event index inside (old, new] asks for a notification, also across 2^16.
        assert!(vring_need_event(5, 6, 5));
        assert!(!vring_need_event(4, 6, 5));
        assert!(vring_need_event(65535, 2, 65530));
        assert!(vring_need_event(1, 2, 65530));
        assert!(!vring_need_event(3, 2, 65530));
        assert!(!vring_need_event(65529, 2, 65530));
    }

    #[test]
    fn event_idx_suppresses_kicks_and_arms_used_event() {
        let ram = GuestRam::new(&[(0, 1 << 20)]).unwrap();
        let mut a = PageAllocator::new(0, 1 << 20);
        let mut q = SplitQueue::new(8, &ram, &mut a).unwrap();
        let buf = [Buffer {
            gpa: 0x8000,
            len: 8,
            write: true,
        }];
        // Without EVENT_IDX every add is kicked.
        q.add(&buf).unwrap();
        assert!(q.kick_prepare());
        assert!(q.kick_prepare(), "nothing added, still a kick: as before");
        q.set_event_idx(true);
        let (_, avail, used) = q.host_addrs();
        let used_event = (avail + 4 + 2 * 8) as *mut u16;
        let avail_event = (used + 4 + 8 * 8) as *mut u16;
        // SAFETY: test; the fields lie in the rings set up above.
        unsafe { avail_event.write(1) };
        q.add(&buf).unwrap();
        assert!(q.kick_prepare(), "the device asked at index 1");
        q.add(&buf).unwrap();
        assert!(!q.kick_prepare(), "the device has not caught up: no kick");
        // Play device: take everything, re-arm at 3, complete two chains.
        // SAFETY: test; the used ring's fields.
        unsafe {
            avail_event.write(3);
            ((used + 4) as *mut u32).write(0);
            ((used + 12) as *mut u32).write(1);
            ((used + 2) as *mut u16).write(2);
        }
        q.add(&buf).unwrap();
        assert!(q.kick_prepare());
        assert!(!q.enable_interrupts(), "used entries are waiting");
        assert_eq!(q.pop_used().unwrap().map(|u| u.id), Some(0));
        // SAFETY: test; the avail ring's used_event.
        assert_eq!(unsafe { used_event.read() }, 1, "armed for the next entry");
        assert_eq!(q.pop_used().unwrap().map(|u| u.id), Some(1));
        assert!(q.enable_interrupts(), "nothing left: armed at 2");
        // SAFETY: as above.
        assert_eq!(unsafe { used_event.read() }, 2);
    }
}
