//! What a module image declares at module scope, read without a GPU: the names of its
//! variables in global and constant memory (`__device__` and `__constant__`), which the
//! migration of a guest's modules reads and writes back by name (CUDA has no call that
//! lists them). Images are guest input: any byte string gives an answer or an error,
//! never a panic.
//!
//! Read: PTX text, and a fatbin's first uncompressed PTX entry (nvcc puts the PTX of
//! the same source beside the cubins, so it names the same variables). Not read: a bare
//! cubin, and a fatbin whose PTX is compressed or absent.

/// A fatbin's magic (its first four bytes, little-endian).
pub const FATBIN_MAGIC: u32 = 0xba55ed50;
/// A fatbin entry's kind: PTX text.
pub const FATBIN_PTX: u16 = 1;

/// Why an image's variables cannot be listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("a cubin's variables cannot be listed (only PTX, or a fatbin holding PTX)")]
    Cubin,
    #[error("the fatbin holds no uncompressed PTX")]
    NoPtx,
    #[error("not PTX text")]
    NotPtx,
}

/// The first uncompressed PTX entry of a fatbin: after the 16-byte header
/// `{u32 magic, u16 version, u16 header size, u64 body size}`, entries
/// `{u16 kind, u16 version, u32 header size, u64 payload size, …}` each followed by its
/// payload. A payload that is not text (compressed) is for [`ptx_text`] to refuse.
pub fn fatbin_ptx(image: &[u8]) -> Option<&[u8]> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(image.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(image.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(image.get(o..o + 8)?.try_into().ok()?));
    let mut at = usize::from(u16_at(6)?);
    let end = at
        .checked_add(usize::try_from(u64_at(8)?).ok()?)?
        .min(image.len());
    while at.checked_add(16)? <= end {
        let (kind, header, payload) = (u16_at(at)?, u32_at(at + 4)? as usize, u64_at(at + 8)?);
        let start = at.checked_add(header)?;
        let stop = start.checked_add(usize::try_from(payload).ok()?)?;
        if kind == FATBIN_PTX {
            return image.get(start..stop);
        }
        if stop <= at {
            return None;
        }
        at = stop;
    }
    None
}

/// The PTX text of an image (a PTX module, or a fatbin's PTX entry), without its NULs.
pub fn ptx_text(image: &[u8]) -> Result<&str, ImageError> {
    let text = match image.get(..4) {
        Some(m) if u32::from_le_bytes([m[0], m[1], m[2], m[3]]) == FATBIN_MAGIC => {
            fatbin_ptx(image).ok_or(ImageError::NoPtx)?
        }
        Some(b"\x7fELF") => return Err(ImageError::Cubin),
        _ => image,
    };
    // The NUL that ends the text, and a fatbin entry's padding.
    let len = text.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&text[..len]).map_err(|_| ImageError::NotPtx)?;
    if !text.contains(".version") || !text.contains(".target") {
        return Err(ImageError::NotPtx);
    }
    Ok(text)
}

/// The names of the variables an image defines at module scope in the global and
/// constant state spaces (`.extern` declarations are defined elsewhere: left out).
pub fn module_variables(image: &[u8]) -> Result<Vec<String>, ImageError> {
    let text = ptx_text(image)?;
    let mut names = Vec::new();
    let mut depth = 0usize;
    for line in text.lines() {
        // Only declarations outside every function body.
        let line = line.split("//").next().unwrap_or("");
        if depth == 0 {
            if let Some(name) = variable(line) {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        for b in line.bytes() {
            match b {
                b'{' => depth += 1,
                b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
    }
    Ok(names)
}

/// The variable a module-scope line defines in `.global` or `.const`, if it does.
fn variable(line: &str) -> Option<String> {
    let tokens: Vec<&str> = line.split_whitespace().collect();
    // Directives first (`.visible`, `.weak`, the state space, `.align 8`, the type...).
    let space = tokens
        .iter()
        .take_while(|t| t.starts_with('.'))
        .position(|&t| t == ".global" || t == ".const")?;
    if tokens[..space].contains(&".extern") {
        return None;
    }
    let mut i = space + 1;
    while let Some(t) = tokens.get(i) {
        if *t == ".align" {
            i += 2;
        } else if t.starts_with('.') {
            i += 1;
        } else {
            break;
        }
    }
    let name = tokens.get(i)?;
    let name = name
        .split(['[', ';', '='])
        .next()
        .filter(|n| crate::module::valid_symbol(n.as_bytes()))?;
    Some(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = ".version 8.0\n.target sm_90\n.address_size 64\n\
        .global .align 4 .u32 calls;\n\
        .visible .global .align 8 .b8 table[64] = {1, 2};\n\
        .const .align 4 .f32 scale = 0f3F800000;\n\
        .extern .global .u32 elsewhere;\n\
        // .global .u32 commented;\n\
        .visible .entry k(\n.param .u64 p\n)\n{\n.reg .b32 %r<2>;\n.global .u32 inside;\nret;\n}\n";

    #[test]
    fn lists_module_scope_globals_and_constants() {
        assert_eq!(
            module_variables(PTX.as_bytes()).unwrap(),
            ["calls", "table", "scale"]
        );
    }

    fn fatbin(payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes());
        f.extend_from_slice(&16u16.to_le_bytes());
        f.extend_from_slice(&(16 + payload.len() as u64).to_le_bytes());
        f.extend_from_slice(&FATBIN_PTX.to_le_bytes());
        f.extend_from_slice(&0u16.to_le_bytes());
        f.extend_from_slice(&16u32.to_le_bytes());
        f.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn reads_a_fatbins_ptx_and_refuses_what_it_cannot_read() {
        assert_eq!(
            module_variables(&fatbin(PTX.as_bytes())).unwrap(),
            ["calls", "table", "scale"]
        );
        assert_eq!(
            module_variables(&fatbin(&[0x9c, 0xff, 0x00, 0x13])),
            Err(ImageError::NotPtx)
        );
        assert_eq!(module_variables(b"\x7fELF\x02\x01"), Err(ImageError::Cubin));
        assert_eq!(module_variables(b"garbage"), Err(ImageError::NotPtx));
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_give_an_answer(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = module_variables(&b);
            let mut f = fatbin(&b);
            f.truncate(b.len() / 2 + 8);
            let _ = module_variables(&f);
        }
    }
}
