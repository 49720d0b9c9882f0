//! The loopback VM's configuration, errors and notification counters.

use crate::*;

#[derive(Debug, Error)]
pub enum LoopbackError {
    #[error(transparent)]
    Frontend(#[from] FrontendError),
    #[error(transparent)]
    Shm(#[from] ShmWindowError),
    #[error(transparent)]
    Memory(#[from] GuestMemoryError),
    #[error("virtqueue: {0}")]
    Virtq(#[from] VirtqError),
    #[error("eventfd: {0}")]
    EventFd(io::Error),
    #[error("spawning a thread: {0}")]
    Spawn(io::Error),
    #[error("bad configuration: {0}")]
    Config(&'static str),
    #[error("request of {0} bytes (must be 1..={max})", max = MAX_REQUEST_SIZE)]
    RequestSize(usize),
    #[error("device config space is malformed")]
    BadDeviceConfig,
    #[error("disconnected from the backend")]
    Disconnected,
    #[error("the backend did not answer a request within {0:?}")]
    Timeout(Duration),
    #[error("the device was reset (its backend restarted): this process's GPU resources are gone")]
    DeviceReset,
}

/// Loopback VM parameters.
#[derive(Debug, Clone)]
pub struct LoopbackConfig {
    /// Guest RAM size (page multiple, at least 4 MiB).
    pub mem_bytes: u64,
    /// Play a frontend without vhost-user SHMEM (QEMU 10, Cloud Hypervisor): no
    /// shared-memory region, and a driver that acks `VIRTIO_VGPU_F_FORWARDED` and submits
    /// with `SUBMIT` requests (protocol.md §9, "Forwarded submission").
    pub forwarded: bool,
    /// Ack `VIRTIO_RING_F_EVENT_IDX` if the backend offers it: the driver then publishes
    /// `used_event` and kicks only when `avail_event` asks, as Linux's `virtio_ring`
    /// does. Off by default.
    pub event_idx: bool,
    /// Harvest a used ring only when the backend signals its call eventfd, as a guest's
    /// interrupt handler does, so that a lost interrupt leaves its request to time out.
    /// Off by default: the interrupt thread also harvests every 100 ms, which hides one.
    pub interrupts_only: bool,
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        LoopbackConfig::with_mem(256 << 20)
    }
}

impl LoopbackConfig {
    /// A direct-mode VM with `mem_bytes` of guest RAM.
    pub fn with_mem(mem_bytes: u64) -> Self {
        LoopbackConfig {
            mem_bytes,
            forwarded: false,
            event_idx: false,
            interrupts_only: false,
        }
    }

    /// The same VM without a shared-memory region (forwarded submission).
    pub fn forwarded(self) -> Self {
        LoopbackConfig {
            forwarded: true,
            ..self
        }
    }

    /// The same VM with [`Self::event_idx`] set to `on`.
    pub fn event_idx(self, on: bool) -> Self {
        LoopbackConfig {
            event_idx: on,
            ..self
        }
    }

    /// The same VM with [`Self::interrupts_only`] set to `on`.
    pub fn interrupts_only(self, on: bool) -> Self {
        LoopbackConfig {
            interrupts_only: on,
            ..self
        }
    }
}

/// Notifications of both virtqueues since the VM connected: kicks the driver sent, and
/// interrupts it saw (wake-ups of the interrupt thread on a call eventfd, and the
/// backend's signals they carried: several signals may merge into one wake-up).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotifyCounts {
    pub ctrl_kicks: u64,
    pub ctrl_interrupts: u64,
    pub ctrl_signals: u64,
    pub event_kicks: u64,
    pub event_interrupts: u64,
    pub event_signals: u64,
}

/// One queue's share of [`NotifyCounts`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) kicks: AtomicU64,
    pub(crate) interrupts: AtomicU64,
    pub(crate) signals: AtomicU64,
}

impl Counters {
    /// Kicks the device through `fd`, counted.
    pub(crate) fn kick(&self, fd: &EventFd) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
        kick(fd);
    }

    /// Consumes a signalled call eventfd, counted.
    pub(crate) fn interrupt(&self, fd: &EventFd) {
        let n = drain(fd);
        if n > 0 {
            self.interrupts.fetch_add(1, Ordering::Relaxed);
            self.signals.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn get(&self) -> (u64, u64, u64) {
        (
            self.kicks.load(Ordering::Relaxed),
            self.interrupts.load(Ordering::Relaxed),
            self.signals.load(Ordering::Relaxed),
        )
    }
}
