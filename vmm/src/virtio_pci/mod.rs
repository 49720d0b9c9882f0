//! A modern (virtio 1.x) virtio-pci function, as the Linux `virtio_pci_modern` driver
//! expects it:
//!
//! - PCI ids `0x1af4:(0x1040 + device type)`, revision 1, subsystem `0x1af4:0x0040`.
//! - **BAR0** (64-bit memory, [`BAR0_SIZE`]) holds the common configuration
//!   ([`COMMON_CFG_OFFSET`]), the ISR byte ([`ISR_OFFSET`]), the device configuration
//!   ([`DEVICE_CFG_OFFSET`]) and the notification area ([`NOTIFY_OFFSET`], one 4-byte
//!   doorbell per queue); all of it is served as MMIO exits.
//! - **BAR2** (64-bit prefetchable memory, when the device has a shared-memory region)
//!   covers the region: `VIRTIO_PCI_CAP_SHARED_MEMORY_CFG` (cfg type 8) with shmid, a
//!   64-bit offset 0 and the region's length (`struct virtio_pci_cap64`). The BAR is the
//!   region's size rounded up to a power of two; the VMM backs the region with a memslot
//!   (the shared-memory window), so guest accesses to it normally never exit.
//! - Vendor capabilities (id 0x09) for common, notify (multiplier 4), ISR and device
//!   config, then shared memory.
//!
//! The transport implements the device-status state machine, feature negotiation (64
//! bits through the select registers; `FEATURES_OK` is refused for features the device
//! does not offer or without `VIRTIO_F_VERSION_1`), the per-queue registers and the
//! config generation. What the device *is* — its type, queues, feature bits, config space,
//! and what happens on `DRIVER_OK`, notify and reset — sits behind [`VirtioBackend`], so
//! that the vhost-user frontend can back it; [`stub::StubBackend`] is a stand-in.
//!
//! Interrupts: MSI-X when the backend offers vectors ([`msix`]: capability, table and PBA
//! in BAR0, the vector registers; the VMM routes the messages), else INTx (the ISR is kept
//! here and the VMM raises the line, `boot/intx.rs`). Doorbells reach
//! [`VirtioBackend::queue_notify`] as MMIO exits unless the VMM registered ioeventfds on
//! them (it does for the vhost-user device). Not yet: `VIRTIO_PCI_CAP_PCI_CFG`.
//! Layout after Cloud Hypervisor's `virtio-devices/src/transport/pci_device.rs` and
//! `pci_common_config.rs`.

pub mod msix;
pub mod state;
pub mod stub;

use thiserror::Error;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

use crate::pci::{BarKind, PciConfig, PciConfigError, PciDevice, PciHeader};
use msix::{Msix, MsixState, PCI_CAP_ID_MSIX};

/// PCI vendor id of virtio devices.
pub const VIRTIO_PCI_VENDOR_ID: u16 = 0x1af4;
/// Modern device ids are `0x1040 + virtio device type`.
pub const VIRTIO_PCI_DEVICE_ID_BASE: u16 = 0x1040;
/// Subsystem id of modern devices (at least 0x40).
pub const VIRTIO_PCI_SUBSYSTEM_ID: u16 = 0x0040;

/// Device status bits.
pub const STATUS_ACKNOWLEDGE: u8 = 0x01;
pub const STATUS_DRIVER: u8 = 0x02;
pub const STATUS_DRIVER_OK: u8 = 0x04;
pub const STATUS_FEATURES_OK: u8 = 0x08;
pub const STATUS_DEVICE_NEEDS_RESET: u8 = 0x40;
pub const STATUS_FAILED: u8 = 0x80;

/// "No MSI-X vector".
pub const VIRTIO_MSI_NO_VECTOR: u16 = 0xffff;

/// ISR bits.
pub const ISR_QUEUE: u8 = 0x1;
pub const ISR_CONFIG: u8 = 0x2;

/// Vendor-specific capability id and virtio cfg types.
pub const PCI_CAP_ID_VNDR: u8 = 0x09;
pub const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
pub const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
pub const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
pub const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;
pub const VIRTIO_PCI_CAP_SHARED_MEMORY_CFG: u8 = 8;

/// BAR0 layout.
pub const BAR0_INDEX: usize = 0;
pub const BAR0_SIZE: u64 = 0x8000;
pub const COMMON_CFG_OFFSET: u64 = 0x0000;
/// `struct virtio_pci_common_cfg` (up to `queue_used`).
pub const COMMON_CFG_SIZE: u64 = 0x38;
pub const ISR_OFFSET: u64 = 0x1000;
pub const DEVICE_CFG_OFFSET: u64 = 0x2000;
pub const DEVICE_CFG_MAX: u64 = 0x1000;
pub const NOTIFY_OFFSET: u64 = 0x3000;
pub const NOTIFY_MULTIPLIER: u32 = 4;
/// The shared-memory BAR.
pub const SHM_BAR_INDEX: usize = 2;

// Common configuration field offsets.
const CC_DEVICE_FEATURE_SELECT: u64 = 0x00;
const CC_DEVICE_FEATURE: u64 = 0x04;
const CC_DRIVER_FEATURE_SELECT: u64 = 0x08;
const CC_DRIVER_FEATURE: u64 = 0x0c;
const CC_MSIX_CONFIG: u64 = 0x10;
const CC_NUM_QUEUES: u64 = 0x12;
const CC_DEVICE_STATUS: u64 = 0x14;
const CC_CONFIG_GENERATION: u64 = 0x15;
const CC_QUEUE_SELECT: u64 = 0x16;
const CC_QUEUE_SIZE: u64 = 0x18;
const CC_QUEUE_MSIX_VECTOR: u64 = 0x1a;
const CC_QUEUE_ENABLE: u64 = 0x1c;
const CC_QUEUE_NOTIFY_OFF: u64 = 0x1e;
const CC_QUEUE_DESC: u64 = 0x20;
const CC_QUEUE_DRIVER: u64 = 0x28;
const CC_QUEUE_DEVICE: u64 = 0x30;

/// `(offset, size)` of every common configuration field.
const CC_FIELDS: [(u64, u64); 16] = [
    (CC_DEVICE_FEATURE_SELECT, 4),
    (CC_DEVICE_FEATURE, 4),
    (CC_DRIVER_FEATURE_SELECT, 4),
    (CC_DRIVER_FEATURE, 4),
    (CC_MSIX_CONFIG, 2),
    (CC_NUM_QUEUES, 2),
    (CC_DEVICE_STATUS, 1),
    (CC_CONFIG_GENERATION, 1),
    (CC_QUEUE_SELECT, 2),
    (CC_QUEUE_SIZE, 2),
    (CC_QUEUE_MSIX_VECTOR, 2),
    (CC_QUEUE_ENABLE, 2),
    (CC_QUEUE_NOTIFY_OFF, 2),
    (CC_QUEUE_DESC, 8),
    (CC_QUEUE_DRIVER, 8),
    (CC_QUEUE_DEVICE, 8),
];

/// A virtqueue as the driver configured it through the common configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtqConfig {
    pub index: u16,
    /// Ring size (entries).
    pub size: u16,
    pub ready: bool,
    /// Guest-physical addresses of the descriptor table, the available ("driver") ring and
    /// the used ("device") ring.
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

#[derive(Debug, Error)]
pub enum ActivateError {
    #[error("queue {0} is not set up correctly")]
    BadQueue(u16),
    #[error("device backend failed: {0}")]
    Backend(String),
}

/// What the device is, behind the virtio-pci transport.
pub trait VirtioBackend: Send {
    /// Virtio device type (`VIRTIO_ID_*`).
    fn device_type(&self) -> u32;
    /// Number of virtqueues.
    fn num_queues(&self) -> usize;
    /// Largest queue size the device accepts (a power of two).
    fn queue_max_size(&self) -> u16;
    /// Feature bits offered (the transport adds `VIRTIO_F_VERSION_1`).
    fn features(&self) -> u64;
    /// Bytes of device configuration space.
    fn config_size(&self) -> u64;
    /// Reads device configuration at `offset` (inside `config_size`).
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device configuration (ignored by default: read-only config).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let _ = (offset, data);
    }
    /// Shared-memory regions `(shmid, length)`; the transport exposes the first one.
    fn shm_regions(&self) -> Vec<(u8, u64)> {
        Vec::new()
    }
    /// MSI-X vectors the function offers (0: INTx only). The VMM must deliver them
    /// ([`VirtioPciDevice::take_msix_update`]).
    fn msix_vectors(&self) -> u16 {
        0
    }
    /// `DRIVER_OK`: the driver accepted `features` and set up the queues (all queues,
    /// enabled or not).
    fn activate(&mut self, features: u64, queues: &[VirtqConfig]) -> Result<(), ActivateError>;
    /// The driver notified queue `index` (a doorbell write on an active device).
    fn queue_notify(&mut self, index: u16) {
        let _ = index;
    }
    /// The driver reset the device (status 0); called only after a successful activate.
    fn reset(&mut self);
}

#[derive(Debug, Error)]
pub enum VirtioPciError {
    #[error("PCI configuration: {0}")]
    Config(#[from] PciConfigError),
    #[error("device type {0} has no modern PCI device id")]
    DeviceType(u32),
    #[error("shared-memory region of {0:#x} bytes cannot be a BAR")]
    ShmSize(u64),
    #[error("{0} queues do not fit the notification area")]
    Queues(usize),
    #[error("saved transport state does not fit this function: {0}")]
    Restore(&'static str),
}

/// Where the transport's BARs go (guest-physical; 0 = let the guest assign).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BarPlacement {
    pub bar0: u64,
    pub shm: u64,
}

/// Size of the BAR that covers a shared-memory region of `len` bytes.
pub fn shm_bar_size(len: u64) -> Option<u64> {
    len.checked_next_power_of_two().map(|s| s.max(0x1000))
}

/// A modern virtio-pci function over a [`VirtioBackend`].
pub struct VirtioPciDevice<B: VirtioBackend> {
    config: PciConfig,
    backend: B,
    name: String,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    status: u8,
    config_generation: u8,
    queue_select: u16,
    queues: Vec<VirtqConfig>,
    isr: u8,
    active: bool,
    notifies: u64,
    /// MSI-X state and the capability's offset in config space.
    msix: Option<(Msix, usize)>,
}

impl<B: VirtioBackend> std::fmt::Debug for VirtioPciDevice<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioPciDevice")
            .field("name", &self.name)
            .field("status", &self.status)
            .field("driver_features", &self.driver_features)
            .field("queues", &self.queues)
            .field("active", &self.active)
            .finish()
    }
}

fn cap(cfg_type: u8, bar: u8, id: u8, offset: u32, length: u32, extra: &[u8]) -> Vec<u8> {
    let len = 16 + extra.len();
    let mut v = vec![PCI_CAP_ID_VNDR, 0, len as u8, cfg_type, bar, id, 0, 0];
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&length.to_le_bytes());
    v.extend_from_slice(extra);
    v
}

impl<B: VirtioBackend> VirtioPciDevice<B> {
    /// Builds the function's configuration space for `backend`, BARs at `place`.
    pub fn new(backend: B, place: BarPlacement) -> Result<Self, VirtioPciError> {
        let dtype = backend.device_type();
        let device_id = u16::try_from(dtype)
            .ok()
            .filter(|&t| t < 0x40)
            .map(|t| VIRTIO_PCI_DEVICE_ID_BASE + t)
            .ok_or(VirtioPciError::DeviceType(dtype))?;
        let nq = backend.num_queues();
        if nq as u64 * u64::from(NOTIFY_MULTIPLIER) > BAR0_SIZE - NOTIFY_OFFSET {
            return Err(VirtioPciError::Queues(nq));
        }
        let mut config = PciConfig::new(&PciHeader {
            vendor_id: VIRTIO_PCI_VENDOR_ID,
            device_id,
            revision: 1,
            // Display controller, "other".
            class: 0x03,
            subclass: 0x80,
            prog_if: 0,
            subsystem_vendor_id: VIRTIO_PCI_VENDOR_ID,
            subsystem_id: VIRTIO_PCI_SUBSYSTEM_ID,
        });
        config.add_bar(
            BAR0_INDEX,
            BAR0_SIZE,
            BarKind::Mem64 {
                prefetchable: false,
            },
            place.bar0,
        )?;
        // INTA#; the line is left to the OS.
        config.set_interrupt(1, 0);
        let bar0 = BAR0_INDEX as u8;
        config.add_capability(
            PCI_CAP_ID_VNDR,
            &cap(
                VIRTIO_PCI_CAP_COMMON_CFG,
                bar0,
                0,
                COMMON_CFG_OFFSET as u32,
                COMMON_CFG_SIZE as u32,
                &[],
            ),
        )?;
        let notify_len = (nq as u32).max(1) * NOTIFY_MULTIPLIER;
        config.add_capability(
            PCI_CAP_ID_VNDR,
            &cap(
                VIRTIO_PCI_CAP_NOTIFY_CFG,
                bar0,
                0,
                NOTIFY_OFFSET as u32,
                notify_len,
                &NOTIFY_MULTIPLIER.to_le_bytes(),
            ),
        )?;
        config.add_capability(
            PCI_CAP_ID_VNDR,
            &cap(VIRTIO_PCI_CAP_ISR_CFG, bar0, 0, ISR_OFFSET as u32, 1, &[]),
        )?;
        let cfg_len = backend.config_size().min(DEVICE_CFG_MAX);
        if cfg_len > 0 {
            config.add_capability(
                PCI_CAP_ID_VNDR,
                &cap(
                    VIRTIO_PCI_CAP_DEVICE_CFG,
                    bar0,
                    0,
                    DEVICE_CFG_OFFSET as u32,
                    cfg_len as u32,
                    &[],
                ),
            )?;
        }
        if let Some(&(shmid, len)) = backend.shm_regions().first() {
            let size = shm_bar_size(len).ok_or(VirtioPciError::ShmSize(len))?;
            config.add_bar(
                SHM_BAR_INDEX,
                size,
                BarKind::Mem64 { prefetchable: true },
                place.shm,
            )?;
            // struct virtio_pci_cap64: offset_hi, length_hi after the 16-byte cap.
            let mut hi = Vec::with_capacity(8);
            hi.extend_from_slice(&0u32.to_le_bytes());
            hi.extend_from_slice(&((len >> 32) as u32).to_le_bytes());
            config.add_capability(
                PCI_CAP_ID_VNDR,
                &cap(
                    VIRTIO_PCI_CAP_SHARED_MEMORY_CFG,
                    SHM_BAR_INDEX as u8,
                    shmid,
                    0,
                    len as u32,
                    &hi,
                ),
            )?;
        }
        let vectors = backend.msix_vectors();
        let msix = if vectors > 0 {
            let m = Msix::new(vectors, nq);
            let off = config.add_capability(PCI_CAP_ID_MSIX, &m.capability())?;
            // Only Enable and Function Mask of message control are writable.
            config.set_write_mask(off / 4, 0xc000_0000);
            Some((m, off))
        } else {
            None
        };
        let queues = (0..nq as u16)
            .map(|i| Self::fresh_queue(&backend, i))
            .collect();
        Ok(VirtioPciDevice {
            config,
            name: format!("virtio-pci-{dtype}"),
            backend,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            queue_select: 0,
            queues,
            isr: 0,
            active: false,
            notifies: 0,
            msix,
        })
    }

    fn fresh_queue(backend: &B, index: u16) -> VirtqConfig {
        VirtqConfig {
            index,
            size: backend.queue_max_size(),
            ready: false,
            desc: 0,
            avail: 0,
            used: 0,
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }
    /// The device status register.
    pub fn status(&self) -> u8 {
        self.status
    }
    /// Features the driver accepted (valid once `FEATURES_OK` stuck).
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }
    /// Whether `DRIVER_OK` activated the backend.
    pub fn is_active(&self) -> bool {
        self.active
    }
    /// The queues as configured.
    pub fn queues(&self) -> &[VirtqConfig] {
        &self.queues
    }
    /// Doorbell writes seen on the active device.
    pub fn notifies(&self) -> u64 {
        self.notifies
    }
    /// Feature bits offered to the driver.
    pub fn device_features(&self) -> u64 {
        self.backend.features() | 1u64 << VIRTIO_F_VERSION_1
    }
    /// Marks the device configuration changed: bumps the generation and sets the ISR's
    /// config bit (interrupt delivery is the caller's business).
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.isr |= ISR_CONFIG;
    }
    /// Sets the ISR's queue bit (used buffers added).
    pub fn signal_queue(&mut self) {
        self.isr |= ISR_QUEUE;
    }
    /// The device broke (e.g. its backend went away): sets `DEVICE_NEEDS_RESET` and
    /// signals a configuration change, as virtio 1.x §2.1.2 asks; true if it did (the
    /// caller raises the interrupt). The driver recovers by resetting the device. A device
    /// in reset (status 0) is left alone: a driver that just reset it polls the status
    /// until it reads 0 (Linux's `vp_reset`), and its next `DRIVER_OK` meets the broken
    /// backend anyway.
    pub fn device_failed(&mut self) -> bool {
        if self.status == 0 {
            return false;
        }
        self.status |= STATUS_DEVICE_NEEDS_RESET;
        self.config_changed();
        true
    }
    /// The MSI-X state, if it changed since the last call (the VMM re-routes).
    pub fn take_msix_update(&mut self) -> Option<MsixState> {
        self.msix.as_mut().and_then(|(m, _)| m.take_update())
    }
    /// Sets the function's interrupt line register (the OS may overwrite it).
    pub fn set_interrupt_line(&mut self, line: u8) {
        self.config.set_interrupt(1, line);
    }

    fn reset(&mut self) {
        if self.active {
            self.backend.reset();
        }
        self.active = false;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.status = 0;
        self.queue_select = 0;
        self.isr = 0;
        if let Some((m, _)) = self.msix.as_mut() {
            // The virtio vector registers reset; the table is PCI state and stays.
            m.config_vector = VIRTIO_MSI_NO_VECTOR;
            m.queue_vectors.fill(VIRTIO_MSI_NO_VECTOR);
            m.mark_dirty();
        }
        for i in 0..self.queues.len() {
            self.queues[i] = Self::fresh_queue(&self.backend, i as u16);
        }
    }

    fn write_status(&mut self, v: u8) {
        if v == 0 {
            log::debug!("{}: reset", self.name);
            self.reset();
            return;
        }
        let old = self.status;
        let mut new = v;
        if new & STATUS_FEATURES_OK != 0 && old & STATUS_FEATURES_OK == 0 {
            let offered = self.device_features();
            let ok = self.driver_features & !offered == 0
                && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if !ok {
                log::warn!(
                    "{}: refusing FEATURES_OK for features {:#x} (offered {offered:#x})",
                    self.name,
                    self.driver_features
                );
                new &= !STATUS_FEATURES_OK;
            }
        }
        if new & STATUS_DRIVER_OK != 0 && old & STATUS_DRIVER_OK == 0 && !self.active {
            if new & STATUS_FEATURES_OK == 0 {
                log::warn!("{}: DRIVER_OK without FEATURES_OK", self.name);
                new = (new & !STATUS_DRIVER_OK) | STATUS_DEVICE_NEEDS_RESET;
            } else {
                match self.activate() {
                    Ok(()) => self.active = true,
                    Err(e) => {
                        log::warn!("{}: activation failed: {e}", self.name);
                        new |= STATUS_DEVICE_NEEDS_RESET;
                        self.config_changed();
                    }
                }
            }
        }
        // The driver cannot clear DEVICE_NEEDS_RESET except by a reset.
        self.status = new | (old & STATUS_DEVICE_NEEDS_RESET);
    }

    fn activate(&mut self) -> Result<(), ActivateError> {
        let max = self.backend.queue_max_size();
        for q in self.queues.iter().filter(|q| q.ready) {
            if q.size == 0 || q.size > max || !q.size.is_power_of_two() {
                return Err(ActivateError::BadQueue(q.index));
            }
        }
        log::debug!(
            "{}: DRIVER_OK, features {:#x}, queues {:x?}",
            self.name,
            self.driver_features,
            self.queues
        );
        self.backend.activate(self.driver_features, &self.queues)
    }

    fn selected_queue(&self) -> Option<&VirtqConfig> {
        self.queues.get(usize::from(self.queue_select))
    }

    fn common_field_read(&self, field: u64) -> u64 {
        let q = self.selected_queue();
        match field {
            CC_DEVICE_FEATURE_SELECT => u64::from(self.device_feature_select),
            CC_DEVICE_FEATURE => match self.device_feature_select {
                0 => self.device_features() & 0xffff_ffff,
                1 => self.device_features() >> 32,
                _ => 0,
            },
            CC_DRIVER_FEATURE_SELECT => u64::from(self.driver_feature_select),
            CC_DRIVER_FEATURE => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            CC_MSIX_CONFIG => u64::from(
                self.msix
                    .as_ref()
                    .map_or(VIRTIO_MSI_NO_VECTOR, |(m, _)| m.config_vector),
            ),
            CC_QUEUE_MSIX_VECTOR => u64::from(
                self.msix
                    .as_ref()
                    .and_then(|(m, _)| m.queue_vectors.get(usize::from(self.queue_select)))
                    .copied()
                    .unwrap_or(VIRTIO_MSI_NO_VECTOR),
            ),
            CC_NUM_QUEUES => self.queues.len() as u64,
            CC_DEVICE_STATUS => u64::from(self.status),
            CC_CONFIG_GENERATION => u64::from(self.config_generation),
            CC_QUEUE_SELECT => u64::from(self.queue_select),
            CC_QUEUE_SIZE => q.map_or(0, |q| u64::from(q.size)),
            CC_QUEUE_ENABLE => q.map_or(0, |q| u64::from(q.ready)),
            CC_QUEUE_NOTIFY_OFF => q.map_or(0, |q| u64::from(q.index)),
            CC_QUEUE_DESC => q.map_or(0, |q| q.desc),
            CC_QUEUE_DRIVER => q.map_or(0, |q| q.avail),
            CC_QUEUE_DEVICE => q.map_or(0, |q| q.used),
            _ => 0,
        }
    }

    fn common_field_write(&mut self, field: u64, v: u64) {
        let locked = self.status & STATUS_FEATURES_OK != 0;
        let max = self.backend.queue_max_size();
        match field {
            CC_DEVICE_FEATURE_SELECT => self.device_feature_select = v as u32,
            CC_DRIVER_FEATURE_SELECT => self.driver_feature_select = v as u32,
            CC_DRIVER_FEATURE if !locked => match self.driver_feature_select {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v,
                1 => self.driver_features = (self.driver_features & 0xffff_ffff) | v << 32,
                _ => {}
            },
            CC_DEVICE_STATUS => self.write_status(v as u8),
            CC_QUEUE_SELECT => self.queue_select = v as u16,
            CC_MSIX_CONFIG => {
                if let Some((m, _)) = self.msix.as_mut() {
                    m.config_vector = m.checked_vector(v as u16);
                    m.mark_dirty();
                }
            }
            CC_QUEUE_MSIX_VECTOR => {
                let sel = usize::from(self.queue_select);
                if let Some((m, _)) = self.msix.as_mut() {
                    let vector = m.checked_vector(v as u16);
                    if let Some(q) = m.queue_vectors.get_mut(sel) {
                        *q = vector;
                        m.mark_dirty();
                    }
                }
            }
            _ => {
                let sel = usize::from(self.queue_select);
                let Some(q) = self.queues.get_mut(sel) else {
                    return;
                };
                if q.ready {
                    // A live queue's configuration is fixed until reset.
                    return;
                }
                match field {
                    CC_QUEUE_SIZE => {
                        let s = v as u16;
                        if s != 0 && s <= max && s.is_power_of_two() {
                            q.size = s;
                        } else {
                            log::debug!("{}: queue {sel}: bad size {s} ignored", self.name);
                        }
                    }
                    CC_QUEUE_ENABLE if v == 1 => q.ready = true,
                    CC_QUEUE_DESC => q.desc = v,
                    CC_QUEUE_DRIVER => q.avail = v,
                    CC_QUEUE_DEVICE => q.used = v,
                    _ => {}
                }
            }
        }
    }

    /// The common-configuration field that holds `[off, off + len)` entirely.
    fn common_field(off: u64, len: usize) -> Option<(u64, u64)> {
        let end = off.checked_add(len as u64)?;
        CC_FIELDS
            .iter()
            .copied()
            .find(|&(f, size)| off >= f && end <= f + size)
    }

    fn common_read(&self, off: u64, data: &mut [u8]) {
        match Self::common_field(off, data.len()) {
            Some((f, _)) => {
                let v = self.common_field_read(f).to_le_bytes();
                let s = (off - f) as usize;
                data.copy_from_slice(&v[s..s + data.len()]);
            }
            None => data.fill(0),
        }
    }

    fn common_write(&mut self, off: u64, data: &[u8]) {
        let Some((f, _)) = Self::common_field(off, data.len()) else {
            log::debug!("{}: odd common-config write at {off:#x}", self.name);
            return;
        };
        // Partial writes (a 64-bit address as two dwords) merge into the current value.
        let mut v = self.common_field_read(f).to_le_bytes();
        let s = (off - f) as usize;
        v[s..s + data.len()].copy_from_slice(data);
        self.common_field_write(f, u64::from_le_bytes(v));
    }

    fn bar0_read(&mut self, off: u64, data: &mut [u8]) {
        let len = data.len() as u64;
        if let Some((m, _)) = self
            .msix
            .as_ref()
            .filter(|(m, _)| m.covers(off, data.len()))
        {
            m.read(off, data);
            return;
        }
        match off {
            o if o + len <= COMMON_CFG_OFFSET + COMMON_CFG_SIZE => {
                self.common_read(o - COMMON_CFG_OFFSET, data)
            }
            ISR_OFFSET => {
                // Read to clear.
                data.fill(0);
                if let Some(b) = data.first_mut() {
                    *b = std::mem::take(&mut self.isr);
                }
            }
            o if o >= DEVICE_CFG_OFFSET
                && o + len
                    <= DEVICE_CFG_OFFSET + self.backend.config_size().min(DEVICE_CFG_MAX) =>
            {
                self.backend.read_config(o - DEVICE_CFG_OFFSET, data)
            }
            _ => data.fill(0),
        }
    }

    fn bar0_write(&mut self, off: u64, data: &[u8]) {
        let len = data.len() as u64;
        if let Some((m, _)) = self
            .msix
            .as_mut()
            .filter(|(m, _)| m.covers(off, data.len()))
        {
            m.write(off, data);
            return;
        }
        let notify_end = NOTIFY_OFFSET + self.queues.len() as u64 * u64::from(NOTIFY_MULTIPLIER);
        match off {
            o if o + len <= COMMON_CFG_OFFSET + COMMON_CFG_SIZE => {
                self.common_write(o - COMMON_CFG_OFFSET, data)
            }
            o if o >= DEVICE_CFG_OFFSET
                && o + len
                    <= DEVICE_CFG_OFFSET + self.backend.config_size().min(DEVICE_CFG_MAX) =>
            {
                self.backend.write_config(o - DEVICE_CFG_OFFSET, data)
            }
            o if o >= NOTIFY_OFFSET && o < notify_end => {
                let q = (o - NOTIFY_OFFSET) / u64::from(NOTIFY_MULTIPLIER);
                match u16::try_from(q) {
                    Ok(q) if usize::from(q) < self.queues.len() && self.active => {
                        self.notifies += 1;
                        self.backend.queue_notify(q);
                    }
                    _ => log::debug!("{}: doorbell for queue {q} ignored", self.name),
                }
            }
            _ => {}
        }
    }
}

impl<B: VirtioBackend + 'static> PciDevice for VirtioPciDevice<B> {
    fn name(&self) -> &str {
        &self.name
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn config(&self) -> &PciConfig {
        &self.config
    }
    fn config_mut(&mut self) -> &mut PciConfig {
        &mut self.config
    }
    fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) {
        self.config.write_reg(reg, offset, data);
        if let Some((m, cap)) = self.msix.as_mut() {
            if reg == *cap / 4 {
                m.set_control((self.config.read_reg(reg) >> 16) as u16);
            }
        }
    }
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        match bar {
            BAR0_INDEX => self.bar0_read(offset, data),
            // The shared-memory BAR where no memslot backs it (a stub, or past the
            // region's end): reads as zero.
            _ => data.fill(0),
        }
    }
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar == BAR0_INDEX {
            self.bar0_write(offset, data);
        }
    }
}

#[cfg(test)]
mod tests;
