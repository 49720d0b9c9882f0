//! Builtin kernels and their argument blocks.
//!
//! A `LAUNCH` names a kernel id and an argument block in GPU memory. The block is a packed
//! little-endian struct whose length must match the kernel exactly. Sizes are validated
//! here (alignment, overflow, limits); addresses are checked by the GPU's MMU when the
//! kernel touches them, so a bad address faults the channel rather than failing here.

use thiserror::Error;

/// Longest a single spin kernel may ask for (the watchdog may kill sooner).
pub const MAX_SPIN_NS: u64 = 60_000_000_000;
/// Largest buffer a kernel may touch in one launch.
pub const MAX_KERNEL_BYTES: u64 = 1 << 40;
/// Largest matrix dimension for `Sgemm` and grid dimension for `Stencil2d`.
pub const MAX_DIM: u32 = 1 << 16;

/// Builtin kernel ids.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// Does nothing; for dispatch-rate measurements.
    Empty = 0,
    /// Occupies the engine for `ns` nanoseconds (the seeds' throttle kernel).
    Spin = 1,
    /// Fills `len` bytes at `dst` with a 32-bit pattern.
    Memset = 2,
    /// Copies `len` bytes from `src` to `dst` on the compute engine.
    Memcpy = 3,
    /// `y[i] = a * x[i] + y[i]` over `n` f32 elements.
    Saxpy = 4,
    /// `C = alpha * A·B + beta * C`, row-major f32, A m×k, B k×n, C m×n.
    Sgemm = 5,
    /// Sums `n` f32 elements (f64 accumulation, in order) and writes the f32 result.
    ReduceSum = 6,
    /// FNV-1a 64 over `len` bytes, written as u64.
    Checksum = 7,
    /// One 5-point stencil step over a `width`×`height` f32 grid (hotspot-style):
    /// `dst = c_center * c + c_neighbor * (n + s + e + w)` for centre `c` and neighbours
    /// north/south/east/west, edges clamped.
    Stencil2d = 8,
    /// Writes the GPU's nanosecond clock at kernel start as u64.
    Timestamp = 9,
}

impl KernelId {
    pub const ALL: [KernelId; 10] = [
        KernelId::Empty,
        KernelId::Spin,
        KernelId::Memset,
        KernelId::Memcpy,
        KernelId::Saxpy,
        KernelId::Sgemm,
        KernelId::ReduceSum,
        KernelId::Checksum,
        KernelId::Stencil2d,
        KernelId::Timestamp,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.get(v as usize).copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            KernelId::Empty => "empty",
            KernelId::Spin => "spin",
            KernelId::Memset => "memset",
            KernelId::Memcpy => "memcpy",
            KernelId::Saxpy => "saxpy",
            KernelId::Sgemm => "sgemm",
            KernelId::ReduceSum => "reduce_sum",
            KernelId::Checksum => "checksum",
            KernelId::Stencil2d => "stencil2d",
            KernelId::Timestamp => "timestamp",
        }
    }
}

/// Decoded, validated kernel arguments. GPU addresses are virtual.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KernelArgs {
    Empty,
    Spin {
        ns: u64,
    },
    Memset {
        dst: u64,
        len: u64,
        pattern: u32,
    },
    Memcpy {
        dst: u64,
        src: u64,
        len: u64,
    },
    Saxpy {
        x: u64,
        y: u64,
        n: u64,
        a: f32,
    },
    Sgemm {
        a: u64,
        b: u64,
        c: u64,
        m: u32,
        n: u32,
        k: u32,
        alpha: f32,
        beta: f32,
    },
    ReduceSum {
        src: u64,
        n: u64,
        dst: u64,
    },
    Checksum {
        src: u64,
        len: u64,
        dst: u64,
    },
    Stencil2d {
        src: u64,
        dst: u64,
        width: u32,
        height: u32,
        c_center: f32,
        c_neighbor: f32,
    },
    Timestamp {
        dst: u64,
    },
}

/// Why an argument block was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum KernelArgsError {
    #[error("{kernel:?} takes {expected} argument bytes, got {got}")]
    WrongLength {
        kernel: KernelId,
        expected: usize,
        got: usize,
    },
    #[error("{kernel:?}: {what}")]
    Invalid {
        kernel: KernelId,
        what: &'static str,
    },
}

/// Little-endian field reader over an exact-length block.
struct Fields<'a> {
    b: &'a [u8],
    at: usize,
}

impl Fields<'_> {
    fn u32(&mut self) -> u32 {
        let v = u32::from_le_bytes([
            self.b[self.at],
            self.b[self.at + 1],
            self.b[self.at + 2],
            self.b[self.at + 3],
        ]);
        self.at += 4;
        v
    }
    fn u64(&mut self) -> u64 {
        let lo = self.u32() as u64;
        let hi = self.u32() as u64;
        lo | hi << 32
    }
    fn f32(&mut self) -> f32 {
        f32::from_bits(self.u32())
    }
}

fn put32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

impl KernelArgs {
    /// The kernel these arguments belong to.
    pub fn kernel(&self) -> KernelId {
        match self {
            KernelArgs::Empty => KernelId::Empty,
            KernelArgs::Spin { .. } => KernelId::Spin,
            KernelArgs::Memset { .. } => KernelId::Memset,
            KernelArgs::Memcpy { .. } => KernelId::Memcpy,
            KernelArgs::Saxpy { .. } => KernelId::Saxpy,
            KernelArgs::Sgemm { .. } => KernelId::Sgemm,
            KernelArgs::ReduceSum { .. } => KernelId::ReduceSum,
            KernelArgs::Checksum { .. } => KernelId::Checksum,
            KernelArgs::Stencil2d { .. } => KernelId::Stencil2d,
            KernelArgs::Timestamp { .. } => KernelId::Timestamp,
        }
    }

    /// Exact size of a kernel's argument block.
    pub fn encoded_len(kernel: KernelId) -> usize {
        match kernel {
            KernelId::Empty => 0,
            KernelId::Spin => 8,
            KernelId::Memset => 24,
            KernelId::Memcpy => 24,
            KernelId::Saxpy => 32,
            KernelId::Sgemm => 44,
            KernelId::ReduceSum => 24,
            KernelId::Checksum => 24,
            KernelId::Stencil2d => 32,
            KernelId::Timestamp => 8,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(Self::encoded_len(self.kernel()));
        match *self {
            KernelArgs::Empty => {}
            KernelArgs::Spin { ns } => put64(&mut o, ns),
            KernelArgs::Memset { dst, len, pattern } => {
                put64(&mut o, dst);
                put64(&mut o, len);
                put32(&mut o, pattern);
                put32(&mut o, 0);
            }
            KernelArgs::Memcpy { dst, src, len }
            | KernelArgs::ReduceSum { src, n: len, dst }
            | KernelArgs::Checksum { src, len, dst } => {
                // Memcpy is (dst, src, len); the reductions are (src, n, dst).
                if let KernelArgs::Memcpy { .. } = self {
                    put64(&mut o, dst);
                    put64(&mut o, src);
                    put64(&mut o, len);
                } else {
                    put64(&mut o, src);
                    put64(&mut o, len);
                    put64(&mut o, dst);
                }
            }
            KernelArgs::Saxpy { x, y, n, a } => {
                put64(&mut o, x);
                put64(&mut o, y);
                put64(&mut o, n);
                put32(&mut o, a.to_bits());
                put32(&mut o, 0);
            }
            KernelArgs::Sgemm {
                a,
                b,
                c,
                m,
                n,
                k,
                alpha,
                beta,
            } => {
                put64(&mut o, a);
                put64(&mut o, b);
                put64(&mut o, c);
                put32(&mut o, m);
                put32(&mut o, n);
                put32(&mut o, k);
                put32(&mut o, alpha.to_bits());
                put32(&mut o, beta.to_bits());
            }
            KernelArgs::Stencil2d {
                src,
                dst,
                width,
                height,
                c_center,
                c_neighbor,
            } => {
                put64(&mut o, src);
                put64(&mut o, dst);
                put32(&mut o, width);
                put32(&mut o, height);
                put32(&mut o, c_center.to_bits());
                put32(&mut o, c_neighbor.to_bits());
            }
            KernelArgs::Timestamp { dst } => put64(&mut o, dst),
        }
        o
    }

    /// Decodes and validates the argument block of `kernel`.
    pub fn decode(kernel: KernelId, bytes: &[u8]) -> Result<Self, KernelArgsError> {
        let expected = Self::encoded_len(kernel);
        if bytes.len() != expected {
            return Err(KernelArgsError::WrongLength {
                kernel,
                expected,
                got: bytes.len(),
            });
        }
        let bad = |what| Err(KernelArgsError::Invalid { kernel, what });
        let mut f = Fields { b: bytes, at: 0 };
        let args = match kernel {
            KernelId::Empty => KernelArgs::Empty,
            KernelId::Spin => {
                let ns = f.u64();
                if ns > MAX_SPIN_NS {
                    return bad("spin longer than MAX_SPIN_NS");
                }
                KernelArgs::Spin { ns }
            }
            KernelId::Memset => {
                let (dst, len, pattern, pad) = (f.u64(), f.u64(), f.u32(), f.u32());
                if pad != 0 {
                    return bad("reserved field not zero");
                }
                if len % 4 != 0 || dst % 4 != 0 {
                    return bad("memset address and length must be 4-byte multiples");
                }
                if len > MAX_KERNEL_BYTES {
                    return bad("length too large");
                }
                KernelArgs::Memset { dst, len, pattern }
            }
            KernelId::Memcpy => {
                let (dst, src, len) = (f.u64(), f.u64(), f.u64());
                if len > MAX_KERNEL_BYTES {
                    return bad("length too large");
                }
                KernelArgs::Memcpy { dst, src, len }
            }
            KernelId::Saxpy => {
                let (x, y, n, a, pad) = (f.u64(), f.u64(), f.u64(), f.f32(), f.u32());
                if pad != 0 {
                    return bad("reserved field not zero");
                }
                if x % 4 != 0 || y % 4 != 0 {
                    return bad("vectors must be 4-byte aligned");
                }
                if n.checked_mul(4).is_none_or(|b| b > MAX_KERNEL_BYTES) {
                    return bad("vector too long");
                }
                KernelArgs::Saxpy { x, y, n, a }
            }
            KernelId::Sgemm => {
                let (a, b, c) = (f.u64(), f.u64(), f.u64());
                let (m, n, k) = (f.u32(), f.u32(), f.u32());
                let (alpha, beta) = (f.f32(), f.f32());
                if [m, n, k].iter().any(|&d| d == 0 || d > MAX_DIM) {
                    return bad("matrix dimension out of range");
                }
                if a % 4 != 0 || b % 4 != 0 || c % 4 != 0 {
                    return bad("matrices must be 4-byte aligned");
                }
                let largest = [(m, k), (k, n), (m, n)]
                    .iter()
                    .map(|&(r, c)| r as u64 * c as u64 * 4)
                    .max()
                    .unwrap_or(0);
                if largest > MAX_KERNEL_BYTES {
                    return bad("matrix too large");
                }
                KernelArgs::Sgemm {
                    a,
                    b,
                    c,
                    m,
                    n,
                    k,
                    alpha,
                    beta,
                }
            }
            KernelId::ReduceSum => {
                let (src, n, dst) = (f.u64(), f.u64(), f.u64());
                if src % 4 != 0 || dst % 4 != 0 {
                    return bad("operands must be 4-byte aligned");
                }
                if n.checked_mul(4).is_none_or(|b| b > MAX_KERNEL_BYTES) {
                    return bad("vector too long");
                }
                KernelArgs::ReduceSum { src, n, dst }
            }
            KernelId::Checksum => {
                let (src, len, dst) = (f.u64(), f.u64(), f.u64());
                if dst % 8 != 0 {
                    return bad("result must be 8-byte aligned");
                }
                if len > MAX_KERNEL_BYTES {
                    return bad("length too large");
                }
                KernelArgs::Checksum { src, len, dst }
            }
            KernelId::Stencil2d => {
                let (src, dst) = (f.u64(), f.u64());
                let (width, height) = (f.u32(), f.u32());
                let (c_center, c_neighbor) = (f.f32(), f.f32());
                if [width, height].iter().any(|&d| d == 0 || d > MAX_DIM) {
                    return bad("grid dimension out of range");
                }
                if src % 4 != 0 || dst % 4 != 0 {
                    return bad("grids must be 4-byte aligned");
                }
                KernelArgs::Stencil2d {
                    src,
                    dst,
                    width,
                    height,
                    c_center,
                    c_neighbor,
                }
            }
            KernelId::Timestamp => {
                let dst = f.u64();
                if !dst.is_multiple_of(8) {
                    return bad("timestamp must be 8-byte aligned");
                }
                KernelArgs::Timestamp { dst }
            }
        };
        Ok(args)
    }
}

/// FNV-1a 64: the `Checksum` kernel's function, shared with CPU references.
pub fn fnv1a64(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a 64 offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_args() -> impl Strategy<Value = KernelArgs> {
        let a4 = || any::<u64>().prop_map(|v| v & !7);
        prop_oneof![
            Just(KernelArgs::Empty),
            (0..=MAX_SPIN_NS).prop_map(|ns| KernelArgs::Spin { ns }),
            (a4(), 0..MAX_KERNEL_BYTES / 4, any::<u32>()).prop_map(|(dst, l, pattern)| {
                KernelArgs::Memset {
                    dst,
                    len: l * 4,
                    pattern,
                }
            }),
            (any::<u64>(), any::<u64>(), 0..=MAX_KERNEL_BYTES)
                .prop_map(|(dst, src, len)| KernelArgs::Memcpy { dst, src, len }),
            (a4(), a4(), 0..MAX_KERNEL_BYTES / 4, -1e6f32..1e6)
                .prop_map(|(x, y, n, a)| KernelArgs::Saxpy { x, y, n, a }),
            (
                a4(),
                a4(),
                a4(),
                1..=1024u32,
                1..=1024u32,
                1..=1024u32,
                -4f32..4.0,
                -4f32..4.0
            )
                .prop_map(|(a, b, c, m, n, k, alpha, beta)| KernelArgs::Sgemm {
                    a,
                    b,
                    c,
                    m,
                    n,
                    k,
                    alpha,
                    beta
                }),
            (a4(), 0..MAX_KERNEL_BYTES / 4, a4()).prop_map(|(src, n, dst)| KernelArgs::ReduceSum {
                src,
                n,
                dst
            }),
            (any::<u64>(), 0..=MAX_KERNEL_BYTES, a4())
                .prop_map(|(src, len, dst)| KernelArgs::Checksum { src, len, dst }),
            (a4(), a4(), 1..=MAX_DIM, 1..=MAX_DIM, -1f32..1.0, -1f32..1.0).prop_map(
                |(src, dst, width, height, c_center, c_neighbor)| KernelArgs::Stencil2d {
                    src,
                    dst,
                    width,
                    height,
                    c_center,
                    c_neighbor
                }
            ),
            a4().prop_map(|dst| KernelArgs::Timestamp { dst }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(args in any_args()) {
            let bytes = args.encode();
            prop_assert_eq!(bytes.len(), KernelArgs::encoded_len(args.kernel()));
            prop_assert_eq!(KernelArgs::decode(args.kernel(), &bytes), Ok(args));
        }

        #[test]
        fn arbitrary_bytes_never_panic(id in 0usize..10, bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let kernel = KernelId::ALL[id];
            if let Ok(args) = KernelArgs::decode(kernel, &bytes) {
                prop_assert_eq!(args.encode(), bytes);
            }
        }
    }

    #[test]
    fn rejects_each_malformation() {
        let bad = |k, a: KernelArgs| {
            assert!(KernelArgs::decode(k, &a.encode()).is_err(), "{a:?}");
        };
        bad(
            KernelId::Spin,
            KernelArgs::Spin {
                ns: MAX_SPIN_NS + 1,
            },
        );
        bad(
            KernelId::Memset,
            KernelArgs::Memset {
                dst: 0,
                len: 3,
                pattern: 0,
            },
        );
        bad(
            KernelId::Memset,
            KernelArgs::Memset {
                dst: 2,
                len: 4,
                pattern: 0,
            },
        );
        bad(
            KernelId::Saxpy,
            KernelArgs::Saxpy {
                x: 0,
                y: 0,
                n: u64::MAX / 2,
                a: 1.0,
            },
        );
        bad(
            KernelId::Sgemm,
            KernelArgs::Sgemm {
                a: 0,
                b: 0,
                c: 0,
                m: 0,
                n: 1,
                k: 1,
                alpha: 1.0,
                beta: 0.0,
            },
        );
        bad(
            KernelId::Stencil2d,
            KernelArgs::Stencil2d {
                src: 0,
                dst: 0,
                width: MAX_DIM + 1,
                height: 1,
                c_center: 0.0,
                c_neighbor: 0.0,
            },
        );
        bad(KernelId::Timestamp, KernelArgs::Timestamp { dst: 4 });
        assert!(matches!(
            KernelArgs::decode(KernelId::Spin, &[0; 7]),
            Err(KernelArgsError::WrongLength {
                expected: 8,
                got: 7,
                ..
            })
        ));
        // Non-zero padding is rejected, so an encoding is unique.
        let mut raw = KernelArgs::Memset {
            dst: 0,
            len: 4,
            pattern: 1,
        }
        .encode();
        raw[20] = 1;
        assert!(KernelArgs::decode(KernelId::Memset, &raw).is_err());
    }

    #[test]
    fn fnv_known_values() {
        assert_eq!(fnv1a64(b"", FNV_OFFSET), FNV_OFFSET);
        assert_eq!(fnv1a64(b"a", FNV_OFFSET), 0xaf63_dc4c_8601_ec8c);
    }
}
