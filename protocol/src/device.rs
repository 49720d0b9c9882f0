//! The virtio device: id, queues, feature bits, config space and the shared-memory
//! region layout.

/// Virtio device id of vgpu. Unassigned in the virtio 1.3 registry (which stops below
/// this); a modern virtio-pci function shows it as PCI device id `0x1040 + 60 = 0x107c`.
pub const VIRTIO_ID_VGPU: u32 = 60;

/// Virtqueue indices.
pub const CONTROL_QUEUE: u16 = 0;
pub const EVENT_QUEUE: u16 = 1;
pub const NUM_QUEUES: usize = 2;
/// Queue size the device offers (and our frontends use).
pub const QUEUE_SIZE: u16 = 256;
/// Largest queue a frontend may set up: vhost-user has no message that tells the frontend
/// the device's limit, and QEMU's generic vhost-user device sets its rings up with 1024
/// entries (virtio's `VIRTQUEUE_MAX_SIZE`, what its guests saw) whatever its `vq_size`.
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// Device feature bit 0, `VIRTIO_VGPU_F_FORWARDED`: the device accepts channels without the
/// shared-memory region. A driver that acks it (it does so only when it found no region)
/// gets channels with no slot ([`NO_SLOT`]), submits with `SUBMIT` and reads completions
/// with `CHANNEL_STATUS` (protocol.md §9, "Forwarded submission").
pub const VIRTIO_VGPU_F_FORWARDED: u32 = 0;

/// The slot `CREATE_CHANNEL` returns for a channel that has no page in the region
/// (forwarded submission).
pub const NO_SLOT: u32 = u32::MAX;

/// Shared-memory region id of the BAR window (GET_SHMEM_CONFIG / virtio shm cap).
pub const SHM_REGION_ID: u8 = 0;
/// Number of channel control-page slots at the start of the region.
pub const CHANNEL_SLOTS: u32 = 1024;
/// Offset of the VRAM aperture window in the region (right after the slots).
pub const APERTURE_OFFSET: u64 = CHANNEL_SLOTS as u64 * crate::PAGE_SIZE;
/// Size of the whole shared-memory region: 256 MiB. A power of two, because a frontend
/// that puts the region in a PCI BAR of its own size (QEMU's vhost-user devices) must.
pub const SHM_SIZE: u64 = 256 << 20;
/// Size of the VRAM aperture window: the rest of the region after the slots (252 MiB).
pub const APERTURE_SIZE: u64 = SHM_SIZE - APERTURE_OFFSET;

const _: () = assert!(SHM_SIZE.is_power_of_two() && APERTURE_OFFSET < SHM_SIZE);

/// Byte offset of a control-page slot in the region.
pub fn slot_offset(slot: u32) -> Option<u64> {
    (slot < CHANNEL_SLOTS).then(|| slot as u64 * crate::PAGE_SIZE)
}

/// Device config space (read-only for the driver), little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    pub version: u32,
    pub channel_slots: u32,
    pub aperture_offset: u64,
    pub aperture_size: u64,
    pub vram_bytes: u64,
}

impl DeviceConfig {
    pub const SIZE: usize = 32;

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&self.version.to_le_bytes());
        b[4..8].copy_from_slice(&self.channel_slots.to_le_bytes());
        b[8..16].copy_from_slice(&self.aperture_offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.aperture_size.to_le_bytes());
        b[24..32].copy_from_slice(&self.vram_bytes.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        let b: &[u8; Self::SIZE] = b.get(..Self::SIZE)?.try_into().ok()?;
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u32_at(o) as u64 | (u32_at(o + 4) as u64) << 32;
        Some(DeviceConfig {
            version: u32_at(0),
            channel_slots: u32_at(4),
            aperture_offset: u64_at(8),
            aperture_size: u64_at(16),
            vram_bytes: u64_at(24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        assert_eq!(slot_offset(0), Some(0));
        assert_eq!(slot_offset(CHANNEL_SLOTS - 1), Some(APERTURE_OFFSET - 4096));
        assert_eq!(slot_offset(CHANNEL_SLOTS), None);
        let c = DeviceConfig {
            version: 1,
            channel_slots: 2,
            aperture_offset: 3,
            aperture_size: 4,
            vram_bytes: 5,
        };
        assert_eq!(DeviceConfig::decode(&c.encode()), Some(c));
        assert_eq!(DeviceConfig::decode(&[0; 31]), None);
    }
}
