//! A context's allocations by GPU address: buffers of their own, and small device
//! allocations carved from shared 2 MiB slabs.
//!
//! Why slabs: the `cuda` GPU makes a guest's GPU addresses the device's own only in
//! 2 MiB-page buffers (identity addressing, docs/design/guest-modules.md), so a small
//! `cuMemAlloc` in a buffer of its own (4 KiB or 64 KiB pages) would hold pointers a
//! kernel cannot follow. Carved from a 2 MiB buffer, like the driver's own allocator
//! does with device memory, it can, and many small allocations cost one 2 MiB page
//! rather than one each.

use std::collections::BTreeMap;

use vgpu_guest::{Buffer, Context, MemKind};
use vgpu_protocol::range::RangeAllocator;

use crate::errors::{from_error, CuResult};
use crate::types::*;

/// Device allocations under this size come from slabs of this size.
pub const SLAB_BYTES: u64 = 2 << 20;
/// The alignment CUDA gives every `cuMemAlloc` result.
pub const ALLOC_ALIGN: u64 = 256;

/// One allocation: a buffer of its own, or `len` bytes at `offset` of the slab whose
/// buffer starts at GPU address `slab`.
enum Alloc {
    Own(Buffer),
    Piece { slab: u64, offset: u64, len: u64 },
}

/// A 2 MiB buffer and the free space in it.
struct Slab {
    buf: Buffer,
    space: RangeAllocator,
}

/// What a pointer falls in: the buffer, the pointer's offset in it, and the allocation's
/// own start (GPU address) and length.
pub struct Found<'a> {
    pub buf: &'a Buffer,
    pub offset: u64,
    pub base: u64,
    pub len: u64,
}

#[derive(Default)]
pub struct Allocs {
    by_va: BTreeMap<u64, Alloc>,
    /// Slabs by their buffer's GPU address.
    slabs: BTreeMap<u64, Slab>,
}

impl Allocs {
    /// `bytes` of the VM's VRAM: a slab's piece when small, else a buffer of its own.
    /// Returns the GPU address.
    pub fn alloc_device(&mut self, ctx: &Context, bytes: u64) -> CuResult<u64> {
        if bytes >= SLAB_BYTES {
            let b = ctx.alloc_vram(bytes).map_err(|e| from_error(&e))?;
            return Ok(self.insert(b));
        }
        let piece = self
            .slabs
            .iter_mut()
            .find_map(|(&at, s)| Some((at, s.space.alloc(bytes, ALLOC_ALIGN)?.0)));
        let (slab, offset) = match piece {
            Some(p) => p,
            None => {
                let buf = ctx.alloc_vram(SLAB_BYTES).map_err(|e| from_error(&e))?;
                let mut space = RangeAllocator::with_range(0, SLAB_BYTES, ALLOC_ALIGN);
                let (offset, _) = space
                    .alloc(bytes, ALLOC_ALIGN)
                    .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
                let at = buf.gpu_va();
                self.slabs.insert(at, Slab { buf, space });
                (at, offset)
            }
        };
        let va = slab + offset;
        self.by_va.insert(
            va,
            Alloc::Piece {
                slab,
                offset,
                len: bytes,
            },
        );
        Ok(va)
    }

    /// A whole buffer (device or host memory) as one allocation; returns its address.
    pub fn insert(&mut self, b: Buffer) -> u64 {
        let va = b.gpu_va();
        self.by_va.insert(va, Alloc::Own(b));
        va
    }

    /// Whether an allocation starts at `va`.
    pub fn contains(&self, va: u64) -> bool {
        self.by_va.contains_key(&va)
    }

    /// Frees the allocation at `va` (its slab goes with its last piece).
    pub fn remove(&mut self, va: u64) -> Option<()> {
        if let Alloc::Piece { slab, offset, .. } = self.by_va.remove(&va)? {
            if let Some(s) = self.slabs.get_mut(&slab) {
                s.space.free(offset);
                if s.space.allocations() == 0 {
                    self.slabs.remove(&slab);
                }
            }
        }
        Some(())
    }

    /// The buffer, offset in it and length of an allocation.
    fn parts<'a>(&'a self, a: &'a Alloc) -> Option<(&'a Buffer, u64, u64)> {
        match a {
            Alloc::Own(b) => Some((b, 0, b.len())),
            Alloc::Piece { slab, offset, len } => Some((&self.slabs.get(slab)?.buf, *offset, *len)),
        }
    }

    /// The allocation holding `len` bytes at `ptr`, and where `ptr` lies in its buffer.
    pub fn find(&self, ptr: u64, len: u64) -> CuResult<Found<'_>> {
        let (&base, a) = self
            .by_va
            .range(..=ptr)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (buf, start, size) = self.parts(a).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let off = ptr - base;
        match off.checked_add(len) {
            Some(end) if end <= size => Ok(Found {
                buf,
                offset: start + off,
                base,
                len: size,
            }),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// Bytes of VRAM the program allocated.
    pub fn vram_bytes(&self) -> u64 {
        self.by_va
            .values()
            .filter_map(|a| self.parts(a))
            .filter(|(b, _, _)| b.kind() == MemKind::Vram)
            .map(|(_, _, len)| len)
            .sum()
    }
}
