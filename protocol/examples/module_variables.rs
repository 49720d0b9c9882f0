//! Lists the module variables a live migration would carry for module images: a PTX
//! file, a cubin, a fatbin, or a host program's `.nv_fatbin` section (`objcopy -O binary
//! --only-section=.nv_fatbin PROGRAM OUT`), whose fatbins follow one another: per image,
//! its variables one per line, or why they cannot be listed.
//! usage: module_variables FILE

use vgpu_protocol::module_image::{module_variables, FATBIN_MAGIC};

/// The fatbins of a `.nv_fatbin` section (each header says its length), or the file.
fn images(b: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(h) = b.get(at..at + 16) {
        if u32::from_le_bytes([h[0], h[1], h[2], h[3]]) != FATBIN_MAGIC {
            break;
        }
        let header = usize::from(u16::from_le_bytes([h[6], h[7]]));
        let body = u64::from_le_bytes(h[8..16].try_into().unwrap_or_default());
        let Some(end) = usize::try_from(body)
            .ok()
            .and_then(|n| (at + header).checked_add(n))
        else {
            break;
        };
        out.push(&b[at..end.min(b.len())]);
        at = end.next_multiple_of(8);
    }
    if out.is_empty() {
        out.push(b);
    }
    out
}

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: module_variables FILE");
        std::process::exit(2);
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    };
    let mut failed = false;
    for (i, image) in images(&bytes).into_iter().enumerate() {
        match module_variables(image) {
            Ok(names) => println!("{path} [{i}]: {} variable(s) {names:?}", names.len()),
            Err(e) => {
                println!("{path} [{i}]: {e}");
                failed = true;
            }
        }
    }
    std::process::exit(i32::from(failed));
}
