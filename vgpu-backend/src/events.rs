//! The per-VM event FIFO between GPU threads and the event virtqueue.
//!
//! GPU threads report channel events through the HAL's [`EventSink`]; they must not block,
//! and they must not touch a virtqueue (the vring belongs to the vhost-user worker thread,
//! and the frontend may stop or move it at any time through the main socket). So a sink
//! only appends to a bounded FIFO and writes an eventfd. That eventfd is registered with
//! the vring worker's epoll set (`VringEpollHandler::register_listener`, the extension
//! point vhost-user-backend provides for backend-specific fds); the worker then moves events
//! into whatever writable buffers the driver has posted on the event queue, and retries
//! whenever the driver posts more (a kick on the event queue). Events that find no buffer
//! wait in the FIFO; when it is full the oldest is dropped and counted (a warning at each
//! power of two). Only an event that finds the FIFO empty writes the eventfd, so a guest
//! that never drains its event queue costs the GPU threads a lock and a counter per event,
//! no syscall, and never stalls them or another VM.
//!
//! Each session generation has an epoch: sinks of channels of a torn-down session carry
//! the old epoch and their late events are discarded instead of reaching a new guest.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use log::warn;
use vgpu_host_shim::{EventSink, GpuEvent};
use vgpu_protocol::request::{event, Event};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Default bound of the pending-event FIFO.
pub const EVENT_FIFO_CAPACITY: usize = 4096;

struct Fifo {
    events: VecDeque<Event>,
    epoch: u64,
}

/// Pending events of one VM.
pub struct EventQueue {
    fifo: Mutex<Fifo>,
    capacity: usize,
    notify: Option<EventFd>,
    dropped: AtomicU64,
    delivered: AtomicU64,
}

impl EventQueue {
    /// A queue that wakes the vring worker through an eventfd.
    pub fn new(capacity: usize) -> std::io::Result<Self> {
        Ok(Self::build(capacity, Some(EventFd::new(EFD_NONBLOCK)?)))
    }

    /// A queue without a wake-up fd (tests, and sessions that are not served).
    pub fn detached(capacity: usize) -> Self {
        Self::build(capacity, None)
    }

    fn build(capacity: usize, notify: Option<EventFd>) -> Self {
        EventQueue {
            fifo: Mutex::new(Fifo {
                events: VecDeque::new(),
                epoch: 0,
            }),
            capacity: capacity.max(1),
            notify,
            dropped: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Fifo> {
        self.fifo.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The eventfd the vring worker polls.
    pub fn notifier(&self) -> Option<&EventFd> {
        self.notify.as_ref()
    }

    /// Consumes the eventfd's counter (after a wake-up).
    pub fn consume_wakeup(&self) {
        if let Some(fd) = &self.notify {
            // WouldBlock just means nothing was pending.
            let _ = fd.read();
        }
    }

    /// The current epoch (captured by sinks created now).
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Appends an event of `epoch`; discarded if the epoch is over.
    pub fn push(&self, epoch: u64, ev: Event) {
        let wake = {
            let mut f = self.lock();
            if f.epoch != epoch {
                return;
            }
            // Only the first pending event wakes the worker: it drains the FIFO until it
            // is empty or the driver has no buffers (then the driver's next kick resumes
            // it). A guest that never drains its event queue thus costs the GPU thread
            // no syscall per event (issue 16).
            let wake = f.events.is_empty();
            if f.events.len() >= self.capacity {
                f.events.pop_front();
                let n = self.dropped.fetch_add(1, Ordering::Relaxed);
                if n.is_power_of_two() || n == 0 {
                    warn!(
                        "event FIFO full ({} events): dropped the oldest ({} dropped so far)",
                        self.capacity,
                        n + 1
                    );
                }
            }
            f.events.push_back(ev);
            wake
        };
        if let (true, Some(fd)) = (wake, &self.notify) {
            let _ = fd.write(1);
        }
    }

    /// Takes the oldest pending event.
    pub fn pop(&self) -> Option<Event> {
        self.lock().events.pop_front()
    }

    /// The oldest pending event, left queued: the vring worker takes it off with
    /// [`Self::commit_head`] only once it lies in a used entry, so the queue never lacks
    /// an event that is neither pending nor delivered (a migration's snapshot, taken
    /// meanwhile, would lose it).
    pub fn peek(&self) -> Option<Event> {
        self.lock().events.front().copied()
    }

    /// Removes the head after [`Self::peek`] returned `ev` and it was delivered (unless
    /// the head moved on meanwhile: a full FIFO drops its oldest).
    pub fn commit_head(&self, ev: &Event) {
        let mut f = self.lock();
        if f.events.front() == Some(ev) {
            f.events.pop_front();
        }
    }

    /// A copy of the pending events, oldest first, taken at one instant (they stay
    /// queued).
    pub fn snapshot(&self) -> Vec<Event> {
        self.lock().events.iter().copied().collect()
    }

    /// Counts an event as delivered to the guest.
    pub fn mark_delivered(&self) {
        self.delivered.fetch_add(1, Ordering::Relaxed);
    }

    pub fn is_empty(&self) -> bool {
        self.lock().events.is_empty()
    }

    pub fn pending(&self) -> usize {
        self.lock().events.len()
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    /// Ends the epoch: forgets pending events; sinks of the old epoch go quiet.
    pub fn reset(&self) -> u64 {
        let mut f = self.lock();
        f.events.clear();
        f.epoch = f.epoch.wrapping_add(1);
        f.epoch
    }
}

/// The HAL event sink of one guest channel: tags events with the guest channel id.
pub struct ChannelSink {
    queue: Arc<EventQueue>,
    epoch: u64,
    channel: u32,
}

impl ChannelSink {
    pub fn new(queue: Arc<EventQueue>, channel: u32) -> Self {
        let epoch = queue.epoch();
        ChannelSink {
            queue,
            epoch,
            channel,
        }
    }
}

impl EventSink for ChannelSink {
    fn event(&self, ev: GpuEvent) {
        let ev = match ev {
            GpuEvent::Notify { token, .. } => Event {
                kind: event::NOTIFY,
                channel: self.channel,
                value: token,
                info: 0,
            },
            GpuEvent::Fence { reference, .. } => Event {
                kind: event::FENCE,
                channel: self.channel,
                value: reference,
                info: 0,
            },
            GpuEvent::Error { code, info, .. } => Event {
                kind: event::CHANNEL_ERROR,
                channel: self.channel,
                value: code.as_u32(),
                info,
            },
        };
        self.queue.push(self.epoch, ev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_host_shim::ChannelId;
    use vgpu_protocol::ErrorCode;

    #[test]
    fn only_the_first_pending_event_wakes_the_worker() {
        let q = Arc::new(EventQueue::new(4).unwrap());
        let sink = ChannelSink::new(q.clone(), 1);
        let notify = |token| {
            sink.event(GpuEvent::Notify {
                channel: ChannelId(1),
                token,
            })
        };
        for token in 0..10 {
            notify(token);
        }
        let fd = q.notifier().unwrap();
        assert_eq!(fd.read().unwrap(), 1, "one wake-up for a burst");
        assert_eq!((q.pending(), q.dropped()), (4, 6));
        while q.pop().is_some() {}
        notify(10);
        assert_eq!(fd.read().unwrap(), 1, "an empty FIFO wakes again");
    }

    #[test]
    fn bounded_drop_oldest_and_epochs() {
        let q = Arc::new(EventQueue::new(2).unwrap());
        let sink = ChannelSink::new(q.clone(), 7);
        for token in 0..3 {
            sink.event(GpuEvent::Notify {
                channel: ChannelId(99),
                token,
            });
        }
        assert_eq!(q.pending(), 2);
        assert_eq!(q.dropped(), 1);
        let e = q.peek().unwrap();
        assert_eq!((e.kind, e.channel, e.value), (event::NOTIFY, 7, 1));
        assert_eq!(q.snapshot(), vec![e, q.snapshot()[1]]);
        assert_eq!(q.pending(), 2, "peek and snapshot leave the events queued");
        q.commit_head(&e);
        assert_eq!(q.peek().unwrap().value, 2);
        // The head moved on (dropped by a full FIFO): the commit takes nothing.
        q.commit_head(&e);
        assert_eq!(q.pending(), 1);
        assert_eq!(q.pop().unwrap().value, 2);
        q.reset();
        assert!(q.is_empty());
        sink.event(GpuEvent::Error {
            channel: ChannelId(99),
            code: ErrorCode::MmuFault,
            info: 5,
        });
        assert!(q.is_empty(), "old epoch is discarded");
        let sink2 = ChannelSink::new(q.clone(), 8);
        sink2.event(GpuEvent::Error {
            channel: ChannelId(99),
            code: ErrorCode::MmuFault,
            info: 5,
        });
        let e = q.pop().unwrap();
        assert_eq!(
            (e.kind, e.channel, e.value, e.info),
            (event::CHANNEL_ERROR, 8, ErrorCode::MmuFault.as_u32(), 5)
        );
    }
}
