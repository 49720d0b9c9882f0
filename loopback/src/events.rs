//! The event queue: buffers posted for the device's events, harvested into a FIFO that
//! guest processes wait on.

use crate::*;

pub(crate) struct EvState {
    pub(crate) q: SplitQueue,
    pub(crate) head_buf: Vec<Option<usize>>,
    pub(crate) pending: VecDeque<(Event, usize)>,
    pub(crate) dead: bool,
    /// Events harvested so far, fence wake-ups included: what blocked waiters sleep on.
    pub(crate) count: u64,
}

/// The event queue: pre-filled with writable EVENT_SIZE buffers, refilled as events are
/// consumed.
pub(crate) struct Events {
    pub(crate) st: Mutex<EvState>,
    pub(crate) cv: Condvar,
    /// Per buffer: (gpa, host address).
    pub(crate) bufs: Vec<(u64, usize)>,
    pub(crate) kick: EventFd,
    pub(crate) call: EventFd,
    pub(crate) counters: Counters,
}

impl Events {
    pub(crate) fn post(&self, st: &mut EvState, buf: usize) -> Result<(), VirtqError> {
        let (gpa, host) = self.bufs[buf];
        // SAFETY: buffer `buf` is EVENT_SIZE bytes of guest RAM owned by this queue and not
        // currently posted to the device.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, EVENT_SIZE) };
        let head = st.q.add(&[Buffer {
            gpa,
            len: EVENT_SIZE as u64,
            write: true,
        }])?;
        st.head_buf[head as usize] = Some(buf);
        Ok(())
    }

    pub(crate) fn kick(&self) {
        self.counters.kick(&self.kick);
    }

    pub(crate) fn harvest(&self) {
        let mut st = lock(&self.st);
        let mut any = false;
        let mut reposted = false;
        loop {
            match st.q.pop_used() {
                Ok(Some(u)) => {
                    let Some(buf) = st.head_buf[u.id as usize].take() else {
                        continue;
                    };
                    let mut b = [0u8; EVENT_SIZE];
                    // SAFETY: the device has completed buffer `buf` (EVENT_SIZE bytes).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.bufs[buf].1 as *const u8,
                            b.as_mut_ptr(),
                            EVENT_SIZE,
                        )
                    };
                    match Event::decode(&b).filter(|_| u.len as usize >= EVENT_SIZE) {
                        // A wake-up only (its waiter re-reads the control page): counted,
                        // and its buffer goes straight back to the device.
                        Some(ev) if ev.kind == vgpu_protocol::request::event::FENCE => {
                            st.count += 1;
                            any = true;
                            if let Err(e) = self.post(&mut st, buf) {
                                error!("event queue: {e}");
                            }
                            reposted = true;
                        }
                        Some(ev) => {
                            st.pending.push_back((ev, buf));
                            st.count += 1;
                            any = true;
                        }
                        None => {
                            warn!("event queue: short event ({} bytes) dropped", u.len);
                            if let Err(e) = self.post(&mut st, buf) {
                                error!("event queue: {e}");
                            }
                            reposted = true;
                        }
                    }
                }
                Ok(None) if st.q.enable_interrupts() => break,
                Ok(None) => {}
                Err(e) => {
                    error!("event queue: {e}");
                    break;
                }
            }
        }
        let notify = reposted && st.q.kick_prepare();
        drop(st);
        if notify {
            self.kick();
        }
        if any {
            self.cv.notify_all();
        }
    }

    pub(crate) fn next(&self, timeout: Duration) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.st);
        loop {
            if let Some((ev, buf)) = st.pending.pop_front() {
                if !st.dead {
                    match self.post(&mut st, buf) {
                        Ok(()) => {
                            let notify = st.q.kick_prepare();
                            drop(st);
                            if notify {
                                self.kick();
                            }
                        }
                        Err(e) => error!("event queue: {e}"),
                    }
                }
                return Some(ev);
            }
            if st.dead {
                return None;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// How many events were harvested so far.
    pub(crate) fn count(&self) -> u64 {
        lock(&self.st).count
    }

    /// Sleeps until more than `seen` events were harvested, the queue dies, or `timeout`
    /// passes; the count then.
    pub(crate) fn wait_count(&self, seen: u64, timeout: Duration) -> u64 {
        let st = lock(&self.st);
        let (st, _) = self
            .cv
            .wait_timeout_while(st, timeout, |s| s.count == seen && !s.dead)
            .unwrap_or_else(|e| e.into_inner());
        st.count
    }

    pub(crate) fn kill(&self) {
        lock(&self.st).dead = true;
        self.cv.notify_all();
    }

    /// Fresh ring with every buffer posted again, for a reconnected backend.
    pub(crate) fn revive(&self) -> Result<(), VirtqError> {
        let mut st = lock(&self.st);
        st.q.reset();
        st.head_buf.fill(None);
        st.pending.clear();
        for i in 0..self.bufs.len() {
            self.post(&mut st, i)?;
        }
        st.dead = false;
        drop(st);
        self.kick();
        Ok(())
    }
}
