//! A stand-in vgpu device behind the virtio-pci transport: it reports the vgpu
//! [`DeviceConfig`], offers the shared-memory region, accepts any queue setup and
//! ignores doorbells. The vhost-user frontend replaces it in the real VMM.

use vgpu_protocol::device::{
    DeviceConfig, APERTURE_OFFSET, APERTURE_SIZE, CHANNEL_SLOTS, NUM_QUEUES, QUEUE_SIZE,
    SHM_REGION_ID, SHM_SIZE, VIRTIO_ID_VGPU,
};
use vgpu_protocol::PROTOCOL_VERSION;

use super::{ActivateError, VirtioBackend, VirtqConfig};

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct StubBackend {
    config: [u8; DeviceConfig::SIZE],
    /// Features and queues of the last activation.
    pub activated: Option<(u64, Vec<VirtqConfig>)>,
    /// Doorbells per queue.
    pub notified: Vec<u64>,
    pub resets: u64,
}

impl StubBackend {
    /// A device that claims `vram_bytes` of VRAM.
    pub fn new(vram_bytes: u64) -> Self {
        let cfg = DeviceConfig {
            version: PROTOCOL_VERSION,
            channel_slots: CHANNEL_SLOTS,
            aperture_offset: APERTURE_OFFSET,
            aperture_size: APERTURE_SIZE,
            vram_bytes,
        };
        StubBackend {
            config: cfg.encode(),
            activated: None,
            notified: vec![0; NUM_QUEUES],
            resets: 0,
        }
    }
}

impl VirtioBackend for StubBackend {
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
        0
    }
    fn config_size(&self) -> u64 {
        DeviceConfig::SIZE as u64
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
    fn activate(&mut self, features: u64, queues: &[VirtqConfig]) -> Result<(), ActivateError> {
        log::info!("vgpu stub: activated with features {features:#x}, queues {queues:x?}");
        self.activated = Some((features, queues.to_vec()));
        Ok(())
    }
    fn queue_notify(&mut self, index: u16) {
        if let Some(n) = self.notified.get_mut(usize::from(index)) {
            *n += 1;
        }
    }
    fn reset(&mut self) {
        self.activated = None;
        self.resets += 1;
    }
}
