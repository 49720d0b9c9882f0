//! CPU reference implementations of the builtin kernels on plain slices: the
//! specification of what each kernel computes. The `sim` GPU's kernels are bit-identical
//! to them (its tests check it); the runtime's workloads, the guest tools and the
//! benchmarks verify GPU results against them.
//!
//! These trust their caller: they panic if a slice is shorter than its dimensions say.

use crate::kernel::{fnv1a64, FNV_OFFSET};

/// `y[i] += a * x[i]` over the shorter of the two slices.
pub fn saxpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// Row-major `C = alpha*A*B + beta*C` with A m×k, B k×n, C m×n. Each dot product is
/// summed in f32 over p = 0..k in order from 0.0 (an i-p-j loop over a row accumulator
/// keeps that order per element while vectorising over j).
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
    let mut acc = vec![0.0f32; n];
    for i in 0..m {
        acc.fill(0.0);
        for p in 0..k {
            let aip = a[i * k + p];
            for (x, &bv) in acc.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                *x += aip * bv;
            }
        }
        for (cv, &av) in c[i * n..(i + 1) * n].iter_mut().zip(&acc) {
            *cv = alpha * av + beta * *cv;
        }
    }
}

/// Sum with f64 accumulation in index order, rounded to f32 at the end.
pub fn reduce_sum(x: &[f32]) -> f32 {
    x.iter().fold(0.0f64, |s, &v| s + f64::from(v)) as f32
}

/// FNV-1a 64 from the standard offset basis.
pub fn checksum(bytes: &[u8]) -> u64 {
    fnv1a64(bytes, FNV_OFFSET)
}

/// One 5-point stencil step: `dst = c_center*c + c_neighbor*(((n + s) + e) + w)`, where
/// n/s are the cells above/below, e/w right/left, and out-of-range neighbours clamp to
/// the edge cell.
pub fn stencil2d(
    width: usize,
    height: usize,
    c_center: f32,
    c_neighbor: f32,
    src: &[f32],
    dst: &mut [f32],
) {
    assert!(src.len() >= width * height && dst.len() >= width * height);
    for y in 0..height {
        for x in 0..width {
            let at = |yy: usize, xx: usize| src[yy * width + xx];
            let n = at(y.saturating_sub(1), x);
            let s = at((y + 1).min(height - 1), x);
            let e = at(y, (x + 1).min(width - 1));
            let w = at(y, x.saturating_sub(1));
            dst[y * width + x] = c_center * at(y, x) + c_neighbor * (n + s + e + w);
        }
    }
}

pub mod parallel;
