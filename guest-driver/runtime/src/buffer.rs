//! `Buffer`: memory the GPU sees at a fixed virtual address and the CPU can read/write.
//!
//! The CPU reaches a buffer through the transport's mapping of it (guest RAM, or the VRAM
//! aperture). On a GPU whose VRAM the CPU cannot map (the device answers `MAP_APERTURE`
//! with `UNSUPPORTED`: the `cuda` GPU), VRAM buffers are read and written through the
//! context's [`Stager`](crate::stage::Stager) instead: copy-engine DMA to and from a
//! buffer in guest RAM, as `cudaMemcpy` does. The same calls work either way.

use std::cell::OnceCell;
use std::sync::Arc;

use vgpu_protocol::mem::{MapFlags, PageSize};
use vgpu_protocol::ErrorCode;

use crate::context::{CtxInner, CtxLink};
use crate::error::{Error, Result};
use crate::transport::{CpuPtr, MemHandle, MemKind};

/// A GPU-mapped allocation. Unmapped and freed on drop.
///
/// CPU accesses copy through raw pointers into the transport's mapping; no Rust
/// reference into GPU-visible memory is ever formed. Synchronise with the GPU (wait on a
/// fence) before reading results or overwriting inputs of work in flight.
pub struct Buffer {
    ctx: CtxLink,
    mem: MemHandle,
    kind: MemKind,
    va: u64,
    len: u64,
    mapped: u64,
    page: PageSize,
    cpu: OnceCell<CpuAccess>,
}

/// How the CPU reaches a buffer's bytes.
#[derive(Debug, Clone, Copy)]
enum CpuAccess {
    /// Through the transport's mapping.
    Mapped(CpuPtr),
    /// Through the copy engine (VRAM without a CPU view).
    Staged,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("kind", &self.kind)
            .field("va", &format_args!("{:#x}", self.va))
            .field("len", &self.len)
            .finish()
    }
}

impl Buffer {
    pub(crate) fn new(
        inner: &Arc<CtxInner>,
        ctx: CtxLink,
        kind: MemKind,
        len: u64,
        page: PageSize,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-sized buffer"));
        }
        let page = match kind {
            MemKind::Host => ctx.transport.host_page_size(page),
            MemKind::Vram => page,
        };
        let p = page.bytes();
        let mapped = len
            .checked_add(p - 1)
            .map(|v| v & !(p - 1))
            .ok_or(Error::InvalidArgument("buffer too large"))?;
        let va = inner
            .va()
            .alloc(mapped, page)
            .ok_or(Error::OutOfVa(mapped))?;
        let t = &ctx.transport;
        let mem = match kind {
            MemKind::Vram => t.alloc_vram(ctx.handle, mapped, p),
            MemKind::Host => t.alloc_host(ctx.handle, mapped, p),
        };
        let mem = match mem {
            Ok(m) => m,
            Err(e) => {
                inner.va().release(va, mapped, page);
                return Err(e);
            }
        };
        if let Err(e) = t.gpu_map(ctx.handle, mem, va, page, MapFlags::default()) {
            if let Err(e2) = t.free_mem(ctx.handle, mem) {
                log::warn!("freeing unmappable buffer: {e2}");
            }
            inner.va().release(va, mapped, page);
            return Err(e);
        }
        log::trace!("{kind:?} buffer {len:#x} bytes at {va:#x}");
        Ok(Buffer {
            ctx,
            mem,
            kind,
            va,
            len,
            mapped,
            page,
            cpu: OnceCell::new(),
        })
    }

    /// The buffer's GPU virtual address (fixed for its whole life).
    pub fn gpu_va(&self) -> u64 {
        self.va
    }

    /// Changes how the buffer reaches its context (a channel's memory kept by the
    /// context between channels: see `CtxInner::keep_spare_arena`).
    pub(crate) fn relink(&mut self, link: CtxLink) {
        self.ctx = link;
    }

    /// Bytes asked for (the mapping may be larger, up to the page size).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// GPU page size of the mapping.
    pub fn page_size(&self) -> PageSize {
        self.page
    }

    /// Checks that `len` bytes at `offset` lie inside the buffer.
    fn check(&self, offset: u64, len: usize) -> Result<()> {
        let oob = || Error::OutOfBounds {
            offset,
            len: len as u64,
            size: self.len,
        };
        let end = offset.checked_add(len as u64).ok_or_else(oob)?;
        if end > self.len {
            return Err(oob());
        }
        Ok(())
    }

    fn access(&self) -> Result<CpuAccess> {
        if let Some(a) = self.cpu.get() {
            return Ok(*a);
        }
        let a = match self.ctx.transport.cpu_map(self.ctx.handle, self.mem) {
            Ok(c) => {
                if (c.len() as u64) < self.len {
                    return Err(Error::InvalidArgument("transport CPU view too short"));
                }
                CpuAccess::Mapped(c)
            }
            Err(e) if self.kind == MemKind::Vram && e.code() == ErrorCode::Unsupported => {
                log::debug!("VRAM at {:#x} has no CPU view: staging", self.va);
                CpuAccess::Staged
            }
            Err(e) => return Err(e),
        };
        Ok(*self.cpu.get_or_init(|| a))
    }

    /// Address of byte `offset` in the CPU mapping, or `None` if the buffer is staged.
    fn at(&self, offset: u64, len: usize) -> Result<Option<*mut u8>> {
        self.check(offset, len)?;
        let cpu = match self.access()? {
            CpuAccess::Mapped(c) => c,
            CpuAccess::Staged => return Ok(None),
        };
        let off = usize::try_from(offset).map_err(|_| Error::InvalidArgument("offset"))?;
        // SAFETY: `off + len <= self.len <= cpu.len()` (checked above), so the result
        // stays inside the transport's mapping, which lives as long as `self.mem`.
        Ok(Some(unsafe { cpu.as_ptr().add(off) }))
    }

    /// The CPU address of the buffer's first byte, for code that hands the memory to
    /// others (a C library's pinned host memory); `None` where the CPU has no view of
    /// it (staged VRAM). Valid while the buffer lives.
    pub fn cpu_ptr(&self) -> Result<Option<*mut u8>> {
        self.at(0, 0)
    }

    /// Whether the CPU reaches this buffer through the copy engine (no CPU view).
    pub fn is_staged(&self) -> Result<bool> {
        Ok(matches!(self.access()?, CpuAccess::Staged))
    }

    fn stager(&self) -> Result<Arc<CtxInner>> {
        self.ctx
            .inner()
            .ok_or(Error::InvalidArgument("context is being destroyed"))
    }

    /// Copies `data` into the buffer at byte `offset`. On a staged buffer the bytes have
    /// reached VRAM when this returns.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let Some(dst) = self.at(offset, data.len())? else {
            return self
                .stager()?
                .with_stager(|s| s.write(self.va + offset, data));
        };
        // SAFETY: `dst` has room for `data.len()` bytes (checked by `at`); `data` is a
        // Rust slice, which cannot overlap the transport's GPU mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let Some(src) = self.at(offset, out.len())? else {
            return self
                .stager()?
                .with_stager(|s| s.read(self.va + offset, out));
        };
        // SAFETY: `src` has `out.len()` readable bytes (checked by `at`); `out` is a Rust
        // slice and cannot overlap the mapping.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<()> {
        let n = usize::try_from(len).map_err(|_| Error::InvalidArgument("fill too long"))?;
        let Some(dst) = self.at(offset, n)? else {
            // Pieces of a staging buffer's size at a time, not one huge vector.
            let piece = vec![byte; n.min(crate::stage::PIECE)];
            let mut done = 0usize;
            while done < n {
                let k = piece.len().min(n - done);
                self.write(offset + done as u64, &piece[..k])?;
                done += k;
            }
            return Ok(());
        };
        // SAFETY: `dst` has room for `n` bytes (checked by `at`).
        unsafe { std::ptr::write_bytes(dst, byte, n) };
        Ok(())
    }

    fn write_words<T: Copy>(
        &self,
        offset: u64,
        data: &[T],
        enc: impl Fn(T) -> [u8; 4],
    ) -> Result<()> {
        let bytes = data
            .len()
            .checked_mul(4)
            .ok_or(Error::InvalidArgument("slice too long"))?;
        let Some(dst) = self.at(offset, bytes)? else {
            let raw: Vec<u8> = data.iter().flat_map(|&v| enc(v)).collect();
            return self.write(offset, &raw);
        };
        for (i, &v) in data.iter().enumerate() {
            // SAFETY: element `i` lies inside the `bytes` checked by `at`; unaligned
            // writes are used because `offset` need not be 4-aligned.
            unsafe { dst.add(i * 4).cast::<[u8; 4]>().write_unaligned(enc(v)) };
        }
        Ok(())
    }

    fn read_words<T>(&self, offset: u64, out: &mut [T], dec: impl Fn([u8; 4]) -> T) -> Result<()> {
        let bytes = out
            .len()
            .checked_mul(4)
            .ok_or(Error::InvalidArgument("slice too long"))?;
        let Some(src) = self.at(offset, bytes)? else {
            let mut raw = vec![0u8; bytes];
            self.read(offset, &mut raw)?;
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = dec([c[0], c[1], c[2], c[3]]);
            }
            return Ok(());
        };
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: element `i` lies inside the `bytes` checked by `at`.
            *o = dec(unsafe { src.add(i * 4).cast::<[u8; 4]>().read_unaligned() });
        }
        Ok(())
    }

    /// Writes f32 values (little-endian) starting at byte `offset`.
    pub fn write_f32(&self, offset: u64, data: &[f32]) -> Result<()> {
        self.write_words(offset, data, |v| v.to_le_bytes())
    }

    pub fn read_f32(&self, offset: u64, out: &mut [f32]) -> Result<()> {
        self.read_words(offset, out, f32::from_le_bytes)
    }

    /// Reads `count` f32 values starting at byte `offset`.
    pub fn read_f32_vec(&self, offset: u64, count: usize) -> Result<Vec<f32>> {
        let mut v = vec![0f32; count];
        self.read_f32(offset, &mut v)?;
        Ok(v)
    }

    /// Writes u32 values (little-endian) starting at byte `offset`.
    pub fn write_u32(&self, offset: u64, data: &[u32]) -> Result<()> {
        self.write_words(offset, data, |v| v.to_le_bytes())
    }

    pub fn read_u32(&self, offset: u64, out: &mut [u32]) -> Result<()> {
        self.read_words(offset, out, u32::from_le_bytes)
    }

    pub fn read_u32_vec(&self, offset: u64, count: usize) -> Result<Vec<u32>> {
        let mut v = vec![0u32; count];
        self.read_u32(offset, &mut v)?;
        Ok(v)
    }

    /// Reads one little-endian u64 (kernel results such as checksums and timestamps).
    pub fn read_u64(&self, offset: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let t = &self.ctx.transport;
        let h = self.ctx.handle;
        if let Err(e) = t.gpu_unmap(h, self.va, self.mapped) {
            // The GPU may still reach the memory: keep it (and the VA) rather than free it.
            log::warn!("unmapping buffer at {:#x}: {e}; leaking it", self.va);
            return;
        }
        if let Err(e) = t.free_mem(h, self.mem) {
            log::warn!("freeing buffer at {:#x}: {e}", self.va);
        }
        // A context tearing down its own stager releases its whole VA space anyway.
        if let Some(c) = self.ctx.inner() {
            c.va().release(self.va, self.mapped, self.page);
        }
    }
}
