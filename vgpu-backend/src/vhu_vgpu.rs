//! The vhost-user device: `VhostUserBackend` for one connection of one VM.
//!
//! Queues: 0 = control (driver → device requests, each chain = readable request then a
//! writable reply buffer), 1 = event (driver posts writable buffers, the device fills them
//! with 24-byte events). Both are served by the single vring worker thread that
//! vhost-user-backend runs per connection; GPU events reach it through an eventfd that is
//! registered as an extra listener of the worker's epoll set (see [`crate::events`]).
//!
//! Teardown happens on disconnect (see the crate docs) and on `VHOST_USER_RESET_DEVICE`.
//! Stopping a vring (`GET_VRING_BASE`) keeps the session: a stopped VM (or one being
//! migrated) keeps its GPU objects.
//!
//! vhost-user-backend registers the exit eventfd we return from `exit_event` with
//! `into_raw_fd` and never closes it. We hand it a duplicate, remember its number, and
//! close it when the device is dropped — after the daemon (whose vring worker polled it)
//! is gone, since the daemon holds the device — so no fd outlives the connection.
//!
//! Nothing here trusts the guest: malformed chains get an error reply (or a zero-length
//! used entry when there is nowhere to write one), never a panic; errors from
//! `handle_event` would stop the worker thread, so it only returns errors for failures of
//! the host side (eventfds). A ring the driver broke (an avail index more than the queue
//! size ahead, a ring outside guest memory) cannot be served at all: the device stops
//! serving it and ends the connection, which a frontend reports to its driver as
//! `DEVICE_NEEDS_RESET` (virtio 1.2 §2.1.2); the VM's GPU objects are freed as on every
//! disconnect and the socket listens again. The worker never loops on such a ring.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use log::{debug, error, warn};
use vgpu_protocol::device::{
    DeviceConfig, APERTURE_OFFSET, APERTURE_SIZE, CHANNEL_SLOTS, CONTROL_QUEUE, EVENT_QUEUE,
    MAX_QUEUE_SIZE, NUM_QUEUES, SHM_REGION_ID, SHM_SIZE, VIRTIO_VGPU_F_FORWARDED,
};
use vgpu_protocol::request::{EVENT_SIZE, MAX_REQUEST_SIZE};
use vgpu_protocol::{ErrorCode, PROTOCOL_VERSION};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
    VhostUserShMemConfig, VhostUserVirtioFeatures,
};
use vhost::vhost_user::Backend;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::bindings::virtio_config::{VIRTIO_F_NOTIFY_ON_EMPTY, VIRTIO_F_VERSION_1};
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::guest_mem::GuestMemory;
use crate::inflight::{InFlight, Ticket, STOP_TIMEOUT};
use crate::shmem::VhostShm;
use crate::vm::device_state::StateTransfer;
use crate::VmState;

/// Guest memory as vhost-user-backend hands it over.
pub type GuestMemoryAtomicMmap = GuestMemoryAtomic<GuestMemory>;
/// The vring type of this device.
pub type Vring = VringRwLock<GuestMemoryAtomicMmap>;

/// Epoll token of the per-VM event eventfd (tokens `0..=NUM_QUEUES` are the library's).
pub const EVENT_FD_TOKEN: u64 = NUM_QUEUES as u64 + 1;

/// Virtio feature bits the device offers.
pub fn device_features() -> u64 {
    (1 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_F_NOTIFY_ON_EMPTY)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_VGPU_F_FORWARDED)
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
}

/// vhost-user protocol features the device offers.
pub fn device_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::BACKEND_SEND_FD
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::RESET_DEVICE
        | VhostUserProtocolFeatures::SHMEM
        | VhostUserProtocolFeatures::DEVICE_STATE
}

/// The device's virtio config space.
pub fn device_config(vram_bytes: u64) -> DeviceConfig {
    DeviceConfig {
        version: PROTOCOL_VERSION,
        channel_slots: CHANNEL_SLOTS,
        aperture_offset: APERTURE_OFFSET,
        aperture_size: APERTURE_SIZE,
        vram_bytes,
    }
}

/// One connection's device.
pub struct VhuVgpu {
    vm: Arc<VmState>,
    mem: RwLock<GuestMemoryAtomicMmap>,
    shm: Arc<VhostShm>,
    event_idx: AtomicBool,
    /// The driver broke a ring: nothing more is served on this connection.
    ring_broken: AtomicBool,
    /// The connection is over: a request still reaching the worker is refused.
    retired: AtomicBool,
    /// Event buffers the driver posted too small (warned about at powers of two).
    bad_event_buffers: AtomicU64,
    exit: (EventConsumer, EventNotifier),
    /// Duplicates of `exit.0` the library took ownership of and never closes.
    given_exit_fds: std::sync::Mutex<Vec<std::os::fd::RawFd>>,
    config: [u8; DeviceConfig::SIZE],
    /// Device-state transfer (live migration).
    transfer: StateTransfer,
    /// Chains taken off a ring and not answered yet (a ring's stop waits for them).
    inflight: Arc<InFlight>,
}

impl Drop for VhuVgpu {
    fn drop(&mut self) {
        let fds = std::mem::take(
            &mut *self
                .given_exit_fds
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for fd in fds {
            // SAFETY: `fd` is a duplicate we created in `exit_event` and whose ownership the
            // library dropped (`into_raw_fd`, never closed). The device outlives the daemon
            // that polled it (the daemon holds an `Arc` of the device), so nothing uses the
            // number any more; it is closed exactly once (taken out of the list).
            unsafe { libc::close(fd) };
        }
    }
}

impl VhuVgpu {
    pub(crate) fn new(vm: Arc<VmState>, mem: GuestMemoryAtomicMmap) -> io::Result<Self> {
        let exit = new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC)?;
        let config = device_config(vm.config_vram_bytes()).encode();
        Ok(VhuVgpu {
            vm,
            mem: RwLock::new(mem),
            shm: Arc::new(VhostShm::new()),
            event_idx: AtomicBool::new(false),
            ring_broken: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            bad_event_buffers: AtomicU64::new(0),
            exit,
            given_exit_fds: std::sync::Mutex::new(Vec::new()),
            config,
            transfer: StateTransfer::default(),
            inflight: InFlight::new(NUM_QUEUES),
        })
    }

    /// A device for VM `name` that no socket serves: the queue handling and the session
    /// alone, for the virtqueue fuzz target and tests that drive `handle_event` directly.
    /// Its GPU events go to `events`; it has no frontend to map BAR pages with.
    pub fn detached(
        name: &str,
        gpu: Arc<dyn vgpu_host_shim::Gpu>,
        limits: crate::VmLimits,
        events: Arc<crate::EventQueue>,
        mem: GuestMemoryAtomicMmap,
    ) -> io::Result<Self> {
        let capacity =
            crate::capacity::VmCapacity::standalone(crate::capacity::gpu_totals(gpu.as_ref()));
        let vm = VmState::new(
            name,
            std::path::PathBuf::new(),
            limits,
            gpu,
            events,
            capacity,
        );
        Self::new(Arc::new(vm), mem)
    }

    /// This connection's way to the frontend's BAR (for the operator's shadow requests).
    pub(crate) fn shm(&self) -> Arc<VhostShm> {
        self.shm.clone()
    }

    /// Tells the vring worker to exit; requests it still reads are refused.
    pub(crate) fn stop_worker(&self) {
        self.retired.store(true, Ordering::Release);
        let _ = self.exit.1.notify();
    }

    fn serving(&self) -> bool {
        !self.ring_broken.load(Ordering::Acquire) && !self.retired.load(Ordering::Acquire)
    }

    /// The driver broke queue `queue`: stop serving, count it, end the connection.
    fn ring_broken(&self, queue: u16, e: &virtio_queue::Error) {
        if self.ring_broken.swap(true, Ordering::AcqRel) {
            return;
        }
        error!(
            "VM {}: queue {queue}: invalid ring ({e}); ending the connection (the driver must reset the device)",
            self.vm.name
        );
        self.vm.shared.count_ring_error();
        self.vm.end_connection();
    }

    /// The next available chain of queue `queue`, counted in flight until its ticket
    /// drops; or the ring's error (an invalid avail index, say), which
    /// `pop_descriptor_chain` would turn into "nothing there" while the avail index keeps
    /// saying there is.
    fn pop_chain<M>(
        &self,
        queue: u16,
        vring: &Vring,
        mem: M,
    ) -> Result<Option<(DescriptorChain<M>, Ticket)>, virtio_queue::Error>
    where
        M: Clone + std::ops::Deref<Target = GuestMemory>,
    {
        let mut state = vring.get_mut();
        let mut iter = state.get_queue_mut().iter(mem)?;
        // Counted under the ring's lock: see `inflight`.
        Ok(iter
            .next()
            .map(|chain| (chain, self.inflight.enter(usize::from(queue)))))
    }

    fn memory(&self) -> GuestMemoryAtomicMmap {
        self.mem.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Runs `drain` over the vring with the EVENT_IDX dance: with EVENT_IDX, notifications
    /// are off while draining and re-armed after; a buffer that arrived meanwhile triggers
    /// another round (while `more` says there is work for it). A ring stopped meanwhile
    /// is left alone (see [`Self::rearm`]).
    fn with_notifications(
        &self,
        vring: &Vring,
        mut drain: impl FnMut(&Vring),
        more: impl Fn() -> bool,
    ) {
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        loop {
            if event_idx {
                if let Err(e) = vring.disable_notification() {
                    warn!("disable notification: {e}");
                }
            }
            drain(vring);
            if !event_idx || !self.serving() {
                break;
            }
            match Self::rearm(vring) {
                Ok(true) if more() && self.serving() => continue,
                Ok(_) => break,
                Err(e) => {
                    warn!("enable notification: {e}");
                    break;
                }
            }
        }
    }

    /// Re-arms the ring's notifications (EVENT_IDX: `avail_event` = the next index to
    /// take) and says whether buffers arrived meanwhile; nothing and `false` on a ring the
    /// frontend stopped (GET_VRING_BASE marks it not ready under the same lock). A
    /// stopped ring is no longer this worker's: after a migration the destination serves
    /// it, in the same guest RAM, and a late `avail_event` from here would undo the
    /// destination's and suppress the driver's kicks; and buffers the driver adds there
    /// would keep this loop spinning, popping and putting back the head of the event
    /// FIFO while the migration saves it (issue 27).
    fn rearm(vring: &Vring) -> Result<bool, virtio_queue::Error> {
        let mut state = vring.get_mut();
        if !state.get_queue().ready() {
            return Ok(false);
        }
        state.enable_notification()
    }

    fn signal(vring: &Vring) {
        match vring.needs_notification() {
            Ok(true) => {
                if let Err(e) = vring.signal_used_queue() {
                    warn!("signal used queue: {e}");
                }
            }
            Ok(false) => {}
            Err(e) => warn!("needs notification: {e}"),
        }
    }

    fn process_control(&self, vring: &Vring) {
        if !self.serving() {
            return;
        }
        // The frontend started the rings again after a device-state transfer: the VM
        // runs here (a loaded VM on the destination, or the source after a failed
        // migration). Under a ticket taken while the ring is ready, as a pop's: a stop of
        // the ring (before the next transfer) waits for it, and a kick seen after the
        // stop resumes nothing. Without it, a resume that started just before a stop ran
        // on into the next save and unpaused it ("the VM is not paused for migration":
        // `migrate_rings`' ping-pong, once in CI on 2026-11-27).
        if let Some(_ticket) = self.ready_ticket(CONTROL_QUEUE, vring) {
            self.vm.migration_resume(self.shm.as_ref());
        }
        self.with_notifications(vring, |v| self.drain_control(v), || true);
    }

    /// A ticket of queue `queue` if its ring is ready (taken under the ring's lock, as
    /// [`Self::pop_chain`]'s: see `inflight`).
    fn ready_ticket(&self, queue: u16, vring: &Vring) -> Option<Ticket> {
        let state = vring.get_mut();
        state
            .get_queue()
            .ready()
            .then(|| self.inflight.enter(usize::from(queue)))
    }

    fn drain_control(&self, vring: &Vring) {
        let atomic = self.memory();
        let mem = atomic.memory();
        let mut used = false;
        // Held until the used entries are signalled: a ring's stop waits for them.
        let mut tickets = Vec::new();
        while self.serving() {
            let chain = match self.pop_chain(CONTROL_QUEUE, vring, mem.clone()) {
                Ok(Some((chain, ticket))) => {
                    tickets.push(ticket);
                    chain
                }
                Ok(None) => break,
                // The frontend stopped the ring (GET_VRING_BASE) while a kick was on its
                // way: nothing to serve, nothing broken.
                Err(virtio_queue::Error::QueueNotReady) => break,
                Err(e) => {
                    self.ring_broken(CONTROL_QUEUE, &e);
                    break;
                }
            };
            let head = chain.head_index();
            let len = self.serve_chain(chain, &mem);
            log::trace!(
                "VM {}: control chain {head} answered ({len} bytes)",
                self.vm.name
            );
            if let Err(e) = vring.add_used(head, len) {
                warn!("control queue: add_used: {e}");
                break;
            }
            used = true;
        }
        if used {
            Self::signal(vring);
        }
        drop(tickets);
    }

    /// Reads the request of one chain, handles it, writes the reply; returns the number of
    /// bytes written.
    fn serve_chain<M>(&self, chain: DescriptorChain<M>, mem: &GuestMemory) -> u32
    where
        M: std::ops::Deref<Target = GuestMemory>,
    {
        let mut req = Vec::new();
        let mut writable = Vec::new();
        let mut bad = None;
        for desc in chain {
            let len = desc.len() as usize;
            if desc.is_write_only() {
                writable.push((desc.addr(), len));
                continue;
            }
            if !writable.is_empty() || req.len() + len > MAX_REQUEST_SIZE {
                // Readable after writable, or longer than any request.
                bad = Some(ErrorCode::InvalidArgument);
                continue;
            }
            if bad.is_some() {
                continue;
            }
            let start = req.len();
            req.resize(start + len, 0);
            if mem.read_slice(&mut req[start..], desc.addr()).is_err() {
                bad = Some(ErrorCode::InvalidArgument);
            }
        }
        let reply = {
            let mut session = self.vm.lock_session();
            if self.retired.load(Ordering::Acquire) {
                // The connection ended (the session is torn down or about to be).
                session.reject(ErrorCode::Busy)
            } else {
                match bad {
                    Some(code) => session.reject(code),
                    None => session.handle(&req, mem, self.shm.as_ref()),
                }
            }
        };
        if writable.is_empty() {
            debug!("control chain without a reply buffer");
        }
        write_buffers(mem, &writable, &reply) as u32
    }

    fn process_events(&self, vring: &Vring) {
        if !self.serving() {
            return;
        }
        {
            let state = vring.get_ref();
            if !state.get_queue().ready() || !state.is_enabled() {
                return;
            }
        }
        let events = self.vm.shared.events.clone();
        self.with_notifications(vring, |v| self.drain_events(v), || !events.is_empty());
    }

    fn drain_events(&self, vring: &Vring) {
        let atomic = self.memory();
        let mem = atomic.memory();
        let events = &self.vm.shared.events;
        let mut used = false;
        let mut tickets = Vec::new();
        // An event leaves the FIFO only once it is in a used entry (see `commit_head`).
        while let Some(ev) = events.peek() {
            let chain = match self.pop_chain(EVENT_QUEUE, vring, mem.clone()) {
                Ok(Some((chain, ticket))) => {
                    tickets.push(ticket);
                    chain
                }
                Ok(None) | Err(virtio_queue::Error::QueueNotReady) => break,
                Err(e) => {
                    self.ring_broken(EVENT_QUEUE, &e);
                    break;
                }
            };
            let head = chain.head_index();
            let writable: Vec<(GuestAddress, usize)> = chain
                .filter(|d| d.is_write_only())
                .map(|d| (d.addr(), d.len() as usize))
                .collect();
            let n = write_buffers(&mem, &writable, &ev.encode());
            if n < EVENT_SIZE {
                // Guest-controlled: one warning per power of two, not one per buffer.
                let k = self.bad_event_buffers.fetch_add(1, Ordering::Relaxed) + 1;
                if k.is_power_of_two() {
                    warn!(
                        "VM {}: event queue: buffer too small or invalid ({n} bytes written; {k} so far)",
                        self.vm.name
                    );
                }
            }
            used = true;
            let len = if n < EVENT_SIZE { 0 } else { n as u32 };
            if let Err(e) = vring.add_used(head, len) {
                warn!("event queue: add_used: {e}");
                break;
            }
            if n >= EVENT_SIZE {
                events.commit_head(&ev);
                events.mark_delivered();
            }
            // Else the event stays at the head for the next buffer.
        }
        if used {
            Self::signal(vring);
        }
        drop(tickets);
    }
}

/// Writes `data` across the writable buffers in order; returns the bytes written.
fn write_buffers(mem: &GuestMemory, bufs: &[(GuestAddress, usize)], data: &[u8]) -> usize {
    let mut done = 0;
    for &(addr, len) in bufs {
        if done >= data.len() {
            break;
        }
        let n = len.min(data.len() - done);
        if mem.write_slice(&data[done..done + n], addr).is_err() {
            break;
        }
        done += n;
    }
    done
}

impl VhostUserBackend for VhuVgpu {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE as usize
    }

    fn features(&self) -> u64 {
        device_features()
    }

    fn acked_features(&self, features: u64) {
        let forwarded = features & (1 << VIRTIO_VGPU_F_FORWARDED) != 0;
        if forwarded != self.vm.shared.forwarded() {
            log::info!(
                "VM {}: {} submission",
                self.vm.name,
                if forwarded { "forwarded" } else { "direct" }
            );
        }
        self.vm.shared.set_forwarded(forwarded);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        device_protocol_features()
    }

    fn reset_device(&self) {
        // The driver starts over: nothing it created may outlive the reset. BAR views are
        // removed through the backend channel (the frontend must serve it on a thread of
        // its own, as for every SHMEM request).
        log::info!(
            "VM {}: device reset, freeing the guest's GPU objects",
            self.vm.name
        );
        self.transfer.forget_deferred();
        self.vm.lock_session().teardown(self.shm.as_ref());
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // The handler needs exactly `size` bytes; past the end the space reads as zero.
        let mut out = vec![0u8; size as usize];
        let start = offset as usize;
        if let Some(src) = self.config.get(start..) {
            let n = src.len().min(out.len());
            out[..n].copy_from_slice(&src[..n]);
        }
        out
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "vgpu config space is read-only",
        ))
    }

    fn update_memory(&self, mem: GuestMemoryAtomicMmap) -> io::Result<()> {
        *self.mem.write().unwrap_or_else(|e| e.into_inner()) = mem.clone();
        // A device state loaded before the table (Cloud Hypervisor's order) goes in now,
        // before any ring can start; if it does not fit, the table is refused.
        self.transfer
            .apply_deferred(&self.vm, &self.shm, &mem)
            .map_err(|e| {
                error!(
                    "VM {}: the device state loaded before the memory table does not fit it: {e} \
                     (nothing of it was kept)",
                    self.vm.name
                );
                io::Error::other(format!("device state does not fit the memory table: {e}"))
            })
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        debug!("VM {}: backend request channel set", self.vm.name);
        self.shm.set_backend(backend);
    }

    fn get_shmem_config(&self) -> io::Result<VhostUserShMemConfig> {
        let mut sizes = [0u64; SHM_REGION_ID as usize + 1];
        sizes[SHM_REGION_ID as usize] = SHM_SIZE;
        Ok(VhostUserShMemConfig::new(sizes.len() as u32, &sizes))
    }

    fn set_device_state_fd(
        &self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: File,
    ) -> io::Result<Option<File>> {
        if phase != VhostTransferStatePhase::STOPPED {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "device state is transferred only while the device is stopped",
            ));
        }
        self.transfer.start(
            self.vm.clone(),
            self.shm.clone(),
            self.memory(),
            direction,
            file,
        )?;
        Ok(None)
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // The ring is already marked not ready: wait for the answers to what was taken.
        let queue = usize::try_from(queue_index).unwrap_or(usize::MAX);
        debug!("VM {}: stopping queue {queue}", self.vm.name);
        self.inflight.wait_idle(queue, STOP_TIMEOUT).map_err(|e| {
            warn!("VM {}: stopping a ring: {e}", self.vm.name);
            io::Error::other(e)
        })
    }

    fn check_device_state(&self) -> io::Result<()> {
        self.transfer.check().map_err(io::Error::other)
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match (self.exit.0.try_clone(), self.exit.1.try_clone()) {
            (Ok(c), Ok(n)) => {
                self.given_exit_fds
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(c.as_raw_fd());
                Some((c, n))
            }
            (Err(e), _) | (_, Err(e)) => {
                warn!("cannot clone the exit event: {e}");
                None
            }
        }
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Self::Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        match u64::from(device_event) {
            t if t == u64::from(CONTROL_QUEUE) => {
                // A kick is a request or a doorbell (no request on the ring): either way
                // the front end looks now, before the requests are served.
                if self.serving() {
                    self.vm.ring_doorbell();
                }
                if let Some(v) = vrings.get(CONTROL_QUEUE as usize) {
                    self.process_control(v);
                }
            }
            t if t == u64::from(EVENT_QUEUE) => {
                if let Some(v) = vrings.get(EVENT_QUEUE as usize) {
                    self.process_events(v);
                }
            }
            EVENT_FD_TOKEN => {
                self.vm.shared.events.consume_wakeup();
                if let Some(v) = vrings.get(EVENT_QUEUE as usize) {
                    self.process_events(v);
                }
            }
            other => warn!("unexpected device event {other}"),
        }
        Ok(())
    }
}
