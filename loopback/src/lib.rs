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

mod config;
mod ctrl;
mod events;
mod irq;
mod link;
mod migrate;
mod setup;

pub use config::*;
use ctrl::*;
use events::*;
use irq::*;
use link::Link;
pub use migrate::{MigrationReport, StateOrder, StreamFilter};
use setup::*;
use vgpu_vmm::vgpu_device::vgpu_requirements;
use vgpu_vmm::virtq::{Buffer, SplitQueue, VirtqError};

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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding one of these locks leaves plain data behind that is
    // still consistent enough to shut down; do not propagate the poison.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn new_eventfd() -> Result<EventFd, LoopbackError> {
    EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).map_err(LoopbackError::EventFd)
}

/// Drains an eventfd: the counter it held (0 for "nothing to read").
pub(crate) fn drain(fd: &EventFd) -> u64 {
    match fd.read() {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => {
            warn!("eventfd read: {e}");
            0
        }
    }
}

pub(crate) fn kick(fd: &EventFd) {
    if let Err(e) = fd.write(1) {
        error!("kick failed: {e}");
    }
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
            doorbells: AtomicU64::new(0),
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
                count: 0,
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

    /// Rings the doorbell: a control-queue kick with no request on it, which the device
    /// takes as "look at the channels now" (protocol.md, "Doorbell"), as the guest
    /// driver's `VGPU_IOC_DOORBELL` does. Not while the rings are frozen for a migration.
    pub fn ring_doorbell(&self) {
        if lock(&self.ctrl.st).frozen {
            return;
        }
        self.ctrl.doorbells.fetch_add(1, Ordering::Relaxed);
        kick(&self.ctrl.kick);
    }

    /// Doorbells rung so far (not counted among the control queue's kicks).
    pub fn doorbells(&self) -> u64 {
        self.ctrl.doorbells.load(Ordering::Relaxed)
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
    /// live there; the rest is PROT_NONE, or scratch zeros with reconnect and after the
    /// connection ends (a guest thread of the old connection may still read its channel
    /// page once). The address range stays reserved while this LoopbackVm lives.
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

    /// Next event from the event queue, waiting up to `timeout`. Fence wake-ups
    /// (`event::FENCE`) are not among them: they only count ([`Self::event_count`]).
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        self.events.next(timeout)
    }

    /// How many events the event queue delivered so far (fence wake-ups included).
    pub fn event_count(&self) -> u64 {
        self.events.count()
    }

    /// Sleeps until [`Self::event_count`] differs from `seen` (an "interrupt"), the
    /// device is gone, or `timeout` passes; the count then.
    pub fn wait_event_count(&self, seen: u64, timeout: Duration) -> u64 {
        self.events.wait_count(seen, timeout)
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
        // The backend frees the VM's objects; drop our view of them (scratch: a guest
        // thread may still read its channel page once, see `ShmWindow::clear_to`).
        self.shm.clear_to(HoleFill::Scratch);
        debug!("loopback VM disconnected");
    }
}

impl Drop for LoopbackVm {
    fn drop(&mut self) {
        self.disconnect();
    }
}
