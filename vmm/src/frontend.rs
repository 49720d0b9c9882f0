//! The vhost-user frontend: connection, feature negotiation, backend-request channel and
//! vring setup. Transport-agnostic: the loopback frontend and the KVM VMM both drive a
//! device through this type (the VMM translating the driver's ring GPAs to host
//! addresses and wiring the call/kick eventfds to irqfd/ioeventfd).
//!
//! Message order (as QEMU / Cloud Hypervisor do it):
//! `connect`: SET_OWNER, GET_FEATURES, GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES,
//! GET_QUEUE_NUM, SET_BACKEND_REQ_FD, GET_SHMEM_CONFIG, GET_CONFIG;
//! `activate`: SET_FEATURES, SET_MEM_TABLE, then per queue SET_VRING_NUM, SET_VRING_ADDR,
//! SET_VRING_BASE, SET_VRING_CALL, SET_VRING_KICK, SET_VRING_ENABLE.

use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use log::{debug, info};
use std::io::{Read, Write};
use thiserror::Error;
use vgpu_protocol::migration::{stream_len, HEADER_SIZE};

use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserHeaderFlag,
};
use vhost::vhost_user::{
    Frontend, VhostUserFrontend, VhostUserFrontendReqHandler, VhostUserProtocolFeatures,
    VhostUserVirtioFeatures,
};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vmm_sys_util::eventfd::EventFd;

use crate::request_timeout::RequestWatchdog;
use crate::shm_window::{BackendReqThread, ShmWindowError};

#[derive(Debug, Error)]
pub enum FrontendError {
    #[error("connecting to {path}: {source}")]
    Connect { path: String, source: vhost::Error },
    #[error("vhost-user {step} failed: {source}")]
    Protocol {
        step: &'static str,
        source: vhost::Error,
    },
    #[error("backend does not offer virtio feature bits {0:#x}")]
    MissingFeatures(u64),
    #[error("backend does not offer protocol features {0:?}")]
    MissingProtocolFeatures(VhostUserProtocolFeatures),
    #[error("backend has {have} queues, need {need}")]
    TooFewQueues { have: u64, need: usize },
    #[error("shared-memory region {id}: backend says {have:#x} bytes, expected {want:#x}")]
    ShmSize { id: u8, have: u64, want: u64 },
    #[error("backend request channel: {0}")]
    BackendReq(#[from] ShmWindowError),
    #[error("device not active / already disconnected")]
    Disconnected,
    #[error("bad queue setup: {0}")]
    BadQueue(&'static str),
    #[error("vhost-user {step}: the backend did not answer within {timeout:?}")]
    Timeout {
        step: &'static str,
        timeout: Duration,
    },
    #[error("starting the request watchdog: {0}")]
    Watchdog(std::io::Error),
    #[error("device-state transfer: {0}")]
    StateIo(std::io::Error),
    #[error("the backend refused the device state (CHECK_DEVICE_STATE): {0}")]
    StateRefused(vhost::Error),
}

/// The error of a failed `step`: a timeout if the watchdog ended it, else the protocol
/// error.
fn timed_err<'a>(
    wd: Option<&'a RequestWatchdog>,
    step: &'static str,
) -> impl FnOnce(vhost::Error) -> FrontendError + 'a {
    move |source| match wd.filter(|w| w.fired()) {
        Some(w) => FrontendError::Timeout {
            step,
            timeout: w.timeout(),
        },
        None => FrontendError::Protocol { step, source },
    }
}

/// CHECK_DEVICE_STATE's failure: a timeout if the watchdog fired, else the backend's
/// refusal of the state.
fn state_check_err(
    wd: Option<&RequestWatchdog>,
) -> impl FnOnce(vhost::Error) -> FrontendError + '_ {
    move |e| match wd.filter(|w| w.fired()) {
        Some(w) => FrontendError::Timeout {
            step: "CHECK_DEVICE_STATE",
            timeout: w.timeout(),
        },
        None => FrontendError::StateRefused(e),
    }
}

/// What the frontend needs from the device.
#[derive(Debug, Clone)]
pub struct DeviceRequirements {
    /// Virtqueues the device must have.
    pub num_queues: usize,
    /// Virtio feature bits the device must offer besides VERSION_1 / PROTOCOL_FEATURES
    /// (the driver acks what it uses when it activates the device).
    pub virtio_features: u64,
    /// Protocol features that must be offered; these are acked.
    pub protocol_features: VhostUserProtocolFeatures,
    /// Protocol features acked as well where the backend offers them.
    pub optional_protocol_features: VhostUserProtocolFeatures,
    /// Shared-memory regions `(id, size)` the device must report in GET_SHMEM_CONFIG.
    pub shm_regions: Vec<(u8, u64)>,
    /// Bytes of config space to read at connect.
    pub config_size: u32,
    /// How long a request that waits for the backend's reply may take (`None`: forever).
    /// After a timeout the connection is shut down and every later request fails.
    pub request_timeout: Option<Duration>,
}

/// One virtqueue as the driver set it up: ring addresses in *this process* (user
/// addresses inside a region passed in SET_MEM_TABLE) and its eventfds.
pub struct QueueSetup<'a> {
    pub index: usize,
    pub size: u16,
    pub desc_addr: u64,
    pub avail_addr: u64,
    pub used_addr: u64,
    /// Signalled by the backend when it adds used buffers (irqfd in the KVM VMM).
    pub call: &'a EventFd,
    /// Signalled by the driver when it adds available buffers (ioeventfd in the KVM VMM).
    pub kick: &'a EventFd,
}

/// A connected vhost-user device.
pub struct VhostUserDevice {
    frontend: Option<Frontend>,
    offered_features: u64,
    acked_features: u64,
    protocol_features: VhostUserProtocolFeatures,
    queue_num: u64,
    shm_sizes: Vec<u64>,
    config: Vec<u8>,
    backend_req: Option<BackendReqThread>,
    socket_fd: RawFd,
    /// Ends requests that outlive `DeviceRequirements::request_timeout`.
    watchdog: Option<RequestWatchdog>,
}

impl VhostUserDevice {
    /// Connects to `path` and negotiates; `backend_req_handler` serves the backend's
    /// requests (SHMEM_MAP/UNMAP) from the moment SET_BACKEND_REQ_FD is sent.
    pub fn connect<S>(
        path: &Path,
        req: &DeviceRequirements,
        backend_req_handler: Arc<S>,
    ) -> Result<Self, FrontendError>
    where
        S: VhostUserFrontendReqHandler + Send + Sync + 'static,
    {
        let mut fe = Frontend::connect(path, req.num_queues as u64).map_err(|source| {
            FrontendError::Connect {
                path: path.display().to_string(),
                source,
            }
        })?;
        let socket_fd = fe.as_raw_fd();
        let watchdog = req
            .request_timeout
            .map(|t| RequestWatchdog::start(socket_fd, t))
            .transpose()
            .map_err(FrontendError::Watchdog)?;
        // Every negotiation step below that waits for a reply runs under the deadline.
        let wd = watchdog.as_ref();
        let armed = wd.map(|w| w.arm());
        let timed = |step: &'static str| timed_err(wd, step);

        fe.set_owner().map_err(timed("SET_OWNER"))?;
        let offered = fe.get_features().map_err(timed("GET_FEATURES"))?;
        let must = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | 1u64 << VIRTIO_F_VERSION_1
            | req.virtio_features;
        if offered & must != must {
            return Err(FrontendError::MissingFeatures(must & !offered));
        }

        let offered_proto = fe
            .get_protocol_features()
            .map_err(timed("GET_PROTOCOL_FEATURES"))?;
        if !offered_proto.contains(req.protocol_features) {
            return Err(FrontendError::MissingProtocolFeatures(
                req.protocol_features - offered_proto,
            ));
        }
        let acked_proto = req.protocol_features | (req.optional_protocol_features & offered_proto);
        fe.set_protocol_features(acked_proto)
            .map_err(timed("SET_PROTOCOL_FEATURES"))?;

        let queue_num = if acked_proto.contains(VhostUserProtocolFeatures::MQ) {
            fe.get_queue_num().map_err(timed("GET_QUEUE_NUM"))?
        } else {
            1
        };
        if queue_num < req.num_queues as u64 {
            return Err(FrontendError::TooFewQueues {
                have: queue_num,
                need: req.num_queues,
            });
        }

        let mut backend_req = None;
        if acked_proto.contains(VhostUserProtocolFeatures::BACKEND_REQ) {
            let reply_ack = acked_proto.contains(VhostUserProtocolFeatures::REPLY_ACK);
            let (thread, fd) = BackendReqThread::start(backend_req_handler, reply_ack)?;
            fe.set_backend_request_fd(&fd)
                .map_err(timed("SET_BACKEND_REQ_FD"))?;
            backend_req = Some(thread);
        }

        let mut shm_sizes = Vec::new();
        if acked_proto.contains(VhostUserProtocolFeatures::SHMEM) {
            let c = fe.get_shmem_config().map_err(timed("GET_SHMEM_CONFIG"))?;
            let n = (c.nregions as usize).min(c.memory_sizes.len());
            shm_sizes = c.memory_sizes.to_vec();
            // Regions are indexed by id; keep the sizes up to the last non-zero one.
            let last = shm_sizes.iter().rposition(|&s| s != 0).map_or(0, |i| i + 1);
            shm_sizes.truncate(last.max(n));
        }
        for &(id, want) in &req.shm_regions {
            let have = shm_sizes.get(id as usize).copied().unwrap_or(0);
            if have != want {
                return Err(FrontendError::ShmSize { id, have, want });
            }
        }

        let mut config = Vec::new();
        if req.config_size > 0 && acked_proto.contains(VhostUserProtocolFeatures::CONFIG) {
            let buf = vec![0u8; req.config_size as usize];
            let (_, payload) = fe
                .get_config(0, req.config_size, VhostUserConfigFlags::empty(), &buf)
                .map_err(timed("GET_CONFIG"))?;
            config = payload;
        }

        drop(armed);
        info!(
            "vhost-user {}: features {offered:#x}, protocol {acked_proto:?}, {queue_num} queues, shm {shm_sizes:x?}",
            path.display()
        );
        Ok(VhostUserDevice {
            frontend: Some(fe),
            offered_features: offered,
            acked_features: 0,
            protocol_features: acked_proto,
            queue_num,
            shm_sizes,
            config,
            backend_req,
            socket_fd,
            watchdog,
        })
    }

    /// The connection and its request deadline, armed until the guard drops.
    fn fe(
        &mut self,
    ) -> Result<
        (
            &mut Frontend,
            Option<&RequestWatchdog>,
            Option<crate::request_timeout::Armed<'_>>,
        ),
        FrontendError,
    > {
        let fe = self.frontend.as_mut().ok_or(FrontendError::Disconnected)?;
        let wd = self.watchdog.as_ref();
        Ok((fe, wd, wd.map(|w| w.arm())))
    }

    /// Whether a request outlived its deadline (the connection is then shut down).
    pub fn timed_out(&self) -> bool {
        self.watchdog.as_ref().is_some_and(|w| w.fired())
    }

    /// Virtio features the backend offers.
    pub fn offered_features(&self) -> u64 {
        self.offered_features
    }
    /// Virtio features acked by `activate`.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }
    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.protocol_features
    }
    pub fn queue_num(&self) -> u64 {
        self.queue_num
    }
    /// Shared-memory region sizes, indexed by region id.
    pub fn shm_sizes(&self) -> &[u64] {
        &self.shm_sizes
    }
    /// Config space read at connect.
    pub fn config(&self) -> &[u8] {
        &self.config
    }
    /// The vhost-user socket (for watching it for hang-up; do not read or write it).
    pub fn socket_fd(&self) -> RawFd {
        self.socket_fd
    }

    /// Reads `len` bytes of config space at `offset` (GET_CONFIG).
    pub fn read_config(&mut self, offset: u32, len: u32) -> Result<Vec<u8>, FrontendError> {
        let buf = vec![0u8; len as usize];
        let (fe, wd, _armed) = self.fe()?;
        let (_, payload) = fe
            .get_config(offset, len, VhostUserConfigFlags::empty(), &buf)
            .map_err(timed_err(wd, "GET_CONFIG"))?;
        Ok(payload)
    }

    /// Starts the device: acks `driver_features` (plus PROTOCOL_FEATURES; only bits the
    /// backend offers), shares guest memory and sets up and enables the queues.
    pub fn activate(
        &mut self,
        driver_features: u64,
        mem: &[VhostUserMemoryRegionInfo],
        queues: &[QueueSetup<'_>],
    ) -> Result<(), FrontendError> {
        self.activate_at(driver_features, mem, queues, &[])
    }

    /// [`Self::activate`] with each queue's next available index (`bases[i]` for
    /// `queues[i]`, 0 where missing): for a device that continues rings another backend
    /// served (live migration).
    pub fn activate_at(
        &mut self,
        driver_features: u64,
        mem: &[VhostUserMemoryRegionInfo],
        queues: &[QueueSetup<'_>],
        bases: &[u16],
    ) -> Result<(), FrontendError> {
        self.prepare(driver_features, mem)?;
        self.start_rings(queues, bases)
    }

    /// The first half of an activation: features and the memory table, no rings. A
    /// migration's destination stops here until the guest's RAM is final (the device
    /// state can be loaded meanwhile), so that the backend cannot serve a ring and write
    /// into RAM that a later RAM round overwrites.
    pub fn prepare(
        &mut self,
        driver_features: u64,
        mem: &[VhostUserMemoryRegionInfo],
    ) -> Result<(), FrontendError> {
        let acked = (driver_features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())
            & self.offered_features;
        let reply_ack = self
            .protocol_features
            .contains(VhostUserProtocolFeatures::REPLY_ACK);
        let (fe, wd, armed) = self.fe()?;
        fe.set_features(acked)
            .map_err(timed_err(wd, "SET_FEATURES"))?;
        // The backend answers REPLY_ACK only once PROTOCOL_FEATURES is acked, so ask for
        // acks from here on: every later setup step then reports the backend's verdict.
        if reply_ack {
            fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        fe.set_mem_table(mem)
            .map_err(timed_err(wd, "SET_MEM_TABLE"))?;
        drop(armed);
        self.acked_features = acked;
        Ok(())
    }

    /// The second half of an activation: sets up and enables `queues`, each continuing
    /// at `bases[i]` (0 where missing). The backend reads each used index from guest RAM
    /// here (`SET_VRING_ADDR`).
    pub fn start_rings(
        &mut self,
        queues: &[QueueSetup<'_>],
        bases: &[u16],
    ) -> Result<(), FrontendError> {
        let queue_num = self.queue_num;
        let (fe, wd, armed) = self.fe()?;
        for (i, q) in queues.iter().enumerate() {
            let base = bases.get(i).copied().unwrap_or(0);
            if q.index as u64 >= queue_num {
                return Err(FrontendError::BadQueue("queue index out of range"));
            }
            if q.size == 0 || !q.size.is_power_of_two() {
                return Err(FrontendError::BadQueue("queue size not a power of two"));
            }
            fe.set_vring_num(q.index, q.size)
                .map_err(timed_err(wd, "SET_VRING_NUM"))?;
            let cfg = VringConfigData {
                queue_max_size: q.size,
                queue_size: q.size,
                flags: 0,
                desc_table_addr: q.desc_addr,
                used_ring_addr: q.used_addr,
                avail_ring_addr: q.avail_addr,
                log_addr: None,
            };
            fe.set_vring_addr(q.index, &cfg)
                .map_err(timed_err(wd, "SET_VRING_ADDR"))?;
            fe.set_vring_base(q.index, base)
                .map_err(timed_err(wd, "SET_VRING_BASE"))?;
            fe.set_vring_call(q.index, q.call)
                .map_err(timed_err(wd, "SET_VRING_CALL"))?;
            fe.set_vring_kick(q.index, q.kick)
                .map_err(timed_err(wd, "SET_VRING_KICK"))?;
            fe.set_vring_enable(q.index, true)
                .map_err(timed_err(wd, "SET_VRING_ENABLE"))?;
            debug!("vring {} enabled ({} entries)", q.index, q.size);
        }
        drop(armed);
        Ok(())
    }

    /// The driver reset the device: stops the `queues` (GET_VRING_BASE, which the backend
    /// answers once it no longer touches them) and, where negotiated, RESET_DEVICE, after
    /// which the backend has freed everything the driver created. The connection stays up
    /// for the next `activate`.
    pub fn reset(&mut self, queues: &[usize]) -> Result<(), FrontendError> {
        let reset_device = self
            .protocol_features
            .contains(VhostUserProtocolFeatures::RESET_DEVICE);
        let (fe, wd, armed) = self.fe()?;
        for &q in queues {
            fe.get_vring_base(q)
                .map_err(timed_err(wd, "GET_VRING_BASE"))?;
        }
        if reset_device {
            fe.reset_device().map_err(timed_err(wd, "RESET_DEVICE"))?;
        }
        drop(armed);
        self.acked_features = 0;
        Ok(())
    }

    /// Stops `queues` (GET_VRING_BASE: the backend no longer touches them when it
    /// answers) and returns each one's next available index.
    pub fn stop_queues(&mut self, queues: &[usize]) -> Result<Vec<u16>, FrontendError> {
        let (fe, wd, _armed) = self.fe()?;
        let mut bases = Vec::with_capacity(queues.len());
        for &q in queues {
            let b = fe
                .get_vring_base(q)
                .map_err(timed_err(wd, "GET_VRING_BASE"))?;
            bases.push(u16::try_from(b).unwrap_or(0));
        }
        Ok(bases)
    }

    /// Starts queues stopped by [`Self::stop_queues`] again at `bases`.
    pub fn restart_queues(
        &mut self,
        queues: &[QueueSetup<'_>],
        bases: &[u16],
    ) -> Result<(), FrontendError> {
        let (fe, wd, _armed) = self.fe()?;
        for (q, &base) in queues.iter().zip(bases) {
            fe.set_vring_base(q.index, base)
                .map_err(timed_err(wd, "SET_VRING_BASE"))?;
            fe.set_vring_call(q.index, q.call)
                .map_err(timed_err(wd, "SET_VRING_CALL"))?;
            fe.set_vring_kick(q.index, q.kick)
                .map_err(timed_err(wd, "SET_VRING_KICK"))?;
            fe.set_vring_enable(q.index, true)
                .map_err(timed_err(wd, "SET_VRING_ENABLE"))?;
        }
        Ok(())
    }

    /// Starts a streamed save (SET_DEVICE_STATE_FD, direction SAVE): the backend writes
    /// the state into the returned reader until EOF; then [`Self::check_state`].
    pub fn begin_save(&mut self) -> Result<std::fs::File, FrontendError> {
        let (rd, wr) = std::io::pipe().map_err(FrontendError::StateIo)?;
        let (fe, wd, _armed) = self.fe()?;
        let back = fe
            .set_device_state_fd(
                VhostTransferStateDirection::SAVE,
                VhostTransferStatePhase::STOPPED,
                wr.into(),
            )
            .map_err(timed_err(wd, "SET_DEVICE_STATE_FD"))?;
        // The backend may choose its own channel.
        Ok(back.unwrap_or_else(|| std::fs::File::from(std::os::fd::OwnedFd::from(rd))))
    }

    /// Starts a streamed load (SET_DEVICE_STATE_FD, direction LOAD): write the state into
    /// the returned writer and drop it; then [`Self::check_state`].
    pub fn begin_load(&mut self) -> Result<std::fs::File, FrontendError> {
        let (rd, wr) = std::io::pipe().map_err(FrontendError::StateIo)?;
        let (fe, wd, _armed) = self.fe()?;
        let back = fe
            .set_device_state_fd(
                VhostTransferStateDirection::LOAD,
                VhostTransferStatePhase::STOPPED,
                rd.into(),
            )
            .map_err(timed_err(wd, "SET_DEVICE_STATE_FD"))?;
        Ok(back.unwrap_or_else(|| std::fs::File::from(std::os::fd::OwnedFd::from(wr))))
    }

    /// The outcome of the transfer begun last (CHECK_DEVICE_STATE).
    pub fn check_state(&mut self) -> Result<(), FrontendError> {
        let (fe, wd, _armed) = self.fe()?;
        fe.check_device_state().map_err(state_check_err(wd))
    }

    /// Saves the stopped device's state (SET_DEVICE_STATE_FD with a pipe, read to EOF,
    /// then CHECK_DEVICE_STATE).
    pub fn save_state(&mut self) -> Result<Vec<u8>, FrontendError> {
        let (mut rd, wr) = std::io::pipe().map_err(FrontendError::StateIo)?;
        let (fe, wd, _armed) = self.fe()?;
        let back = fe
            .set_device_state_fd(
                VhostTransferStateDirection::SAVE,
                VhostTransferStatePhase::STOPPED,
                wr.into(),
            )
            .map_err(timed_err(wd, "SET_DEVICE_STATE_FD"))?;
        let mut bytes = Vec::new();
        match back {
            // The backend chose its own channel.
            Some(mut f) => f.read_to_end(&mut bytes),
            None => rd.read_to_end(&mut bytes),
        }
        .map_err(FrontendError::StateIo)?;
        fe.check_device_state().map_err(state_check_err(wd))?;
        Ok(bytes)
    }

    /// Loads `bytes` as the device's state (SET_DEVICE_STATE_FD with a pipe written to
    /// EOF, then CHECK_DEVICE_STATE, which fails if the backend refused it).
    pub fn load_state(&mut self, bytes: &[u8]) -> Result<(), FrontendError> {
        let (rd, mut wr) = std::io::pipe().map_err(FrontendError::StateIo)?;
        let (fe, wd, _armed) = self.fe()?;
        let back = fe
            .set_device_state_fd(
                VhostTransferStateDirection::LOAD,
                VhostTransferStatePhase::STOPPED,
                rd.into(),
            )
            .map_err(timed_err(wd, "SET_DEVICE_STATE_FD"))?;
        let written = match back {
            Some(mut f) => f.write_all(bytes),
            None => wr.write_all(bytes),
        };
        drop(wr);
        // A backend that stopped reading (it refused the stream) breaks the pipe: its
        // verdict comes from CHECK_DEVICE_STATE.
        if let Err(e) = written {
            debug!("device-state write: {e}");
        }
        fe.check_device_state().map_err(state_check_err(wd))
    }

    /// Whether the backend-request channel has stopped (closed or broken).
    pub fn backend_req_stopped(&self) -> bool {
        self.backend_req.as_ref().is_some_and(|t| t.stopped())
    }

    /// Closes the connection: the backend sees the socket hang up. Idempotent.
    pub fn disconnect(&mut self) {
        if let Some(fe) = self.frontend.take() {
            // SAFETY: shutting down a socket we own (it stays open until `fe` drops
            // below); this wakes the peer even if another clone of the fd lingers.
            unsafe {
                libc::shutdown(fe.as_raw_fd(), libc::SHUT_RDWR);
            }
            drop(fe);
            info!("vhost-user connection closed");
        }
        if let Some(mut t) = self.backend_req.take() {
            t.stop();
        }
        // Nothing is sent any more: the watchdog's thread can go.
        self.watchdog = None;
    }

    pub fn is_connected(&self) -> bool {
        self.frontend.is_some()
    }
}

impl Drop for VhostUserDevice {
    fn drop(&mut self) {
        self.disconnect();
    }
}

/// The next frame of a device-state stream being saved (a header and its declared
/// body), `None` at EOF.
pub fn read_state_frame(rd: &mut std::fs::File) -> std::io::Result<Option<Vec<u8>>> {
    let mut frame = vec![0u8; HEADER_SIZE];
    let mut got = 0;
    while got < HEADER_SIZE {
        let n = rd.read(&mut frame[got..])?;
        if n == 0 {
            break;
        }
        got += n;
    }
    if got == 0 {
        return Ok(None);
    }
    frame.truncate(got);
    // A bad header goes on as it is: the destination refuses it.
    if let Ok(total) = stream_len(&frame) {
        let want = total.saturating_sub(got as u64);
        rd.take(want).read_to_end(&mut frame)?;
    }
    Ok(Some(frame))
}
