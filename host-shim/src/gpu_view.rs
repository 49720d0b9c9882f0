//! GPU-virtual memory as the engines see it: translation through one address space's
//! MMU, then VRAM or system memory.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::hal::MapTarget;
use crate::kernels::{FaultKind, KernelMemory, MemFault};
use crate::mmu::{AddressSpace, TranslateError};
use crate::shared_mem::SharedMem;

/// Copies are split into pieces of at most this size so aborts are noticed promptly.
const COPY_PIECE: usize = 1 << 20;

/// Why a copy-engine transfer stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyError {
    Fault(MemFault),
    Aborted,
}

/// One address space plus the physical memories its pages can point at.
pub struct GpuView<'a> {
    space: &'a AddressSpace,
    /// VRAM the host can reach through pointers; `None` when VRAM is device memory (the
    /// `cuda` GPU), where VRAM targets fault.
    vram: Option<&'a SharedMem>,
}

impl<'a> GpuView<'a> {
    pub fn new(space: &'a AddressSpace, vram: Option<&'a SharedMem>) -> Self {
        GpuView { space, vram }
    }

    /// Host pointer and length of the contiguous run at `va` (at most `len` bytes), and
    /// its target. Only valid while the caller holds the address space's access guard.
    fn host_run(
        &self,
        va: u64,
        len: usize,
        write: bool,
    ) -> Result<(*mut u8, usize, MapTarget), MemFault> {
        let fault = |kind| MemFault { va, write, kind };
        let t = self.space.translate(va, write).map_err(|e| match e {
            TranslateError::NotMapped => fault(FaultKind::NotMapped),
            TranslateError::ReadOnly => fault(FaultKind::ReadOnly),
        })?;
        let n = (len as u64).min(t.contiguous);
        match t.target {
            MapTarget::Vram { offset } => self
                .vram
                .and_then(|v| v.range_ptr(offset, n))
                .map(|p| (p, n as usize, t.target))
                .ok_or(fault(FaultKind::BadTarget)),
            MapTarget::Sysram { addr } => match self.space.sysmem().translate(addr, n) {
                Some(r) if r.len > 0 && !r.ptr.is_null() => {
                    Ok((r.ptr, r.len.min(n as usize), t.target))
                }
                _ => Err(fault(FaultKind::BadTarget)),
            },
        }
    }

    /// Copy-engine transfer of `len` bytes from `src` to `dst` (both GPU virtual).
    pub fn copy(&self, dst: u64, src: u64, len: u64, abort: &AtomicBool) -> Result<(), CopyError> {
        let mut done = 0u64;
        while done < len {
            if abort.load(Ordering::Relaxed) {
                return Err(CopyError::Aborted);
            }
            let (s, d) = match (src.checked_add(done), dst.checked_add(done)) {
                (Some(s), Some(d)) => (s, d),
                _ => {
                    return Err(CopyError::Fault(MemFault {
                        va: src.wrapping_add(done),
                        write: false,
                        kind: FaultKind::NotMapped,
                    }))
                }
            };
            let want = ((len - done) as usize).min(COPY_PIECE);
            let _access = self.space.access_guard();
            let (sp, sn, _) = self.host_run(s, want, false).map_err(CopyError::Fault)?;
            let (dp, dn, target) = self.host_run(d, sn, true).map_err(CopyError::Fault)?;
            let n = sn.min(dn);
            // SAFETY: `host_run` returned pointers to at least `sn`/`dn` valid bytes of
            // VRAM or registered system memory; `ptr::copy` tolerates overlap.
            unsafe { std::ptr::copy(sp, dp, n) };
            // Noted after it landed (see `WriteLog`).
            self.space.writes().note(target, n as u64);
            done += n as u64;
        }
        Ok(())
    }
}

impl KernelMemory for GpuView<'_> {
    fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), MemFault> {
        let mut done = 0usize;
        while done < buf.len() {
            let at = va.checked_add(done as u64).ok_or(MemFault {
                va,
                write: false,
                kind: FaultKind::NotMapped,
            })?;
            let _access = self.space.access_guard();
            let (p, n, _) = self.host_run(at, buf.len() - done, false)?;
            // SAFETY: `p` points at `n` readable bytes (see `host_run`); `buf[done..done+n]`
            // is in bounds because `n <= buf.len() - done`, and GPU memory never aliases it.
            unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr().add(done), n) };
            done += n;
        }
        Ok(())
    }

    fn write(&mut self, va: u64, buf: &[u8]) -> Result<(), MemFault> {
        let mut done = 0usize;
        while done < buf.len() {
            let at = va.checked_add(done as u64).ok_or(MemFault {
                va,
                write: true,
                kind: FaultKind::NotMapped,
            })?;
            let _access = self.space.access_guard();
            let (p, n, target) = self.host_run(at, buf.len() - done, true)?;
            // SAFETY: as in `read`, with the direction reversed.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(done), p, n) };
            // Noted after it landed (see `WriteLog`).
            self.space.writes().note(target, n as u64);
            done += n;
        }
        Ok(())
    }
}
