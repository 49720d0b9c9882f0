//! The migration device-state decoder, fed arbitrary streams: it may refuse them but must
//! never panic, and whatever decodes re-encodes to the same bytes. Inputs are also
//! re-sealed with a valid checksum so the fuzzer gets past the CRC into the sections.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_protocol::migration::{crc32, Stream, HEADER_SIZE, STATE_MAGIC, STATE_VERSION};

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = Stream::decode(data) {
        // Writers write the newest version; a version-1 input re-encodes as version 2.
        let mut re = s.encode();
        re[8..12].copy_from_slice(&data[8..12]);
        assert_eq!(re, data);
    }
    // The same bytes as a body behind a valid header of every kind (3 to 5: pre-copy).
    for kind in 1u32..=5 {
        let mut b = Vec::with_capacity(HEADER_SIZE + data.len());
        b.extend_from_slice(&STATE_MAGIC);
        b.extend_from_slice(&STATE_VERSION.to_le_bytes());
        b.extend_from_slice(&kind.to_le_bytes());
        b.extend_from_slice(&(data.len() as u64).to_le_bytes());
        b.extend_from_slice(&crc32(data).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(data);
        let _ = Stream::decode(&b);
    }
});
