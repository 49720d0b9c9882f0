//! A PCI function's 256-byte type-0 configuration space: the standard header, BARs with
//! the sizing protocol (write all ones, read back the size mask), and a capability list.
//!
//! Writes go through a per-register write mask, so read-only fields (ids, class, BAR type
//! bits, capability bodies) never change and a BAR keeps its natural alignment — which is
//! what makes sizing work: after a write of `0xffff_ffff` a BAR reads back
//! `!(size - 1) | type bits`.

use thiserror::Error;

/// Bytes of (conventional) configuration space.
pub const CONFIG_SPACE_SIZE: usize = 256;
const NUM_REGS: usize = CONFIG_SPACE_SIZE / 4;

/// Register offsets of the type-0 header.
pub const PCI_VENDOR_ID: usize = 0x00;
pub const PCI_COMMAND: usize = 0x04;
pub const PCI_STATUS: usize = 0x06;
pub const PCI_REVISION_ID: usize = 0x08;
pub const PCI_CACHE_LINE_SIZE: usize = 0x0c;
pub const PCI_HEADER_TYPE: usize = 0x0e;
pub const PCI_BAR0: usize = 0x10;
pub const PCI_SUBSYSTEM_VENDOR_ID: usize = 0x2c;
pub const PCI_ROM_ADDRESS: usize = 0x30;
pub const PCI_CAPABILITY_LIST: usize = 0x34;
pub const PCI_INTERRUPT_LINE: usize = 0x3c;
/// First byte available to capabilities.
pub const PCI_CAP_START: usize = 0x40;

/// Command register bits.
pub const PCI_COMMAND_IO: u16 = 0x1;
pub const PCI_COMMAND_MEMORY: u16 = 0x2;
pub const PCI_COMMAND_MASTER: u16 = 0x4;
pub const PCI_COMMAND_PARITY: u16 = 0x40;
pub const PCI_COMMAND_SERR: u16 = 0x100;
pub const PCI_COMMAND_INTX_DISABLE: u16 = 0x400;
/// Status: the function has a capability list.
pub const PCI_STATUS_CAP_LIST: u16 = 0x10;

/// BAR type bits.
const BAR_IO: u32 = 0x1;
const BAR_MEM_64: u32 = 0x4;
const BAR_MEM_PREFETCH: u32 = 0x8;

/// Number of BAR registers in a type-0 header.
pub const NUM_BARS: usize = 6;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PciConfigError {
    #[error("BAR {0} does not exist (0..6; a 64-bit BAR takes two registers)")]
    BadBarIndex(usize),
    #[error("BAR {0} is already in use")]
    BarInUse(usize),
    #[error("BAR size {0:#x} is not a power of two of at least 16 bytes (4 for I/O)")]
    BadBarSize(u64),
    #[error("BAR address {addr:#x} is not aligned to its size {size:#x} or out of range")]
    BadBarAddress { addr: u64, size: u64 },
    #[error("capability of {0} bytes does not fit in configuration space")]
    NoCapSpace(usize),
    #[error("capability body must hold at least the 2 header bytes")]
    BadCap,
    #[error("saved configuration space does not fit this function: {0}")]
    Restore(&'static str),
}

/// What a BAR decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// I/O ports (32-bit register).
    Io,
    /// 32-bit memory BAR.
    Mem32 { prefetchable: bool },
    /// 64-bit memory BAR: takes this register and the next one.
    Mem64 { prefetchable: bool },
}

impl BarKind {
    fn is_64(self) -> bool {
        matches!(self, BarKind::Mem64 { .. })
    }
    fn type_bits(self) -> u32 {
        match self {
            BarKind::Io => BAR_IO,
            BarKind::Mem32 { prefetchable } => {
                if prefetchable {
                    BAR_MEM_PREFETCH
                } else {
                    0
                }
            }
            BarKind::Mem64 { prefetchable } => {
                BAR_MEM_64 | if prefetchable { BAR_MEM_PREFETCH } else { 0 }
            }
        }
    }
    fn addr_mask(self) -> u32 {
        match self {
            BarKind::Io => !0x3,
            _ => !0xf,
        }
    }
    /// Whether the BAR is a memory BAR (decoded when `PCI_COMMAND_MEMORY` is set).
    pub fn is_memory(self) -> bool {
        !matches!(self, BarKind::Io)
    }
}

/// A BAR as the device declared it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarInfo {
    pub size: u64,
    pub kind: BarKind,
}

/// Identity fields of a type-0 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciHeader {
    pub vendor_id: u16,
    pub device_id: u16,
    pub revision: u8,
    /// Class code, subclass, programming interface.
    pub class: u8,
    pub subclass: u8,
    pub prog_if: u8,
    pub subsystem_vendor_id: u16,
    pub subsystem_id: u16,
}

/// A function's configuration space.
#[derive(Debug, Clone)]
pub struct PciConfig {
    regs: [u32; NUM_REGS],
    wmask: [u32; NUM_REGS],
    bars: [Option<BarInfo>; NUM_BARS],
    /// Offset of the last capability added (its `next` byte is patched by the next add).
    last_cap: Option<usize>,
    /// First free byte for capabilities.
    next_cap: usize,
}

impl PciConfig {
    /// A type-0 header with `hdr`'s ids, no BARs, no capabilities, no interrupt pin.
    pub fn new(hdr: &PciHeader) -> Self {
        let mut c = PciConfig {
            regs: [0; NUM_REGS],
            wmask: [0; NUM_REGS],
            bars: [None; NUM_BARS],
            last_cap: None,
            next_cap: PCI_CAP_START,
        };
        c.regs[0] = u32::from(hdr.vendor_id) | u32::from(hdr.device_id) << 16;
        c.regs[PCI_REVISION_ID / 4] = u32::from(hdr.revision)
            | u32::from(hdr.prog_if) << 8
            | u32::from(hdr.subclass) << 16
            | u32::from(hdr.class) << 24;
        c.regs[PCI_SUBSYSTEM_VENDOR_ID / 4] =
            u32::from(hdr.subsystem_vendor_id) | u32::from(hdr.subsystem_id) << 16;
        // Command: the bits a driver may set (status bits are read-only here).
        c.wmask[PCI_COMMAND / 4] = u32::from(
            PCI_COMMAND_IO
                | PCI_COMMAND_MEMORY
                | PCI_COMMAND_MASTER
                | PCI_COMMAND_PARITY
                | PCI_COMMAND_SERR
                | PCI_COMMAND_INTX_DISABLE,
        );
        // Cache line size and latency timer are scratch registers; header type 0.
        c.wmask[PCI_CACHE_LINE_SIZE / 4] = 0x0000_ffff;
        // Interrupt line is scratch for the OS.
        c.wmask[PCI_INTERRUPT_LINE / 4] = 0x0000_00ff;
        c
    }

    /// The configuration registers as the guest sees them (for live migration).
    pub fn regs(&self) -> &[u32] {
        &self.regs
    }

    /// Takes over registers from [`Self::regs`] of the same function. Where the layout
    /// differs (ids, BAR sizes, capabilities: another build), nothing changes.
    pub fn restore_regs(&mut self, regs: &[u32]) -> Result<(), PciConfigError> {
        if regs.len() != NUM_REGS {
            return Err(PciConfigError::Restore("register count"));
        }
        // Read-only words (no bit writable) must match: they are the layout.
        for (i, (&old, &new)) in self.regs.iter().zip(regs).enumerate() {
            let bar = (PCI_BAR0 / 4..PCI_BAR0 / 4 + NUM_BARS).contains(&i);
            if self.wmask[i] == 0 && !bar && old != new {
                return Err(PciConfigError::Restore("read-only register differs"));
            }
        }
        self.regs.copy_from_slice(regs);
        Ok(())
    }

    /// Declares BAR `index` of `size` bytes at `addr` (0 = unassigned). A 64-bit BAR uses
    /// registers `index` and `index + 1`.
    pub fn add_bar(
        &mut self,
        index: usize,
        size: u64,
        kind: BarKind,
        addr: u64,
    ) -> Result<(), PciConfigError> {
        let regs_needed = if kind.is_64() { 2 } else { 1 };
        if index + regs_needed > NUM_BARS {
            return Err(PciConfigError::BadBarIndex(index));
        }
        for i in index..index + regs_needed {
            if self.bar_register_used(i) {
                return Err(PciConfigError::BarInUse(i));
            }
        }
        let min = if kind.is_memory() { 16 } else { 4 };
        let max = if kind.is_64() { 1 << 63 } else { 1 << 31 };
        if !size.is_power_of_two() || size < min || size > max {
            return Err(PciConfigError::BadBarSize(size));
        }
        let limit = if kind.is_64() {
            u64::MAX
        } else {
            u64::from(u32::MAX)
        };
        if !addr.is_multiple_of(size) || addr > limit - (size - 1) {
            return Err(PciConfigError::BadBarAddress { addr, size });
        }
        let mask = !(size - 1);
        let r = PCI_BAR0 / 4 + index;
        self.regs[r] = (addr as u32 & kind.addr_mask()) | kind.type_bits();
        self.wmask[r] = mask as u32 & kind.addr_mask();
        if kind.is_64() {
            self.regs[r + 1] = (addr >> 32) as u32;
            self.wmask[r + 1] = (mask >> 32) as u32;
        }
        self.bars[index] = Some(BarInfo { size, kind });
        Ok(())
    }

    fn bar_register_used(&self, reg: usize) -> bool {
        self.bars[reg].is_some() || (reg > 0 && self.bars[reg - 1].is_some_and(|b| b.kind.is_64()))
    }

    /// BAR `index` as declared.
    pub fn bar(&self, index: usize) -> Option<BarInfo> {
        self.bars.get(index).copied().flatten()
    }

    /// The address BAR `index` is programmed to (type bits stripped).
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let info = self.bar(index)?;
        let r = PCI_BAR0 / 4 + index;
        let lo = u64::from(self.regs[r] & info.kind.addr_mask());
        let hi = if info.kind.is_64() {
            u64::from(self.regs[r + 1]) << 32
        } else {
            0
        };
        Some(hi | lo)
    }

    /// Where BAR `index` decodes now: `Some((addr, size))` when the BAR exists, its
    /// decoding is enabled in the command register and it is assigned (non-zero, not
    /// wrapping).
    pub fn bar_window(&self, index: usize) -> Option<(u64, u64)> {
        let info = self.bar(index)?;
        let enabled = if info.kind.is_memory() {
            self.command() & PCI_COMMAND_MEMORY != 0
        } else {
            self.command() & PCI_COMMAND_IO != 0
        };
        let addr = self.bar_address(index)?;
        (enabled && addr != 0 && addr.checked_add(info.size).is_some()).then_some((addr, info.size))
    }

    /// The command register.
    pub fn command(&self) -> u16 {
        self.regs[PCI_COMMAND / 4] as u16
    }

    /// Sets the interrupt pin (1 = INTA#) and the initial interrupt line.
    pub fn set_interrupt(&mut self, pin: u8, line: u8) {
        let r = PCI_INTERRUPT_LINE / 4;
        self.regs[r] = (self.regs[r] & !0xffff) | u32::from(pin) << 8 | u32::from(line);
    }

    /// Appends a capability: `body` starts with the capability id and a placeholder for
    /// the next pointer (both bytes are filled in here). Returns its offset. Its bytes are
    /// read-only to the guest unless [`set_write_mask`](Self::set_write_mask) says otherwise.
    pub fn add_capability(&mut self, id: u8, body: &[u8]) -> Result<usize, PciConfigError> {
        if body.len() < 2 {
            return Err(PciConfigError::BadCap);
        }
        let off = self.next_cap;
        let end = off + body.len();
        if end > CONFIG_SPACE_SIZE {
            return Err(PciConfigError::NoCapSpace(body.len()));
        }
        for (i, &b) in body.iter().enumerate() {
            self.set_byte(off + i, b);
        }
        self.set_byte(off, id);
        self.set_byte(off + 1, 0);
        match self.last_cap {
            Some(prev) => self.set_byte(prev + 1, off as u8),
            None => {
                self.set_byte(PCI_CAPABILITY_LIST, off as u8);
                let st = PCI_STATUS / 4;
                self.regs[st] |= u32::from(PCI_STATUS_CAP_LIST) << 16;
            }
        }
        self.last_cap = Some(off);
        // Dword-align the next capability.
        self.next_cap = end.next_multiple_of(4);
        Ok(off)
    }

    /// Makes the bits of `mask` in register `reg` (dword index) writable by the guest.
    pub fn set_write_mask(&mut self, reg: usize, mask: u32) {
        if let Some(m) = self.wmask.get_mut(reg) {
            *m = mask;
        }
    }

    fn set_byte(&mut self, off: usize, v: u8) {
        let r = off / 4;
        let sh = (off % 4) * 8;
        self.regs[r] = (self.regs[r] & !(0xff << sh)) | u32::from(v) << sh;
    }

    /// Reads dword register `reg` (0..64); out of range reads all ones.
    pub fn read_reg(&self, reg: usize) -> u32 {
        self.regs.get(reg).copied().unwrap_or(u32::MAX)
    }

    /// Writes `data` (1, 2 or 4 bytes) at byte `offset` within dword register `reg`,
    /// through the write mask. Accesses crossing the register are ignored.
    pub fn write_reg(&mut self, reg: usize, offset: usize, data: &[u8]) {
        if reg >= NUM_REGS || !matches!(data.len(), 1 | 2 | 4) || offset + data.len() > 4 {
            return;
        }
        let mut v = 0u32;
        let mut bytes_mask = 0u32;
        for (i, &b) in data.iter().enumerate() {
            let sh = (offset + i) * 8;
            v |= u32::from(b) << sh;
            bytes_mask |= 0xff << sh;
        }
        let m = self.wmask[reg] & bytes_mask;
        self.regs[reg] = (self.regs[reg] & !m) | (v & m);
    }
}

/// Reads `data.len()` bytes at byte `offset` within the dword `value`.
pub fn extract(value: u32, offset: usize, data: &mut [u8]) {
    let bytes = value.to_le_bytes();
    for (i, d) in data.iter_mut().enumerate() {
        *d = bytes.get(offset + i).copied().unwrap_or(0xff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr() -> PciHeader {
        PciHeader {
            vendor_id: 0x1af4,
            device_id: 0x107c,
            revision: 1,
            class: 0x03,
            subclass: 0x80,
            prog_if: 0,
            subsystem_vendor_id: 0x1af4,
            subsystem_id: 0x40,
        }
    }

    fn w32(c: &mut PciConfig, off: usize, v: u32) {
        c.write_reg(off / 4, 0, &v.to_le_bytes());
    }
    fn r32(c: &PciConfig, off: usize) -> u32 {
        c.read_reg(off / 4)
    }

    #[test]
    fn header_fields_read_only() {
        let mut c = PciConfig::new(&hdr());
        assert_eq!(r32(&c, 0), 0x107c_1af4);
        assert_eq!(r32(&c, 8), 0x0380_0001);
        assert_eq!(r32(&c, 0x2c), 0x0040_1af4);
        w32(&mut c, 0, 0xdead_beef);
        w32(&mut c, 8, 0);
        assert_eq!(r32(&c, 0), 0x107c_1af4);
        assert_eq!(r32(&c, 8), 0x0380_0001);
        // Command bits through a 16-bit write; status untouched.
        c.write_reg(1, 0, &0xffffu16.to_le_bytes());
        assert_eq!(c.command(), 0x0547);
        assert_eq!(r32(&c, 4) >> 16, 0);
        // Interrupt line is scratch, pin is not.
        c.set_interrupt(1, 10);
        c.write_reg(PCI_INTERRUPT_LINE / 4, 0, &[0x0b, 0x04]);
        assert_eq!(r32(&c, 0x3c) & 0xffff, 0x010b);
        // No ROM: sizing reads zero.
        w32(&mut c, PCI_ROM_ADDRESS, 0xffff_ffff);
        assert_eq!(r32(&c, PCI_ROM_ADDRESS), 0);
        // Out of range.
        assert_eq!(c.read_reg(64), u32::MAX);
        c.write_reg(64, 0, &[1]);
        c.write_reg(1, 3, &[1, 2]);
    }

    #[test]
    fn bar32_sizing() {
        let mut c = PciConfig::new(&hdr());
        c.add_bar(
            1,
            0x1000,
            BarKind::Mem32 {
                prefetchable: false,
            },
            0xe000_0000,
        )
        .unwrap();
        assert_eq!(r32(&c, 0x14), 0xe000_0000);
        w32(&mut c, 0x14, 0xffff_ffff);
        assert_eq!(r32(&c, 0x14), 0xffff_f000);
        w32(&mut c, 0x14, 0xe000_0000);
        assert_eq!(c.bar_address(1), Some(0xe000_0000));
        // Unused BARs read zero and stay zero.
        w32(&mut c, 0x10, 0xffff_ffff);
        assert_eq!(r32(&c, 0x10), 0);
        // Decoding only with the memory bit.
        assert_eq!(c.bar_window(1), None);
        w32(&mut c, 4, u32::from(PCI_COMMAND_MEMORY));
        assert_eq!(c.bar_window(1), Some((0xe000_0000, 0x1000)));
    }

    #[test]
    fn bar64_sizing() {
        let mut c = PciConfig::new(&hdr());
        let size = 512 << 20;
        c.add_bar(2, size, BarKind::Mem64 { prefetchable: true }, 0xc000_0000)
            .unwrap();
        assert_eq!(r32(&c, 0x18), 0xc000_000c);
        assert_eq!(r32(&c, 0x1c), 0);
        // Linux sizes low then high dword.
        w32(&mut c, 0x18, 0xffff_ffff);
        w32(&mut c, 0x1c, 0xffff_ffff);
        assert_eq!(r32(&c, 0x18), 0xe000_000c);
        assert_eq!(r32(&c, 0x1c), 0xffff_ffff);
        let lo = u64::from(r32(&c, 0x18) & !0xf);
        let hi = u64::from(r32(&c, 0x1c)) << 32;
        assert_eq!(!(hi | lo) + 1, size);
        // Move it above 4 GiB.
        w32(&mut c, 0x18, 0x2000_0000);
        w32(&mut c, 0x1c, 0x1);
        assert_eq!(c.bar_address(2), Some(0x1_2000_0000));
        assert_eq!(r32(&c, 0x18), 0x2000_000c);

        // A BAR larger than 4 GiB: the low dword has no writable address bits.
        let mut c = PciConfig::new(&hdr());
        c.add_bar(
            0,
            8 << 30,
            BarKind::Mem64 {
                prefetchable: false,
            },
            0,
        )
        .unwrap();
        w32(&mut c, 0x10, 0xffff_ffff);
        w32(&mut c, 0x14, 0xffff_ffff);
        assert_eq!(r32(&c, 0x10), 0x4);
        assert_eq!(r32(&c, 0x14), 0xffff_fffe);
    }

    #[test]
    fn bar_errors() {
        let mut c = PciConfig::new(&hdr());
        let m64 = BarKind::Mem64 {
            prefetchable: false,
        };
        assert_eq!(
            c.add_bar(5, 0x1000, m64, 0),
            Err(PciConfigError::BadBarIndex(5))
        );
        assert_eq!(
            c.add_bar(0, 0x1001, m64, 0),
            Err(PciConfigError::BadBarSize(0x1001))
        );
        assert_eq!(
            c.add_bar(0, 0x1000, m64, 0x800),
            Err(PciConfigError::BadBarAddress {
                addr: 0x800,
                size: 0x1000
            })
        );
        c.add_bar(0, 0x1000, m64, 0).unwrap();
        assert_eq!(
            c.add_bar(1, 0x1000, BarKind::Io, 0),
            Err(PciConfigError::BarInUse(1))
        );
        c.add_bar(2, 0x100, BarKind::Io, 0xc000).unwrap();
        assert_eq!(r32(&c, 0x18), 0xc001);
        w32(&mut c, 0x18, 0xffff_ffff);
        assert_eq!(r32(&c, 0x18), 0xffff_ff01);
    }

    #[test]
    fn capability_list() {
        let mut c = PciConfig::new(&hdr());
        assert_eq!(r32(&c, 4) >> 16 & u32::from(PCI_STATUS_CAP_LIST), 0);
        let a = c.add_capability(0x09, &[0, 0, 16, 1, 0, 0, 0, 0]).unwrap();
        let b = c.add_capability(0x09, &[0, 0, 3]).unwrap();
        assert_eq!((a, b), (0x40, 0x48));
        assert_ne!(r32(&c, 4) >> 16 & u32::from(PCI_STATUS_CAP_LIST), 0);
        assert_eq!(r32(&c, 0x34) & 0xff, 0x40);
        let mut d = [0u8; 4];
        extract(r32(&c, 0x40), 0, &mut d);
        assert_eq!(d, [0x09, 0x48, 16, 1]);
        extract(r32(&c, 0x48), 0, &mut d);
        assert_eq!(d, [0x09, 0x00, 3, 0]);
        // Read-only.
        w32(&mut c, 0x40, 0);
        assert_eq!(r32(&c, 0x40) & 0xff, 0x09);
        assert_eq!(
            c.add_capability(0x09, &[0; 200]),
            Err(PciConfigError::NoCapSpace(200))
        );
        assert_eq!(c.add_capability(0x09, &[0]), Err(PciConfigError::BadCap));
    }
}
