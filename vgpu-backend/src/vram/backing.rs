//! The backing of one VRAM object: a list of chunks (2 MiB, the last one smaller), each in
//! VRAM (its own HAL allocation) or in the VM's swap store. The guest sees one object at
//! fixed GPU virtual addresses and one aperture window; which chunk lives where is the VRAM
//! manager's business.

use vgpu_host_shim::MapTarget;

use super::store::SWAP_BASE;

/// Chunk size: the unit of eviction and swap-in.
pub const CHUNK: u64 = 2 << 20;

/// Where a chunk's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loc {
    /// Its own VRAM allocation at this offset.
    Vram(u64),
    /// In the swap store, at the object's swap region + the chunk's offset.
    Swap,
}

/// One chunk of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Offset in the object.
    pub off: u64,
    pub len: u64,
    pub loc: Loc,
    /// Manager epoch at which the GPU last touched it (access counters), or at which it
    /// was allocated or swapped in.
    pub last_used: u64,
}

/// The backing of a VRAM object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjBacking {
    pub chunks: Vec<Chunk>,
    /// VRAM alignment of a piece shorter than a chunk ([`vram_align`]); whole chunks are
    /// always chunk-aligned.
    pub align: u64,
    /// Offset of the object's region in the swap store, once it needed one.
    pub swap_region: Option<u64>,
}

/// A run of consecutive chunks that map as one piece: `len` bytes at object offset `off`
/// to `target` (contiguous VRAM, or contiguous swap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub off: u64,
    pub len: u64,
    pub target: RunTarget,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunTarget {
    Vram(u64),
    /// Offset in the swap store.
    Swap(u64),
}

impl RunTarget {
    /// The GPU page-table target of this run.
    pub fn map_target(self) -> MapTarget {
        match self {
            RunTarget::Vram(offset) => MapTarget::Vram { offset },
            RunTarget::Swap(off) => MapTarget::Sysram {
                addr: SWAP_BASE + off,
            },
        }
    }
}

/// The VRAM alignment an object of `size` bytes gets for a guest's `requested` one: no
/// more than any page that can map the object needs (the largest power of two dividing
/// its size: a mapping's size is a multiple of its page) and no more than a chunk, so a
/// tiny object asking for a huge alignment cannot make the VRAM around it unusable.
pub fn vram_align(size: u64, requested: u64) -> u64 {
    let by_size = 1u64 << size.trailing_zeros().min(63);
    requested.min(by_size).clamp(4096, CHUNK)
}

impl ObjBacking {
    /// Chunk layout of an object of `size` bytes (all chunks still unplaced: `Swap`).
    pub fn layout(size: u64, align: u64, epoch: u64) -> Self {
        let mut chunks = Vec::new();
        let mut off = 0;
        while off < size {
            let len = CHUNK.min(size - off);
            chunks.push(Chunk {
                off,
                len,
                loc: Loc::Swap,
                last_used: epoch,
            });
            off += len;
        }
        ObjBacking {
            chunks,
            align: vram_align(size, align),
            swap_region: None,
        }
    }

    pub fn size(&self) -> u64 {
        self.chunks.last().map_or(0, |c| c.off + c.len)
    }

    pub fn resident_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .filter(|c| matches!(c.loc, Loc::Vram(_)))
            .map(|c| c.len)
            .sum()
    }

    pub fn swapped_bytes(&self) -> u64 {
        self.size() - self.resident_bytes()
    }

    /// Where chunk `c` is, as a run target (a swapped chunk needs the swap region).
    pub fn chunk_target(&self, c: &Chunk) -> Option<RunTarget> {
        match c.loc {
            Loc::Vram(o) => Some(RunTarget::Vram(o)),
            Loc::Swap => self.swap_region.map(|r| RunTarget::Swap(r + c.off)),
        }
    }

    /// The object as maximal runs of contiguous backing.
    pub fn runs(&self) -> Option<Vec<Run>> {
        let mut out: Vec<Run> = Vec::new();
        for c in &self.chunks {
            let t = self.chunk_target(c)?;
            if let Some(last) = out.last_mut() {
                let next = match last.target {
                    RunTarget::Vram(o) => RunTarget::Vram(o + last.len),
                    RunTarget::Swap(o) => RunTarget::Swap(o + last.len),
                };
                if next == t {
                    last.len += c.len;
                    continue;
                }
            }
            out.push(Run {
                off: c.off,
                len: c.len,
                target: t,
            });
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_what_the_object_needs() {
        assert_eq!(vram_align(4096, 2 << 20), 4096);
        assert_eq!(vram_align(4096, 1 << 30), 4096);
        assert_eq!(vram_align(12 << 10, 64 << 10), 4096);
        assert_eq!(vram_align(64 << 10, 64 << 10), 64 << 10);
        assert_eq!(vram_align(3 << 20, 2 << 20), 1 << 20);
        assert_eq!(vram_align(16 << 20, 1 << 30), CHUNK);
        assert_eq!(vram_align(16 << 20, 4096), 4096);
    }

    #[test]
    fn layout_and_runs() {
        let mut b = ObjBacking::layout(5 << 20, 65536, 7);
        assert_eq!(b.chunks.len(), 3);
        assert_eq!(b.chunks[2].len, 1 << 20);
        assert_eq!(b.size(), 5 << 20);
        assert!(b.runs().is_none(), "swapped chunks need a region");
        b.swap_region = Some(4 << 20);
        b.chunks[0].loc = Loc::Vram(0);
        b.chunks[1].loc = Loc::Vram(2 << 20);
        let runs = b.runs().unwrap();
        assert_eq!(
            runs,
            vec![
                Run {
                    off: 0,
                    len: 4 << 20,
                    target: RunTarget::Vram(0)
                },
                Run {
                    off: 4 << 20,
                    len: 1 << 20,
                    target: RunTarget::Swap(8 << 20)
                }
            ]
        );
        assert_eq!(b.resident_bytes(), 4 << 20);
        assert_eq!(b.swapped_bytes(), 1 << 20);
    }
}
