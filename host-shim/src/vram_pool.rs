//! The HAL's VRAM calls over a range allocator (both GPUs) and a memfd region (the `sim`;
//! the `cuda` GPU's VRAM is device memory, see `cuda::vram`).

use std::sync::{Mutex, MutexGuard};

use crate::hal::{FdRange, HalError, VramAlloc};
use crate::shared_mem::SharedMem;
use crate::vram::VramAllocator;

type Result<T> = std::result::Result<T, HalError>;

/// A GPU's VRAM allocator.
#[derive(Debug)]
pub(crate) struct VramPool(Mutex<VramAllocator>);

impl VramPool {
    pub(crate) fn new(bytes: u64) -> Self {
        VramPool(Mutex::new(VramAllocator::new(bytes)))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, VramAllocator> {
        // The allocator is consistent after every call, so a poisoned lock is fine to use.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Gpu::alloc_vram`.
    pub(crate) fn alloc(&self, size: u64, align: u64) -> Result<VramAlloc> {
        if size == 0 || !align.is_power_of_two() {
            return Err(HalError::InvalidArgument(
                "VRAM size zero or alignment not a power of two",
            ));
        }
        let (offset, size) = self
            .lock()
            .alloc(size, align)
            .ok_or(HalError::OutOfVram(size))?;
        Ok(VramAlloc { offset, size })
    }

    /// `Gpu::free_vram`.
    pub(crate) fn free(&self, offset: u64) -> Result<()> {
        self.lock()
            .free(offset)
            .map(|_| ())
            .ok_or(HalError::NoAllocation(offset))
    }

    /// `Gpu::vram_free_bytes`.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.lock().free_bytes()
    }
}

/// `Gpu::alloc_vram` from `pool` over `mem`: the range reads as zero.
pub(crate) fn alloc_zeroed(
    pool: &VramPool,
    mem: &SharedMem,
    size: u64,
    align: u64,
) -> Result<VramAlloc> {
    let a = pool.alloc(size, align)?;
    if !mem.discard(a.offset, a.size) {
        let _ = pool.free(a.offset);
        return Err(HalError::InvalidArgument("VRAM range out of bounds"));
    }
    Ok(a)
}

/// `Gpu::vram_fd` of VRAM backed by `mem`.
pub(crate) fn fd_range(mem: &SharedMem) -> Option<FdRange> {
    Some(FdRange {
        fd: mem.fd(),
        offset: 0,
        len: mem.len(),
    })
}

/// `Gpu::vram_read` from `mem`.
pub(crate) fn read(mem: &SharedMem, offset: u64, buf: &mut [u8]) -> Result<()> {
    if mem.read(offset, buf) {
        Ok(())
    } else {
        Err(HalError::InvalidArgument("VRAM range out of bounds"))
    }
}

/// `Gpu::vram_write` into `mem`.
pub(crate) fn write(mem: &SharedMem, offset: u64, buf: &[u8]) -> Result<()> {
    if mem.write(offset, buf) {
        Ok(())
    } else {
        Err(HalError::InvalidArgument("VRAM range out of bounds"))
    }
}
