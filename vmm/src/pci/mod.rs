//! A PCI bus (bus 0 only) reached through configuration mechanism #1 — the address
//! register at port `0xCF8` and the data window at `0xCFC..=0xCFF` — with a host bridge at
//! 00:00.0 and single-function devices in the other slots. Memory BARs are served as MMIO
//! exits: [`PciBus::mmio_read`]/[`PciBus::mmio_write`] route an access to the device whose
//! BAR decodes the address *now* (as the guest programmed it, memory decoding enabled).
//!
//! The shape follows Cloud Hypervisor's `pci` crate (`configuration.rs`, `bus.rs`), cut
//! down to what a guest with one paravirtual device needs. Guest input never panics:
//! accesses to absent functions read all ones and writes to them are dropped.

pub mod config;

use thiserror::Error;

pub use config::{BarInfo, BarKind, PciConfig, PciConfigError, PciHeader};

/// Configuration mechanism #1 ports.
pub const PCI_CONFIG_ADDRESS: u16 = 0xcf8;
pub const PCI_CONFIG_DATA: u16 = 0xcfc;
/// The ports the bus claims (`0xCF8..=0xCFF`).
pub const PCI_CONFIG_PORTS: std::ops::RangeInclusive<u16> = 0xcf8..=0xcff;

/// Devices per bus.
pub const PCI_SLOTS: usize = 32;

/// The host bridge's ids: Red Hat's "QEMU PCIe host bridge", class host bridge.
pub const HOST_BRIDGE_VENDOR: u16 = 0x1b36;
pub const HOST_BRIDGE_DEVICE: u16 = 0x0008;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PciError {
    #[error("no free slot on the PCI bus")]
    BusFull,
    #[error("slot {0} is taken or out of range")]
    SlotTaken(u8),
}

/// A PCI function on the bus. The bus reads and writes configuration space through
/// [`config`](Self::config)/[`config_mut`](Self::config_mut) unless the device overrides
/// [`config_read`](Self::config_read)/[`config_write`](Self::config_write); BAR accesses
/// arrive with the offset inside the BAR.
pub trait PciDevice: Send {
    /// A short name for logs.
    fn name(&self) -> &str;
    /// For downcasting to the concrete device (the VMM reaches its device on the bus).
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
    fn config(&self) -> &PciConfig;
    fn config_mut(&mut self) -> &mut PciConfig;

    /// Reads dword register `reg` (0..64).
    fn config_read(&mut self, reg: usize) -> u32 {
        self.config().read_reg(reg)
    }
    /// Writes `data` at byte `offset` of dword register `reg`.
    fn config_write(&mut self, reg: usize, offset: usize, data: &[u8]) {
        self.config_mut().write_reg(reg, offset, data)
    }
    /// A read of `data.len()` bytes at `offset` inside BAR `bar`.
    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        let _ = (bar, offset);
        data.fill(0xff);
    }
    /// A write of `data` at `offset` inside BAR `bar`.
    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        let _ = (bar, offset, data);
    }
}

/// The host bridge at 00:00.0: ids only.
#[derive(Debug)]
pub struct HostBridge {
    config: PciConfig,
}

impl Default for HostBridge {
    fn default() -> Self {
        HostBridge {
            config: PciConfig::new(&PciHeader {
                vendor_id: HOST_BRIDGE_VENDOR,
                device_id: HOST_BRIDGE_DEVICE,
                revision: 0,
                class: 0x06,
                subclass: 0x00,
                prog_if: 0,
                subsystem_vendor_id: HOST_BRIDGE_VENDOR,
                subsystem_id: 0x1100,
            }),
        }
    }
}

impl PciDevice for HostBridge {
    fn name(&self) -> &str {
        "host-bridge"
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
}

/// A BAR that started or stopped decoding, or moved (see [`PciBus::take_bar_events`]).
/// The VMM moves what backs the BAR outside the MMIO-exit path (memslots) accordingly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarEvent {
    pub slot: u8,
    pub bar: usize,
    /// `(addr, size)` where the BAR decoded before and decodes now.
    pub old: Option<(u64, u64)>,
    pub new: Option<(u64, u64)>,
}

/// PCI bus 0.
pub struct PciBus {
    slots: Vec<Option<Box<dyn PciDevice>>>,
    /// The latched `CONFIG_ADDRESS` register.
    config_address: u32,
    /// Per slot and BAR: the window it decoded at after the last config write.
    windows: Vec<[Option<(u64, u64)>; config::NUM_BARS]>,
    events: Vec<BarEvent>,
}

impl std::fmt::Debug for PciBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciBus")
            .field(
                "devices",
                &self
                    .slots
                    .iter()
                    .enumerate()
                    .filter_map(|(i, d)| d.as_ref().map(|d| (i, d.name().to_owned())))
                    .collect::<Vec<_>>(),
            )
            .field("config_address", &self.config_address)
            .finish()
    }
}

impl Default for PciBus {
    fn default() -> Self {
        Self::new()
    }
}

impl PciBus {
    /// A bus with the host bridge at slot 0.
    pub fn new() -> Self {
        let mut slots: Vec<Option<Box<dyn PciDevice>>> = (0..PCI_SLOTS).map(|_| None).collect();
        slots[0] = Some(Box::new(HostBridge::default()));
        PciBus {
            slots,
            config_address: 0,
            windows: vec![[None; config::NUM_BARS]; PCI_SLOTS],
            events: Vec::new(),
        }
    }

    /// Plugs `dev` into the lowest free slot; returns the slot (device number).
    pub fn add_device(&mut self, dev: Box<dyn PciDevice>) -> Result<u8, PciError> {
        let slot = self
            .slots
            .iter()
            .position(Option::is_none)
            .ok_or(PciError::BusFull)?;
        self.add_device_at(slot as u8, dev)?;
        Ok(slot as u8)
    }

    /// Plugs `dev` into `slot`.
    pub fn add_device_at(&mut self, slot: u8, dev: Box<dyn PciDevice>) -> Result<(), PciError> {
        match self.slots.get_mut(usize::from(slot)) {
            Some(s @ None) => {
                log::debug!("pci: {} at 00:{slot:02x}.0", dev.name());
                *s = Some(dev);
                self.refresh_windows(usize::from(slot));
                Ok(())
            }
            _ => Err(PciError::SlotTaken(slot)),
        }
    }

    /// The device in `slot`.
    pub fn device(&self, slot: u8) -> Option<&dyn PciDevice> {
        self.slots.get(usize::from(slot))?.as_deref()
    }

    /// The device in `slot`, mutably.
    pub fn device_mut(&mut self, slot: u8) -> Option<&mut (dyn PciDevice + 'static)> {
        self.slots.get_mut(usize::from(slot))?.as_deref_mut()
    }

    /// BAR changes since the last call.
    pub fn take_bar_events(&mut self) -> Vec<BarEvent> {
        std::mem::take(&mut self.events)
    }

    /// Reads register `reg` of `bus:dev.func`; absent functions read all ones.
    pub fn config_read(&mut self, bus: u8, dev: u8, func: u8, reg: usize) -> u32 {
        match self.function(bus, dev, func) {
            Some(d) => d.config_read(reg),
            None => u32::MAX,
        }
    }

    /// Writes `data` at byte `offset` of register `reg` of `bus:dev.func`.
    pub fn config_write(
        &mut self,
        bus: u8,
        dev: u8,
        func: u8,
        reg: usize,
        offset: usize,
        data: &[u8],
    ) {
        if let Some(d) = self.function(bus, dev, func) {
            d.config_write(reg, offset, data);
            self.refresh_windows(usize::from(dev));
        }
    }

    fn function(&mut self, bus: u8, dev: u8, func: u8) -> Option<&mut Box<dyn PciDevice>> {
        if bus != 0 || func != 0 {
            return None;
        }
        self.slots.get_mut(usize::from(dev))?.as_mut()
    }

    /// Re-reads where `slot`'s BARs decode, queueing [`BarEvent`]s for what changed: after
    /// its configuration space was restored (live migration) rather than written.
    pub fn refresh_slot(&mut self, slot: u8) {
        self.refresh_windows(usize::from(slot));
    }

    fn refresh_windows(&mut self, slot: usize) {
        let Some(Some(dev)) = self.slots.get(slot) else {
            return;
        };
        for bar in 0..config::NUM_BARS {
            let new = dev.config().bar_window(bar);
            let old = std::mem::replace(&mut self.windows[slot][bar], new);
            if old != new {
                log::debug!("pci: 00:{slot:02x}.0 BAR{bar}: {old:x?} -> {new:x?}");
                self.events.push(BarEvent {
                    slot: slot as u8,
                    bar,
                    old,
                    new,
                });
            }
        }
    }

    /// `(bus, dev, func, reg)` of the latched address, if its enable bit is set.
    fn decode_address(&self) -> Option<(u8, u8, u8, usize)> {
        let a = self.config_address;
        (a & 0x8000_0000 != 0).then_some((
            (a >> 16) as u8,
            ((a >> 11) & 0x1f) as u8,
            ((a >> 8) & 0x7) as u8,
            ((a >> 2) & 0x3f) as usize,
        ))
    }

    /// A guest `in` from `port`. Returns false if the port is not the bus's.
    pub fn pio_read(&mut self, port: u16, data: &mut [u8]) -> bool {
        if !PCI_CONFIG_PORTS.contains(&port) {
            return false;
        }
        match port {
            PCI_CONFIG_ADDRESS if data.len() == 4 => {
                data.copy_from_slice(&self.config_address.to_le_bytes())
            }
            p if p >= PCI_CONFIG_DATA => {
                let off = usize::from(p - PCI_CONFIG_DATA);
                let value = match self.decode_address() {
                    Some((b, d, f, r)) if off + data.len() <= 4 => self.config_read(b, d, f, r),
                    _ => u32::MAX,
                };
                config::extract(value, off, data);
            }
            _ => data.fill(0xff),
        }
        true
    }

    /// A guest `out` of `data` to `port`. Returns false if the port is not the bus's.
    pub fn pio_write(&mut self, port: u16, data: &[u8]) -> bool {
        if !PCI_CONFIG_PORTS.contains(&port) {
            return false;
        }
        match port {
            PCI_CONFIG_ADDRESS if data.len() == 4 => {
                self.config_address =
                    u32::from_le_bytes([data[0], data[1], data[2], data[3]]) & 0x80ff_fffc;
            }
            p if p >= PCI_CONFIG_DATA => {
                let off = usize::from(p - PCI_CONFIG_DATA);
                if let Some((b, d, f, r)) = self.decode_address() {
                    if off + data.len() <= 4 {
                        self.config_write(b, d, f, r, off, data);
                    }
                }
            }
            // Byte/word writes to 0xCF8..0xCFB (mechanism #2 probing): ignored.
            _ => {}
        }
        true
    }

    fn find_bar(&self, addr: u64, len: usize) -> Option<(usize, usize, u64)> {
        let end = addr.checked_add(len as u64)?;
        self.windows.iter().enumerate().find_map(|(slot, bars)| {
            bars.iter().enumerate().find_map(|(bar, w)| {
                let (base, size) = (*w)?;
                let memory = self.slots[slot]
                    .as_ref()?
                    .config()
                    .bar(bar)?
                    .kind
                    .is_memory();
                (memory && addr >= base && end <= base + size).then(|| (slot, bar, addr - base))
            })
        })
    }

    /// A read of guest-physical `addr`; false if no BAR decodes it.
    pub fn mmio_read(&mut self, addr: u64, data: &mut [u8]) -> bool {
        let Some((slot, bar, off)) = self.find_bar(addr, data.len()) else {
            return false;
        };
        match self.slots[slot].as_mut() {
            Some(d) => d.bar_read(bar, off, data),
            None => data.fill(0xff),
        }
        true
    }

    /// A write to guest-physical `addr`; false if no BAR decodes it.
    pub fn mmio_write(&mut self, addr: u64, data: &[u8]) -> bool {
        let Some((slot, bar, off)) = self.find_bar(addr, data.len()) else {
            return false;
        };
        if let Some(d) = self.slots[slot].as_mut() {
            d.bar_write(bar, off, data);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device with one 64-bit BAR of 4 KiB that records accesses.
    struct Dummy {
        config: PciConfig,
        last_write: Option<(usize, u64, Vec<u8>)>,
    }

    impl Dummy {
        fn new(addr: u64) -> Self {
            let mut config = PciConfig::new(&PciHeader {
                vendor_id: 0x1234,
                device_id: 0x5678,
                revision: 0,
                class: 0xff,
                subclass: 0,
                prog_if: 0,
                subsystem_vendor_id: 0,
                subsystem_id: 0,
            });
            config
                .add_bar(
                    0,
                    0x1000,
                    BarKind::Mem64 {
                        prefetchable: false,
                    },
                    addr,
                )
                .unwrap();
            Dummy {
                config,
                last_write: None,
            }
        }
    }

    impl PciDevice for Dummy {
        fn name(&self) -> &str {
            "dummy"
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
        fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
            data.fill((bar as u8) << 4 | offset as u8);
        }
        fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
            self.last_write = Some((bar, offset, data.to_vec()));
        }
    }

    fn addr(dev: u8, reg: usize) -> u32 {
        0x8000_0000 | u32::from(dev) << 11 | (reg as u32) << 2
    }

    fn cfg_read32(bus: &mut PciBus, dev: u8, off: usize) -> u32 {
        assert!(bus.pio_write(PCI_CONFIG_ADDRESS, &addr(dev, off / 4).to_le_bytes()));
        let mut d = [0u8; 4];
        assert!(bus.pio_read(PCI_CONFIG_DATA, &mut d));
        u32::from_le_bytes(d)
    }

    fn cfg_write32(bus: &mut PciBus, dev: u8, off: usize, v: u32) {
        bus.pio_write(PCI_CONFIG_ADDRESS, &addr(dev, off / 4).to_le_bytes());
        bus.pio_write(PCI_CONFIG_DATA, &v.to_le_bytes());
    }

    #[test]
    fn type1_probe_and_host_bridge() {
        let mut bus = PciBus::new();
        // Linux's pci_check_type1: the address register latches a dword write.
        bus.pio_write(0xcfb, &[1]);
        bus.pio_write(PCI_CONFIG_ADDRESS, &0x8000_0000u32.to_le_bytes());
        let mut d = [0u8; 4];
        bus.pio_read(PCI_CONFIG_ADDRESS, &mut d);
        assert_eq!(u32::from_le_bytes(d), 0x8000_0000);
        // Host bridge ids and class (pci_sanity_check reads the class word at 0x0a).
        assert_eq!(cfg_read32(&mut bus, 0, 0), 0x0008_1b36);
        bus.pio_write(PCI_CONFIG_ADDRESS, &addr(0, 2).to_le_bytes());
        let mut w = [0u8; 2];
        bus.pio_read(PCI_CONFIG_DATA + 2, &mut w);
        assert_eq!(u16::from_le_bytes(w), 0x0600);
        // Empty slot, other functions, other buses: all ones.
        assert_eq!(cfg_read32(&mut bus, 5, 0), u32::MAX);
        bus.pio_write(PCI_CONFIG_ADDRESS, &(addr(0, 0) | 1 << 8).to_le_bytes());
        bus.pio_read(PCI_CONFIG_DATA, &mut d);
        assert_eq!(d, [0xff; 4]);
        bus.pio_write(PCI_CONFIG_ADDRESS, &(addr(0, 0) | 1 << 16).to_le_bytes());
        bus.pio_read(PCI_CONFIG_DATA, &mut d);
        assert_eq!(d, [0xff; 4]);
        // Enable bit clear: all ones.
        bus.pio_write(PCI_CONFIG_ADDRESS, &0u32.to_le_bytes());
        bus.pio_read(PCI_CONFIG_DATA, &mut d);
        assert_eq!(d, [0xff; 4]);
        // Not our ports.
        assert!(!bus.pio_read(0x3f8, &mut [0]));
        assert!(!bus.pio_write(0xcf7, &[0]));
    }

    #[test]
    fn byte_access_and_bar_routing() {
        let mut bus = PciBus::new();
        let slot = bus.add_device(Box::new(Dummy::new(0xe000_0000))).unwrap();
        assert_eq!(slot, 1);
        assert_eq!(cfg_read32(&mut bus, slot, 0), 0x5678_1234);
        // Byte read of the device id's high byte.
        bus.pio_write(PCI_CONFIG_ADDRESS, &addr(slot, 0).to_le_bytes());
        let mut b = [0u8; 1];
        bus.pio_read(PCI_CONFIG_DATA + 3, &mut b);
        assert_eq!(b[0], 0x56);
        // Not decoding until the memory bit is set.
        assert!(!bus.mmio_read(0xe000_0010, &mut [0u8; 4]));
        assert!(bus.take_bar_events().is_empty());
        // Enable memory through a 16-bit write at 0xCFC.
        bus.pio_write(PCI_CONFIG_ADDRESS, &addr(slot, 1).to_le_bytes());
        bus.pio_write(PCI_CONFIG_DATA, &2u16.to_le_bytes());
        assert_eq!(
            bus.take_bar_events(),
            vec![BarEvent {
                slot,
                bar: 0,
                old: None,
                new: Some((0xe000_0000, 0x1000)),
            }]
        );
        let mut d = [0u8; 4];
        assert!(bus.mmio_read(0xe000_0010, &mut d));
        assert_eq!(d, [0x10; 4]);
        assert!(bus.mmio_write(0xe000_0ffc, &[1, 2, 3, 4]));
        // Crossing the end of the BAR: not ours.
        assert!(!bus.mmio_write(0xe000_0ffe, &[1, 2, 3, 4]));
        assert!(!bus.mmio_read(0xe000_1000, &mut d));

        // Sizing with decode off, then a move: one event each way.
        cfg_write32(&mut bus, slot, 4, 0);
        cfg_write32(&mut bus, slot, 0x10, 0xffff_ffff);
        cfg_write32(&mut bus, slot, 0x14, 0xffff_ffff);
        assert_eq!(cfg_read32(&mut bus, slot, 0x10), 0xffff_f004);
        assert_eq!(cfg_read32(&mut bus, slot, 0x14), 0xffff_ffff);
        cfg_write32(&mut bus, slot, 0x10, 0xd000_0000);
        cfg_write32(&mut bus, slot, 0x14, 0);
        cfg_write32(&mut bus, slot, 4, 2);
        let ev = bus.take_bar_events();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[1].new, Some((0xd000_0000, 0x1000)));
        assert!(bus.mmio_read(0xd000_0000, &mut d));
        assert!(!bus.mmio_read(0xe000_0000, &mut d));
    }

    #[test]
    fn slots() {
        let mut bus = PciBus::new();
        assert_eq!(
            bus.add_device_at(0, Box::new(Dummy::new(0))),
            Err(PciError::SlotTaken(0))
        );
        assert_eq!(
            bus.add_device_at(32, Box::new(Dummy::new(0))),
            Err(PciError::SlotTaken(32))
        );
        for _ in 1..PCI_SLOTS {
            bus.add_device(Box::new(Dummy::new(0))).unwrap();
        }
        assert_eq!(
            bus.add_device(Box::new(Dummy::new(0))),
            Err(PciError::BusFull)
        );
        assert_eq!(bus.device(3).unwrap().name(), "dummy");
    }
}
