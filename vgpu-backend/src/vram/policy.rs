//! The VRAM policy, as pure functions over per-VM figures: each VM's share, which VM gives
//! VRAM up, which VM gets it back.
//!
//! **Share.** VRAM is split among the VMs that hold VRAM objects by their scheduler weight
//! (water-filling): a VM's share is at most its quota (`VmLimits::vram_bytes`, settable)
//! and at most what it allocated; what such capped VMs leave goes to the others, again by
//! weight. A VM alone gets all of VRAM (up to its quota): oversubscription costs nothing
//! while nobody else needs the space (Metter's "dynamic allocation" requirement).
//!
//! A VM without a swap limit is **pinned**: its VRAM is never moved out, so its share is
//! what it allocated, and the others share what is left.
//!
//! **Eviction** takes from the VM furthest over its share (resident − share), never from a
//! pinned one; **swap-in**
//! serves the VM furthest below it first (deficit order). A move happens only from a VM
//! over its share to one under it, or into free VRAM, so the split converges instead of
//! ping-ponging.

/// What the policy knows about one VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VmFigures {
    pub weight: u32,
    /// Quota: the most VRAM it should hold resident when others need VRAM.
    pub quota: u64,
    /// Bytes of VRAM objects it holds (resident + swapped).
    pub allocated: u64,
    /// Of those, resident in VRAM.
    pub resident: u64,
    /// No swap limit: never evicted.
    pub pinned: bool,
}

/// Each VM's share of `vram` bytes (same order as `vms`).
pub fn shares(vram: u64, vms: &[VmFigures]) -> Vec<u64> {
    let mut share = vec![0u64; vms.len()];
    let mut left = vram;
    for (i, v) in vms.iter().enumerate().filter(|(_, v)| v.pinned) {
        share[i] = v.allocated;
        left = left.saturating_sub(v.allocated);
    }
    let cap: Vec<u64> = vms.iter().map(|v| v.quota.min(v.allocated)).collect();
    let mut open: Vec<usize> = (0..vms.len())
        .filter(|&i| cap[i] > 0 && !vms[i].pinned)
        .collect();
    // Each round either fixes at least one capped VM or ends.
    while !open.is_empty() && left > 0 {
        let wsum: u128 = open.iter().map(|&i| u128::from(vms[i].weight.max(1))).sum();
        let fair = |i: usize| -> u64 {
            (u128::from(left) * u128::from(vms[i].weight.max(1)) / wsum) as u64
        };
        let capped: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| cap[i] <= fair(i))
            .collect();
        if capped.is_empty() {
            for &i in &open {
                share[i] = fair(i);
            }
            break;
        }
        for &i in &capped {
            share[i] = cap[i];
            left -= cap[i];
        }
        open.retain(|i| !capped.contains(i));
    }
    share
}

/// Index of the VM to evict from: the one furthest over its share, if any is over and
/// not pinned.
pub fn victim(vms: &[VmFigures], share: &[u64]) -> Option<usize> {
    vms.iter()
        .zip(share)
        .enumerate()
        .filter(|(_, (v, s))| !v.pinned && v.resident > **s)
        .max_by_key(|(_, (v, s))| v.resident - **s)
        .map(|(i, _)| i)
}

/// VMs with swapped bytes, in swap-in order: furthest below its share first (then the
/// least over it, for spare VRAM nobody is owed).
pub fn swap_in_order(vms: &[VmFigures], share: &[u64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..vms.len())
        .filter(|&i| vms[i].allocated > vms[i].resident)
        .collect();
    idx.sort_by_key(|&i| vms[i].resident as i128 - share[i] as i128);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(weight: u32, quota: u64, allocated: u64, resident: u64) -> VmFigures {
        VmFigures {
            weight,
            quota,
            allocated,
            resident,
            pinned: false,
        }
    }

    #[test]
    fn pinned_vms_keep_what_they_hold_and_are_never_the_victim() {
        let pinned = VmFigures {
            pinned: true,
            ..vm(1, 1000, 70, 70)
        };
        let vms = [pinned, vm(1, 1000, 80, 30)];
        let s = shares(100, &vms);
        assert_eq!(s, vec![70, 30]);
        assert_eq!(victim(&vms, &s), None);
        // Over its weight's half, yet the other VM is the one over its share.
        let vms = [pinned, vm(1, 1000, 80, 40)];
        let s = shares(100, &vms);
        assert_eq!(victim(&vms, &s), Some(1));
    }

    #[test]
    fn alone_gets_everything_pairs_split_by_weight() {
        assert_eq!(shares(100, &[vm(1, 1000, 300, 100)]), vec![100]);
        assert_eq!(
            shares(100, &[vm(1, 1000, 300, 0), vm(1, 1000, 300, 0)]),
            vec![50, 50]
        );
        assert_eq!(
            shares(100, &[vm(3, 1000, 300, 0), vm(1, 1000, 300, 0)]),
            vec![75, 25]
        );
    }

    #[test]
    fn caps_redistribute() {
        // The small VM needs 10; the rest goes to the big ones by weight.
        assert_eq!(
            shares(
                100,
                &[vm(1, 1000, 10, 0), vm(1, 1000, 500, 0), vm(1, 1000, 500, 0)]
            ),
            vec![10, 45, 45]
        );
        // A quota caps too; an idle VM gets nothing.
        assert_eq!(
            shares(
                100,
                &[vm(1, 20, 500, 0), vm(1, 1000, 500, 0), vm(1, 1000, 0, 0)]
            ),
            vec![20, 80, 0]
        );
    }

    #[test]
    fn victim_and_order() {
        let vms = [
            vm(1, 1000, 80, 70),
            vm(1, 1000, 80, 20),
            vm(1, 1000, 20, 10),
        ];
        let s = shares(100, &vms);
        assert_eq!(s, vec![40, 40, 20]);
        assert_eq!(victim(&vms, &s), Some(0));
        assert_eq!(swap_in_order(&vms, &s), vec![1, 2, 0]);
        let balanced = [vm(1, 1000, 80, 40), vm(1, 1000, 80, 40)];
        assert_eq!(victim(&balanced, &shares(80, &balanced)), None);
    }
}
