//! GP ring entries: each points at one push-buffer segment in GPU virtual memory.

use thiserror::Error;

/// Encoded size of a GP entry.
pub const GP_ENTRY_SIZE: usize = 16;
/// Highest GPU virtual address + 1 (a 48-bit address space).
pub const GPU_VA_LIMIT: u64 = 1 << 48;
/// Longest push-buffer segment one entry may name, in 32-bit words.
pub const MAX_PB_WORDS: u32 = 1 << 16;

/// One GP entry: a push-buffer segment of `len_words` words at `pb_va`.
///
/// Wire format (little-endian): `u64 pb_va`, `u32 len_words`, `u32 flags` (must be 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpEntry {
    pub pb_va: u64,
    pub len_words: u32,
}

/// Why a GP entry was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum GpEntryError {
    #[error("GP entry needs {GP_ENTRY_SIZE} bytes, got {0}")]
    Truncated(usize),
    #[error("push-buffer address {0:#x} is not 4-byte aligned")]
    Misaligned(u64),
    #[error("push-buffer length {0} words is out of range 1..={MAX_PB_WORDS}")]
    BadLength(u32),
    #[error("push-buffer range at {0:#x} leaves the GPU address space")]
    OutOfRange(u64),
    #[error("reserved flag bits set: {0:#x}")]
    ReservedFlags(u32),
}

impl GpEntry {
    /// Builds a validated entry.
    pub fn new(pb_va: u64, len_words: u32) -> Result<Self, GpEntryError> {
        let e = GpEntry { pb_va, len_words };
        e.validate()?;
        Ok(e)
    }

    fn validate(&self) -> Result<(), GpEntryError> {
        if !self.pb_va.is_multiple_of(4) {
            return Err(GpEntryError::Misaligned(self.pb_va));
        }
        if self.len_words == 0 || self.len_words > MAX_PB_WORDS {
            return Err(GpEntryError::BadLength(self.len_words));
        }
        let end = self.pb_va.checked_add(self.len_words as u64 * 4);
        match end {
            Some(end) if end <= GPU_VA_LIMIT => Ok(()),
            _ => Err(GpEntryError::OutOfRange(self.pb_va)),
        }
    }

    /// Size of the push-buffer segment in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.len_words as u64 * 4
    }

    pub fn encode(&self) -> [u8; GP_ENTRY_SIZE] {
        let mut out = [0u8; GP_ENTRY_SIZE];
        out[0..8].copy_from_slice(&self.pb_va.to_le_bytes());
        out[8..12].copy_from_slice(&self.len_words.to_le_bytes());
        out
    }

    /// Decodes and validates an entry read from a (guest-writable) ring.
    pub fn decode(bytes: &[u8]) -> Result<Self, GpEntryError> {
        let b: &[u8; GP_ENTRY_SIZE] = bytes
            .get(..GP_ENTRY_SIZE)
            .and_then(|s| s.try_into().ok())
            .ok_or(GpEntryError::Truncated(bytes.len()))?;
        let pb_va = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        let len_words = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let flags = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if flags != 0 {
            return Err(GpEntryError::ReservedFlags(flags));
        }
        let e = GpEntry { pb_va, len_words };
        e.validate()?;
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(va in 0u64..(GPU_VA_LIMIT / 4), len in 1u32..=MAX_PB_WORDS) {
            let va = va * 4;
            if let Ok(e) = GpEntry::new(va, len) {
                prop_assert_eq!(GpEntry::decode(&e.encode()), Ok(e));
            } else {
                prop_assert!(va + len as u64 * 4 > GPU_VA_LIMIT);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            if let Ok(e) = GpEntry::decode(&bytes) {
                prop_assert_eq!(&e.encode()[..], &bytes[..GP_ENTRY_SIZE]);
            }
        }
    }

    #[test]
    fn rejects_each_malformation() {
        assert_eq!(GpEntry::decode(&[0; 15]), Err(GpEntryError::Truncated(15)));
        assert_eq!(GpEntry::new(2, 1), Err(GpEntryError::Misaligned(2)));
        assert_eq!(GpEntry::new(0, 0), Err(GpEntryError::BadLength(0)));
        assert_eq!(
            GpEntry::new(0, MAX_PB_WORDS + 1),
            Err(GpEntryError::BadLength(MAX_PB_WORDS + 1))
        );
        assert_eq!(
            GpEntry::new(GPU_VA_LIMIT - 4, 2),
            Err(GpEntryError::OutOfRange(GPU_VA_LIMIT - 4))
        );
        let mut raw = GpEntry::new(0x1000, 4).unwrap().encode();
        raw[12] = 1;
        assert_eq!(GpEntry::decode(&raw), Err(GpEntryError::ReservedFlags(1)));
    }
}
