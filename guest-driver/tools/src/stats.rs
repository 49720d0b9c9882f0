//! Small statistics helpers for benchmarks.

/// The `p`-th percentile (0..=100) of `samples` by nearest rank; `None` if empty.
pub fn percentile<T: Ord + Copy>(samples: &mut [T], p: f64) -> Option<T> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    Some(samples[rank.clamp(1, samples.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<u64> = (1..=100).rev().collect();
        assert_eq!(percentile(&mut v, 50.0), Some(50));
        assert_eq!(percentile(&mut v, 99.0), Some(99));
        assert_eq!(percentile(&mut v, 100.0), Some(100));
        assert_eq!(percentile(&mut v, 0.0), Some(1));
        assert_eq!(percentile::<u64>(&mut [], 50.0), None);
        let mut signed = [3i64, -2, -7, 5];
        assert_eq!(percentile(&mut signed, 50.0), Some(-2));
    }
}
