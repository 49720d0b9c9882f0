//! The same references spread over the host's cores, for the workloads' realistic sizes
//! (sgemm 4096³ is minutes on one core). Each output element is computed by exactly the
//! operations, in exactly the order, of its sequential reference, so the results are
//! bit-identical (the tests below check it); only which thread computes which rows
//! differs. Small problems run on the calling thread.

use std::num::NonZeroUsize;

/// Below this many element operations a problem is not worth a thread.
const PARALLEL_MIN_OPS: u64 = 1 << 22;

/// Rows of C an sgemm band accumulates together, so each row of B is read from memory
/// once per this many rows instead of once per row.
const SGEMM_ROW_BLOCK: usize = 8;

fn threads_for(ops: u64) -> usize {
    if ops < PARALLEL_MIN_OPS {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
}

/// Splits `out` (`rows` rows of `row_len`) into one contiguous band of rows per thread
/// and runs `f(first_row, band)` on each.
fn bands<T: Send>(
    out: &mut [T],
    rows: usize,
    row_len: usize,
    threads: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let out = &mut out[..rows * row_len];
    if threads <= 1 || rows <= 1 || row_len == 0 {
        f(0, out);
        return;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, band) in out.chunks_mut(per * row_len).enumerate() {
            let f = &f;
            s.spawn(move || f(i * per, band));
        }
    });
}

/// [`super::saxpy`] over the host's cores.
pub fn saxpy(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let threads = threads_for(n as u64);
    bands(y, n, 1, threads, |first, band| {
        super::saxpy(a, &x[first..first + band.len()], band)
    });
}

/// [`super::sgemm`] over the host's cores (rows of C in bands, blocks of rows sharing
/// each pass over B).
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let threads = threads_for((m as u64) * (n as u64) * (k as u64));
    bands(c, m, n, threads, |first, band| {
        sgemm_rows(first, n, k, alpha, a, b, beta, band)
    });
}

/// Rows `first..` of C (as many as `c` holds), [`SGEMM_ROW_BLOCK`] rows at a time; per
/// element the same sum over p = 0..k in order from 0.0 as [`super::sgemm`].
#[allow(clippy::too_many_arguments)]
fn sgemm_rows(
    first: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    if n == 0 {
        return;
    }
    let mut acc = vec![0.0f32; SGEMM_ROW_BLOCK * n];
    for (blk, cblock) in c.chunks_mut(SGEMM_ROW_BLOCK * n).enumerate() {
        let rows = cblock.len() / n;
        let row0 = first + blk * SGEMM_ROW_BLOCK;
        let acc = &mut acc[..rows * n];
        acc.fill(0.0);
        for p in 0..k {
            let brow = &b[p * n..(p + 1) * n];
            for (r, accr) in acc.chunks_mut(n).enumerate() {
                let aip = a[(row0 + r) * k + p];
                for (x, &bv) in accr.iter_mut().zip(brow) {
                    *x += aip * bv;
                }
            }
        }
        for (cv, &av) in cblock.iter_mut().zip(acc.iter()) {
            *cv = alpha * av + beta * *cv;
        }
    }
}

/// [`super::stencil2d`] over the host's cores (rows of `dst` in bands).
pub fn stencil2d(
    width: usize,
    height: usize,
    c_center: f32,
    c_neighbor: f32,
    src: &[f32],
    dst: &mut [f32],
) {
    assert!(src.len() >= width * height && dst.len() >= width * height);
    let threads = threads_for((width as u64) * (height as u64));
    bands(dst, height, width, threads, |first, band| {
        for (r, row) in band.chunks_mut(width).enumerate() {
            let y = first + r;
            let at = |yy: usize, xx: usize| src[yy * width + xx];
            for (x, d) in row.iter_mut().enumerate() {
                let n = at(y.saturating_sub(1), x);
                let s = at((y + 1).min(height - 1), x);
                let e = at(y, (x + 1).min(width - 1));
                let w = at(y, x.saturating_sub(1));
                *d = c_center * at(y, x) + c_neighbor * (n + s + e + w);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2003) as f32 / 97.0 - 10.0)
            .collect()
    }

    #[test]
    fn sgemm_matches_the_sequential_reference_bit_for_bit() {
        // Big enough to run in parallel bands with a partial last row block.
        for (m, n, k) in [(203, 177, 131), (7, 5, 3), (1, 64, 9)] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let (mut c1, mut c2) = (data(m * n, 3), data(m * n, 3));
            super::super::sgemm(m, n, k, 1.5, &a, &b, 0.5, &mut c1);
            sgemm(m, n, k, 1.5, &a, &b, 0.5, &mut c2);
            let (b1, b2): (Vec<u32>, Vec<u32>) = (
                c1.iter().map(|v| v.to_bits()).collect(),
                c2.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(b1, b2, "{m}x{n}x{k}");
        }
    }

    #[test]
    fn stencil_and_saxpy_match_the_sequential_references_bit_for_bit() {
        let (w, h) = (2100, 2003);
        let src = data(w * h, 4);
        let (mut d1, mut d2) = (vec![0.0; w * h], vec![0.0; w * h]);
        super::super::stencil2d(w, h, 0.6, 0.1, &src, &mut d1);
        stencil2d(w, h, 0.6, 0.1, &src, &mut d2);
        assert!(d1.iter().zip(&d2).all(|(a, b)| a.to_bits() == b.to_bits()));
        let x = data(5_000_011, 5);
        let (mut y1, mut y2) = (data(5_000_011, 6), data(5_000_011, 6));
        super::super::saxpy(0.75, &x, &mut y1);
        saxpy(0.75, &x, &mut y2);
        assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
