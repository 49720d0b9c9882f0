//! The `cuda` GPU's VRAM: device memory addressed by VRAM offset, one physical 2 MiB
//! allocation per granule (the VMM API: `cuMemCreate`), mapped back to back in one
//! reserved range so that VRAM offset `o` is device address `base + o`.
//!
//! vgpu's GPU virtual addresses are its own (the software MMU in [`crate::mmu`] translates
//! them when an entry is planned), so builtin kernels and copies use these addresses. A
//! granule's physical handle can also be mapped a second time, at the guest's own virtual
//! address, for kernels that follow pointers stored in memory ([`super::identity`]); that
//! is why VRAM is made of handles rather than one `cuMemAlloc` block.
//!
//! The CPU cannot map this memory (no BAR1 mapping for user space): host access is by
//! copies on a stream of its own ([`Device::copy_to_host`] and friends), and the HAL
//! reports no CPU view ([`crate::hal::Gpu::vram_fd`] is `None`).

use super::device::{Device, VM_GRANULE};
use crate::hal::HalError;

type Result<T> = std::result::Result<T, HalError>;

/// Copies are split so one call never pins a huge host range at once.
const PIECE: usize = 64 << 20;

/// Device memory standing for VRAM offsets `0..len`.
#[derive(Debug)]
pub(crate) struct DeviceVram {
    base: u64,
    len: u64,
    /// The physical allocation of each granule, in offset order.
    granules: Vec<u64>,
}

fn dev_err(e: impl std::fmt::Display) -> HalError {
    HalError::Os(e.to_string())
}

impl DeviceVram {
    /// Allocates and zeroes `len` bytes of device memory (rounded up to whole granules).
    pub(crate) fn new<D: Device>(dev: &D, len: u64) -> Result<Self> {
        let len = len
            .checked_next_multiple_of(VM_GRANULE)
            .ok_or(HalError::InvalidArgument("VRAM size"))?;
        let base = dev.reserve_va(0, len).map_err(dev_err)?;
        let mut vram = DeviceVram {
            base,
            len,
            granules: Vec::with_capacity((len / VM_GRANULE) as usize),
        };
        let filled = (0..len / VM_GRANULE).try_for_each(|i| {
            let h = dev.create_physical(VM_GRANULE).map_err(dev_err)?;
            if let Err(e) = dev.map_physical(base + i * VM_GRANULE, VM_GRANULE, h, true) {
                dev.release_physical(h);
                return Err(dev_err(e));
            }
            vram.granules.push(h);
            Ok(())
        });
        if let Err(e) = filled.and_then(|()| vram.zero(dev, 0, len)) {
            vram.free(dev);
            return Err(e);
        }
        Ok(vram)
    }

    /// The physical allocation of the granule at `offset` (granule-aligned).
    pub(crate) fn granule(&self, offset: u64) -> Option<u64> {
        if !offset.is_multiple_of(VM_GRANULE) {
            return None;
        }
        self.granules.get((offset / VM_GRANULE) as usize).copied()
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The device pointer of `offset..offset+n`, if that lies inside VRAM.
    pub(crate) fn ptr(&self, offset: u64, n: u64) -> Option<u64> {
        let end = offset.checked_add(n)?;
        (end <= self.len).then_some(self.base + offset)
    }

    fn range(&self, offset: u64, n: usize) -> Result<u64> {
        self.ptr(offset, n as u64)
            .ok_or(HalError::InvalidArgument("VRAM range out of bounds"))
    }

    /// Copies VRAM at `offset` into `buf`.
    pub(crate) fn read<D: Device>(&self, dev: &D, offset: u64, buf: &mut [u8]) -> Result<()> {
        let src = self.range(offset, buf.len())?;
        for (i, piece) in buf.chunks_mut(PIECE).enumerate() {
            let at = src + (i * PIECE) as u64;
            // SAFETY: `piece` is a live mutable slice; `at..at+len` lies in this block
            // (checked by `range`).
            unsafe { dev.copy_to_host(piece.as_mut_ptr(), at, piece.len()) }.map_err(dev_err)?;
        }
        Ok(())
    }

    /// Copies `buf` into VRAM at `offset`.
    pub(crate) fn write<D: Device>(&self, dev: &D, offset: u64, buf: &[u8]) -> Result<()> {
        let dst = self.range(offset, buf.len())?;
        for (i, piece) in buf.chunks(PIECE).enumerate() {
            let at = dst + (i * PIECE) as u64;
            // SAFETY: `piece` is a live slice; `at..at+len` lies in this block.
            unsafe { dev.copy_from_host(at, piece.as_ptr(), piece.len()) }.map_err(dev_err)?;
        }
        Ok(())
    }

    /// Copies VRAM at each `offset` into its buffer: all copies queued at once, one wait.
    pub(crate) fn read_many<D: Device>(
        &self,
        dev: &D,
        reads: &mut [(u64, &mut [u8])],
    ) -> Result<()> {
        let mut copies = Vec::with_capacity(reads.len());
        for (offset, buf) in reads.iter_mut() {
            let src = self.range(*offset, buf.len())?;
            for (i, piece) in buf.chunks_mut(PIECE).enumerate() {
                copies.push((piece.as_mut_ptr(), src + (i * PIECE) as u64, piece.len()));
            }
        }
        // SAFETY: every destination is a piece of a live mutable slice the caller lent us
        // until we return (distinct slices, so no two copies write the same bytes); every
        // source range lies in this block (checked by `range`).
        unsafe { dev.copy_to_host_many(&copies) }.map_err(dev_err)
    }

    /// Copies each buffer into VRAM at its `offset`: all copies queued at once, one wait.
    pub(crate) fn write_many<D: Device>(&self, dev: &D, writes: &[(u64, &[u8])]) -> Result<()> {
        let mut copies = Vec::with_capacity(writes.len());
        for (offset, buf) in writes {
            let dst = self.range(*offset, buf.len())?;
            for (i, piece) in buf.chunks(PIECE).enumerate() {
                copies.push((dst + (i * PIECE) as u64, piece.as_ptr(), piece.len()));
            }
        }
        // SAFETY: every source is a piece of a live slice borrowed until we return; every
        // destination range lies in this block (checked by `range`).
        unsafe { dev.copy_from_host_many(&copies) }.map_err(dev_err)
    }

    /// Zeroes `len` bytes at `offset` (fresh allocations never show a former tenant's data).
    pub(crate) fn zero<D: Device>(&self, dev: &D, offset: u64, len: u64) -> Result<()> {
        let n = usize::try_from(len).map_err(|_| HalError::InvalidArgument("VRAM range"))?;
        let dst = self.range(offset, n)?;
        dev.zero_device(dst, n).map_err(dev_err)
    }

    /// Returns the memory to the driver; no GPU work may use it any more.
    pub(crate) fn free<D: Device>(&self, dev: &D) {
        for (i, &h) in self.granules.iter().enumerate() {
            let at = self.base + i as u64 * VM_GRANULE;
            if let Err(e) = dev.unmap_va(at, VM_GRANULE) {
                log::warn!("cuda: unmapping VRAM at {at:#x}: {e}");
            }
            dev.release_physical(h);
        }
        dev.free_va(self.base, self.len);
    }
}
