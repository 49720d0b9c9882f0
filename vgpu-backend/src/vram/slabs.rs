//! A VM's own 2 MiB frames for its pieces smaller than a chunk (issue 28, item 4).
//!
//! Whole chunks come straight from the GPU at chunk alignment, and every piece smaller
//! than a chunk (a small object, an object's shorter last chunk) is placed in one of its
//! VM's frames, each a chunk-sized, chunk-aligned GPU allocation. So the GPU's allocator
//! only ever holds whole aligned chunks: a VM's small objects can never split a chunk
//! another VM could use, and the frames they pin are the VM's own, charged to it whole
//! ([`SlabPool::slack_bytes`]) when it allocates and when the VRAM manager shares VRAM.

use std::collections::BTreeMap;

use vgpu_host_shim::{Gpu, HalError};
use vgpu_protocol::range::{RangeAllocator, VRAM_GRANULE};

use super::backing::CHUNK;

/// Zeros written into a reused piece (a fresh GPU allocation is zeroed by the GPU).
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// The frames of one VM and the pieces placed in them.
#[derive(Debug, Default)]
pub struct SlabPool {
    /// Frame offset in VRAM → its owner and the allocator of its `CHUNK` bytes. With a GPU
    /// that keeps owners' VRAM apart (a worker per guest process) the owner is the guest
    /// process and a frame holds pieces of that owner only; else it is 0 for every frame.
    frames: BTreeMap<u64, (u32, RangeAllocator)>,
    /// Bytes of pieces placed.
    used: u64,
}

impl SlabPool {
    /// Places a piece of `len` bytes (less than a chunk) aligned to `align` in one of
    /// `owner`'s frames with room (first fit), or in a new frame of `owner`'s
    /// ([`Gpu::alloc_vram_for`]). The piece reads as zero.
    pub fn alloc(
        &mut self,
        gpu: &dyn Gpu,
        owner: u32,
        len: u64,
        align: u64,
    ) -> Result<u64, HalError> {
        if len == 0 || len >= CHUNK || !align.is_power_of_two() {
            return Err(HalError::InvalidArgument("slab piece size or alignment"));
        }
        let found = self
            .frames
            .values_mut()
            .filter(|(o, _)| *o == owner)
            .find_map(|(_, a)| a.alloc(len, align.min(CHUNK)));
        let (off, size) = match found {
            Some(p) => p,
            None => {
                let frame = gpu.alloc_vram_for(owner, CHUNK, CHUNK)?;
                let mut a =
                    RangeAllocator::with_range(frame.offset, frame.offset + CHUNK, VRAM_GRANULE);
                let Some(p) = a.alloc(len, align.min(CHUNK)) else {
                    if let Err(e) = gpu.free_vram(frame.offset) {
                        log::warn!("VRAM frame {:#x}: {e}", frame.offset);
                    }
                    return Err(HalError::OutOfVram(len));
                };
                self.frames.insert(frame.offset, (owner, a));
                // A fresh frame is zeroed by the GPU.
                self.used += p.1;
                return Ok(p.0);
            }
        };
        self.used += size;
        if let Err(e) = zero(gpu, off, size) {
            self.free(gpu, off);
            return Err(e);
        }
        Ok(off)
    }

    /// Whether `off` is a piece in one of the frames.
    pub fn contains(&self, off: u64) -> bool {
        self.frame_of(off)
            .is_some_and(|f| self.frames[&f].1.allocation(off).is_some())
    }

    /// Frees the piece at `off`; a frame left empty goes back to the GPU. `false` if
    /// `off` is no piece of this pool.
    pub fn free(&mut self, gpu: &dyn Gpu, off: u64) -> bool {
        let Some(f) = self.frame_of(off) else {
            return false;
        };
        let Some((_, a)) = self.frames.get_mut(&f) else {
            return false;
        };
        let Some(size) = a.free(off) else {
            return false;
        };
        self.used = self.used.saturating_sub(size);
        if a.allocations() == 0 {
            self.frames.remove(&f);
            if let Err(e) = gpu.free_vram(f) {
                log::warn!("VRAM frame {f:#x}: {e}");
            }
        }
        true
    }

    /// VRAM the frames take on the GPU.
    pub fn frame_bytes(&self) -> u64 {
        self.frames.len() as u64 * CHUNK
    }

    /// Of that, bytes no piece uses: what the VM's small pieces make unusable to others
    /// beyond their own size.
    pub fn slack_bytes(&self) -> u64 {
        self.frame_bytes().saturating_sub(self.used)
    }

    /// The frame holding `off`, if any.
    fn frame_of(&self, off: u64) -> Option<u64> {
        let (&f, _) = self.frames.range(..=off).next_back()?;
        (off < f + CHUNK).then_some(f)
    }
}

fn zero(gpu: &dyn Gpu, off: u64, len: u64) -> Result<(), HalError> {
    let mut at = 0;
    while at < len {
        let n = (len - at).min(ZEROS.len() as u64);
        gpu.vram_write(off + at, &ZEROS[..n as usize])?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use vgpu_host_shim::{SimConfig, SimGpu};

    use super::*;

    #[test]
    fn pieces_share_frames_and_frames_go_back_when_empty() {
        let gpu = SimGpu::new(SimConfig {
            vram_bytes: 8 << 20,
            ..SimConfig::default()
        })
        .unwrap();
        let free0 = gpu.vram_free_bytes();
        let mut p = SlabPool::default();
        let a = p.alloc(gpu.as_ref(), 0, 4096, 4096).unwrap();
        let b = p.alloc(gpu.as_ref(), 0, 4096, 4096).unwrap();
        assert_eq!(p.frame_bytes(), CHUNK, "both in one frame");
        assert_eq!(p.slack_bytes(), CHUNK - 8192);
        assert!(p.contains(a) && p.contains(b) && !p.contains(a + 8192));
        // A piece that does not fit next to them takes a second frame.
        let c = p.alloc(gpu.as_ref(), 0, CHUNK - 4096, 4096).unwrap();
        assert_eq!(p.frame_bytes(), 2 * CHUNK);
        // A reused piece reads as zero.
        gpu.vram_write(b, &[0xaa; 4096]).unwrap();
        assert!(p.free(gpu.as_ref(), b));
        let b2 = p.alloc(gpu.as_ref(), 0, 4096, 4096).unwrap();
        let mut got = [1u8; 4096];
        gpu.vram_read(b2, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0));
        assert!(!p.free(gpu.as_ref(), b2 + 4096));
        for x in [a, b2, c] {
            assert!(p.free(gpu.as_ref(), x));
        }
        assert_eq!((p.frame_bytes(), p.slack_bytes()), (0, 0));
        assert_eq!(gpu.vram_free_bytes(), free0);
    }
}
