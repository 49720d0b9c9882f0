//! `vgpu-backend`: the vhost-user backend of the vgpu paravirtual GPU. One process serves
//! many VMs (one unix socket each) and multiplexes one GPU (a [`Gpu`] HAL) among them.
//!
//! Layout, in the style of rust-vmm's vhost-device crates:
//! - [`vhu_vgpu`]: `VhostUserBackend` — features, config space, shared-memory region,
//!   control and event virtqueues; `inflight` makes a ring's stop wait for the requests
//!   the worker already took;
//! - [`vm`]: **the one owner of per-VM state** — `VmState` and its `Session` (what each
//!   guest process owns), control requests by subject, the session's channels through the
//!   shadow mechanism, its VRAM objects and moves, teardown; nothing else has an `impl`
//!   for them, and the managers below reach a VM only through narrow handles that `vm`
//!   implements ([`sched::handle::SchedVm`], [`vram::handle::VramVm`]);
//! - [`shadow`]: the shadow-channel mechanism (page switches, the holders of a channel,
//!   owner holds for channels at birth), knowing nothing of sessions;
//! - [`guest_mem`]: the GPU's view of a VM's guest memory ([`SysMemory`](vgpu_host_shim::SysMemory));
//! - [`shmem`]: the BAR window (control-page slots, VRAM aperture) and SHMEM_MAP/UNMAP;
//! - [`events`]: GPU events → per-VM FIFO → event virtqueue;
//! - [`sched`]: the GPU scheduler (VM weights, per-process shares, shadowing over-users,
//!   policies none/timeslice/fair/sampling, kernel watchdog, share accounting);
//! - [`vram`]: the VRAM manager (per-VM shares, transparent swapping to system memory);
//! - [`capacity`]: the GPU's contexts and channels shared by the VMs (a reserve per VM,
//!   borrowing above it);
//! - [`control`]: operator controls of a VM (pause, resume, drain, VRAM quota);
//! - [`api`]: the operator HTTP/JSON control API on a unix socket, its client, metrics;
//! - [`config`]: the daemon's TOML configuration.
//!
//! # What a frontend must do
//!
//! - Negotiate `VHOST_USER_F_PROTOCOL_FEATURES` and the protocol features `CONFIG`,
//!   `BACKEND_REQ` (+ `BACKEND_SEND_FD`), `REPLY_ACK` and `SHMEM` (offered besides:
//!   `MQ`, `CONFIGURE_MEM_SLOTS`, `RESET_DEVICE` — a frontend that acks the latter should
//!   send `RESET_DEVICE` when the driver resets the device, which frees the guest's GPU
//!   objects; without it they are freed only on disconnect). Virtio features offered: `VERSION_1`, `INDIRECT_DESC`,
//!   `EVENT_IDX`, `NOTIFY_ON_EMPTY`.
//! - Send `SET_BACKEND_REQ_FD` before the driver creates a channel or maps an aperture:
//!   without it those requests fail with `Unsupported` (everything else works). With
//!   `REPLY_ACK` acked, every SHMEM_MAP/UNMAP waits for the frontend's ack, so a request's
//!   reply is only sent once the BAR shows the mapping. Without `REPLY_ACK` the backend
//!   cannot know whether a mapping failed.
//! - Serve backend requests on a thread that is not blocked waiting for replies on the
//!   main socket: a control request may send SHMEM_MAP while the frontend talks to us.
//! - Expose the shared-memory region reported by `GET_SHMEM_CONFIG` (one region, id
//!   [`SHM_REGION_ID`](vgpu_protocol::device::SHM_REGION_ID), size
//!   [`SHM_SIZE`](vgpu_protocol::device::SHM_SIZE)) as the device's BAR window.
//! - On disconnect, drop every mapping it placed in that region: the backend frees the
//!   VM's GPU objects (VRAM and control pages may then go to another VM) without being
//!   able to send SHMEM_UNMAP over a dead connection.
//!
//! # Restart and reconnect
//!
//! Each VM socket serves one frontend connection at a time; when it closes, all of the
//! VM's contexts, channels and VRAM are destroyed in the HAL and the socket listens again
//! (the same happens on `RESET_DEVICE`, with SHMEM_UNMAPs since the frontend is still
//! there). Nothing of a guest's GPU state survives a disconnect or a backend restart: the
//! guest driver must re-create its contexts, buffers and channels. Per-PID busy-time books
//! and the request/error/disconnect counters of a VM do survive reconnects (not restarts).

pub mod api;
pub mod capacity;
pub mod config;
pub mod error;
pub mod events;
pub mod guest_mem;
mod inflight;
pub mod sandbox;
pub mod sched;
pub mod shadow;
pub mod shmem;
pub mod vhu_vgpu;
pub mod vm;
pub mod vram;

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use vhost::vhost_user::{Error as VhostUserError, Listener};
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;

pub use control::{ChannelInfo, ControlError, DrainOutcome, PauseOutcome};
pub use error::{BackendError, ShmError};
pub use events::{EventQueue, EVENT_FIFO_CAPACITY};
pub use guest_mem::{GuestMemory, GuestSysMemory};
pub use sched::cli::SchedArgs;
pub use sched::shares::{GpuShares, IntervalRecord, ProcShare, VmShare};
pub use sched::{Policy, SchedConfig, SchedError, SchedStats};
pub use shadow::{ChannelPeek, Holder, Holders, ShadowError, ShadowStats, ShadowSwitch};
pub use shmem::{NullShm, ShmMapper, VhostShm};
pub use vgpu_host_shim::Gpu;
/// The operator controls of a VM live with the VM ([`vm::control`]).
pub use vm::control;
pub use vm::migration::policy::StreamPolicy;
pub use vm::migration::progress::{MigrationPhase, MigrationProgress, PrecopyConfig, RoundStat};
pub use vm::session::{Session, SessionShared, SessionState, VmLimits, VmStats};
pub use vram::{
    MoveReport, ProcVramStats, VmVramStats, VramConfig, VramError, VramOverview, VramReport,
};

use crate::shmem::NullShm as Gone;
use crate::vhu_vgpu::{VhuVgpu, EVENT_FD_TOKEN};
pub(crate) use crate::vm::VmState;

/// Gives a VM its own GPU (a worker process of its own, `vgpu-gpu-worker`'s
/// `WorkerPool::vm_gpu`), from its name and limits.
pub type VmGpuSource = Arc<dyn Fn(&str, &VmLimits) -> Arc<dyn Gpu> + Send + Sync>;

/// The backend: a GPU shared by the VMs it serves.
pub struct VgpuBackend {
    /// The GPU as a whole: its totals, and channel calls by id (the scheduler's).
    gpu: Arc<dyn Gpu>,
    /// Each VM's own GPU, where VMs do not share `gpu`'s objects (a worker per VM), and
    /// the workers' pool.
    vm_gpus: Option<VmGpuSource>,
    workers: Option<Arc<vgpu_gpu_worker::WorkerPool>>,
    defaults: VmLimits,
    vms: Mutex<BTreeMap<String, Arc<VmState>>>,
    /// Moves whenever `vms` changes (the scheduler keeps its own list until it does).
    vms_gen: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    stop: Arc<AtomicBool>,
    sched: sched::SchedSlot,
    vram: vram::VramManager,
    /// The GPU's contexts and channels: each VM's reserve and what it borrows.
    capacity: Arc<capacity::Capacity>,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && !name.starts_with('.')
}

impl VgpuBackend {
    /// A backend for `gpu`; VMs get `defaults` as their limits unless told otherwise.
    pub fn new(gpu: Arc<dyn Gpu>, defaults: VmLimits) -> Arc<Self> {
        Self::build(gpu, None, defaults)
    }

    /// A backend whose VMs each get their own GPU from `vm_gpus` (a worker process of
    /// `pool` per VM); `pool` is the whole GPU's view: totals, and channel calls routed
    /// to their VM.
    pub fn with_vm_gpus(
        pool: Arc<vgpu_gpu_worker::WorkerPool>,
        vm_gpus: VmGpuSource,
        defaults: VmLimits,
    ) -> Arc<Self> {
        Self::build(pool.clone(), Some((vm_gpus, pool)), defaults)
    }

    /// A backend with a worker process of `pool` per VM, each with the VM's VRAM quota.
    pub fn with_workers(pool: Arc<vgpu_gpu_worker::WorkerPool>, defaults: VmLimits) -> Arc<Self> {
        let p = pool.clone();
        let vm_gpus: VmGpuSource = Arc::new(move |name: &str, limits: &VmLimits| -> Arc<dyn Gpu> {
            p.vm_gpu(name, limits.vram_bytes)
        });
        Self::with_vm_gpus(pool, vm_gpus, defaults)
    }

    fn build(
        gpu: Arc<dyn Gpu>,
        per_vm: Option<(VmGpuSource, Arc<vgpu_gpu_worker::WorkerPool>)>,
        defaults: VmLimits,
    ) -> Arc<Self> {
        let capacity = capacity::Capacity::new(capacity::gpu_totals(gpu.as_ref()));
        let (vm_gpus, workers) = per_vm.unzip();
        Arc::new(VgpuBackend {
            capacity,
            gpu,
            vm_gpus,
            workers,
            defaults,
            vms: Mutex::new(BTreeMap::new()),
            vms_gen: AtomicU64::new(0),
            threads: Mutex::new(Vec::new()),
            stop: Arc::new(AtomicBool::new(false)),
            sched: sched::SchedSlot::default(),
            vram: vram::VramManager::default(),
        })
    }

    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    /// The GPU workers' counts, when each VM has a worker process.
    pub fn worker_stats(&self) -> Option<vgpu_gpu_worker::PoolStats> {
        self.workers.as_ref().map(|p| p.stats())
    }

    fn lock_vms(&self) -> MutexGuard<'_, BTreeMap<String, Arc<VmState>>> {
        self.vms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The served VMs as the scheduler sees them.
    pub(crate) fn sched_vms(&self) -> Vec<Arc<dyn sched::handle::SchedVm>> {
        self.lock_vms()
            .values()
            .map(|vm| vm.clone() as Arc<dyn sched::handle::SchedVm>)
            .collect()
    }

    /// A number that moves whenever the set of served VMs changes.
    pub(crate) fn sched_vms_gen(&self) -> u64 {
        self.vms_gen.load(Ordering::Acquire)
    }

    /// The served VMs as the VRAM manager sees them.
    pub(crate) fn vram_vms(&self) -> Vec<Arc<dyn vram::handle::VramVm>> {
        self.lock_vms()
            .values()
            .map(|vm| vm.clone() as Arc<dyn vram::handle::VramVm>)
            .collect()
    }

    /// One served VM as the VRAM manager sees it.
    pub(crate) fn vram_vm(&self, name: &str) -> Option<Arc<dyn vram::handle::VramVm>> {
        self.vm(name).map(|vm| vm as Arc<dyn vram::handle::VramVm>)
    }

    fn vm(&self, name: &str) -> Option<Arc<VmState>> {
        self.lock_vms().get(name).cloned()
    }

    /// Serves VM `name` on the unix socket `socket` with the default limits.
    pub fn serve_vm(self: &Arc<Self>, name: &str, socket: &Path) -> Result<(), BackendError> {
        self.serve_vm_with_limits(name, socket, self.defaults)
    }

    /// Serves VM `name` on `socket`: a thread listens (a stale socket file is removed
    /// first), serves one frontend at a time, tears the VM's GPU state down when the
    /// frontend disconnects, and listens again.
    pub fn serve_vm_with_limits(
        self: &Arc<Self>,
        name: &str,
        socket: &Path,
        limits: VmLimits,
    ) -> Result<(), BackendError> {
        if self.stop.load(Ordering::Acquire) {
            return Err(BackendError::ShuttingDown);
        }
        if !valid_name(name) {
            return Err(BackendError::InvalidName(name.to_string()));
        }
        let mut vms = self.lock_vms();
        if vms.contains_key(name) {
            return Err(BackendError::DuplicateVm(name.to_string()));
        }
        // Admitted only if its reserve fits beside the others' (given back if a later
        // step fails).
        let share = self.capacity.admit(limits.reserve())?;
        match std::fs::symlink_metadata(socket) {
            Ok(md) if md.file_type().is_socket() => {
                std::fs::remove_file(socket).map_err(|source| BackendError::Socket {
                    path: socket.to_path_buf(),
                    source,
                })?;
            }
            Ok(_) => {
                return Err(BackendError::NotASocket {
                    path: socket.to_path_buf(),
                })
            }
            Err(_) => {}
        }
        let listener = Listener::new(socket, true).map_err(|e| BackendError::Socket {
            path: socket.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let events = Arc::new(EventQueue::new(EVENT_FIFO_CAPACITY).map_err(BackendError::EventFd)?);
        let vm_gpu = match &self.vm_gpus {
            Some(source) => source(name, &limits),
            None => self.gpu.clone(),
        };
        let vm = Arc::new(VmState::new(
            name,
            socket.to_path_buf(),
            limits,
            vm_gpu,
            events,
            share,
        ));
        vm.lock_session().set_vram_waker(self.vram.waker());
        let stop = self.stop.clone();
        let vm2 = vm.clone();
        let handle = std::thread::Builder::new()
            .name(format!("vgpu-vm-{name}"))
            .spawn(move || serve_loop(vm2, listener, stop))
            .map_err(BackendError::Thread)?;
        vms.insert(name.to_string(), vm);
        self.vms_gen.fetch_add(1, Ordering::Release);
        self.vram.start(self);
        self.threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
        info!("VM {name}: listening on {}", socket.display());
        Ok(())
    }

    /// Names of the served VMs.
    pub fn vm_names(&self) -> Vec<String> {
        self.lock_vms().keys().cloned().collect()
    }

    /// Usage and counters of a VM.
    pub fn vm_stats(&self, name: &str) -> Option<VmStats> {
        let vm = self.vm(name)?;
        let mut s = vm.shared.stats();
        s.connected = vm.connected.load(Ordering::Acquire);
        Some(s)
    }

    /// The VM's last migration as this backend saw it (source or destination).
    pub fn vm_migration(&self, name: &str) -> Option<MigrationProgress> {
        self.vm(name).map(|vm| vm.progress.get())
    }

    /// Sets the pre-copy tuning of a VM's next migration saves; false if no such VM.
    pub fn set_precopy(&self, name: &str, cfg: PrecopyConfig) -> bool {
        match self.vm(name) {
            Some(vm) => {
                *vm.precopy_cfg.lock().unwrap_or_else(|e| e.into_inner()) = cfg;
                true
            }
            None => false,
        }
    }

    /// The GPU's contexts and channels: total, used, reserved and free for borrowing.
    pub fn capacity(&self) -> capacity::CapacityStats {
        self.capacity.stats()
    }

    /// The limits a VM runs with.
    pub fn vm_limits(&self, name: &str) -> Option<VmLimits> {
        self.vm(name).map(|vm| VmLimits {
            vram_bytes: vm.shared.vram_quota(),
            ..vm.limits
        })
    }

    /// GPU busy time of a VM per guest PID (live and destroyed channels), sorted by PID.
    pub fn process_busy_ns(&self, name: &str) -> Vec<(u32, u64)> {
        match self.vm(name) {
            Some(vm) => vm.shared.process_busy_ns(self.gpu.as_ref()),
            None => Vec::new(),
        }
    }

    /// The VM's channels: (guest channel id, owning guest PID), by channel id.
    pub fn vm_channels(&self, name: &str) -> Vec<(u32, u32)> {
        match self.vm(name) {
            Some(vm) => vm.lock_session().channel_list(),
            None => Vec::new(),
        }
    }

    /// Takes (`on`) or drops the scheduler's hold of a channel of VM `name`: its BAR slot
    /// is remapped through the VM's vhost-user backend request channel (see [`shadow`]).
    /// While another holder (the operator's pause, a VRAM move) holds the channel, an
    /// unshadow only drops the scheduler's hold.
    pub fn shadow_channel(
        &self,
        name: &str,
        guest_channel: u32,
        on: bool,
    ) -> Result<ShadowSwitch, ShadowError> {
        let vm = self
            .vm(name)
            .ok_or_else(|| ShadowError::NoVm(name.to_string()))?;
        let shm = vm
            .shm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(ShadowError::NotConnected)?;
        let mut session = vm.lock_session();
        session.hold_channel(guest_channel, Holder::Scheduler, on, shm.as_ref())
    }

    /// Lets at most `n` more entries of a shadowed channel run; returns how many were
    /// newly released.
    pub fn release_capped(
        &self,
        name: &str,
        guest_channel: u32,
        n: u32,
    ) -> Result<u32, ShadowError> {
        let vm = self
            .vm(name)
            .ok_or_else(|| ShadowError::NoVm(name.to_string()))?;
        let mut session = vm.lock_session();
        session.release_capped(guest_channel, n)
    }

    /// Copies the GPU's progress into the shadow pages of the VM's shadowed channels;
    /// returns how many were refreshed.
    pub fn mirror_shadows(&self, name: &str) -> Result<usize, ShadowError> {
        let vm = self
            .vm(name)
            .ok_or_else(|| ShadowError::NoVm(name.to_string()))?;
        let mut session = vm.lock_session();
        Ok(session.mirror_shadows())
    }

    /// Shadow counters of a VM.
    pub fn shadow_stats(&self, name: &str) -> Option<ShadowStats> {
        self.vm(name).map(|vm| vm.lock_session().shadow_stats())
    }

    /// Starts the GPU scheduler with `cfg`, or reconfigures it (the running one stops first,
    /// unshadowing the channels it shadowed). Under [`Policy::None`] it only accounts
    /// (shares) and runs the watchdog. `fair` and the watchdog need busy counters.
    pub fn start_scheduler(self: &Arc<Self>, cfg: SchedConfig) -> Result<(), SchedError> {
        sched::start(self, cfg)
    }

    /// The scheduler's configuration (`None` if it was never started).
    pub fn scheduler_config(&self) -> Option<SchedConfig> {
        self.sched.config()
    }

    /// The scheduler's counters.
    pub fn sched_stats(&self) -> SchedStats {
        self.sched.stats()
    }

    /// Sets VM `name`'s share weight (1..=10000; VMs start at
    /// [`DEFAULT_WEIGHT`](sched::DEFAULT_WEIGHT)). Takes effect at the next interval.
    pub fn set_vm_weight(&self, name: &str, weight: u32) -> Result<(), SchedError> {
        if !(sched::MIN_WEIGHT..=sched::MAX_WEIGHT).contains(&weight) {
            return Err(SchedError::InvalidWeight(weight));
        }
        let vm = self
            .vm(name)
            .ok_or_else(|| SchedError::NoVm(name.to_string()))?;
        vm.weight.store(weight, Ordering::Relaxed);
        info!("VM {name}: weight {weight}");
        Ok(())
    }

    /// VM `name`'s share weight.
    pub fn vm_weight(&self, name: &str) -> Option<u32> {
        self.vm(name).map(|vm| vm.weight.load(Ordering::Relaxed))
    }

    /// Stops serving (best effort): closes connections, wakes listeners, tears sessions
    /// down and waits a few seconds for the VM threads.
    pub fn shutdown(&self) {
        if self.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        // First, while frontends are still there: the scheduler unshadows its channels.
        self.sched.stop();
        self.vram.stop();
        let vms: Vec<Arc<VmState>> = self.lock_vms().values().cloned().collect();
        for vm in &vms {
            if let Some(h) = vm.conn.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                h.shutdown();
            }
            // Wake a thread blocked in accept(); it sees the stop flag.
            if let Ok(s) = UnixStream::connect(&vm.socket) {
                drop(s);
            }
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let deadline = Instant::now() + Duration::from_secs(5);
        for t in threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                warn!("a VM thread did not stop in time");
            }
        }
        for vm in &vms {
            vm.lock_session().teardown(&Gone);
        }
    }
}

impl Drop for VgpuBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn serve_loop(vm: Arc<VmState>, mut listener: Listener, stop: Arc<AtomicBool>) {
    // Before any connection: the vhost-user threads it starts inherit the filters.
    vgpu_sandbox::enter(vgpu_sandbox::Role::VmServe);
    while !stop.load(Ordering::Acquire) {
        if let Err(e) = serve_connection(&vm, &mut listener, &stop) {
            error!("VM {}: {e}", vm.name);
            // Do not spin on a persistent error.
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let _ = std::fs::remove_file(&vm.socket);
    info!("VM {}: stopped serving", vm.name);
}

/// How long a disconnect waits for the connection's vring worker to exit.
const WORKER_EXIT_WAIT: Duration = Duration::from_secs(2);

/// Drops the daemon (which joins its vring worker), waiting at most
/// [`WORKER_EXIT_WAIT`]: a worker stuck in a request must not keep the VM's session
/// alive or its socket closed. The worker was told to stop and refuses further requests
/// (`VhuVgpu::stop_worker`), so the session can be torn down meanwhile; a worker that
/// never exits is left to finish on its own.
fn join_worker(name: &str, daemon: VhostUserDaemon<Arc<VhuVgpu>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("vgpu-reap-{name}"))
        .spawn(move || {
            drop(daemon);
            let _ = tx.send(());
        });
    match spawned {
        Ok(_) => {
            if rx.recv_timeout(WORKER_EXIT_WAIT).is_err() {
                error!(
                    "VM {name}: the vring worker did not exit; tearing the session down without it"
                );
            }
        }
        Err(e) => error!("VM {name}: cannot reap the vring worker: {e}"),
    }
}

fn vhost_err(e: vhost_user_backend::Error) -> BackendError {
    BackendError::VhostUser(e)
}

/// Serves one frontend connection, then tears the VM's session down.
fn serve_connection(
    vm: &Arc<VmState>,
    listener: &mut Listener,
    stop: &AtomicBool,
) -> Result<(), BackendError> {
    let mem = GuestMemoryAtomic::new(GuestMemory::new());
    let dev = Arc::new(VhuVgpu::new(vm.clone(), mem.clone()).map_err(BackendError::EventFd)?);
    let mut daemon =
        VhostUserDaemon::new(format!("vgpu-{}", vm.name), dev.clone(), mem).map_err(vhost_err)?;
    if let Some(fd) = vm.shared.events.notifier() {
        for h in daemon.get_epoll_handlers() {
            h.register_listener(fd.as_raw_fd(), EventSet::IN, EVENT_FD_TOKEN)
                .map_err(BackendError::EventFd)?;
        }
    }
    // Blocks until a frontend connects.
    daemon.start(listener).map_err(vhost_err)?;
    if stop.load(Ordering::Acquire) {
        daemon.request_shutdown();
    }
    *vm.conn.lock().unwrap_or_else(|e| e.into_inner()) = daemon.shutdown_handle();
    *vm.shm.lock().unwrap_or_else(|e| e.into_inner()) = Some(dev.shm());
    vm.connected.store(true, Ordering::Release);
    if !stop.load(Ordering::Acquire) {
        info!("VM {}: frontend connected", vm.name);
        vm.lock_session().prepare_gpu();
    }
    let result = daemon.wait();
    vm.connected.store(false, Ordering::Release);
    *vm.conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
    *vm.shm.lock().unwrap_or_else(|e| e.into_inner()) = None;
    dev.stop_worker();
    join_worker(&vm.name, daemon);
    // A migration pause belongs to the connection that ended.
    vm.migration_forget();
    {
        let mut s = vm.lock_session();
        let c = s.vram_move_counters();
        s.teardown(&Gone);
        if c.evictions + c.swap_ins + c.spilled_chunks > 0 {
            info!(
                "VM {}: VRAM moves so far: {} chunk evictions, {} swap-ins, {} chunks spilled at allocation, {} MiB out, {} MiB in, {} pauses (longest {} ms), {} failed moves",
                vm.name,
                c.evictions,
                c.swap_ins,
                c.spilled_chunks,
                c.bytes_out >> 20,
                c.bytes_in >> 20,
                c.pauses,
                c.pause_ns_max / 1_000_000,
                c.move_failures
            );
        }
    }
    vm.shared.count_disconnect();
    info!("VM {}: frontend disconnected, GPU state freed", vm.name);
    match result {
        Ok(()) => Ok(()),
        Err(vhost_user_backend::Error::HandleRequest(
            VhostUserError::Disconnected | VhostUserError::PartialMessage,
        )) => Ok(()),
        Err(e) => Err(vhost_err(e)),
    }
}
