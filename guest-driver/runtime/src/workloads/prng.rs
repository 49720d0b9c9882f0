//! A small deterministic PRNG for workload inputs (xorshift64*), so runs are repeatable
//! and need no external crate.

/// xorshift64* generator.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator from `seed` (zero is remapped: xorshift must not start at 0).
    pub fn new(seed: u64) -> Self {
        XorShift(if seed == 0 {
            0x9e37_79b9_7f4a_7c15
        } else {
            seed
        })
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [-1, 1), with 24 bits of precision (exactly representable).
    pub fn next_f32(&mut self) -> f32 {
        let v = (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32;
        v * 2.0 - 1.0
    }

    pub fn f32_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = XorShift::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = XorShift::new(7);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        let mut r = XorShift::new(0);
        for _ in 0..1000 {
            let f = r.next_f32();
            assert!((-1.0..1.0).contains(&f));
        }
        assert_eq!(XorShift::new(1).bytes(13).len(), 13);
    }
}
