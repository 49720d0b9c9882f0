//! Every decoder of guest-written bytes, fed arbitrary input: none may panic, and whatever
//! decodes must re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vgpu_protocol::method::{encode_all, MethodDecoder};
use vgpu_protocol::request::{decode_reply, Event, Request};
use vgpu_protocol::{ErrorCode, GpEntry, KernelArgs, KernelId};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    match selector % 8 {
        0 => {
            if let Ok(e) = GpEntry::decode(rest) {
                assert_eq!(&e.encode()[..], &rest[..16]);
            }
        }
        1 => {
            let words: Vec<u32> = rest
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let ok: Vec<_> = MethodDecoder::new(&words).map_while(Result::ok).collect();
            let re = encode_all(&ok);
            assert_eq!(&re[..], &words[..re.len()]);
        }
        2 => {
            let kernel = KernelId::ALL[(selector as usize / 4) % KernelId::ALL.len()];
            if let Ok(a) = KernelArgs::decode(kernel, rest) {
                assert_eq!(a.encode(), rest);
            }
        }
        3 => {
            // Control-queue requests come from the guest: the backend's first parser.
            if let Ok(r) = Request::decode(rest) {
                assert_eq!(r.encode(), rest);
            }
        }
        4 => {
            let _ = decode_reply(selector as u32 / 7, rest);
        }
        5 => {
            let _ = Event::decode(rest);
        }
        6 => {
            // A guest's module image, as a migration lists its variables; with the top
            // bit, the bytes as the zstd frame (or, with the next bit too, the LZ4 block)
            // of a fatbin's one compressed PTX entry.
            let wrapped;
            let image = if selector & 0x80 != 0 {
                wrapped = packed_fatbin(rest, selector & 0x40 != 0);
                &wrapped[..]
            } else {
                rest
            };
            if let Ok(names) = vgpu_protocol::module_image::module_variables(image) {
                assert!(names
                    .iter()
                    .all(|n| vgpu_protocol::module::valid_symbol(n.as_bytes())));
            }
        }
        _ => {
            if rest.len() >= 4 {
                let v = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                if let Ok(c) = ErrorCode::from_u32(v) {
                    assert_eq!(c.as_u32(), v);
                }
            }
        }
    }
});

/// A fatbin whose one entry is compressed PTX: its payload zstd's magic and `rest` after
/// the first two bytes, which give the unpacked size the header states.
fn packed_fatbin(rest: &[u8], lz4: bool) -> Vec<u8> {
    let (size, frame) = match rest {
        [a, b, frame @ ..] => (u64::from(u16::from_le_bytes([*a, *b])), frame),
        _ => (0, rest),
    };
    let mut payload = if lz4 {
        Vec::new()
    } else {
        vec![0x28, 0xb5, 0x2f, 0xfd]
    };
    payload.extend_from_slice(frame);
    let mut entry = vec![0u8; 64];
    entry[0..2].copy_from_slice(&1u16.to_le_bytes()); // PTX
    entry[4..8].copy_from_slice(&64u32.to_le_bytes());
    entry[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    entry[16..20].copy_from_slice(&(payload.len() as u32).to_le_bytes()); // packed length
    let flags: u32 = if lz4 { 0x2000 } else { 0x8000 }; // compressed
    entry[40..44].copy_from_slice(&flags.to_le_bytes());
    entry[56..64].copy_from_slice(&size.to_le_bytes());
    let mut out = vec![0u8; 16];
    out[0..4].copy_from_slice(&0xba55_ed50u32.to_le_bytes());
    out[6..8].copy_from_slice(&16u16.to_le_bytes());
    out[8..16].copy_from_slice(&((entry.len() + payload.len()) as u64).to_le_bytes());
    out.extend(entry);
    out.extend(payload);
    out
}
