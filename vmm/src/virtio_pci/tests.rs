//! Drives the transport through a PCI bus the way Linux's `virtio_pci_modern` does.

use super::stub::StubBackend;
use super::*;
use crate::pci::{PciBus, PCI_CONFIG_ADDRESS, PCI_CONFIG_DATA};
use vgpu_protocol::device::{DeviceConfig, SHM_SIZE};

const BAR0: u64 = 0xe000_0000;
const SHM: u64 = 0xc000_0000;

struct Guest {
    bus: PciBus,
    slot: u8,
}

impl Guest {
    fn new() -> Self {
        let mut bus = PciBus::new();
        let dev = VirtioPciDevice::new(
            StubBackend::new(1 << 30),
            BarPlacement {
                bar0: BAR0,
                shm: SHM,
            },
        )
        .unwrap();
        let slot = bus.add_device(Box::new(dev)).unwrap();
        Guest { bus, slot }
    }

    fn cfg32(&mut self, off: usize) -> u32 {
        let a = 0x8000_0000u32 | u32::from(self.slot) << 11 | (off as u32 & 0xfc);
        self.bus.pio_write(PCI_CONFIG_ADDRESS, &a.to_le_bytes());
        let mut d = [0u8; 4];
        self.bus.pio_read(PCI_CONFIG_DATA, &mut d);
        u32::from_le_bytes(d)
    }
    fn cfg8(&mut self, off: usize) -> u8 {
        (self.cfg32(off & !3) >> ((off & 3) * 8)) as u8
    }
    fn cfg_write32(&mut self, off: usize, v: u32) {
        let a = 0x8000_0000u32 | u32::from(self.slot) << 11 | (off as u32 & 0xfc);
        self.bus.pio_write(PCI_CONFIG_ADDRESS, &a.to_le_bytes());
        self.bus.pio_write(PCI_CONFIG_DATA, &v.to_le_bytes());
    }

    fn r8(&mut self, addr: u64) -> u8 {
        let mut d = [0u8; 1];
        assert!(self.bus.mmio_read(addr, &mut d), "no BAR at {addr:#x}");
        d[0]
    }
    fn r16(&mut self, addr: u64) -> u16 {
        let mut d = [0u8; 2];
        assert!(self.bus.mmio_read(addr, &mut d));
        u16::from_le_bytes(d)
    }
    fn r32(&mut self, addr: u64) -> u32 {
        let mut d = [0u8; 4];
        assert!(self.bus.mmio_read(addr, &mut d));
        u32::from_le_bytes(d)
    }
    fn w8(&mut self, addr: u64, v: u8) {
        assert!(self.bus.mmio_write(addr, &[v]));
    }
    fn w16(&mut self, addr: u64, v: u16) {
        assert!(self.bus.mmio_write(addr, &v.to_le_bytes()));
    }
    fn w32(&mut self, addr: u64, v: u32) {
        assert!(self.bus.mmio_write(addr, &v.to_le_bytes()));
    }
    fn w64(&mut self, addr: u64, v: u64) {
        // As Linux's vp_iowrite64_twopart: low dword, then high.
        self.w32(addr, v as u32);
        self.w32(addr + 4, (v >> 32) as u32);
    }

    fn dev(&self) -> &VirtioPciDevice<StubBackend> {
        self.bus
            .device(self.slot)
            .and_then(|d| d.as_any().downcast_ref())
            .unwrap()
    }

    fn dev_mut(&mut self) -> &mut VirtioPciDevice<StubBackend> {
        self.bus
            .device_mut(self.slot)
            .and_then(|d| d.as_any_mut().downcast_mut())
            .unwrap()
    }

    /// Walks the capability list: `(cfg_type, bar, id, offset, length, cap offset)`.
    fn virtio_caps(&mut self) -> Vec<(u8, u8, u8, u64, u64, usize)> {
        assert_ne!(self.cfg32(0x04) >> 16 & 0x10, 0, "capability list bit");
        let mut caps = Vec::new();
        let mut p = usize::from(self.cfg8(0x34));
        while p != 0 {
            assert_eq!(self.cfg8(p), PCI_CAP_ID_VNDR);
            let len = self.cfg8(p + 2);
            let cfg_type = self.cfg8(p + 3);
            let bar = self.cfg8(p + 4);
            let id = self.cfg8(p + 5);
            let mut offset = u64::from(self.cfg32(p + 8));
            let mut length = u64::from(self.cfg32(p + 12));
            if cfg_type == VIRTIO_PCI_CAP_SHARED_MEMORY_CFG {
                assert_eq!(len, 24);
                offset |= u64::from(self.cfg32(p + 16)) << 32;
                length |= u64::from(self.cfg32(p + 20)) << 32;
            }
            caps.push((cfg_type, bar, id, offset, length, p));
            p = usize::from(self.cfg8(p + 1));
        }
        caps
    }
}

const CC: u64 = BAR0 + COMMON_CFG_OFFSET;

#[test]
fn ids_bars_and_capabilities() {
    let mut g = Guest::new();
    assert_eq!(g.cfg32(0x00), 0x107c_1af4);
    assert_eq!(g.cfg8(0x08), 1, "modern devices have revision >= 1");
    assert_eq!(g.cfg32(0x2c), 0x0040_1af4);
    assert_eq!(g.cfg8(0x3d), 1, "INTA#");
    // BAR0: 64-bit memory at BAR0, sized 16 KiB.
    assert_eq!(g.cfg32(0x10), BAR0 as u32 | 0x4);
    g.cfg_write32(0x10, 0xffff_ffff);
    g.cfg_write32(0x14, 0xffff_ffff);
    assert_eq!(g.cfg32(0x10), !(BAR0_SIZE as u32 - 1) | 0x4);
    g.cfg_write32(0x10, BAR0 as u32);
    g.cfg_write32(0x14, 0);
    // BAR2: 64-bit prefetchable covering SHM_SIZE.
    let shm_bar = shm_bar_size(SHM_SIZE).unwrap();
    assert!(shm_bar >= SHM_SIZE);
    assert_eq!(g.cfg32(0x18), SHM as u32 | 0xc);
    g.cfg_write32(0x18, 0xffff_ffff);
    assert_eq!(g.cfg32(0x18), !(shm_bar as u32 - 1) | 0xc);
    g.cfg_write32(0x18, SHM as u32);
    assert_eq!(g.cfg32(0x20), 0, "BAR4 unused");

    let caps = g.virtio_caps();
    let types: Vec<u8> = caps.iter().map(|c| c.0).collect();
    assert_eq!(
        types,
        [
            VIRTIO_PCI_CAP_COMMON_CFG,
            VIRTIO_PCI_CAP_NOTIFY_CFG,
            VIRTIO_PCI_CAP_ISR_CFG,
            VIRTIO_PCI_CAP_DEVICE_CFG,
            VIRTIO_PCI_CAP_SHARED_MEMORY_CFG
        ]
    );
    let notify = caps[1];
    assert_eq!((notify.1, notify.3), (0, NOTIFY_OFFSET));
    assert_eq!(g.cfg32(notify.5 + 16), NOTIFY_MULTIPLIER);
    assert_eq!(caps[3].4, DeviceConfig::SIZE as u64);
    let shm = caps[4];
    assert_eq!((shm.1, shm.2, shm.3, shm.4), (2, 0, 0, SHM_SIZE));
    // Every region lies inside its BAR.
    for c in &caps[..4] {
        assert!(c.3 + c.4 <= BAR0_SIZE);
    }
}

#[test]
fn linux_driver_sequence() {
    let mut g = Guest::new();
    // pci_enable_device: memory decoding on.
    g.cfg_write32(0x04, 0x6);
    // vp_modern_probe / virtio core: reset and wait for 0, ACKNOWLEDGE, DRIVER.
    g.w8(CC + CC_DEVICE_STATUS, 0);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS), 0);
    g.w8(CC + CC_DEVICE_STATUS, STATUS_ACKNOWLEDGE);
    g.w8(CC + CC_DEVICE_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    assert_eq!(g.r16(CC + CC_NUM_QUEUES), 2);
    assert_eq!(g.r16(CC + CC_MSIX_CONFIG), VIRTIO_MSI_NO_VECTOR);

    // Device config: the vgpu DeviceConfig, read under a stable generation.
    let gen = g.r8(CC + CC_CONFIG_GENERATION);
    let mut raw = Vec::new();
    for i in 0..DeviceConfig::SIZE as u64 / 4 {
        raw.extend_from_slice(&g.r32(BAR0 + DEVICE_CFG_OFFSET + 4 * i).to_le_bytes());
    }
    assert_eq!(g.r8(CC + CC_CONFIG_GENERATION), gen);
    let cfg = DeviceConfig::decode(&raw).unwrap();
    assert_eq!(cfg.channel_slots, vgpu_protocol::device::CHANNEL_SLOTS);
    assert_eq!(cfg.vram_bytes, 1 << 30);
    // Past the config: zero.
    assert_eq!(
        g.r32(BAR0 + DEVICE_CFG_OFFSET + DeviceConfig::SIZE as u64),
        0
    );

    // Features: 64 bits through the select register.
    g.w32(CC + CC_DEVICE_FEATURE_SELECT, 0);
    let lo = g.r32(CC + CC_DEVICE_FEATURE);
    g.w32(CC + CC_DEVICE_FEATURE_SELECT, 1);
    let hi = g.r32(CC + CC_DEVICE_FEATURE);
    let offered = u64::from(hi) << 32 | u64::from(lo);
    assert_eq!(offered, 1 << VIRTIO_F_VERSION_1);
    g.w32(CC + CC_DRIVER_FEATURE_SELECT, 0);
    g.w32(CC + CC_DRIVER_FEATURE, lo);
    g.w32(CC + CC_DRIVER_FEATURE_SELECT, 1);
    g.w32(CC + CC_DRIVER_FEATURE, hi);
    let s = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
    g.w8(CC + CC_DEVICE_STATUS, s);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS), s, "FEATURES_OK accepted");
    // Features are locked now.
    g.w32(CC + CC_DRIVER_FEATURE, 0);
    assert_eq!(g.dev().driver_features(), offered);

    // Queue setup, as vp_modern setup_vq.
    let rings = [
        (0x10_0000u64, 0x10_1000u64, 0x10_2000u64),
        (0x20_0000, 0x20_1000, 0x20_2000),
    ];
    for (q, &(desc, avail, used)) in rings.iter().enumerate() {
        g.w16(CC + CC_QUEUE_SELECT, q as u16);
        assert_eq!(g.r16(CC + CC_QUEUE_SIZE), 256);
        assert_eq!(g.r16(CC + CC_QUEUE_ENABLE), 0);
        g.w16(CC + CC_QUEUE_SIZE, 128);
        g.w64(CC + CC_QUEUE_DESC, desc);
        g.w64(CC + CC_QUEUE_DRIVER, avail);
        g.w64(CC + CC_QUEUE_DEVICE, used);
        assert_eq!(g.r16(CC + CC_QUEUE_NOTIFY_OFF), q as u16);
        assert_eq!(g.r16(CC + CC_QUEUE_MSIX_VECTOR), VIRTIO_MSI_NO_VECTOR);
        g.w16(CC + CC_QUEUE_ENABLE, 1);
        assert_eq!(g.r16(CC + CC_QUEUE_ENABLE), 1);
        // Read back a 64-bit address as two dwords.
        let lo = g.r32(CC + CC_QUEUE_DESC);
        let hi = g.r32(CC + CC_QUEUE_DESC + 4);
        assert_eq!(u64::from(hi) << 32 | u64::from(lo), desc);
        // A live queue is fixed.
        g.w16(CC + CC_QUEUE_SIZE, 64);
        assert_eq!(g.r16(CC + CC_QUEUE_SIZE), 128);
    }
    // A queue that does not exist reads size 0 (the driver's "no such queue").
    g.w16(CC + CC_QUEUE_SELECT, 2);
    assert_eq!(g.r16(CC + CC_QUEUE_SIZE), 0);
    g.w16(CC + CC_QUEUE_ENABLE, 1);

    // Doorbells before DRIVER_OK are dropped.
    g.w16(BAR0 + NOTIFY_OFFSET, 0);
    assert_eq!(g.dev().notifies(), 0);

    g.w8(CC + CC_DEVICE_STATUS, s | STATUS_DRIVER_OK);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS), s | STATUS_DRIVER_OK);
    assert!(g.dev().is_active());
    let (features, queues) = g.dev().backend().activated.clone().unwrap();
    assert_eq!(features, offered);
    assert_eq!(queues.len(), 2);
    assert_eq!(
        queues[1],
        VirtqConfig {
            index: 1,
            size: 128,
            ready: true,
            desc: 0x20_0000,
            avail: 0x20_1000,
            used: 0x20_2000,
        }
    );

    // Doorbells: queue 1's notify address, and one past the queues (ignored).
    g.w16(BAR0 + NOTIFY_OFFSET + u64::from(NOTIFY_MULTIPLIER), 1);
    g.w16(BAR0 + NOTIFY_OFFSET + 2 * u64::from(NOTIFY_MULTIPLIER), 2);
    assert_eq!(g.dev().backend().notified, vec![0, 1]);

    // ISR is read-to-clear.
    assert_eq!(g.r8(BAR0 + ISR_OFFSET), 0);

    // Reset: everything back, the backend told.
    g.w8(CC + CC_DEVICE_STATUS, 0);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS), 0);
    assert!(!g.dev().is_active());
    assert_eq!(g.dev().backend().resets, 1);
    assert!(g.dev().backend().activated.is_none());
    g.w16(CC + CC_QUEUE_SELECT, 1);
    assert_eq!(g.r16(CC + CC_QUEUE_SIZE), 256);
    assert_eq!(g.r16(CC + CC_QUEUE_ENABLE), 0);
    assert_eq!(g.dev().driver_features(), 0);
}

#[test]
fn feature_negotiation_failures() {
    let mut g = Guest::new();
    g.cfg_write32(0x04, 0x2);
    g.w8(CC + CC_DEVICE_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    // A legacy driver (no VERSION_1): FEATURES_OK does not stick.
    g.w32(CC + CC_DRIVER_FEATURE_SELECT, 0);
    g.w32(CC + CC_DRIVER_FEATURE, 0);
    let s = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
    g.w8(CC + CC_DEVICE_STATUS, s);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS), s & !STATUS_FEATURES_OK);
    // A feature not offered: refused too.
    g.w32(CC + CC_DRIVER_FEATURE_SELECT, 1);
    g.w32(CC + CC_DRIVER_FEATURE, 1 | 2);
    g.w8(CC + CC_DEVICE_STATUS, s);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS) & STATUS_FEATURES_OK, 0);
    // DRIVER_OK without FEATURES_OK: needs reset, no activation.
    g.w8(
        CC + CC_DEVICE_STATUS,
        STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_DRIVER_OK,
    );
    let st = g.r8(CC + CC_DEVICE_STATUS);
    assert_ne!(st & STATUS_DEVICE_NEEDS_RESET, 0);
    assert_eq!(st & STATUS_DRIVER_OK, 0);
    assert!(!g.dev().is_active());
    // Only the right feature set, after a reset.
    g.w8(CC + CC_DEVICE_STATUS, 0);
    g.w8(CC + CC_DEVICE_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    g.w32(CC + CC_DRIVER_FEATURE_SELECT, 1);
    g.w32(CC + CC_DRIVER_FEATURE, 1);
    g.w8(CC + CC_DEVICE_STATUS, s);
    assert_eq!(g.r8(CC + CC_DEVICE_STATUS), s);
    // Bad queue sizes are ignored.
    g.w16(CC + CC_QUEUE_SELECT, 0);
    for bad in [0u16, 3, 512] {
        g.w16(CC + CC_QUEUE_SIZE, bad);
        assert_eq!(g.r16(CC + CC_QUEUE_SIZE), 256);
    }
    // Odd accesses: a 4-byte read across two fields, a write past the common config.
    assert_eq!(g.r32(CC + CC_NUM_QUEUES), 0);
    g.w32(CC + 0x36, 0xffff_ffff);
    // The shared-memory BAR without a memslot reads zero.
    assert_eq!(g.r32(SHM + 0x1000), 0);
    // Config change: generation moves, ISR bit set and cleared by the read.
    g.bus
        .device_mut(g.slot)
        .and_then(|d| {
            d.as_any_mut()
                .downcast_mut::<VirtioPciDevice<StubBackend>>()
        })
        .unwrap()
        .config_changed();
    assert_eq!(g.r8(CC + CC_CONFIG_GENERATION), 1);
    assert_eq!(g.r8(BAR0 + ISR_OFFSET), ISR_CONFIG);
    assert_eq!(g.r8(BAR0 + ISR_OFFSET), 0);
}

#[test]
fn bad_device_types() {
    struct Odd(u32, usize);
    impl VirtioBackend for Odd {
        fn device_type(&self) -> u32 {
            self.0
        }
        fn num_queues(&self) -> usize {
            self.1
        }
        fn queue_max_size(&self) -> u16 {
            16
        }
        fn features(&self) -> u64 {
            0
        }
        fn config_size(&self) -> u64 {
            0
        }
        fn read_config(&self, _: u64, d: &mut [u8]) {
            d.fill(0)
        }
        fn activate(&mut self, _: u64, _: &[VirtqConfig]) -> Result<(), ActivateError> {
            Err(ActivateError::Backend("no".into()))
        }
        fn reset(&mut self) {}
    }
    assert!(matches!(
        VirtioPciDevice::new(Odd(0x40, 1), BarPlacement::default()),
        Err(VirtioPciError::DeviceType(0x40))
    ));
    assert!(matches!(
        VirtioPciDevice::new(Odd(1, 10_000), BarPlacement::default()),
        Err(VirtioPciError::Queues(10_000))
    ));
    // A failing backend: DRIVER_OK turns into DEVICE_NEEDS_RESET.
    let mut d = VirtioPciDevice::new(Odd(1, 1), BarPlacement::default()).unwrap();
    let s = STATUS_ACKNOWLEDGE | STATUS_DRIVER;
    d.bar_write(0, CC_DEVICE_STATUS, &[s]);
    d.bar_write(0, CC_DRIVER_FEATURE_SELECT, &1u32.to_le_bytes());
    d.bar_write(0, CC_DRIVER_FEATURE, &1u32.to_le_bytes());
    d.bar_write(0, CC_DEVICE_STATUS, &[s | STATUS_FEATURES_OK]);
    d.bar_write(
        0,
        CC_DEVICE_STATUS,
        &[s | STATUS_FEATURES_OK | STATUS_DRIVER_OK],
    );
    assert_ne!(d.status() & STATUS_DEVICE_NEEDS_RESET, 0);
    assert!(!d.is_active());
    // No device config capability when the config is empty; no shm BAR.
    assert_eq!(d.config().bar(SHM_BAR_INDEX), None);
}

#[test]
fn a_failed_device_asks_for_a_reset_unless_it_is_in_reset() {
    let mut d = VirtioPciDevice::new(StubBackend::new(0), BarPlacement::default()).unwrap();
    // In reset (status 0): a driver that just wrote 0 polls until it reads 0 again.
    assert!(!d.device_failed());
    assert_eq!(d.status(), 0);
    d.bar_write(0, CC_DEVICE_STATUS, &[STATUS_ACKNOWLEDGE]);
    assert!(d.device_failed());
    assert_ne!(d.status() & STATUS_DEVICE_NEEDS_RESET, 0);
    // The configuration interrupt's cause is in the ISR (read to clear).
    let mut isr = [0u8];
    d.bar_read(0, ISR_OFFSET, &mut isr);
    assert_ne!(isr[0] & ISR_CONFIG, 0);
    // Only a reset clears it.
    d.bar_write(0, CC_DEVICE_STATUS, &[STATUS_ACKNOWLEDGE | STATUS_DRIVER]);
    assert_ne!(d.status() & STATUS_DEVICE_NEEDS_RESET, 0);
    d.bar_write(0, CC_DEVICE_STATUS, &[0]);
    assert_eq!(d.status(), 0);
}

/// Live migration: a transport the guest set up moves to a fresh function; the fresh one
/// then answers the guest as the old one did (status, queues, MSI-X, BARs) without the
/// backend being activated again, and a different function refuses the state.
#[test]
fn transport_state_moves_to_a_fresh_function() {
    let mut g = Guest::new();
    g.cfg_write32(0x04, 0x6);
    g.w8(CC + CC_DEVICE_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    g.w32(CC + CC_DRIVER_FEATURE_SELECT, 1);
    g.w32(CC + CC_DRIVER_FEATURE, 1);
    let s = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
    g.w8(CC + CC_DEVICE_STATUS, s);
    g.w16(CC + CC_QUEUE_SELECT, 1);
    g.w16(CC + CC_QUEUE_SIZE, 64);
    g.w64(CC + CC_QUEUE_DESC, 0x30_0000);
    g.w64(CC + CC_QUEUE_DRIVER, 0x30_1000);
    g.w64(CC + CC_QUEUE_DEVICE, 0x30_2000);
    g.w16(CC + CC_QUEUE_MSIX_VECTOR, 1);
    g.w16(CC + CC_QUEUE_ENABLE, 1);
    g.w8(CC + CC_DEVICE_STATUS, s | STATUS_DRIVER_OK);
    let saved = g.dev().transport_state();
    assert!(saved.active);

    let mut h = Guest::new();
    let slot = h.slot;
    let dev = h.dev_mut();
    dev.restore_transport(&saved).unwrap();
    assert!(
        dev.backend().activated.is_none(),
        "restore does not activate"
    );
    assert_eq!(dev.transport_state(), saved);
    assert_eq!(
        dev.take_msix_update().is_some(),
        saved.msix.is_some(),
        "MSI-X routes are re-read"
    );
    h.bus.refresh_slot(slot);
    assert!(!h.bus.take_bar_events().is_empty(), "the BARs decode again");
    assert_eq!(h.r8(CC + CC_DEVICE_STATUS), s | STATUS_DRIVER_OK);
    h.w16(CC + CC_QUEUE_SELECT, 1);
    assert_eq!(h.r16(CC + CC_QUEUE_SIZE), 64);
    assert_eq!(
        h.r16(CC + CC_QUEUE_MSIX_VECTOR),
        g.r16(CC + CC_QUEUE_MSIX_VECTOR)
    );
    assert_eq!(h.cfg32(0x04) & 0x6, 0x6);

    // Another layout: one queue less, or a changed read-only id.
    let mut bad = saved.clone();
    bad.queues.pop();
    let mut k = Guest::new();
    let dev = k.dev_mut();
    assert!(dev.restore_transport(&bad).is_err());
    let mut bad = saved.clone();
    bad.config_regs[0] ^= 1;
    assert!(dev.restore_transport(&bad).is_err());
    assert!(
        !dev.transport_state().active,
        "a refused state changes nothing"
    );
}
