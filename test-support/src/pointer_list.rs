//! A linked list for kernels that follow pointers stored in memory (the test module's
//! `vgpu_test_chase`, which needs identity addressing): the bytes to write at the start
//! of a buffer and the sum a walk through them gives.

/// `nodes` nodes of 16 bytes for a buffer at GPU address `base`, node i at
/// 16·((i·97) mod `nodes`): the next node's address, then the value i + 1. A walk from
/// `base` visits every node once (97 is prime to the node counts tests use).
pub fn pointer_list(base: u64, nodes: u32) -> Vec<u8> {
    let at = |i: u32| 16 * u64::from(i.wrapping_mul(97) % nodes);
    let mut bytes = vec![0u8; 16 * nodes as usize];
    for i in 0..nodes {
        let o = at(i) as usize;
        bytes[o..o + 8].copy_from_slice(&(base + at((i + 1) % nodes)).to_le_bytes());
        bytes[o + 8..o + 12].copy_from_slice(&(i + 1).to_le_bytes());
    }
    bytes
}

/// What a walk through [`pointer_list`]'s `nodes` sums to.
pub fn pointer_list_sum(nodes: u32) -> u32 {
    (1..=nodes).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_visits_every_node_once() {
        let (base, nodes) = (0x7000_0000u64, 5000);
        let b = pointer_list(base, nodes);
        let (mut at, mut sum, mut seen) = (base, 0u32, 0);
        while seen < nodes {
            let o = (at - base) as usize;
            sum += u32::from_le_bytes(b[o + 8..o + 12].try_into().unwrap());
            at = u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
            seen += 1;
        }
        assert_eq!(at, base, "back at the head after every node");
        assert_eq!(sum, pointer_list_sum(nodes));
    }
}
