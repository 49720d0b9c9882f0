//! VRAM objects in chunks: allocation (chunks that do not fit go straight to swap), free,
//! GPU mapping and aperture mapping of an object whose chunks may be anywhere.

use std::sync::Arc;

use log::warn;
use vgpu_host_shim::{ContextId, HalError, MapFlags, PageSize};
use vgpu_protocol::ErrorCode;

use crate::error::ShmError;
use crate::shmem::ShmMapper;
use crate::vm::session::Session;
use crate::vram::backing::{Loc, ObjBacking, RunTarget, CHUNK};
use crate::vram::store::SwapStore;

impl Session {
    /// The VM's swap store, created on first use with room for its VRAM + swap limit.
    pub(crate) fn swap_store(&mut self) -> Result<Arc<SwapStore>, ErrorCode> {
        if let Some(s) = &self.swap.store {
            return Ok(s.clone());
        }
        let cap = self
            .shared
            .vram_quota()
            .saturating_add(self.limits.swap_bytes)
            // Room for fragmentation (virtual only: pages are committed when written).
            .saturating_mul(2)
            .min(crate::vram::MAX_SWAP_STORE);
        let store = Arc::new(SwapStore::new(cap).map_err(|e| {
            warn!("swap store: {e}");
            ErrorCode::Internal
        })?);
        self.swap.store = Some(store.clone());
        Ok(store)
    }

    /// Gives object `b` a swap region if it has none.
    pub(crate) fn ensure_swap_region(&mut self, b: &mut ObjBacking) -> Result<u64, ErrorCode> {
        if let Some(r) = b.swap_region {
            return Ok(r);
        }
        let store = self.swap_store()?;
        let r = store.alloc(b.size()).ok_or(ErrorCode::NoMemory)?;
        b.swap_region = Some(r);
        Ok(r)
    }

    /// VRAM for a chunk of `len` bytes: a whole chunk straight from the GPU, chunk-aligned
    /// (so the GPU's allocator only ever holds whole aligned chunks), a shorter piece in
    /// one of the VM's own frames ([`crate::vram::slabs`]) at `align`; VRAM of guest
    /// process `pid` ([`vgpu_host_shim::Gpu::alloc_vram_for`]).
    pub(crate) fn alloc_chunk_vram(
        &mut self,
        pid: u32,
        len: u64,
        align: u64,
    ) -> Result<u64, HalError> {
        if len >= CHUNK {
            return self.gpu.alloc_vram_for(pid, len, CHUNK).map(|a| a.offset);
        }
        // Pieces of processes whose VRAM lives apart never share a frame.
        let owner = if self.gpu.separates_owners() { pid } else { 0 };
        self.hal.slabs.alloc(self.gpu.as_ref(), owner, len, align)
    }

    /// Frees VRAM [`Session::alloc_chunk_vram`] gave.
    pub(crate) fn free_chunk_vram(&mut self, offset: u64) -> Result<(), HalError> {
        if self.hal.slabs.free(self.gpu.as_ref(), offset) {
            return Ok(());
        }
        self.gpu.free_vram(offset)
    }

    /// Bytes of VRAM the VM's resident objects make unusable to others beyond their own
    /// size: the unused parts of its frames for small pieces (its footprint minus its
    /// resident bytes; the VRAM manager shares VRAM by the footprint).
    pub(crate) fn vram_slack(&self) -> u64 {
        self.hal.slabs.slack_bytes()
    }

    /// What `ALLOC_VRAM` charges the VM beyond its objects' bytes: the slack of its frames
    /// past one frame's worth (the frame being filled is room any VM with small objects
    /// has; every further frame a few small objects pin is charged to their VM).
    pub(crate) fn vram_charged_slack(&self) -> u64 {
        self.vram_slack().saturating_sub(CHUNK)
    }

    /// Allocates an object of `size` bytes in chunks: in VRAM while it has room, the rest
    /// in the swap store (the VRAM manager is woken to rebalance) if the VM has a swap
    /// limit. A VM without one is never given system memory: `NoMemory` instead. The
    /// object belongs to guest process `pid`.
    pub(crate) fn alloc_object(
        &mut self,
        pid: u32,
        size: u64,
        align: u64,
    ) -> Result<ObjBacking, ErrorCode> {
        let epoch = self.swap.epoch;
        let mut b = ObjBacking::layout(size, align, epoch);
        let mut spilled = 0u64;
        for i in 0..b.chunks.len() {
            let len = b.chunks[i].len;
            match self.alloc_chunk_vram(pid, len, b.align) {
                Ok(offset) => b.chunks[i].loc = Loc::Vram(offset),
                Err(HalError::OutOfVram(_)) if self.limits.swap_bytes > 0 => spilled += 1,
                Err(e) => {
                    self.free_object(&b);
                    return Err(e.code());
                }
            }
        }
        if spilled > 0 {
            if let Err(e) = self.ensure_swap_region(&mut b) {
                self.free_object(&b);
                return Err(e);
            }
            self.swap.counters.vm.spilled_chunks += spilled;
            self.swap.wake();
        }
        Ok(b)
    }

    /// Frees an object's VRAM chunks and swap region (nothing may reach them any more).
    pub(crate) fn free_object(&mut self, b: &ObjBacking) {
        for c in &b.chunks {
            if let Loc::Vram(o) = c.loc {
                if let Err(e) = self.free_chunk_vram(o) {
                    warn!("free VRAM chunk {o:#x}: {e}");
                }
            }
        }
        if let (Some(r), Some(store)) = (b.swap_region, &self.swap.store) {
            store.release(r, b.size());
        }
        if b.swapped_bytes() > 0 {
            // Swap space and possibly a deficit changed.
            self.swap.wake();
        }
        // VRAM freed: others may swap in.
        self.swap.wake();
    }

    /// Maps object `b` at `va` of `hctx` (all or nothing).
    pub(crate) fn map_object(
        &self,
        hctx: ContextId,
        va: u64,
        b: &ObjBacking,
        page: PageSize,
        flags: MapFlags,
    ) -> Result<(), HalError> {
        let runs = b
            .runs()
            .ok_or(HalError::InvalidArgument("object without swap region"))?;
        for (i, r) in runs.iter().enumerate() {
            let res = self
                .gpu
                .map(hctx, va + r.off, r.len, r.target.map_target(), page, flags);
            if let Err(e) = res {
                for u in &runs[..i] {
                    if let Err(e2) = self.gpu.unmap(hctx, va + u.off, u.len) {
                        warn!("MAP_VRAM: undo unmap: {e2}");
                    }
                }
                if let Err(e2) = self.gpu.invalidate_tlb(hctx) {
                    warn!("MAP_VRAM: undo invalidate: {e2}");
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The file range that shows `len` bytes of run target `t` to the CPU.
    pub(crate) fn cpu_range(
        &mut self,
        t: RunTarget,
        len: u64,
    ) -> Result<(std::os::fd::RawFd, u64), ErrorCode> {
        match t {
            RunTarget::Vram(o) => {
                // A GPU whose VRAM the CPU cannot map has no aperture to show.
                let vram = self.gpu.vram_fd().ok_or(ErrorCode::Unsupported)?;
                if o.checked_add(len).is_none_or(|end| end > vram.len) {
                    return Err(ErrorCode::Internal);
                }
                Ok((vram.fd, vram.offset + o))
            }
            RunTarget::Swap(o) => Ok((self.swap_store()?.fd(), o)),
        }
    }

    /// Places the aperture window of object `b` at BAR offset `off`: each run shows its
    /// current backing (VRAM or the swap copy).
    pub(crate) fn map_object_aperture(
        &mut self,
        off: u64,
        b: &ObjBacking,
        shm: &dyn ShmMapper,
    ) -> Result<(), ErrorCode> {
        let runs = b.runs().ok_or(ErrorCode::Internal)?;
        for r in runs {
            let (fd, fd_off) = self.cpu_range(r.target, r.len)?;
            shm.map(off + r.off, fd, fd_off, r.len, true)
                .map_err(|e: ShmError| {
                    warn!("MAP_APERTURE: SHMEM_MAP: {e}");
                    e.code()
                })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use vgpu_host_shim::{Gpu, SimConfig, SimGpu};
    use vgpu_protocol::request::{Op, ReplyBody, Request, PAGE_2M};
    use vm_memory::GuestAddress;

    use super::*;
    use crate::guest_mem::GuestMemory;
    use crate::shmem::NullShm;
    use crate::vm::session::VmLimits;

    const MIB: u64 = 1 << 20;

    #[test]
    fn allocations_spill_to_swap_within_the_limit_and_map_there() {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 4 * MIB,
            ..SimConfig::default()
        })
        .unwrap();
        let free0 = gpu.vram_free_bytes();
        let mut s = Session::new(
            gpu.clone(),
            VmLimits {
                vram_bytes: 4 * MIB,
                swap_bytes: 8 * MIB,
                ..VmLimits::default()
            },
        );
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x10000)]).unwrap();
        let req = |s: &mut Session, ctx: u32, op: Op| {
            s.execute(&Request { pid: 7, ctx, op }, &mem, &NullShm)
        };
        let Ok(ReplyBody::Context { ctx, .. }) = req(&mut s, 0, Op::CreateContext) else {
            panic!("context");
        };
        let alloc = |s: &mut Session, size: u64| {
            let r = |s: &mut Session, op| s.execute(&Request { pid: 7, ctx, op }, &mem, &NullShm);
            match r(
                s,
                Op::AllocVram {
                    size,
                    align: 2 * MIB,
                },
            ) {
                Ok(ReplyBody::Mem { mem, .. }) => Ok(mem),
                Err(e) => Err(e),
                other => panic!("{other:?}"),
            }
        };
        let a = alloc(&mut s, 4 * MIB).unwrap();
        let b = alloc(&mut s, 6 * MIB).unwrap();
        assert_eq!(gpu.vram_free_bytes(), free0 - 4 * MIB);
        let r = s.vram_report();
        assert_eq!(
            (r.vm.resident_bytes, r.vm.swapped_bytes),
            (4 * MIB, 6 * MIB)
        );
        assert_eq!(r.vm.spilled_chunks, 3);
        // Quota + swap = 12 MiB: 2 more fit, 4 do not.
        assert_eq!(
            alloc(&mut s, 4 * MIB),
            Err(vgpu_protocol::ErrorCode::LimitExceeded)
        );
        let c = alloc(&mut s, 2 * MIB).unwrap();
        // The spilled object maps with 2 MiB pages onto its swap copy.
        let map = Op::MapVram {
            mem: b,
            flags: 0,
            va: 64 * MIB,
            page: PAGE_2M,
        };
        assert!(req(&mut s, ctx, map).is_ok());
        for m in [a, b, c] {
            assert!(req(&mut s, ctx, Op::FreeMem { mem: m }).is_ok());
        }
        assert_eq!(gpu.vram_free_bytes(), free0);
        let r = s.vram_report();
        assert_eq!(r.vm.resident_bytes + r.vm.swapped_bytes, 0);
    }
}
