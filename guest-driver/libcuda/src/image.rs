//! How long a module image is. `cuModuleLoadData` gets a bare pointer: the image's own
//! header says its length (an ELF cubin's section table, a fatbin's header); anything
//! else is PTX text, which ends at its NUL.

use vgpu_protocol::module::MAX_MODULE_BYTES;

/// `__fatBinC_Wrapper_t`'s magic: the struct nvcc emits around a fatbin (and what
/// `cuModuleLoadFatBinary` and the runtime's registration get).
const FATBIN_WRAPPER_MAGIC: u32 = 0x466243b1;
/// A fatbin's header magic.
const FATBIN_MAGIC: u32 = 0xba55ed50;
const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
const SHT_NOBITS: u32 = 8;

/// Why an image was refused before it was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageError {
    /// Larger than the device takes (`MAX_MODULE_BYTES`), or a header that lies.
    TooLarge,
    /// A header too short or inconsistent to say the image's length.
    Malformed,
}

/// Reads `N` bytes at `off` of the image at `p`.
///
/// # Safety
/// `p..p+off+N` must be readable.
unsafe fn bytes<const N: usize>(p: *const u8, off: usize) -> [u8; N] {
    let mut b = [0u8; N];
    // SAFETY: readable by the caller's contract; `b` is a distinct local.
    unsafe { std::ptr::copy_nonoverlapping(p.add(off), b.as_mut_ptr(), N) };
    b
}

/// The image at `p` as a slice of its whole length.
///
/// # Safety
/// `p` points at a module image the program handed to the driver: a complete ELF or
/// fatbin whose headers are true, a fatbin wrapper pointing at one, or NUL-terminated
/// text. (A program that lies about its own image reads its own memory wrongly, as it
/// would with NVIDIA's driver; the host checks whatever arrives.)
pub unsafe fn image<'a>(p: *const u8) -> Result<&'a [u8], ImageError> {
    // SAFETY: binary images are longer than 4 bytes and text is NUL-terminated;
    // `prefix4` stops at a NUL.
    let head = unsafe { prefix4(p) };
    let len = match head {
        // SAFETY: an ELF image, complete by the caller's contract.
        Some(h) if h == ELF_MAGIC => unsafe { elf_len(p)? },
        // SAFETY: a fatbin, complete by the caller's contract.
        Some(h) if u32::from_le_bytes(h) == FATBIN_MAGIC => unsafe { fatbin_len(p)? },
        Some(h) if u32::from_le_bytes(h) == FATBIN_WRAPPER_MAGIC => {
            // SAFETY: a wrapper is { magic, version, data pointer, filename }: 16 bytes.
            let data = u64::from_le_bytes(unsafe { bytes::<8>(p, 8) }) as usize as *const u8;
            if data.is_null() {
                return Err(ImageError::Malformed);
            }
            // SAFETY: the wrapper's data is the fatbin it wraps (the caller's contract).
            return unsafe { image(data) };
        }
        // SAFETY: text, NUL-terminated by the caller's contract.
        _ => unsafe { text_len(p)? },
    };
    if len == 0 {
        return Err(ImageError::Malformed);
    }
    if len as u64 > MAX_MODULE_BYTES {
        return Err(ImageError::TooLarge);
    }
    // SAFETY: the image is `len` bytes long by its own header (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The first four bytes, or `None` when a NUL comes first (text shorter than a magic).
unsafe fn prefix4(p: *const u8) -> Option<[u8; 4]> {
    let mut b = [0u8; 4];
    for (i, slot) in b.iter_mut().enumerate() {
        // SAFETY: bytes up to and including the first NUL are readable in any image.
        *slot = unsafe { *p.add(i) };
        if *slot == 0 && i < 3 {
            return None;
        }
    }
    Some(b)
}

unsafe fn text_len(p: *const u8) -> Result<usize, ImageError> {
    let cap = MAX_MODULE_BYTES as usize;
    // SAFETY: text is NUL-terminated; the search stops at the NUL or at the cap.
    let n = (0..=cap).find(|&i| unsafe { *p.add(i) } == 0);
    n.ok_or(ImageError::TooLarge)
}

unsafe fn fatbin_len(p: *const u8) -> Result<usize, ImageError> {
    // { u32 magic, u16 version, u16 header size, u64 body size }
    // SAFETY: a fatbin header is 16 bytes (the caller's contract).
    let (header, body) = unsafe { (bytes::<2>(p, 6), bytes::<8>(p, 8)) };
    let (header, body) = (u16::from_le_bytes(header) as u64, u64::from_le_bytes(body));
    let len = header.checked_add(body).ok_or(ImageError::TooLarge)?;
    if header < 16 {
        return Err(ImageError::Malformed);
    }
    usize::try_from(len).map_err(|_| ImageError::TooLarge)
}

unsafe fn elf_len(p: *const u8) -> Result<usize, ImageError> {
    // Reads a little-endian field; every offset read lies in the 64-byte header or in
    // the section table, whose end was checked against the size limit first.
    let u16_at = |off: usize| {
        // SAFETY: the header and the section table are readable (the caller's contract).
        u64::from(u16::from_le_bytes(unsafe { bytes::<2>(p, off) }))
    };
    let u32_at = |off: usize| {
        // SAFETY: as above.
        u32::from_le_bytes(unsafe { bytes::<4>(p, off) })
    };
    let u64_at = |off: usize| {
        // SAFETY: as above.
        u64::from_le_bytes(unsafe { bytes::<8>(p, off) })
    };
    if u32_at(4) & 0xff != 2 {
        return Err(ImageError::Malformed); // not ELFCLASS64: no CUDA cubin
    }
    let (shoff, shentsize, shnum) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    if shentsize < 64 && shnum > 0 {
        return Err(ImageError::Malformed);
    }
    let table_end = |off: u64, size: u64, n: u64| {
        size.checked_mul(n)
            .and_then(|t| t.checked_add(off))
            .filter(|&e| e <= MAX_MODULE_BYTES)
            .ok_or(ImageError::TooLarge)
    };
    let mut len = table_end(shoff, shentsize, shnum)?.max(64);
    if phnum > 0 {
        len = len.max(table_end(phoff, phentsize, phnum)?);
    }
    for i in 0..shnum {
        let at = (shoff + i * shentsize) as usize;
        let (kind, off, size) = (u32_at(at + 4), u64_at(at + 0x18), u64_at(at + 0x20));
        if kind != SHT_NOBITS {
            len = len.max(table_end(off, size, 1)?);
        }
    }
    usize::try_from(len).map_err(|_| ImageError::TooLarge)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_ends_at_its_nul() {
        let t = b".version 8.0\n.target sm_90\0garbage";
        // SAFETY: NUL-terminated.
        assert_eq!(unsafe { image(t.as_ptr()) }.unwrap().len(), 26);
        // SAFETY: NUL-terminated (empty).
        let empty = unsafe { image(c"".as_ptr().cast()) };
        assert_eq!(empty, Err(ImageError::Malformed));
        // SAFETY: NUL-terminated (shorter than a magic).
        assert_eq!(unsafe { image(c"ab".as_ptr().cast()) }.unwrap(), b"ab");
    }

    #[test]
    fn a_fatbin_is_as_long_as_its_header_says() {
        let mut f = [0u8; 64];
        f[..4].copy_from_slice(&FATBIN_MAGIC.to_le_bytes());
        f[6..8].copy_from_slice(&16u16.to_le_bytes());
        f[8..16].copy_from_slice(&40u64.to_le_bytes());
        // SAFETY: 64 readable bytes, the header says 56.
        assert_eq!(unsafe { image(f.as_ptr()) }.unwrap().len(), 56);
        // Through nvcc's wrapper.
        let mut w = [0u8; 24];
        w[..4].copy_from_slice(&FATBIN_WRAPPER_MAGIC.to_le_bytes());
        w[8..16].copy_from_slice(&(f.as_ptr() as u64).to_le_bytes());
        // SAFETY: the wrapper points at the fatbin above.
        assert_eq!(unsafe { image(w.as_ptr()) }.unwrap().len(), 56);
        // A header that claims more than the device takes is refused before any read.
        f[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        // SAFETY: only the 16-byte header is read.
        assert_eq!(unsafe { image(f.as_ptr()) }, Err(ImageError::TooLarge));
    }

    #[test]
    fn an_elf_ends_after_its_last_section_or_table() {
        let mut e = vec![0u8; 512];
        e[..4].copy_from_slice(&ELF_MAGIC);
        e[4] = 2;
        // Two section headers at 256 (64 bytes each): the table ends at 384; section 1
        // holds bytes 100..450 (ends later), section 0 is NOBITS (its size is ignored).
        e[0x28..0x30].copy_from_slice(&256u64.to_le_bytes());
        e[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        e[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes());
        let sh = |e: &mut Vec<u8>, i: usize, kind: u32, off: u64, size: u64| {
            let at = 256 + i * 64;
            e[at + 4..at + 8].copy_from_slice(&kind.to_le_bytes());
            e[at + 0x18..at + 0x20].copy_from_slice(&off.to_le_bytes());
            e[at + 0x20..at + 0x28].copy_from_slice(&size.to_le_bytes());
        };
        sh(&mut e, 0, SHT_NOBITS, 0, 1 << 30);
        sh(&mut e, 1, 1, 100, 350);
        // SAFETY: 512 readable bytes; the headers say 450.
        assert_eq!(unsafe { image(e.as_ptr()) }.unwrap().len(), 450);
        sh(&mut e, 1, 1, 100, u64::MAX);
        // SAFETY: as above; the lying size is refused before it is used.
        assert_eq!(unsafe { image(e.as_ptr()) }, Err(ImageError::TooLarge));
    }
}
