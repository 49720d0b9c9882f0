//! The vgpu device of the KVM VMM: what the virtio-pci transport
//! ([`crate::virtio_pci`]) exposes is a vhost-user connection to `vgpu-backend`.
//!
//! - At VM creation [`VhostUserVgpu::connect`] connects to the backend's socket and
//!   negotiates (a refused socket or a backend without the SHMEM protocol feature is a
//!   setup error, before the guest runs). The backend's shared-memory requests
//!   (SHMEM_MAP/UNMAP) are served into the [`ShmWindow`] that the VMM registers as the
//!   memslot behind the shared-memory BAR, so a remap is seen by the guest at once.
//! - At `DRIVER_OK` the driver's ring addresses (guest-physical) are translated to this
//!   process's addresses and handed over with the guest memory table; the queues'
//!   kick eventfds are the ioeventfds on the doorbells, the call eventfds are what the
//!   interrupt forwarder ([`crate::boot::intx`]) waits on.
//! - A driver reset stops the rings and sends RESET_DEVICE: the backend frees everything
//!   the guest created, and the driver may start over on the same connection.
//!
//! - When the backend goes away (or stops answering a request in time), the watcher
//!   thread ([`crate::boot::intx`]) drops the connection ([`VhostUserVgpu::drop_connection`]:
//!   the old backend's pages leave the BAR window), marks the device `DEVICE_NEEDS_RESET`
//!   with a configuration interrupt, and under a [`FaultPolicy`] reconnects
//!   ([`VhostUserVgpu::connect_again`] + [`VhostUserVgpu::adopt`]); the guest driver's
//!   reset then brings the device up on the new backend.
//!
//! The device configuration is read from the backend at each connect (it is constant).

use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use log::{info, warn};
use thiserror::Error;
use vgpu_protocol::device::VIRTIO_ID_VGPU;
use vgpu_protocol::device::{DeviceConfig, NUM_QUEUES, QUEUE_SIZE, SHM_REGION_ID, SHM_SIZE};
use vhost::vhost_user::VhostUserProtocolFeatures;
use vhost::VhostUserMemoryRegionInfo;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::frontend::{DeviceRequirements, FrontendError, QueueSetup, VhostUserDevice};
use crate::guest_memory::GuestRam;
use crate::reconnect::FaultPolicy;
use crate::shm_window::{ShmHandler, ShmWindow};
use crate::virtio_pci::{ActivateError, VirtioBackend, VirtqConfig};

/// What a vgpu frontend needs of the backend: both queues, the shared-memory region of
/// the protocol's size, config space, the backend channel for SHMEM_MAP with acks. (A
/// frontend whose guest can reset the device also needs `RESET_DEVICE`.)
pub fn vgpu_requirements() -> DeviceRequirements {
    DeviceRequirements {
        num_queues: NUM_QUEUES,
        virtio_features: 1 << VIRTIO_F_VERSION_1,
        protocol_features: VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::SHMEM,
        // Live migration moves the device's state through the backend.
        optional_protocol_features: VhostUserProtocolFeatures::DEVICE_STATE,
        shm_regions: vec![(SHM_REGION_ID, SHM_SIZE)],
        config_size: DeviceConfig::SIZE as u32,
        request_timeout: None,
    }
}

#[derive(Debug, Error)]
pub enum VgpuDeviceError {
    #[error("vgpu backend at {path}: {source}")]
    Frontend { path: String, source: FrontendError },
    #[error("vgpu backend at {0}: malformed device configuration space")]
    BadConfig(String),
    #[error("the shared-memory window has {have:#x} bytes, the device needs {want:#x}")]
    WindowSize { have: u64, want: u64 },
    #[error("creating an eventfd failed: {0}")]
    EventFd(io::Error),
    #[error("vgpu backend at {0}: a different device configuration than before")]
    ConfigChanged(String),
}

/// A guest-physical range of RAM and where this process maps it.
#[derive(Debug, Clone, Copy)]
struct RamSpan {
    gpa: u64,
    len: u64,
    host: u64,
}

/// The vgpu device over a vhost-user connection (see the module documentation).
pub struct VhostUserVgpu {
    dev: VhostUserDevice,
    socket: PathBuf,
    faults: FaultPolicy,
    /// Serves the backend's SHMEM requests into `window`, for every connection.
    handler: Arc<ShmHandler>,
    window: Arc<ShmWindow>,
    mem_table: Vec<VhostUserMemoryRegionInfo>,
    ram: Vec<RamSpan>,
    config: Vec<u8>,
    kicks: Vec<Arc<EventFd>>,
    calls: Vec<Arc<EventFd>>,
    /// Queues handed to the backend by the last activation.
    active_queues: Vec<usize>,
    activations: u64,
    /// A migration's destination: the rings to start at the commit, and where.
    pending_rings: Option<(Vec<VirtqConfig>, Vec<u16>)>,
}

impl std::fmt::Debug for VhostUserVgpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserVgpu")
            .field("active_queues", &self.active_queues)
            .field("activations", &self.activations)
            .finish()
    }
}

fn eventfd() -> Result<Arc<EventFd>, VgpuDeviceError> {
    EventFd::new(EFD_NONBLOCK)
        .map(Arc::new)
        .map_err(VgpuDeviceError::EventFd)
}

impl VhostUserVgpu {
    /// Connects to the backend at `socket`. The guest's RAM is described to the backend
    /// from `ram` (whose mappings must outlive this device); SHMEM_MAP requests land in
    /// `window`.
    pub fn connect(
        socket: &Path,
        ram: &GuestRam,
        window: Arc<ShmWindow>,
        faults: FaultPolicy,
    ) -> Result<Self, VgpuDeviceError> {
        if window.len() != SHM_SIZE {
            return Err(VgpuDeviceError::WindowSize {
                have: window.len(),
                want: SHM_SIZE,
            });
        }
        let handler = Arc::new(ShmHandler::new(vec![window.clone()]));
        let dev = Self::connect_again(socket, faults, &handler, None)?;
        let config = dev.config().to_vec();
        let decoded = DeviceConfig::decode(&config)
            .ok_or_else(|| VgpuDeviceError::BadConfig(socket.display().to_string()))?;
        info!(
            "vgpu: connected to {}: protocol {}, {} channel slots, {} MiB VRAM",
            socket.display(),
            decoded.version,
            decoded.channel_slots,
            decoded.vram_bytes >> 20
        );
        let ram_spans = ram
            .regions()
            .iter()
            .map(|r| RamSpan {
                gpa: r.gpa(),
                len: r.len(),
                host: r.host_addr() as u64,
            })
            .collect();
        Ok(VhostUserVgpu {
            dev,
            socket: socket.to_path_buf(),
            faults,
            handler,
            window,
            mem_table: ram.vhost_regions(),
            ram: ram_spans,
            config,
            kicks: (0..NUM_QUEUES)
                .map(|_| eventfd())
                .collect::<Result<_, _>>()?,
            calls: (0..NUM_QUEUES)
                .map(|_| eventfd())
                .collect::<Result<_, _>>()?,
            active_queues: Vec::new(),
            activations: 0,
            pending_rings: None,
        })
    }

    /// A new connection to the backend at `socket` (what [`Self::connect`] and a
    /// reconnect do; slow, so called without the device's lock). With `same_config`, the
    /// backend must present that configuration space (the guest has seen it).
    pub fn connect_again(
        socket: &Path,
        faults: FaultPolicy,
        handler: &Arc<ShmHandler>,
        same_config: Option<&[u8]>,
    ) -> Result<VhostUserDevice, VgpuDeviceError> {
        let path = socket.display().to_string();
        // A guest driver resets the device on unload and reboot: the backend must then free
        // what the guest created without a disconnect.
        let mut reqs = vgpu_requirements();
        reqs.protocol_features |= VhostUserProtocolFeatures::RESET_DEVICE;
        reqs.request_timeout = faults.request_timeout;
        let mut dev =
            VhostUserDevice::connect(socket, &reqs, handler.clone()).map_err(|source| {
                VgpuDeviceError::Frontend {
                    path: path.clone(),
                    source,
                }
            })?;
        if DeviceConfig::decode(dev.config()).is_none() {
            dev.disconnect();
            return Err(VgpuDeviceError::BadConfig(path));
        }
        if same_config.is_some_and(|c| c != dev.config()) {
            dev.disconnect();
            return Err(VgpuDeviceError::ConfigChanged(path));
        }
        Ok(dev)
    }

    /// Where the backend listens.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }
    /// What to do when the backend is lost.
    pub fn fault_policy(&self) -> FaultPolicy {
        self.faults
    }
    /// The SHMEM request handler, to give a new connection.
    pub fn handler(&self) -> &Arc<ShmHandler> {
        &self.handler
    }
    /// The configuration space the guest sees.
    pub fn config_bytes(&self) -> &[u8] {
        &self.config
    }
    /// Whether a backend is connected.
    pub fn is_connected(&self) -> bool {
        self.dev.is_connected()
    }

    /// The backend is gone or hung: closes the connection (no late SHMEM_MAP can land
    /// after this) and takes every page it mapped out of the BAR window, so that the guest
    /// never touches a stale page (holes read as scratch zeros).
    pub fn drop_connection(&mut self) {
        self.dev.disconnect();
        self.active_queues.clear();
        self.window.clear();
    }

    /// Takes over a connection made by [`Self::connect_again`]: the device is live again
    /// once the driver resets it and sets `DRIVER_OK`.
    pub fn adopt(&mut self, dev: VhostUserDevice) {
        self.dev.disconnect();
        self.dev = dev;
        self.active_queues.clear();
        self.pending_rings = None;
        info!("vgpu: reconnected to {}", self.socket.display());
    }

    /// The kick eventfd of queue `q` (to register as an ioeventfd on its doorbell).
    pub fn kick(&self, q: usize) -> Option<&Arc<EventFd>> {
        self.kicks.get(q)
    }
    /// The call eventfds of all queues (signalled by the backend).
    pub fn calls(&self) -> &[Arc<EventFd>] {
        &self.calls
    }
    /// The vhost-user socket, to watch for the backend hanging up.
    pub fn socket_fd(&self) -> RawFd {
        self.dev.socket_fd()
    }
    /// The shared-memory window behind the BAR.
    pub fn window(&self) -> &Arc<ShmWindow> {
        &self.window
    }
    /// Successful activations so far.
    pub fn activations(&self) -> u64 {
        self.activations
    }
    /// Virtio features the backend acked in the last activation.
    pub fn acked_features(&self) -> u64 {
        self.dev.acked_features()
    }

    /// The vhost-user setup of every ready queue of `queues`.
    fn setups<'a>(
        ram: &[RamSpan],
        calls: &'a [Arc<EventFd>],
        kicks: &'a [Arc<EventFd>],
        queues: &[VirtqConfig],
    ) -> Result<Vec<QueueSetup<'a>>, ActivateError> {
        let host_addr = |gpa: u64, len: u64| {
            let end = gpa.checked_add(len)?;
            ram.iter()
                .find(|s| gpa >= s.gpa && end <= s.gpa + s.len)
                .map(|s| s.host + (gpa - s.gpa))
        };
        let mut setups = Vec::new();
        for q in queues.iter().filter(|q| q.ready) {
            let i = usize::from(q.index);
            let (dlen, alen, ulen) = Self::ring_sizes(q.size);
            let (Some(desc), Some(avail), Some(used)) = (
                host_addr(q.desc, dlen),
                host_addr(q.avail, alen),
                host_addr(q.used, ulen),
            ) else {
                warn!("vgpu: queue {i}: ring outside guest RAM: {q:x?}");
                return Err(ActivateError::BadQueue(q.index));
            };
            let (Some(call), Some(kick)) = (calls.get(i), kicks.get(i)) else {
                return Err(ActivateError::BadQueue(q.index));
            };
            setups.push(QueueSetup {
                index: i,
                size: q.size,
                desc_addr: desc,
                avail_addr: avail,
                used_addr: used,
                call,
                kick,
            });
        }
        Ok(setups)
    }

    /// Starts the device with each ready queue continuing at `bases[k]` (the k-th ready
    /// queue; 0 where missing): a fresh activation, or the continuation of rings another
    /// backend served (live migration).
    pub fn activate_at(
        &mut self,
        features: u64,
        queues: &[VirtqConfig],
        bases: &[u16],
    ) -> Result<(), ActivateError> {
        self.prepare_at(features, queues, bases)?;
        self.start_prepared()
    }

    /// The first half of [`Self::activate_at`]: features and memory table only; the
    /// rings wait for [`Self::start_prepared`]. A migration's destination loads the
    /// device's state in between, while RAM rounds still arrive: a ring served then
    /// would write used entries a later round overwrites.
    pub fn prepare_at(
        &mut self,
        features: u64,
        queues: &[VirtqConfig],
        bases: &[u16],
    ) -> Result<(), ActivateError> {
        // Checked now, so that the start cannot fail on the rings' placement.
        Self::setups(&self.ram, &self.calls, &self.kicks, queues)?;
        self.dev
            .prepare(features, &self.mem_table)
            .map_err(|e| ActivateError::Backend(e.to_string()))?;
        self.pending_rings = Some((queues.to_vec(), bases.to_vec()));
        Ok(())
    }

    /// Whether [`Self::prepare_at`] left rings to start.
    pub fn has_prepared(&self) -> bool {
        self.pending_rings.is_some()
    }

    /// Starts the rings [`Self::prepare_at`] described.
    pub fn start_prepared(&mut self) -> Result<(), ActivateError> {
        let Some((queues, bases)) = self.pending_rings.take() else {
            return Err(ActivateError::Backend("no prepared activation".into()));
        };
        let setups = Self::setups(&self.ram, &self.calls, &self.kicks, &queues)?;
        let indices: Vec<usize> = setups.iter().map(|s| s.index).collect();
        self.dev
            .start_rings(&setups, &bases)
            .map_err(|e| ActivateError::Backend(e.to_string()))?;
        self.active_queues = indices;
        self.activations += 1;
        info!(
            "vgpu: device active, features {:#x}, queues {:?}",
            self.dev.acked_features(),
            self.active_queues
        );
        Ok(())
    }

    /// Live migration: stops the active rings (the backend no longer touches them once
    /// this returns) and returns each one's next available index, in queue order.
    pub fn stop_rings(&mut self) -> Result<Vec<u16>, FrontendError> {
        let q = self.active_queues.clone();
        self.dev.stop_queues(&q)
    }

    /// Undoes [`Self::stop_rings`] (a migration that failed): the rings run again at
    /// `bases`.
    pub fn restart_rings(
        &mut self,
        queues: &[VirtqConfig],
        bases: &[u16],
    ) -> Result<(), FrontendError> {
        let setups = Self::setups(&self.ram, &self.calls, &self.kicks, queues)
            .map_err(|_| FrontendError::BadQueue("ring outside guest RAM"))?;
        self.dev.restart_queues(&setups, bases)
    }

    /// The connection, for the device-state transfer.
    pub fn connection(&mut self) -> &mut VhostUserDevice {
        &mut self.dev
    }

    /// Byte sizes of a split ring's parts for `size` entries (virtio 1.x §2.7).
    fn ring_sizes(size: u16) -> (u64, u64, u64) {
        let n = u64::from(size);
        (16 * n, 6 + 2 * n, 6 + 8 * n)
    }
}

impl VirtioBackend for VhostUserVgpu {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VGPU
    }
    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }
    fn queue_max_size(&self) -> u16 {
        QUEUE_SIZE
    }
    fn features(&self) -> u64 {
        // Everything the backend offers but the vhost-user protocol bit, which is the
        // frontend's business.
        self.dev.offered_features()
            & !vhost::vhost_user::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }
    fn config_size(&self) -> u64 {
        self.config.len() as u64
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            *d = usize::try_from(offset)
                .ok()
                .and_then(|o| self.config.get(o + i))
                .copied()
                .unwrap_or(0);
        }
    }
    fn shm_regions(&self) -> Vec<(u8, u64)> {
        vec![(SHM_REGION_ID, SHM_SIZE)]
    }
    fn msix_vectors(&self) -> u16 {
        // One per queue and one for configuration changes, as Linux asks first.
        NUM_QUEUES as u16 + 1
    }

    fn activate(&mut self, features: u64, queues: &[VirtqConfig]) -> Result<(), ActivateError> {
        self.activate_at(features, queues, &[])
    }

    fn queue_notify(&mut self, index: u16) {
        // A doorbell that reached us as an MMIO exit (no ioeventfd at its address yet):
        // pass it on as the kick the ioeventfd would have given.
        if let Some(k) = self.kicks.get(usize::from(index)) {
            if let Err(e) = k.write(1) {
                warn!("vgpu: kicking queue {index}: {e}");
            }
        }
    }

    fn reset(&mut self) {
        self.pending_rings = None;
        let queues = std::mem::take(&mut self.active_queues);
        match self.dev.reset(&queues) {
            Ok(()) => info!("vgpu: device reset"),
            // A backend that did not answer in time is closed by the request watchdog:
            // the watcher thread sees the hang-up and reconnects.
            Err(e) => warn!("vgpu: device reset: {e}"),
        }
        // Whatever the backend did not unmap (it should have unmapped everything) goes.
        self.window.clear();
    }
}
