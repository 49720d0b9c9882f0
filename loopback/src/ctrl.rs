//! The control queue: requests and their replies, a connection epoch so a reply from
//! before a reconnect is never taken for a later request's, and freezing for migration.

use crate::*;

/// Guest buffers of one control-request slot (host addresses kept as integers).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    pub(crate) req_gpa: u64,
    pub(crate) req_host: usize,
    pub(crate) reply_gpa: u64,
    pub(crate) reply_host: usize,
}

pub(crate) struct CtrlState {
    pub(crate) q: SplitQueue,
    pub(crate) free_slots: Vec<usize>,
    pub(crate) head_slot: Vec<Option<usize>>,
    pub(crate) done: Vec<Option<u32>>,
    pub(crate) dead: bool,
    /// The device is being moved to another backend: new requests wait.
    pub(crate) frozen: bool,
    /// Device generation: bumped when the rings start over on a reconnected backend, so
    /// a request of an older generation never takes a newer one's reply.
    pub(crate) epoch: u64,
}

/// The control queue: requests from many threads, at most one per slot in flight.
pub(crate) struct Ctrl {
    pub(crate) st: Mutex<CtrlState>,
    pub(crate) cv: Condvar,
    pub(crate) slots: Vec<Slot>,
    pub(crate) kick: EventFd,
    pub(crate) call: EventFd,
    pub(crate) counters: Counters,
    /// How long a request may wait for its reply before the backend counts as hung.
    pub(crate) timeout: Option<Duration>,
    pub(crate) link: Arc<Link>,
    /// The generation while the device works, `DOWN` while it does not: read without the
    /// lock by guest threads polling their channels.
    pub(crate) live_epoch: AtomicU64,
    /// Doorbells rung ([`crate::LoopbackVm::ring_doorbell`]).
    pub(crate) doorbells: AtomicU64,
}

/// `Ctrl::live_epoch` of a device that does not work.
pub(crate) const DOWN: u64 = u64::MAX;

impl Ctrl {
    /// Sends `req` and waits for the reply. With `epoch`, fails with `DeviceReset` if the
    /// device has started over since that generation.
    pub(crate) fn request(&self, epoch: Option<u64>, req: &[u8]) -> Result<Vec<u8>, LoopbackError> {
        if req.is_empty() || req.len() > MAX_REQUEST_SIZE {
            return Err(LoopbackError::RequestSize(req.len()));
        }
        let mut st = lock(&self.st);
        let slot = loop {
            if epoch.is_some_and(|e| e != st.epoch) {
                return Err(LoopbackError::DeviceReset);
            }
            if st.dead {
                return Err(LoopbackError::Disconnected);
            }
            if st.frozen {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            if let Some(s) = st.free_slots.pop() {
                break s;
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        };
        let s = self.slots[slot];
        // SAFETY: the slot's buffers (MAX_REQUEST_SIZE and MAX_REPLY_SIZE bytes of guest
        // RAM) belong to this request until it completes; req.len() <= MAX_REQUEST_SIZE.
        unsafe {
            std::ptr::copy_nonoverlapping(req.as_ptr(), s.req_host as *mut u8, req.len());
            std::ptr::write_bytes(s.reply_host as *mut u8, 0, MAX_REPLY_SIZE);
        }
        let chain = [
            Buffer {
                gpa: s.req_gpa,
                len: req.len() as u64,
                write: false,
            },
            Buffer {
                gpa: s.reply_gpa,
                len: MAX_REPLY_SIZE as u64,
                write: true,
            },
        ];
        let head = match st.q.add(&chain) {
            Ok(h) => h,
            Err(e) => {
                st.free_slots.push(slot);
                return Err(e.into());
            }
        };
        st.head_slot[head as usize] = Some(slot);
        st.done[slot] = None;
        let my_epoch = st.epoch;
        let notify = st.q.kick_prepare();
        drop(st);
        if notify {
            self.kick();
        }

        let deadline = self.timeout.map(|t| Instant::now() + t);
        let mut st = lock(&self.st);
        let len = loop {
            if st.epoch != my_epoch {
                return Err(LoopbackError::DeviceReset);
            }
            if let Some(len) = st.done[slot].take() {
                break len;
            }
            if st.dead {
                return Err(LoopbackError::Disconnected);
            }
            st = match deadline {
                None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        drop(st);
                        self.link.report_lost("a control request timed out");
                        return Err(LoopbackError::Timeout(self.timeout.unwrap_or_default()));
                    }
                    self.cv
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        };
        let n = (len as usize).min(MAX_REPLY_SIZE);
        let mut reply = vec![0u8; n];
        // SAFETY: the device has completed the chain; the reply buffer holds n <=
        // MAX_REPLY_SIZE bytes and is still ours until the slot is freed below.
        unsafe {
            std::ptr::copy_nonoverlapping(s.reply_host as *const u8, reply.as_mut_ptr(), n);
        }
        st.free_slots.push(slot);
        drop(st);
        self.cv.notify_all();
        Ok(reply)
    }

    pub(crate) fn kick(&self) {
        self.counters.kick(&self.kick);
    }

    pub(crate) fn harvest(&self) {
        let mut st = lock(&self.st);
        let mut any = false;
        loop {
            match st.q.pop_used() {
                Ok(Some(u)) => {
                    if let Some(slot) = st.head_slot[u.id as usize].take() {
                        st.done[slot] = Some(u.len);
                        any = true;
                    }
                }
                // Re-armed with nothing new: done (else what came meanwhile may never
                // interrupt).
                Ok(None) if st.q.enable_interrupts() => break,
                Ok(None) => {}
                Err(e) => {
                    error!("control queue: {e}");
                    break;
                }
            }
        }
        drop(st);
        if any {
            self.cv.notify_all();
        }
    }

    pub(crate) fn kill(&self) {
        lock(&self.st).dead = true;
        self.live_epoch.store(DOWN, Ordering::Release);
        self.cv.notify_all();
    }

    /// Fresh rings for the device's next backend (it begins at index 0); the queue stays
    /// dead until [`Self::revive`].
    pub(crate) fn reset_rings(&self) {
        let mut st = lock(&self.st);
        st.q.reset();
        st.free_slots = (0..self.slots.len()).rev().collect();
        st.head_slot.fill(None);
        st.done.fill(None);
    }

    /// Starts a new generation: requests of the old one fail with `DeviceReset`.
    pub(crate) fn revive(&self) {
        let mut st = lock(&self.st);
        st.epoch += 1;
        st.dead = false;
        self.live_epoch.store(st.epoch, Ordering::Release);
        drop(st);
        self.cv.notify_all();
    }

    pub(crate) fn epoch(&self) -> u64 {
        lock(&self.st).epoch
    }

    /// Stops new requests and waits until none is in flight (the harvest runs on the
    /// irq thread, which must still be running).
    pub(crate) fn freeze(&self) -> Result<(), LoopbackError> {
        let mut st = lock(&self.st);
        st.frozen = true;
        let nslots = self.slots.len();
        while st.free_slots.len() < nslots {
            if st.dead {
                st.frozen = false;
                return Err(LoopbackError::Disconnected);
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    pub(crate) fn thaw(&self) {
        lock(&self.st).frozen = false;
        self.cv.notify_all();
    }
}
