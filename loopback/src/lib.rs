//! The loopback frontend: a "VM" without KVM. Guest RAM, the device's BAR window and the
//! two virtqueues live in this process; threads of the test or benchmark act as guest
//! processes. Everything the backend sees is exactly what a real VM would show it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use thiserror::Error;
use vgpu_protocol::device::{
    DeviceConfig, CONTROL_QUEUE, EVENT_QUEUE, QUEUE_SIZE, SHM_REGION_ID, SHM_SIZE,
};
use vgpu_protocol::request::{Event, EVENT_SIZE, MAX_REPLY_SIZE, MAX_REQUEST_SIZE};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vmm_sys_util::eventfd::EventFd;

use vgpu_vmm::frontend::{FrontendError, QueueSetup, VhostUserDevice};
use vgpu_vmm::guest_memory::{GuestMemoryError, GuestRam, PageAllocator, PAGE_SIZE};
use vgpu_vmm::reconnect::FaultPolicy;
use vgpu_vmm::shm_window::{HoleFill, ShmHandler, ShmWindow, ShmWindowError};

mod link;
mod migrate;
use link::Link;
pub use migrate::{MigrationReport, StreamFilter};
use vgpu_vmm::vgpu_device::vgpu_requirements;
use vgpu_vmm::virtq::{Buffer, SplitQueue, VirtqError};

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
struct Counters {
    kicks: AtomicU64,
    interrupts: AtomicU64,
    signals: AtomicU64,
}

impl Counters {
    /// Kicks the device through `fd`, counted.
    fn kick(&self, fd: &EventFd) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
        kick(fd);
    }

    /// Consumes a signalled call eventfd, counted.
    fn interrupt(&self, fd: &EventFd) {
        let n = drain(fd);
        if n > 0 {
            self.interrupts.fetch_add(1, Ordering::Relaxed);
            self.signals.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn get(&self) -> (u64, u64, u64) {
        (
            self.kicks.load(Ordering::Relaxed),
            self.interrupts.load(Ordering::Relaxed),
            self.signals.load(Ordering::Relaxed),
        )
    }
}

/// A guest RAM allocation: guest-physical address and this process's view of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestAlloc {
    pub gpa: u64,
    pub ptr: *mut u8,
    pub len: u64,
}

// SAFETY: a GuestAlloc is only an address pair; dereferencing `ptr` is the holder's
// (unsafe) business and is valid for any thread while the LoopbackVm lives.
unsafe impl Send for GuestAlloc {}
// SAFETY: see `Send`.
unsafe impl Sync for GuestAlloc {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding one of these locks leaves plain data behind that is
    // still consistent enough to shut down; do not propagate the poison.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn new_eventfd() -> Result<EventFd, LoopbackError> {
    EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).map_err(LoopbackError::EventFd)
}

/// Drains an eventfd: the counter it held (0 for "nothing to read").
fn drain(fd: &EventFd) -> u64 {
    match fd.read() {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => {
            warn!("eventfd read: {e}");
            0
        }
    }
}

fn kick(fd: &EventFd) {
    if let Err(e) = fd.write(1) {
        error!("kick failed: {e}");
    }
}

/// Guest buffers of one control-request slot (host addresses kept as integers).
#[derive(Debug, Clone, Copy)]
struct Slot {
    req_gpa: u64,
    req_host: usize,
    reply_gpa: u64,
    reply_host: usize,
}

struct CtrlState {
    q: SplitQueue,
    free_slots: Vec<usize>,
    head_slot: Vec<Option<usize>>,
    done: Vec<Option<u32>>,
    dead: bool,
    /// The device is being moved to another backend: new requests wait.
    frozen: bool,
    /// Device generation: bumped when the rings start over on a reconnected backend, so
    /// a request of an older generation never takes a newer one's reply.
    epoch: u64,
}

/// The control queue: requests from many threads, at most one per slot in flight.
struct Ctrl {
    st: Mutex<CtrlState>,
    cv: Condvar,
    slots: Vec<Slot>,
    kick: EventFd,
    call: EventFd,
    counters: Counters,
    /// How long a request may wait for its reply before the backend counts as hung.
    timeout: Option<Duration>,
    link: Arc<Link>,
    /// The generation while the device works, `DOWN` while it does not: read without the
    /// lock by guest threads polling their channels.
    live_epoch: AtomicU64,
}

/// `Ctrl::live_epoch` of a device that does not work.
const DOWN: u64 = u64::MAX;

impl Ctrl {
    /// Sends `req` and waits for the reply. With `epoch`, fails with `DeviceReset` if the
    /// device has started over since that generation.
    fn request(&self, epoch: Option<u64>, req: &[u8]) -> Result<Vec<u8>, LoopbackError> {
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

    fn kick(&self) {
        self.counters.kick(&self.kick);
    }

    fn harvest(&self) {
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

    fn kill(&self) {
        lock(&self.st).dead = true;
        self.live_epoch.store(DOWN, Ordering::Release);
        self.cv.notify_all();
    }

    /// Fresh rings for the device's next backend (it begins at index 0); the queue stays
    /// dead until [`Self::revive`].
    fn reset_rings(&self) {
        let mut st = lock(&self.st);
        st.q.reset();
        st.free_slots = (0..self.slots.len()).rev().collect();
        st.head_slot.fill(None);
        st.done.fill(None);
    }

    /// Starts a new generation: requests of the old one fail with `DeviceReset`.
    fn revive(&self) {
        let mut st = lock(&self.st);
        st.epoch += 1;
        st.dead = false;
        self.live_epoch.store(st.epoch, Ordering::Release);
        drop(st);
        self.cv.notify_all();
    }

    fn epoch(&self) -> u64 {
        lock(&self.st).epoch
    }

    /// Stops new requests and waits until none is in flight (the harvest runs on the
    /// irq thread, which must still be running).
    fn freeze(&self) -> Result<(), LoopbackError> {
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

    fn thaw(&self) {
        lock(&self.st).frozen = false;
        self.cv.notify_all();
    }
}

struct EvState {
    q: SplitQueue,
    head_buf: Vec<Option<usize>>,
    pending: VecDeque<(Event, usize)>,
    dead: bool,
}

/// The event queue: pre-filled with writable EVENT_SIZE buffers, refilled as events are
/// consumed.
struct Events {
    st: Mutex<EvState>,
    cv: Condvar,
    /// Per buffer: (gpa, host address).
    bufs: Vec<(u64, usize)>,
    kick: EventFd,
    call: EventFd,
    counters: Counters,
}

impl Events {
    fn post(&self, st: &mut EvState, buf: usize) -> Result<(), VirtqError> {
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

    fn kick(&self) {
        self.counters.kick(&self.kick);
    }

    fn harvest(&self) {
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
                        Some(ev) => {
                            st.pending.push_back((ev, buf));
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

    fn next(&self, timeout: Duration) -> Option<Event> {
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

    fn kill(&self) {
        lock(&self.st).dead = true;
        self.cv.notify_all();
    }

    /// Fresh ring with every buffer posted again, for a reconnected backend.
    fn revive(&self) -> Result<(), VirtqError> {
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

/// The "interrupt" thread: waits on the call eventfds and harvests used rings; also
/// notices the backend hanging up.
struct IrqThread {
    exit: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl IrqThread {
    /// With `interrupts_only`, a ring is harvested only after its call eventfd fired.
    fn start(
        ctrl: Arc<Ctrl>,
        events: Arc<Events>,
        shm: Arc<ShmWindow>,
        sock: RawFd,
        interrupts_only: bool,
    ) -> Result<Self, LoopbackError> {
        let exit = new_eventfd()?;
        let exit_fd = exit.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("vgpu-loopback-irq".into())
            .spawn(move || irq_loop(&ctrl, &events, &shm, exit_fd, sock, interrupts_only))
            .map_err(LoopbackError::Spawn)?;
        Ok(IrqThread {
            exit,
            thread: Some(thread),
        })
    }

    fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            kick(&self.exit);
            if t.join().is_err() {
                error!("irq thread panicked");
            }
        }
    }
}

fn irq_loop(
    ctrl: &Ctrl,
    events: &Events,
    shm: &ShmWindow,
    exit_fd: RawFd,
    mut sock: RawFd,
    interrupts_only: bool,
) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: exit_fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: ctrl.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: events.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                // Negative fds are ignored by poll.
                fd: sock,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of 4 pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                error!("irq thread: poll: {e}");
                return;
            }
            continue;
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds[3].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            warn!("backend hung up");
            sock = -1;
            ctrl.kill();
            events.kill();
            // The backend has freed what it mapped into the BAR.
            shm.clear();
            ctrl.link.report_lost("the backend hung up");
        }
        let ctrl_irq = fds[1].revents != 0;
        if ctrl_irq {
            ctrl.counters.interrupt(&ctrl.call);
        }
        let events_irq = fds[2].revents != 0;
        if events_irq {
            events.counters.interrupt(&events.call);
        }
        // Unless told to behave as an interrupt handler, harvest unconditionally: cheap,
        // and robust against a lost notification.
        if ctrl_irq || !interrupts_only {
            ctrl.harvest();
        }
        if events_irq || !interrupts_only {
            events.harvest();
        }
    }
}

/// Virtio features the loopback driver acks (of those the backend offers): forwarded
/// submission when it has no shared-memory region, EVENT_IDX when asked for.
fn driver_features(forwarded: bool, event_idx: bool) -> u64 {
    let fwd = if forwarded {
        1 << vgpu_protocol::device::VIRTIO_VGPU_F_FORWARDED
    } else {
        0
    };
    let eidx = if event_idx {
        1 << VIRTIO_RING_F_EVENT_IDX
    } else {
        0
    };
    1 << VIRTIO_F_VERSION_1 | fwd | eidx
}

/// Whether the driver runs its rings with EVENT_IDX on `dev`: asked for and offered.
fn uses_event_idx(dev: &VhostUserDevice, want: bool) -> bool {
    want && dev.offered_features() & (1 << VIRTIO_RING_F_EVENT_IDX) != 0
}

/// Sets both queues' EVENT_IDX mode (before the device uses the rings).
fn set_event_idx(ctrl: &Ctrl, events: &Events, on: bool) {
    lock(&ctrl.st).q.set_event_idx(on);
    lock(&events.st).q.set_event_idx(on);
}

/// What the loopback VM needs of the backend: the vgpu requirements, plus device-state
/// transfer where offered (for [`LoopbackVm::migrate_to`]).
fn loopback_requirements(
    request_timeout: Option<Duration>,
    forwarded: bool,
) -> vgpu_vmm::frontend::DeviceRequirements {
    let mut r = vgpu_requirements();
    r.request_timeout = request_timeout;
    r.optional_protocol_features |= vhost::vhost_user::VhostUserProtocolFeatures::DEVICE_STATE;
    if forwarded {
        // As QEMU 10 does: a backend-request channel, but no SHMEM and no region; the
        // driver then acks the forwarded-submission feature.
        r.protocol_features -= vhost::vhost_user::VhostUserProtocolFeatures::SHMEM;
        r.shm_regions.clear();
        r.virtio_features |= 1 << vgpu_protocol::device::VIRTIO_VGPU_F_FORWARDED;
    }
    r
}

/// Runs `f` with the setup of both queues (control, event).
fn with_queues<T>(ctrl: &Ctrl, events: &Events, f: impl FnOnce(&[QueueSetup<'_>]) -> T) -> T {
    let (cd, ca, cu) = lock(&ctrl.st).q.host_addrs();
    let (ed, ea, eu) = lock(&events.st).q.host_addrs();
    let queues = [
        QueueSetup {
            index: CONTROL_QUEUE as usize,
            size: QUEUE_SIZE,
            desc_addr: cd,
            avail_addr: ca,
            used_addr: cu,
            call: &ctrl.call,
            kick: &ctrl.kick,
        },
        QueueSetup {
            index: EVENT_QUEUE as usize,
            size: QUEUE_SIZE,
            desc_addr: ed,
            avail_addr: ea,
            used_addr: eu,
            call: &events.call,
            kick: &events.kick,
        },
    ];
    f(&queues)
}

/// A loopback VM connected to a vgpu backend.
pub struct LoopbackVm {
    dev: Mutex<VhostUserDevice>,
    /// Where the backend listens (reconnects go there; a migration moves it).
    socket: Mutex<PathBuf>,
    faults: FaultPolicy,
    /// No shared-memory region: channels are forwarded ([`LoopbackConfig::forwarded`]).
    forwarded: bool,
    /// [`LoopbackConfig::event_idx`]: asked for (used where the backend offers it).
    want_event_idx: bool,
    /// [`LoopbackConfig::interrupts_only`].
    interrupts_only: bool,
    /// Loss reports and the thread that reacts to them (`link.rs`).
    link: Arc<Link>,
    supervisor: Mutex<Option<JoinHandle<()>>>,
    /// Serves the backend's SHMEM requests into `shm` (kept for a migration's next
    /// backend).
    handler: Arc<ShmHandler>,
    ctrl: Arc<Ctrl>,
    events: Arc<Events>,
    irq: Mutex<IrqThread>,
    shm: Arc<ShmWindow>,
    alloc: Mutex<PageAllocator>,
    connected: AtomicBool,
    // Last: dropped after everything that points into it.
    ram: GuestRam,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<LoopbackVm>();
};

impl LoopbackVm {
    /// Connects to the backend socket, negotiates, shares guest RAM and starts the queues.
    /// A lost backend leaves the device dead (see [`Self::connect_with`]).
    pub fn connect(socket: &Path, cfg: LoopbackConfig) -> Result<Arc<LoopbackVm>, LoopbackError> {
        Self::connect_with(socket, cfg, FaultPolicy::default())
    }

    /// [`Self::connect`] with a policy for a backend that dies or hangs: requests time
    /// out, and the VM reconnects and starts the device over, as a guest driver does on
    /// `DEVICE_NEEDS_RESET` (requests of the old generation fail with `DeviceReset`).
    pub fn connect_with(
        socket: &Path,
        cfg: LoopbackConfig,
        faults: FaultPolicy,
    ) -> Result<Arc<LoopbackVm>, LoopbackError> {
        if cfg.mem_bytes < 4 << 20 || !cfg.mem_bytes.is_multiple_of(PAGE_SIZE) {
            return Err(LoopbackError::Config(
                "mem_bytes must be a page multiple of at least 4 MiB",
            ));
        }
        let ram = GuestRam::new(&[(0, cfg.mem_bytes)])?;
        // Keep GPA page 0 out of circulation so that 0 never is a valid buffer address.
        let mut alloc = PageAllocator::new(PAGE_SIZE, cfg.mem_bytes - PAGE_SIZE);

        // A guest thread of the old generation may still read its channel page after the
        // backend is gone: with reconnect it reads scratch zeros rather than faulting.
        let fill = if faults.reconnect.is_some() {
            HoleFill::Scratch
        } else {
            HoleFill::NoAccess
        };
        let shm = Arc::new(ShmWindow::with_fill(SHM_REGION_ID, SHM_SIZE, fill)?);
        let handler = Arc::new(ShmHandler::new(vec![shm.clone()]));
        let mut dev = VhostUserDevice::connect(
            socket,
            &loopback_requirements(faults.request_timeout, cfg.forwarded),
            handler.clone(),
        )?;
        let link = Arc::new(Link::default());
        if DeviceConfig::decode(dev.config()).is_none() {
            return Err(LoopbackError::BadDeviceConfig);
        }

        // Control queue: two descriptors per request.
        let ctrl_q = SplitQueue::new(QUEUE_SIZE, &ram, &mut alloc)?;
        let nslots = QUEUE_SIZE as usize / 2;
        let slot_bytes = (MAX_REQUEST_SIZE + MAX_REPLY_SIZE).next_multiple_of(64) as u64;
        let (sgpa, slen) = alloc.alloc(slot_bytes * nslots as u64, PAGE_SIZE)?;
        let shost = ram
            .host_ptr(sgpa, slen)
            .ok_or(LoopbackError::Config("slot buffers outside RAM"))? as usize;
        let slots = (0..nslots as u64)
            .map(|i| Slot {
                req_gpa: sgpa + i * slot_bytes,
                req_host: shost + (i * slot_bytes) as usize,
                reply_gpa: sgpa + i * slot_bytes + MAX_REQUEST_SIZE as u64,
                reply_host: shost + (i * slot_bytes) as usize + MAX_REQUEST_SIZE,
            })
            .collect();
        let ctrl = Arc::new(Ctrl {
            st: Mutex::new(CtrlState {
                q: ctrl_q,
                free_slots: (0..nslots).rev().collect(),
                head_slot: vec![None; QUEUE_SIZE as usize],
                done: vec![None; nslots],
                dead: false,
                frozen: false,
                epoch: 0,
            }),
            cv: Condvar::new(),
            slots,
            kick: new_eventfd()?,
            call: new_eventfd()?,
            counters: Counters::default(),
            timeout: faults.request_timeout,
            link: link.clone(),
            live_epoch: AtomicU64::new(0),
        });

        // Event queue: one writable buffer per descriptor, all posted up front.
        let ev_q = SplitQueue::new(QUEUE_SIZE, &ram, &mut alloc)?;
        let (egpa, elen) = alloc.alloc(EVENT_SIZE as u64 * QUEUE_SIZE as u64, PAGE_SIZE)?;
        let ehost =
            ram.host_ptr(egpa, elen)
                .ok_or(LoopbackError::Config("event buffers outside RAM"))? as usize;
        let bufs = (0..QUEUE_SIZE as usize)
            .map(|i| (egpa + (i * EVENT_SIZE) as u64, ehost + i * EVENT_SIZE))
            .collect();
        let events = Arc::new(Events {
            st: Mutex::new(EvState {
                q: ev_q,
                head_buf: vec![None; QUEUE_SIZE as usize],
                pending: VecDeque::new(),
                dead: false,
            }),
            cv: Condvar::new(),
            bufs,
            kick: new_eventfd()?,
            call: new_eventfd()?,
            counters: Counters::default(),
        });
        {
            let mut st = lock(&events.st);
            for i in 0..QUEUE_SIZE as usize {
                events.post(&mut st, i)?;
            }
        }

        let event_idx = uses_event_idx(&dev, cfg.event_idx);
        set_event_idx(&ctrl, &events, event_idx);
        with_queues(&ctrl, &events, |queues| {
            dev.activate(
                driver_features(cfg.forwarded, event_idx),
                &ram.vhost_regions(),
                queues,
            )
        })?;
        events.kick();

        let irq = IrqThread::start(
            ctrl.clone(),
            events.clone(),
            shm.clone(),
            dev.socket_fd(),
            cfg.interrupts_only,
        )?;
        info!(
            "loopback VM up: {} MiB RAM, features {:#x}",
            cfg.mem_bytes >> 20,
            dev.acked_features()
        );
        let vm = Arc::new(LoopbackVm {
            dev: Mutex::new(dev),
            socket: Mutex::new(socket.to_path_buf()),
            faults,
            forwarded: cfg.forwarded,
            want_event_idx: cfg.event_idx,
            interrupts_only: cfg.interrupts_only,
            link,
            supervisor: Mutex::new(None),
            handler,
            ctrl,
            events,
            irq: Mutex::new(irq),
            shm,
            alloc: Mutex::new(alloc),
            connected: AtomicBool::new(true),
            ram,
        });
        link::start_supervisor(&vm)?;
        Ok(vm)
    }

    /// Sends one control request (bytes from `vgpu_protocol::request::Request::encode`)
    /// and returns the reply bytes. Thread-safe; up to QUEUE_SIZE/2 requests are in flight
    /// at once, further callers wait for a free slot.
    pub fn request(&self, req: &[u8]) -> Result<Vec<u8>, LoopbackError> {
        self.ctrl.request(None, req)
    }

    /// [`Self::request`] on behalf of a guest process that started in device generation
    /// `epoch` ([`Self::epoch`]): fails with `DeviceReset` once the device started over,
    /// as `/dev/vgpu` fails the files opened before a reset.
    pub fn request_in(&self, epoch: u64, req: &[u8]) -> Result<Vec<u8>, LoopbackError> {
        self.ctrl.request(Some(epoch), req)
    }

    /// The device's generation: 0 at connect, one more after each reconnect.
    /// Whether the VM has no shared-memory region and submits forwarded.
    pub fn forwarded(&self) -> bool {
        self.forwarded
    }

    pub fn epoch(&self) -> u64 {
        self.ctrl.epoch()
    }

    /// Whether the device works in generation `epoch` (false while the backend is lost
    /// and after the device started over): cheap enough to poll.
    pub fn live_in(&self, epoch: u64) -> bool {
        self.ctrl.live_epoch.load(Ordering::Acquire) == epoch
    }

    /// Whether the rings run with `VIRTIO_RING_F_EVENT_IDX` (asked for and offered).
    pub fn event_idx(&self) -> bool {
        lock(&self.ctrl.st).q.event_idx()
    }

    /// Kicks sent and interrupts seen so far, per queue.
    pub fn notify_counts(&self) -> NotifyCounts {
        let (ctrl_kicks, ctrl_interrupts, ctrl_signals) = self.ctrl.counters.get();
        let (event_kicks, event_interrupts, event_signals) = self.events.counters.get();
        NotifyCounts {
            ctrl_kicks,
            ctrl_interrupts,
            ctrl_signals,
            event_kicks,
            event_interrupts,
            event_signals,
        }
    }

    /// The driver's avail indices of the control and event queues (they go on across
    /// a migration and wrap at 2^16).
    pub fn avail_indices(&self) -> [u16; 2] {
        [
            lock(&self.ctrl.st).q.avail_idx(),
            lock(&self.events.st).q.avail_idx(),
        ]
    }

    /// Reads the device config space (GET_CONFIG).
    pub fn config(&self) -> Result<DeviceConfig, LoopbackError> {
        let bytes = lock(&self.dev).read_config(0, DeviceConfig::SIZE as u32)?;
        DeviceConfig::decode(&bytes).ok_or(LoopbackError::BadDeviceConfig)
    }

    /// Host view of the shared-memory region (the BAR). Pages the backend SHMEM_MAPped are
    /// live there; the rest is PROT_NONE (all of it again after a disconnect). The
    /// address range stays reserved while this LoopbackVm lives.
    pub fn shm_base(&self) -> *mut u8 {
        self.shm.base()
    }

    pub fn shm_len(&self) -> u64 {
        self.shm.len()
    }

    /// Allocates zeroed guest RAM: page-aligned (at least), contiguous in GPA space.
    pub fn alloc_guest(&self, size: u64, align: u64) -> Result<GuestAlloc, LoopbackError> {
        let (gpa, len) = lock(&self.alloc).alloc(size, align)?;
        let Some(ptr) = self.ram.host_ptr(gpa, len) else {
            // Cannot happen: the allocator only hands out RAM ranges.
            let _ = lock(&self.alloc).free(gpa);
            return Err(LoopbackError::Config("allocation outside RAM"));
        };
        // SAFETY: `ptr` addresses `len` bytes of guest RAM just allocated to the caller.
        unsafe { std::ptr::write_bytes(ptr, 0, len as usize) };
        Ok(GuestAlloc { gpa, ptr, len })
    }

    /// Guest RAM not allocated (to rings or to processes' buffers): back to where it was
    /// once every process that allocated is gone.
    pub fn guest_free_bytes(&self) -> u64 {
        lock(&self.alloc).free_bytes()
    }

    /// Frees an allocation made by `alloc_guest`.
    pub fn free_guest(&self, gpa: u64) -> Result<(), LoopbackError> {
        lock(&self.alloc).free(gpa)?;
        Ok(())
    }

    /// Host address of guest-physical `[gpa, gpa+len)` (if inside RAM).
    pub fn guest_ptr(&self, gpa: u64, len: u64) -> Option<*mut u8> {
        self.ram.host_ptr(gpa, len)
    }

    /// Next event from the event queue, waiting up to `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        self.events.next(timeout)
    }

    /// Number of SHMEM_MAP requests served.
    pub fn shmem_maps(&self) -> u64 {
        self.shm.maps()
    }

    /// Fault injection: while `on`, the frontend answers every SHMEM_MAP of the backend
    /// with an error and maps nothing (a VMM out of address space, say). The backend must
    /// turn that into a clean error for the guest request that needed the map.
    pub fn refuse_maps(&self, on: bool) {
        self.handler.set_refuse_maps(on);
    }

    /// Number of SHMEM_UNMAP requests served.
    pub fn shmem_unmaps(&self) -> u64 {
        self.shm.unmaps()
    }

    /// Whether the connection is up (neither side has closed it).
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire) && !lock(&self.ctrl.st).dead
    }

    /// Closes the vhost-user connection (the backend frees the VM's resources). Pending
    /// and later requests fail with `Disconnected`. Idempotent; also done on drop.
    pub fn disconnect(&self) {
        if !self.connected.swap(false, Ordering::AcqRel) {
            return;
        }
        self.link.stop();
        link::join_supervisor(self);
        self.ctrl.kill();
        self.events.kill();
        lock(&self.irq).stop();
        lock(&self.dev).disconnect();
        // The backend frees the VM's objects; drop our view of them.
        self.shm.clear();
        debug!("loopback VM disconnected");
    }
}

impl Drop for LoopbackVm {
    fn drop(&mut self) {
        self.disconnect();
    }
}
