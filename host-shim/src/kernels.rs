//! The builtin kernels of the `sim` GPU, run against GPU-virtual memory.
//!
//! Arguments come from untrusted guests, so every kernel here bounds what it allocates,
//! checks every address computation (an address that would wrap past the top of the
//! address space faults like an unmapped one) and streams data in chunks of
//! [`CHUNK_BYTES`], checking the abort flag between chunks so the engine can stop a long
//! kernel promptly.

use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_protocol::kernel::{fnv1a64, FNV_OFFSET};
use vgpu_protocol::KernelArgs;

/// Largest single memory access a kernel makes, and the work between two abort checks.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Largest amount of guest data a kernel holds in host memory at once. Sgemm keeps all of B
/// resident and Stencil2d keeps a few grid rows; arguments needing more fail with
/// [`KernelError::TooLarge`] rather than letting a guest make the host allocate without bound.
pub const MAX_RESIDENT_BYTES: u64 = 64 << 20;

/// Target size of the A and C row panels Sgemm works on at once.
const PANEL_BYTES: usize = 1 << 20;
/// Sgemm register tile: rows of A.
const MR: usize = 4;
/// Sgemm register tile: columns of B.
const NR: usize = 8;

/// Why a memory access by the GPU failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FaultKind {
    #[error("not mapped")]
    NotMapped,
    #[error("read-only")]
    ReadOnly,
    #[error("bad target")]
    BadTarget,
}

/// A failed GPU memory access: `va` is an address within the access that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{} fault at {:#x}: {}", if *.write { "write" } else { "read" }, .va, .kind)]
pub struct MemFault {
    pub va: u64,
    pub write: bool,
    pub kind: FaultKind,
}

/// GPU-virtual memory as a kernel sees it (implemented by the sim's MMU accessor).
pub trait KernelMemory {
    fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), MemFault>;
    fn write(&mut self, va: u64, buf: &[u8]) -> Result<(), MemFault>;
}

/// Why a kernel did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("memory fault: {0}")]
    Fault(#[source] MemFault),
    #[error("kernel aborted")]
    Aborted,
    #[error("kernel arguments too large: {0}")]
    TooLarge(&'static str),
}

impl From<MemFault> for KernelError {
    fn from(fault: MemFault) -> Self {
        KernelError::Fault(fault)
    }
}

/// Runs one builtin kernel to completion. `Spin` is a no-op here (the engine times spins itself).
/// `now_ns` is the GPU clock (used by Timestamp). Long kernels check `abort` at least every
/// chunk (~1 MiB of data or equivalent compute) and return Err(Aborted) when it is set.
///
/// A fault stops the kernel at once; writes made before it stay, as on real hardware.
pub fn run_kernel(
    args: &KernelArgs,
    mem: &mut dyn KernelMemory,
    abort: &AtomicBool,
    now_ns: &dyn Fn() -> u64,
) -> Result<(), KernelError> {
    let mut gpu = KernelCtx { mem, abort };
    match *args {
        KernelArgs::Empty | KernelArgs::Spin { .. } => Ok(()),
        KernelArgs::Memset { dst, len, pattern } => memset(&mut gpu, dst, len, pattern),
        KernelArgs::Memcpy { dst, src, len } => memcpy(&mut gpu, dst, src, len),
        KernelArgs::Saxpy { x, y, n, a } => saxpy(&mut gpu, x, y, n, a),
        KernelArgs::Sgemm {
            a,
            b,
            c,
            m,
            n,
            k,
            alpha,
            beta,
        } => sgemm(
            &mut gpu,
            Gemm {
                a,
                b,
                c,
                m: m.into(),
                n: n.into(),
                k: k.into(),
                alpha,
                beta,
            },
        ),
        KernelArgs::ReduceSum { src, n, dst } => reduce_sum(&mut gpu, src, n, dst),
        KernelArgs::Checksum { src, len, dst } => checksum(&mut gpu, src, len, dst),
        KernelArgs::Stencil2d {
            src,
            dst,
            width,
            height,
            c_center,
            c_neighbor,
        } => stencil2d(&mut gpu, src, dst, width, height, c_center, c_neighbor),
        KernelArgs::Timestamp { dst } => {
            // The clock is sampled before touching memory: "at kernel start".
            let now = now_ns();
            check_range(dst, 8, true)?;
            gpu.write(dst, &now.to_le_bytes())
        }
    }
}

/// The fault reported for an address computation that wraps past the top of the address space.
fn wrap_fault(va: u64, write: bool) -> KernelError {
    KernelError::Fault(MemFault {
        va,
        write,
        kind: FaultKind::NotMapped,
    })
}

/// Fails when `len` bytes at `va` would run past the top of the address space, so later
/// `base + offset` computations within the range cannot overflow.
fn check_range(va: u64, len: u64, write: bool) -> Result<(), KernelError> {
    if len != 0 && va.checked_add(len - 1).is_none() {
        return Err(wrap_fault(va, write));
    }
    Ok(())
}

/// Byte length of `count` f32 elements at `base`; overflow means the operand cannot exist.
fn f32_len(base: u64, count: u64, write: bool) -> Result<u64, KernelError> {
    count.checked_mul(4).ok_or(wrap_fault(base, write))
}

/// `base + off`, faulting (instead of wrapping) on overflow.
fn byte_va(base: u64, off: u64, write: bool) -> Result<u64, KernelError> {
    base.checked_add(off).ok_or(wrap_fault(base, write))
}

/// Address of f32 element `index` of the array at `base`.
fn elem_va(base: u64, index: usize, write: bool) -> Result<u64, KernelError> {
    let off = (index as u64)
        .checked_mul(4)
        .ok_or(wrap_fault(base, write))?;
    byte_va(base, off, write)
}

/// Address of row `row` of a row-major f32 matrix at `base` with `row_len` elements per row.
fn row_va(base: u64, row: u64, row_len: u64, write: bool) -> Result<u64, KernelError> {
    let off = row
        .checked_mul(row_len)
        .and_then(|e| e.checked_mul(4))
        .ok_or(wrap_fault(base, write))?;
    byte_va(base, off, write)
}

/// Size of the next chunk of a `len`-byte stream that has `done` bytes behind it.
fn chunk_at(len: u64, done: u64) -> usize {
    // Bounded by CHUNK_BYTES, so the cast cannot truncate.
    (len - done).min(CHUNK_BYTES as u64) as usize
}

/// Decodes one little-endian f32; callers pass 4-byte slices from `chunks_exact(4)`.
fn le_f32(b: &[u8]) -> f32 {
    f32::from_le_bytes(b.try_into().unwrap_or_default())
}

/// A kernel's view of the GPU: memory plus the abort flag.
struct KernelCtx<'a> {
    mem: &'a mut dyn KernelMemory,
    abort: &'a AtomicBool,
}

impl KernelCtx<'_> {
    /// Called between chunks so a watchdog or channel kill takes effect promptly.
    fn poll(&self) -> Result<(), KernelError> {
        if self.abort.load(Ordering::Relaxed) {
            return Err(KernelError::Aborted);
        }
        Ok(())
    }

    fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), KernelError> {
        if buf.is_empty() {
            return Ok(());
        }
        Ok(self.mem.read(va, buf)?)
    }

    fn write(&mut self, va: u64, buf: &[u8]) -> Result<(), KernelError> {
        if buf.is_empty() {
            return Ok(());
        }
        Ok(self.mem.write(va, buf)?)
    }

    /// Appends `count` f32s read from `va` to `out`, a chunk at a time.
    fn read_f32s(
        &mut self,
        va: u64,
        count: usize,
        out: &mut Vec<f32>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), KernelError> {
        let mut done = 0;
        while done < count {
            self.poll()?;
            let n = (count - done).min(CHUNK_BYTES / 4);
            scratch.resize(n * 4, 0);
            self.read(elem_va(va, done, false)?, scratch)?;
            out.extend(scratch.chunks_exact(4).map(le_f32));
            done += n;
        }
        Ok(())
    }

    /// Writes `vals` as little-endian f32s at `va`, a chunk at a time.
    fn write_f32s(
        &mut self,
        va: u64,
        vals: &[f32],
        scratch: &mut Vec<u8>,
    ) -> Result<(), KernelError> {
        for (i, piece) in vals.chunks(CHUNK_BYTES / 4).enumerate() {
            self.poll()?;
            scratch.resize(piece.len() * 4, 0);
            for (o, v) in scratch.chunks_exact_mut(4).zip(piece) {
                o.copy_from_slice(&v.to_le_bytes());
            }
            self.write(elem_va(va, i * (CHUNK_BYTES / 4), true)?, scratch)?;
        }
        Ok(())
    }
}

fn memset(gpu: &mut KernelCtx<'_>, dst: u64, len: u64, pattern: u32) -> Result<(), KernelError> {
    check_range(dst, len, true)?;
    // CHUNK_BYTES is a multiple of 4, so every chunk starts at the pattern's first byte.
    let buf: Vec<u8> = pattern
        .to_le_bytes()
        .into_iter()
        .cycle()
        .take(chunk_at(len, 0))
        .collect();
    let mut done = 0;
    while done < len {
        gpu.poll()?;
        let n = chunk_at(len, done);
        gpu.write(byte_va(dst, done, true)?, &buf[..n])?;
        done += n as u64;
    }
    Ok(())
}

fn memcpy(gpu: &mut KernelCtx<'_>, dst: u64, src: u64, len: u64) -> Result<(), KernelError> {
    check_range(src, len, false)?;
    check_range(dst, len, true)?;
    let mut buf = vec![0u8; chunk_at(len, 0)];
    // memmove semantics: when dst lies inside the source range, copying from the end means
    // no chunk is overwritten before it has been read.
    let backward = dst > src && dst - src < len;
    let chunks = len.div_ceil(CHUNK_BYTES as u64);
    for i in 0..chunks {
        gpu.poll()?;
        let idx = if backward { chunks - 1 - i } else { i };
        let off = idx * CHUNK_BYTES as u64;
        let piece = &mut buf[..chunk_at(len, off)];
        gpu.read(byte_va(src, off, false)?, piece)?;
        gpu.write(byte_va(dst, off, true)?, piece)?;
    }
    Ok(())
}

fn saxpy(gpu: &mut KernelCtx<'_>, x: u64, y: u64, n: u64, a: f32) -> Result<(), KernelError> {
    let len = f32_len(x, n, false)?;
    check_range(x, len, false)?;
    check_range(y, len, false)?;
    let chunk = chunk_at(len, 0);
    let (mut xb, mut yb) = (vec![0u8; chunk], vec![0u8; chunk]);
    let mut done = 0;
    while done < len {
        gpu.poll()?;
        let n = chunk_at(len, done);
        let (xs, ys) = (&mut xb[..n], &mut yb[..n]);
        gpu.read(byte_va(x, done, false)?, xs)?;
        gpu.read(byte_va(y, done, false)?, ys)?;
        for (xv, yv) in xs.chunks_exact(4).zip(ys.chunks_exact_mut(4)) {
            let r = le_f32(yv) + a * le_f32(xv);
            yv.copy_from_slice(&r.to_le_bytes());
        }
        gpu.write(byte_va(y, done, true)?, ys)?;
        done += n as u64;
    }
    Ok(())
}

/// Sgemm's arguments, widened for address arithmetic.
struct Gemm {
    a: u64,
    b: u64,
    c: u64,
    m: u64,
    n: u64,
    k: u64,
    alpha: f32,
    beta: f32,
}

/// `C = alpha·A·B + beta·C`, bit-identical to [`reference::sgemm`]: each element's dot
/// product is accumulated in f32 over p = 0..k in order, starting from 0.0.
///
/// B is loaded once and packed into NR-column strips; A and C are processed in row panels
/// of about [`PANEL_BYTES`], with a MR×NR register tile per strip and row group.
fn sgemm(gpu: &mut KernelCtx<'_>, g: Gemm) -> Result<(), KernelError> {
    let b_len =
        g.k.checked_mul(g.n)
            .and_then(|e| e.checked_mul(4))
            .filter(|&l| l <= MAX_RESIDENT_BYTES)
            .ok_or(KernelError::TooLarge("sgemm B operand exceeds 64 MiB"))?;
    let a_len =
        g.m.checked_mul(g.k)
            .and_then(|e| e.checked_mul(4))
            .ok_or(wrap_fault(g.a, false))?;
    let c_len =
        g.m.checked_mul(g.n)
            .and_then(|e| e.checked_mul(4))
            .ok_or(wrap_fault(g.c, false))?;
    check_range(g.a, a_len, false)?;
    check_range(g.b, b_len, false)?;
    check_range(g.c, c_len, false)?;
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    // Both are bounded by the B cap, so they fit in usize.
    let (n, k) = (g.n as usize, g.k as usize);
    let bpack = pack_b(gpu, g.b, k, n)?;

    let mut rows = (PANEL_BYTES / 4 / n.max(k)).max(1);
    if rows >= MR {
        rows -= rows % MR;
    }
    let (mut scratch, mut arows, mut apack, mut cpanel) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut i0 = 0u64;
    while i0 < g.m {
        let r = (g.m - i0).min(rows as u64) as usize;
        let c_va = row_va(g.c, i0, g.n, false)?;
        cpanel.clear();
        if k == 0 {
            // Empty dot products: C = alpha·0 + beta·C, as in the reference.
            gpu.read_f32s(c_va, r * n, &mut cpanel, &mut scratch)?;
            for cv in cpanel.iter_mut() {
                *cv = g.alpha * 0.0 + g.beta * *cv;
            }
        } else {
            arows.clear();
            let a_va = row_va(g.a, i0, g.k, false)?;
            gpu.read_f32s(a_va, r * k, &mut arows, &mut scratch)?;
            pack_a(&arows, k, r, &mut apack);
            gpu.read_f32s(c_va, r * n, &mut cpanel, &mut scratch)?;
            for (s, bstrip) in bpack.chunks_exact(k * NR).enumerate() {
                gpu.poll()?;
                let j0 = s * NR;
                let cols = (n - j0).min(NR);
                for (grp, apanel) in apack.chunks_exact(k * MR).enumerate() {
                    let acc = micro_tile(apanel, bstrip);
                    let i_base = grp * MR;
                    for (rr, acc_row) in acc.iter().enumerate().take(r - i_base) {
                        let crow = &mut cpanel[(i_base + rr) * n + j0..][..cols];
                        for (cv, &av) in crow.iter_mut().zip(acc_row) {
                            *cv = g.alpha * av + g.beta * *cv;
                        }
                    }
                }
            }
        }
        gpu.write_f32s(row_va(g.c, i0, g.n, true)?, &cpanel, &mut scratch)?;
        i0 += r as u64;
    }
    Ok(())
}

/// Reads the k×n matrix B and packs it as NR-column strips, each k rows of NR contiguous
/// values (zero-padded past column n), so the register tile reads B sequentially.
fn pack_b(gpu: &mut KernelCtx<'_>, b: u64, k: usize, n: usize) -> Result<Vec<f32>, KernelError> {
    let mut packed = vec![0.0f32; n.div_ceil(NR) * k * NR];
    let rows_per_read = (CHUNK_BYTES / 4 / n).max(1);
    let (mut rows, mut scratch) = (Vec::new(), Vec::new());
    let mut p0 = 0;
    while p0 < k {
        let cnt = (k - p0).min(rows_per_read);
        rows.clear();
        let va = row_va(b, p0 as u64, n as u64, false)?;
        gpu.read_f32s(va, cnt * n, &mut rows, &mut scratch)?;
        for (dp, brow) in rows.chunks_exact(n).enumerate() {
            let p = p0 + dp;
            for (s, seg) in brow.chunks(NR).enumerate() {
                packed[(s * k + p) * NR..][..seg.len()].copy_from_slice(seg);
            }
        }
        p0 += cnt;
    }
    Ok(packed)
}

/// Packs `r` rows of A (each `k` long) into groups of MR rows interleaved per p, zero-padding
/// the last group, so the register tile reads A sequentially.
fn pack_a(rows: &[f32], k: usize, r: usize, out: &mut Vec<f32>) {
    out.clear();
    out.resize(r.div_ceil(MR) * k * MR, 0.0);
    for (i, arow) in rows.chunks_exact(k).enumerate() {
        let (grp, rr) = (i / MR, i % MR);
        let group = &mut out[grp * k * MR..][..k * MR];
        for (slot, &v) in group.chunks_exact_mut(MR).zip(arow) {
            slot[rr] = v;
        }
    }
}

/// One MR×NR tile of A·B over the full k, accumulated per element in order p = 0..k.
fn micro_tile(apanel: &[f32], bstrip: &[f32]) -> [[f32; NR]; MR] {
    let mut acc = [[0.0f32; NR]; MR];
    for (av, bv) in apanel.chunks_exact(MR).zip(bstrip.chunks_exact(NR)) {
        let av: [f32; MR] = av.try_into().unwrap_or_default();
        let bv: [f32; NR] = bv.try_into().unwrap_or_default();
        for (acc_row, a) in acc.iter_mut().zip(av) {
            for (x, b) in acc_row.iter_mut().zip(bv) {
                *x += a * b;
            }
        }
    }
    acc
}

fn reduce_sum(gpu: &mut KernelCtx<'_>, src: u64, n: u64, dst: u64) -> Result<(), KernelError> {
    let len = f32_len(src, n, false)?;
    check_range(src, len, false)?;
    check_range(dst, 4, true)?;
    let mut buf = vec![0u8; chunk_at(len, 0)];
    let mut sum = 0.0f64;
    let mut done = 0;
    while done < len {
        gpu.poll()?;
        let piece = &mut buf[..chunk_at(len, done)];
        gpu.read(byte_va(src, done, false)?, piece)?;
        sum = piece
            .chunks_exact(4)
            .fold(sum, |s, v| s + f64::from(le_f32(v)));
        done += piece.len() as u64;
    }
    gpu.write(dst, &(sum as f32).to_le_bytes())
}

fn checksum(gpu: &mut KernelCtx<'_>, src: u64, len: u64, dst: u64) -> Result<(), KernelError> {
    check_range(src, len, false)?;
    check_range(dst, 8, true)?;
    let mut buf = vec![0u8; chunk_at(len, 0)];
    let mut h = FNV_OFFSET;
    let mut done = 0;
    while done < len {
        gpu.poll()?;
        let piece = &mut buf[..chunk_at(len, done)];
        gpu.read(byte_va(src, done, false)?, piece)?;
        h = fnv1a64(piece, h);
        done += piece.len() as u64;
    }
    gpu.write(dst, &h.to_le_bytes())
}

/// One stencil step over bands of about [`CHUNK_BYTES`] of rows, holding only the band plus
/// one halo row each side.
///
/// Overlapping `src` and `dst` behave as if `src` were copied first: bands run top-down when
/// `dst <= src` and bottom-up otherwise, every source row is read exactly once (halo rows are
/// carried over, not re-read), and a band is written only after all rows it needs were read.
/// A band's write can then only clobber source rows that were already read.
fn stencil2d(
    gpu: &mut KernelCtx<'_>,
    src: u64,
    dst: u64,
    width: u32,
    height: u32,
    c_center: f32,
    c_neighbor: f32,
) -> Result<(), KernelError> {
    let row_bytes = u64::from(width) * 4;
    // A band of one row holds three source rows and an output row.
    if row_bytes.saturating_mul(4) > MAX_RESIDENT_BYTES {
        return Err(KernelError::TooLarge("stencil2d grid row exceeds 16 MiB"));
    }
    let grid_len = row_bytes
        .checked_mul(height.into())
        .ok_or(wrap_fault(src, false))?;
    check_range(src, grid_len, false)?;
    check_range(dst, grid_len, true)?;
    let (w, h) = (width as usize, height as usize);
    if w == 0 || h == 0 {
        return Ok(());
    }
    let band = (CHUNK_BYTES / 4 / w).clamp(1, h);
    let top_down = dst <= src;
    let (mut win, mut next, mut out) = (Vec::new(), Vec::new(), Vec::new());
    let (mut scratch, mut out_bytes) = (Vec::new(), Vec::new());
    // Source rows [win_lo, win_hi) are held in `win`.
    let (mut win_lo, mut win_hi) = (0usize, 0usize);
    for bi in 0..h.div_ceil(band) {
        gpu.poll()?;
        let (y0, y1) = if top_down {
            (bi * band, ((bi + 1) * band).min(h))
        } else {
            (h.saturating_sub((bi + 1) * band), h - bi * band)
        };
        let (lo, hi) = (y0.saturating_sub(1), (y1 + 1).min(h));
        let (keep_lo, keep_hi) = (lo.max(win_lo), hi.min(win_hi));
        let mut read_rows =
            |gpu: &mut KernelCtx<'_>, from: usize, to: usize, next: &mut Vec<f32>| {
                let va = row_va(src, from as u64, width.into(), false)?;
                gpu.read_f32s(va, (to - from) * w, next, &mut scratch)
            };
        next.clear();
        if keep_lo < keep_hi {
            read_rows(gpu, lo, keep_lo, &mut next)?;
            next.extend_from_slice(&win[(keep_lo - win_lo) * w..(keep_hi - win_lo) * w]);
            read_rows(gpu, keep_hi, hi, &mut next)?;
        } else {
            read_rows(gpu, lo, hi, &mut next)?;
        }
        std::mem::swap(&mut win, &mut next);
        (win_lo, win_hi) = (lo, hi);

        out.clear();
        out.resize((y1 - y0) * w, 0.0);
        let row = |y: usize| &win[(y - lo) * w..][..w];
        for (y, orow) in (y0..y1).zip(out.chunks_exact_mut(w)) {
            let (north, south) = (row(y.saturating_sub(1)), row((y + 1).min(h - 1)));
            stencil_row(c_center, c_neighbor, north, row(y), south, orow);
        }
        let va = row_va(dst, y0 as u64, width.into(), true)?;
        gpu.write_f32s(va, &out, &mut out_bytes)?;
    }
    Ok(())
}

/// One output row: `c_center*c + c_neighbor*(((n + s) + e) + w)`, the same expression and
/// order as [`reference::stencil2d`], with east and west clamped to the row's ends.
fn stencil_row(cc: f32, cn: f32, north: &[f32], row: &[f32], south: &[f32], out: &mut [f32]) {
    let w = row.len();
    let cell =
        |x: usize, west: f32, east: f32| cc * row[x] + cn * (north[x] + south[x] + east + west);
    if w == 1 {
        out[0] = cell(0, row[0], row[0]);
        return;
    }
    out[0] = cell(0, row[0], row[1]);
    let interior = out[1..w - 1]
        .iter_mut()
        .zip(row.windows(3))
        .zip(&north[1..])
        .zip(&south[1..]);
    for (((o, win), &n), &s) in interior {
        *o = cc * win[1] + cn * (n + s + win[2] + win[0]);
    }
    out[w - 1] = cell(w - 1, row[w - 2], row[w - 1]);
}

/// CPU reference implementations on plain slices (in `vgpu-protocol`, shared with the
/// runtime and the tools). Results are bit-identical to the kernels'.
pub use vgpu_protocol::reference;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::ops::Range;

    const BASE: u64 = 0x10_0000;

    /// A flat test memory: `data` mapped at `base`, with optional read-only and unmapped
    /// ranges. Faults report the first failing byte, as the sim's MMU does.
    struct FlatMemory {
        base: u64,
        data: Vec<u8>,
        read_only: Option<Range<u64>>,
        holes: Vec<Range<u64>>,
        largest_access: usize,
    }

    impl FlatMemory {
        fn new(size: usize) -> Self {
            FlatMemory {
                base: BASE,
                data: vec![0; size],
                read_only: None,
                holes: Vec::new(),
                largest_access: 0,
            }
        }

        /// Offset of the access into `data`, or the fault for its first bad byte.
        fn check(&mut self, va: u64, len: usize, write: bool) -> Result<usize, MemFault> {
            self.largest_access = self.largest_access.max(len);
            let (start, end) = (u128::from(va), u128::from(va) + len as u128);
            let mapped = u128::from(self.base)..u128::from(self.base) + self.data.len() as u128;
            let mut first: Option<(u128, FaultKind)> = None;
            let mut note = |at: u128, kind| {
                if first.is_none_or(|(f, _)| at < f) {
                    first = Some((at, kind));
                }
            };
            if start < mapped.start {
                note(start, FaultKind::NotMapped);
            }
            if end > mapped.end {
                note(start.max(mapped.end), FaultKind::NotMapped);
            }
            for hole in &self.holes {
                if u128::from(hole.start) < end && u128::from(hole.end) > start {
                    note(start.max(hole.start.into()), FaultKind::NotMapped);
                }
            }
            if let (true, Some(ro)) = (write, &self.read_only) {
                if u128::from(ro.start) < end && u128::from(ro.end) > start {
                    note(start.max(ro.start.into()), FaultKind::ReadOnly);
                }
            }
            match first {
                Some((at, kind)) => Err(MemFault {
                    va: at as u64,
                    write,
                    kind,
                }),
                None => Ok((va - self.base) as usize),
            }
        }

        fn f32s(&self, va: u64, n: usize) -> Vec<f32> {
            let at = (va - self.base) as usize;
            self.data[at..at + 4 * n]
                .chunks_exact(4)
                .map(le_f32)
                .collect()
        }

        fn put_f32s(&mut self, va: u64, vals: &[f32]) {
            let at = (va - self.base) as usize;
            for (o, v) in self.data[at..].chunks_exact_mut(4).zip(vals) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }

        fn u64_at(&self, va: u64) -> u64 {
            let at = (va - self.base) as usize;
            u64::from_le_bytes(self.data[at..at + 8].try_into().unwrap())
        }
    }

    impl KernelMemory for FlatMemory {
        fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), MemFault> {
            let at = self.check(va, buf.len(), false)?;
            buf.copy_from_slice(&self.data[at..at + buf.len()]);
            Ok(())
        }

        fn write(&mut self, va: u64, buf: &[u8]) -> Result<(), MemFault> {
            let at = self.check(va, buf.len(), true)?;
            self.data[at..at + buf.len()].copy_from_slice(buf);
            Ok(())
        }
    }

    fn run(args: KernelArgs, mem: &mut FlatMemory) -> Result<(), KernelError> {
        run_kernel(&args, mem, &AtomicBool::new(false), &|| 0)
    }

    /// Deterministic pseudo-random data (xorshift), for the multi-chunk cases.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    fn noise_bytes(seed: u64, n: usize) -> Vec<u8> {
        noise(seed, n).iter().map(|v| v.to_bits() as u8).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The textbook i-j-p loop, to check the faster reference against.
    fn naive_sgemm(
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &mut [f32],
    ) {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for p in 0..k {
                    acc += a[i * k + p] * b[p * n + j];
                }
                c[i * n + j] = alpha * acc + beta * c[i * n + j];
            }
        }
    }

    fn check_memset(len: usize, pattern: u32) {
        let mut mem = FlatMemory::new(len + 8);
        run(
            KernelArgs::Memset {
                dst: BASE + 4,
                len: len as u64,
                pattern,
            },
            &mut mem,
        )
        .unwrap();
        let p = pattern.to_le_bytes();
        assert_eq!(&mem.data[..4], &[0; 4]);
        assert!(mem.data[4..4 + len]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == p[i % 4]));
        assert_eq!(&mem.data[4 + len..], &[0; 4]);
    }

    fn check_memcpy(len: usize, dst_off: usize, src_off: usize) {
        let size = len + dst_off.max(src_off) + 16;
        let mut mem = FlatMemory::new(size);
        mem.data = noise_bytes(len as u64 ^ 7, size);
        let mut want = mem.data.clone();
        want.copy_within(src_off..src_off + len, dst_off);
        let args = KernelArgs::Memcpy {
            dst: BASE + dst_off as u64,
            src: BASE + src_off as u64,
            len: len as u64,
        };
        run(args, &mut mem).unwrap();
        assert!(
            mem.data == want,
            "memcpy len {len} dst +{dst_off} src +{src_off}"
        );
    }

    fn check_saxpy(a: f32, x: &[f32], y: &[f32]) {
        let n = x.len();
        let mut mem = FlatMemory::new(8 * n + 8);
        let (xva, yva) = (BASE, BASE + 4 * n as u64 + 8);
        mem.put_f32s(xva, x);
        mem.put_f32s(yva, y);
        run(
            KernelArgs::Saxpy {
                x: xva,
                y: yva,
                n: n as u64,
                a,
            },
            &mut mem,
        )
        .unwrap();
        let mut want = y.to_vec();
        reference::saxpy(a, x, &mut want);
        assert_eq!(bits(&mem.f32s(yva, n)), bits(&want));
        assert_eq!(mem.f32s(xva, n).len(), n);
    }

    /// Returns the largest memory access the kernel made.
    fn check_sgemm(m: usize, n: usize, k: usize, alpha: f32, beta: f32, seed: u64) -> usize {
        let (a, b, c) = (
            noise(seed, m * k),
            noise(seed + 1, k * n),
            noise(seed + 2, m * n),
        );
        let (ava, bva) = (BASE, BASE + 4 * (m * k) as u64);
        let cva = bva + 4 * (k * n) as u64;
        let mut mem = FlatMemory::new(4 * (m * k + k * n + m * n) + 4);
        mem.put_f32s(ava, &a);
        mem.put_f32s(bva, &b);
        mem.put_f32s(cva, &c);
        let args = KernelArgs::Sgemm {
            a: ava,
            b: bva,
            c: cva,
            m: m as u32,
            n: n as u32,
            k: k as u32,
            alpha,
            beta,
        };
        run(args, &mut mem).unwrap();
        let mut want = c.clone();
        reference::sgemm(m, n, k, alpha, &a, &b, beta, &mut want);
        let mut naive = c;
        naive_sgemm((m, n, k), alpha, &a, &b, beta, &mut naive);
        assert_eq!(bits(&want), bits(&naive), "reference vs naive {m}x{n}x{k}");
        assert_eq!(
            bits(&mem.f32s(cva, m * n)),
            bits(&want),
            "sgemm {m}x{n}x{k}"
        );
        assert_eq!(*mem.data.last().unwrap(), 0, "sgemm wrote past C");
        mem.largest_access
    }

    fn check_reduce(x: &[f32]) {
        let mut mem = FlatMemory::new(4 * x.len() + 8);
        mem.put_f32s(BASE, x);
        let dst = BASE + 4 * x.len() as u64;
        run(
            KernelArgs::ReduceSum {
                src: BASE,
                n: x.len() as u64,
                dst,
            },
            &mut mem,
        )
        .unwrap();
        assert_eq!(
            mem.f32s(dst, 1)[0].to_bits(),
            reference::reduce_sum(x).to_bits()
        );
    }

    fn check_checksum(bytes: &[u8]) {
        let mut mem = FlatMemory::new(bytes.len() + 16);
        mem.data[..bytes.len()].copy_from_slice(bytes);
        let dst = BASE + (bytes.len() as u64).next_multiple_of(8);
        let len = bytes.len() as u64;
        run(
            KernelArgs::Checksum {
                src: BASE,
                len,
                dst,
            },
            &mut mem,
        )
        .unwrap();
        assert_eq!(mem.u64_at(dst), reference::checksum(bytes));
    }

    /// Runs a stencil with `dst` at `dst_shift` f32s from `src` (negative: before it), which
    /// may overlap; the result must be as if `src` had been copied first.
    fn check_stencil(w: usize, h: usize, cc: f32, cn: f32, dst_shift: isize, seed: u64) {
        let cells = w * h;
        let pad = dst_shift.unsigned_abs();
        let mut mem = FlatMemory::new(4 * (cells + pad + if dst_shift == 0 { cells } else { 0 }));
        let grid = noise(seed, cells);
        let (src, dst) = match dst_shift {
            0 => (BASE, BASE + 4 * cells as u64),
            s if s > 0 => (BASE, BASE + 4 * s as u64),
            s => (BASE + 4 * s.unsigned_abs() as u64, BASE),
        };
        mem.put_f32s(src, &grid);
        let args = KernelArgs::Stencil2d {
            src,
            dst,
            width: w as u32,
            height: h as u32,
            c_center: cc,
            c_neighbor: cn,
        };
        run(args, &mut mem).unwrap();
        let mut want = vec![0.0; cells];
        reference::stencil2d(w, h, cc, cn, &grid, &mut want);
        assert_eq!(
            bits(&mem.f32s(dst, cells)),
            bits(&want),
            "stencil {w}x{h} shift {dst_shift}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn memset_matches(len in 0usize..2000, pattern in any::<u32>()) {
            check_memset(len * 4, pattern);
        }

        #[test]
        fn memcpy_matches_memmove(len in 0usize..3000, dst_off in 0usize..3000, src_off in 0usize..3000) {
            check_memcpy(len, dst_off, src_off);
        }

        #[test]
        fn saxpy_matches(a in -8f32..8.0, xy in proptest::collection::vec((-1e3f32..1e3, -1e3f32..1e3), 0..500)) {
            let (x, y): (Vec<f32>, Vec<f32>) = xy.into_iter().unzip();
            check_saxpy(a, &x, &y);
        }

        #[test]
        fn sgemm_matches(m in 1usize..20, n in 1usize..20, k in 1usize..20, alpha in -2f32..2.0, beta in -2f32..2.0, seed in any::<u64>()) {
            check_sgemm(m, n, k, alpha, beta, seed);
        }

        #[test]
        fn reduce_sum_matches(x in proptest::collection::vec(-1e6f32..1e6, 0..1000)) {
            check_reduce(&x);
        }

        #[test]
        fn checksum_matches(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            check_checksum(&bytes);
        }

        #[test]
        fn stencil_matches(w in 1usize..24, h in 1usize..24, cc in -1f32..1.0, cn in -1f32..1.0, shift in -600isize..600, seed in any::<u64>()) {
            check_stencil(w, h, cc, cn, shift, seed);
        }

        /// Hostile arguments near and far from mapped memory never panic.
        #[test]
        fn hostile_args_never_panic(
            kind in 0usize..10,
            addrs in proptest::collection::vec(
                prop_oneof![any::<u64>(), (0u64..0x3_0000).prop_map(|o| BASE - 0x1_0000 + o), (0u64..64).prop_map(|o| u64::MAX - o)],
                3,
            ),
            len in prop_oneof![0u64..0x2_0000, any::<u64>()],
            dims in proptest::collection::vec(prop_oneof![0u32..200, any::<u32>()], 3),
        ) {
            let (a, b, c) = (addrs[0], addrs[1], addrs[2]);
            let (m, n, k) = (dims[0], dims[1], dims[2]);
            let args = match kind {
                0 => KernelArgs::Empty,
                1 => KernelArgs::Spin { ns: len },
                2 => KernelArgs::Memset { dst: a, len, pattern: m },
                3 => KernelArgs::Memcpy { dst: a, src: b, len },
                4 => KernelArgs::Saxpy { x: a, y: b, n: len, a: 1.5 },
                5 => KernelArgs::Sgemm { a, b, c, m, n, k, alpha: 1.0, beta: 0.5 },
                6 => KernelArgs::ReduceSum { src: a, n: len, dst: b },
                7 => KernelArgs::Checksum { src: a, len, dst: b },
                8 => KernelArgs::Stencil2d { src: a, dst: b, width: m, height: n, c_center: 0.5, c_neighbor: 0.125 },
                _ => KernelArgs::Timestamp { dst: a },
            };
            let mut mem = FlatMemory::new(0x1_0000);
            mem.holes.push(BASE + 0x8000..BASE + 0x9000);
            let _ = run(args, &mut mem);
            prop_assert!(mem.largest_access <= CHUNK_BYTES);
        }
    }

    #[test]
    fn multi_chunk_sizes_match_references() {
        let big = 2 * CHUNK_BYTES + 12;
        check_memset(big, 0xdead_beef);
        check_memset(CHUNK_BYTES, 7);
        check_memcpy(big + 5, 0, 40);
        check_memcpy(CHUNK_BYTES, 0, CHUNK_BYTES);
        let n = big / 4 + 3;
        check_saxpy(0.75, &noise(1, n), &noise(2, n));
        check_reduce(&noise(3, n));
        check_checksum(&noise_bytes(4, big + 1));
    }

    #[test]
    fn memcpy_overlapping_is_memmove_across_chunks() {
        let len = 2 * CHUNK_BYTES + 100;
        // dst after src, by less than a chunk and by more than one.
        check_memcpy(len, 3, 0);
        check_memcpy(len, CHUNK_BYTES + 7, 0);
        // dst before src.
        check_memcpy(len, 0, 5);
        check_memcpy(len, 0, CHUNK_BYTES + 1);
        // Exact alias.
        check_memcpy(len, 9, 9);
    }

    #[test]
    fn sgemm_multi_panel_and_multi_chunk_b() {
        // k = 40000: panels of 4 rows (9 rows: 3 panels, one partial) and B (1.28 MB) read
        // in several chunks; n = 9 leaves a partial NR strip.
        check_sgemm(9, 9, 40_000, 1.25, -0.5, 11);
        // Many row panels with small k and n, partial register tiles everywhere.
        check_sgemm(3001, 13, 3, 0.5, 1.0, 12);
        check_sgemm(70, 70, 70, 1.0, 0.0, 13);
        check_sgemm(1, 1, 1, 2.0, 3.0, 14);
    }

    #[test]
    fn sgemm_zero_k_scales_c() {
        let mut mem = FlatMemory::new(64);
        mem.put_f32s(BASE, &[1.0, -2.0, 4.0]);
        let args = KernelArgs::Sgemm {
            a: BASE,
            b: BASE,
            c: BASE,
            m: 3,
            n: 1,
            k: 0,
            alpha: 2.0,
            beta: 0.5,
        };
        run(args, &mut mem).unwrap();
        assert_eq!(mem.f32s(BASE, 3), vec![0.5, -1.0, 2.0]);
    }

    #[test]
    fn stencil_multi_band_and_overlap() {
        // 300 wide: bands of 873 rows, so 2000 rows take three bands.
        check_stencil(300, 2000, 0.6, 0.1, 0, 21);
        // In place, and shifted by less than a row, more than a band, in both directions.
        for shift in [0, 1, -1, 299, -301, 300 * 900 + 5, -(300 * 900) - 5] {
            let mut mem_shift = shift;
            if shift == 0 {
                // check_stencil(.., 0, ..) is the disjoint case; exercise true aliasing here.
                let (w, h) = (300, 2000);
                let grid = noise(22, w * h);
                let mut mem = FlatMemory::new(4 * w * h);
                mem.put_f32s(BASE, &grid);
                let args = KernelArgs::Stencil2d {
                    src: BASE,
                    dst: BASE,
                    width: w as u32,
                    height: h as u32,
                    c_center: 0.5,
                    c_neighbor: 0.125,
                };
                run(args, &mut mem).unwrap();
                let mut want = vec![0.0; w * h];
                reference::stencil2d(w, h, 0.5, 0.125, &grid, &mut want);
                assert_eq!(bits(&mem.f32s(BASE, w * h)), bits(&want));
                mem_shift = 1;
            }
            check_stencil(300, 2000, 0.5, 0.125, mem_shift, 23);
        }
        // Degenerate shapes.
        check_stencil(1, 1, 0.5, 0.25, 0, 24);
        check_stencil(1, 3000, 0.5, 0.25, -1, 25);
        check_stencil(70_000, 2, 0.5, 0.25, 70_001, 26);
    }

    #[test]
    fn stencil_reference_known_values() {
        // 2×2 grid: every neighbour clamps onto the grid.
        let src = [1.0, 2.0, 3.0, 4.0];
        let mut dst = [0.0; 4];
        reference::stencil2d(2, 2, 1.0, 1.0, &src, &mut dst);
        // Cell (0,0): c=1, n=1 (clamped), s=3, e=2, w=1 (clamped).
        assert_eq!(dst, [1.0 + 7.0, 2.0 + 9.0, 3.0 + 11.0, 4.0 + 13.0]);
    }

    #[test]
    fn sgemm_reference_known_values() {
        let (a, b) = ([1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]);
        let mut c = [1.0; 4];
        reference::sgemm(2, 2, 2, 1.0, &a, &b, 2.0, &mut c);
        assert_eq!(c, [21.0, 24.0, 45.0, 52.0]);
    }

    #[test]
    fn timestamp_writes_clock() {
        let mut mem = FlatMemory::new(16);
        let args = KernelArgs::Timestamp { dst: BASE + 8 };
        run_kernel(&args, &mut mem, &AtomicBool::new(false), &|| {
            0x0123_4567_89ab_cdef
        })
        .unwrap();
        assert_eq!(mem.u64_at(BASE + 8), 0x0123_4567_89ab_cdef);
        assert_eq!(mem.u64_at(BASE), 0);
    }

    #[test]
    fn empty_and_spin_touch_nothing() {
        let mut mem = FlatMemory::new(0);
        run(KernelArgs::Empty, &mut mem).unwrap();
        run(KernelArgs::Spin { ns: 1_000_000 }, &mut mem).unwrap();
        assert_eq!(mem.largest_access, 0);
    }

    #[test]
    fn faults_report_the_failing_address() {
        // Read from an unmapped hole, in the second chunk.
        let mut mem = FlatMemory::new(3 * CHUNK_BYTES);
        let hole = BASE + CHUNK_BYTES as u64 + 100;
        mem.holes.push(hole..hole + 4096);
        let args = KernelArgs::Checksum {
            src: BASE,
            len: 2 * CHUNK_BYTES as u64,
            dst: BASE,
        };
        let fault = MemFault {
            va: hole,
            write: false,
            kind: FaultKind::NotMapped,
        };
        assert_eq!(run(args, &mut mem), Err(KernelError::Fault(fault)));

        // Write into a read-only range.
        mem.holes.clear();
        let ro = BASE + 2 * CHUNK_BYTES as u64 + 8;
        mem.read_only = Some(ro..ro + 64);
        let args = KernelArgs::Memset {
            dst: BASE + 4,
            len: 3 * CHUNK_BYTES as u64 - 4,
            pattern: 1,
        };
        let fault = MemFault {
            va: ro,
            write: true,
            kind: FaultKind::ReadOnly,
        };
        assert_eq!(run(args, &mut mem), Err(KernelError::Fault(fault)));
        // The chunks before the fault were written, like real hardware.
        assert_eq!(&mem.data[4..8], &1u32.to_le_bytes());

        // Reading is fine from the read-only range, writing the result there is not.
        let args = KernelArgs::ReduceSum {
            src: ro,
            n: 4,
            dst: ro + 16,
        };
        let fault = MemFault {
            va: ro + 16,
            write: true,
            kind: FaultKind::ReadOnly,
        };
        assert_eq!(run(args, &mut mem), Err(KernelError::Fault(fault)));

        // Past the end of mapped memory.
        let end = BASE + mem.data.len() as u64;
        let args = KernelArgs::Memcpy {
            dst: BASE,
            src: end - 8,
            len: 16,
        };
        let fault = MemFault {
            va: end,
            write: false,
            kind: FaultKind::NotMapped,
        };
        assert_eq!(run(args, &mut mem), Err(KernelError::Fault(fault)));

        // Sgemm with C partly read-only faults on the write.
        let mut mem = FlatMemory::new(4096);
        mem.read_only = Some(BASE + 2048..BASE + 2052);
        let args = KernelArgs::Sgemm {
            a: BASE,
            b: BASE,
            c: BASE + 2000,
            m: 4,
            n: 4,
            k: 4,
            alpha: 1.0,
            beta: 1.0,
        };
        let fault = MemFault {
            va: BASE + 2048,
            write: true,
            kind: FaultKind::ReadOnly,
        };
        assert_eq!(run(args, &mut mem), Err(KernelError::Fault(fault)));
    }

    #[test]
    fn address_overflow_faults_without_panic() {
        let top = u64::MAX - 7;
        let mut mem = FlatMemory::new(64);
        let wrap = |va, write| {
            Err(KernelError::Fault(MemFault {
                va,
                write,
                kind: FaultKind::NotMapped,
            }))
        };
        assert_eq!(
            run(
                KernelArgs::Memcpy {
                    dst: BASE,
                    src: top,
                    len: 100
                },
                &mut mem
            ),
            wrap(top, false)
        );
        assert_eq!(
            run(
                KernelArgs::Memcpy {
                    dst: top,
                    src: BASE,
                    len: 100
                },
                &mut mem
            ),
            wrap(top, true)
        );
        assert_eq!(
            run(
                KernelArgs::Memset {
                    dst: top,
                    len: 16,
                    pattern: 0
                },
                &mut mem
            ),
            wrap(top, true)
        );
        assert_eq!(
            run(
                KernelArgs::Saxpy {
                    x: BASE,
                    y: BASE,
                    n: u64::MAX / 2,
                    a: 1.0
                },
                &mut mem
            ),
            wrap(BASE, false)
        );
        assert_eq!(
            run(
                KernelArgs::Checksum {
                    src: BASE,
                    len: 8,
                    dst: u64::MAX - 3
                },
                &mut mem
            ),
            wrap(u64::MAX - 3, true)
        );
        assert_eq!(
            run(
                KernelArgs::ReduceSum {
                    src: top,
                    n: 4,
                    dst: BASE
                },
                &mut mem
            ),
            wrap(top, false)
        );
        let gemm = KernelArgs::Sgemm {
            a: top,
            b: BASE,
            c: BASE,
            m: 2,
            n: 2,
            k: 2,
            alpha: 1.0,
            beta: 0.0,
        };
        assert_eq!(run(gemm, &mut mem), wrap(top, false));
        let st = KernelArgs::Stencil2d {
            src: BASE,
            dst: top,
            width: 4,
            height: 4,
            c_center: 1.0,
            c_neighbor: 0.0,
        };
        assert_eq!(run(st, &mut mem), wrap(top, true));
        // Ending exactly at the top of the address space is representable: the MMU decides.
        let fault = MemFault {
            va: top,
            write: true,
            kind: FaultKind::NotMapped,
        };
        assert_eq!(
            run(KernelArgs::Timestamp { dst: top }, &mut mem),
            Err(KernelError::Fault(fault))
        );
        // Nothing was written by any of them.
        assert!(mem.data.iter().all(|&b| b == 0));
    }

    /// Sets `abort` on the first write, like a watchdog firing mid-kernel.
    struct AbortOnWrite<'a> {
        inner: FlatMemory,
        abort: &'a AtomicBool,
        writes: usize,
    }

    impl KernelMemory for AbortOnWrite<'_> {
        fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), MemFault> {
            self.inner.read(va, buf)
        }
        fn write(&mut self, va: u64, buf: &[u8]) -> Result<(), MemFault> {
            self.writes += 1;
            self.abort.store(true, Ordering::Relaxed);
            self.inner.write(va, buf)
        }
    }

    #[test]
    fn abort_stops_between_chunks() {
        let len = 4 * CHUNK_BYTES as u64;
        let memset = KernelArgs::Memset {
            dst: BASE,
            len,
            pattern: 0xffff_ffff,
        };

        // Already set: nothing is written.
        let mut mem = FlatMemory::new(len as usize);
        let abort = AtomicBool::new(true);
        assert_eq!(
            run_kernel(&memset, &mut mem, &abort, &|| 0),
            Err(KernelError::Aborted)
        );
        assert!(mem.data.iter().all(|&b| b == 0));

        // Set during the first chunk: exactly one chunk is written.
        let abort = AtomicBool::new(false);
        let mut mem = AbortOnWrite {
            inner: FlatMemory::new(len as usize),
            abort: &abort,
            writes: 0,
        };
        assert_eq!(
            run_kernel(&memset, &mut mem, &abort, &|| 0),
            Err(KernelError::Aborted)
        );
        assert_eq!(mem.writes, 1);
        assert!(mem.inner.data[..CHUNK_BYTES].iter().all(|&b| b == 0xff));
        assert!(mem.inner.data[CHUNK_BYTES..].iter().all(|&b| b == 0));

        // Compute-bound sgemm also stops: the flag is checked between B strips.
        let abort = AtomicBool::new(false);
        let gemm = KernelArgs::Sgemm {
            a: BASE,
            b: BASE,
            c: BASE,
            m: 256,
            n: 256,
            k: 256,
            alpha: 1.0,
            beta: 0.0,
        };
        let mut mem = AbortOnWrite {
            inner: FlatMemory::new(1 << 20),
            abort: &abort,
            writes: 0,
        };
        abort.store(true, Ordering::Relaxed);
        assert_eq!(
            run_kernel(&gemm, &mut mem, &abort, &|| 0),
            Err(KernelError::Aborted)
        );
        assert_eq!(mem.writes, 0);

        // Memcpy, saxpy and stencil stop after their first written chunk too.
        for args in [
            KernelArgs::Memcpy {
                dst: BASE,
                src: BASE + 2 * CHUNK_BYTES as u64,
                len: 2 * CHUNK_BYTES as u64,
            },
            KernelArgs::Saxpy {
                x: BASE,
                y: BASE,
                n: len / 4,
                a: 1.0,
            },
            KernelArgs::Stencil2d {
                src: BASE,
                dst: BASE,
                width: 1024,
                height: 1024,
                c_center: 1.0,
                c_neighbor: 0.0,
            },
        ] {
            let abort = AtomicBool::new(false);
            let mut mem = AbortOnWrite {
                inner: FlatMemory::new(len as usize),
                abort: &abort,
                writes: 0,
            };
            assert_eq!(
                run_kernel(&args, &mut mem, &abort, &|| 0),
                Err(KernelError::Aborted),
                "{args:?}"
            );
            assert_eq!(mem.writes, 1, "{args:?}");
        }
    }

    #[test]
    fn too_large_operands_are_refused_before_touching_memory() {
        let mut mem = FlatMemory::new(0);
        // B = 8192×8192 f32 = 256 MiB.
        let gemm = KernelArgs::Sgemm {
            a: BASE,
            b: BASE,
            c: BASE,
            m: 1,
            n: 8192,
            k: 8192,
            alpha: 1.0,
            beta: 0.0,
        };
        assert!(matches!(run(gemm, &mut mem), Err(KernelError::TooLarge(_))));
        // Exactly at the cap is fine (it then faults on the empty memory instead).
        let gemm = KernelArgs::Sgemm {
            a: BASE,
            b: BASE,
            c: BASE,
            m: 1,
            n: 4096,
            k: 4096,
            alpha: 1.0,
            beta: 0.0,
        };
        let mut empty = FlatMemory::new(0);
        assert!(matches!(run(gemm, &mut empty), Err(KernelError::Fault(_))));
        // B dimensions whose product overflows.
        let gemm = KernelArgs::Sgemm {
            a: 0,
            b: 0,
            c: 0,
            m: u32::MAX,
            n: u32::MAX,
            k: u32::MAX,
            alpha: 1.0,
            beta: 0.0,
        };
        assert!(matches!(run(gemm, &mut mem), Err(KernelError::TooLarge(_))));
        // A stencil row too wide for the row window.
        let st = KernelArgs::Stencil2d {
            src: BASE,
            dst: BASE,
            width: u32::MAX,
            height: 1,
            c_center: 1.0,
            c_neighbor: 0.0,
        };
        assert!(matches!(run(st, &mut mem), Err(KernelError::TooLarge(_))));
        assert_eq!(mem.largest_access, 0);
    }

    #[test]
    fn accesses_stay_within_a_chunk() {
        let len = 5 * CHUNK_BYTES + 3;
        let mut mem = FlatMemory::new(2 * len);
        run(
            KernelArgs::Memcpy {
                dst: BASE + len as u64,
                src: BASE,
                len: len as u64,
            },
            &mut mem,
        )
        .unwrap();
        assert!(mem.largest_access <= CHUNK_BYTES);
        // B is 4 MiB, A and C 512 KiB.
        assert!(check_sgemm(128, 1024, 1024, 1.0, 0.0, 31) <= CHUNK_BYTES);
    }

    #[test]
    fn errors_display() {
        let fault = MemFault {
            va: 0x1000,
            write: true,
            kind: FaultKind::ReadOnly,
        };
        assert_eq!(
            KernelError::from(fault).to_string(),
            "memory fault: write fault at 0x1000: read-only"
        );
        assert_eq!(KernelError::Aborted.to_string(), "kernel aborted");
    }
}
