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
