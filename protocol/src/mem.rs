//! Memory mapping types both sides use: the GPU's page sizes and a mapping's attributes
//! (the runtime picks them per buffer; the HAL and its page tables apply them).

/// GPU page sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageSize {
    Small4K,
    Big64K,
    Huge2M,
}

impl PageSize {
    pub const ALL: [PageSize; 3] = [PageSize::Small4K, PageSize::Big64K, PageSize::Huge2M];

    pub fn bytes(self) -> u64 {
        match self {
            PageSize::Small4K => 4 << 10,
            PageSize::Big64K => 64 << 10,
            PageSize::Huge2M => 2 << 20,
        }
    }
}

/// Mapping attributes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapFlags {
    pub read_only: bool,
}

/// Where a guest runtime starts its huge-page (2 MiB) buffers: in one of [`HUGE_SLOTS`]
/// terabyte slots from [`HUGE_BASE`], one per context. Where guests load modules, the
/// `cuda` GPU maps such buffers at the guest's own address in the device's address space
/// ("identity addressing"), which a VM's contexts share: the host names a slot no other
/// context of the VM uses in `CREATE_CONTEXT`'s reply.
pub const HUGE_BASE: u64 = 0x400_0000_0000;
/// How many 1 TiB slots a context's huge-page buffers may start in, from [`HUGE_BASE`].
pub const HUGE_SLOTS: u32 = 96;
/// The span of one slot.
pub const HUGE_SLOT_BYTES: u64 = 1 << 40;

/// A huge-page slot as `CREATE_CONTEXT`'s reply carries it: slot + 1, 0 for none.
pub fn huge_slot_to_wire(slot: Option<u32>) -> u32 {
    slot.map_or(0, |s| s.saturating_add(1))
}

/// The slot a reply's word names: none for 0 (an older device's reserved word) or a value
/// out of range.
pub fn huge_slot_from_wire(word: u32) -> Option<u32> {
    word.checked_sub(1).filter(|&s| s < HUGE_SLOTS)
}

/// The slot a huge-page address lies in, if it lies in one.
pub fn huge_slot_of(va: u64) -> Option<u32> {
    let slot = va.checked_sub(HUGE_BASE)? / HUGE_SLOT_BYTES;
    u32::try_from(slot).ok().filter(|&s| s < HUGE_SLOTS)
}

#[cfg(test)]
mod huge_slot_tests {
    use super::*;

    #[test]
    fn slots_cover_the_huge_range_only() {
        assert_eq!(huge_slot_of(HUGE_BASE - 1), None);
        assert_eq!(huge_slot_of(HUGE_BASE), Some(0));
        assert_eq!(huge_slot_of(HUGE_BASE + HUGE_SLOT_BYTES + 5), Some(1));
        let end = HUGE_BASE + u64::from(HUGE_SLOTS) * HUGE_SLOT_BYTES;
        assert_eq!(huge_slot_of(end - 1), Some(HUGE_SLOTS - 1));
        assert_eq!(huge_slot_of(end), None);
        assert_eq!(huge_slot_of(u64::MAX), None);
    }
}
