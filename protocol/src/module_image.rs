//! What a module image declares at module scope, read without a GPU: the names of its
//! variables in global and constant memory (`__device__` and `__constant__`), which the
//! migration of a guest's modules reads and writes back by name (CUDA has no call that
//! lists them). Images are guest input: any byte string gives an answer or an error,
//! never a panic.
//!
//! Read: PTX text (its `.global`/`.const` declarations at module scope), a cubin (the
//! `OBJECT` symbols of its ELF symbol table in `.nv.global*` and user `.nv.constant*`
//! sections), and a fatbin through its first uncompressed PTX entry, else its first
//! uncompressed cubin, else the same compressed (nvcc compresses the PTX of a fatbin with
//! zstd by default since CUDA 12.8 and leaves the cubins as they are; `-compress-all`
//! compresses them too; `--compress-mode=speed`, and as far as we know nvcc before 12.8,
//! use LZ4 blocks). A compressed entry is unpacked by a memory-safe decoder (zstd or LZ4,
//! as its flags say) to exactly the size its header states, at most [`MAX_UNPACKED`].

use std::borrow::Cow;
use std::io::Read;

/// A fatbin's magic (its first four bytes, little-endian).
pub const FATBIN_MAGIC: u32 = 0xba55ed50;
/// A fatbin entry's kind: PTX text.
pub const FATBIN_PTX: u16 = 1;

/// Why an image's variables cannot be listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("a malformed cubin (ELF): {0}")]
    BadElf(&'static str),
    #[error("the fatbin holds no PTX or cubin that can be read (or unpacked)")]
    NoPtx,
    #[error("not PTX text")]
    NotPtx,
}

/// A fatbin entry's kind: a cubin (ELF).
const FATBIN_ELF: u16 = 2;
/// A fatbin entry's flags (in the header's word at 40): the payload is compressed, with
/// zstd (nvcc 12.8 and later by default) or as an LZ4 block (`--compress-mode=speed`;
/// older nvcc). Seen in nvcc 13.0's fatbins (`tests/data/matmul_sm75*.fatbin`).
const FATBIN_ZSTD: u32 = 0x8000;
const FATBIN_LZ4: u32 = 0x2000;
/// Where a compressed entry's header states its compressed length (u32; the payload is
/// padded after it) and the payload's unpacked size (u64).
const FATBIN_PACKED_LEN_AT: usize = 16;
const FATBIN_UNPACKED_SIZE_AT: usize = 56;
/// An LZ4 block's most bytes out per byte in (a match's length grows by 255 a byte).
const LZ4_MAX_RATIO: usize = 256;
/// A zstd frame's first bytes.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// Most bytes a compressed entry may unpack to (a VM's images are bounded by the same).
pub const MAX_UNPACKED: u64 = 256 << 20;

/// How an entry's payload is packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Packing {
    Zstd,
    /// An LZ4 block of the stated length (the rest of the payload is padding).
    Lz4 {
        len: usize,
    },
}

/// A compressed entry's payload unpacked: exactly `size` bytes, or nothing (a size over
/// [`MAX_UNPACKED`], a corrupt, short or long stream).
fn unpack(payload: &[u8], packing: Packing, size: u64) -> Option<Vec<u8>> {
    if size == 0 || size > MAX_UNPACKED {
        return None;
    }
    let size = usize::try_from(size).ok()?;
    match packing {
        Packing::Zstd => {
            if !payload.starts_with(&ZSTD_MAGIC) {
                return None;
            }
            let mut input = payload;
            let decoder = ruzstd::decoding::StreamingDecoder::new(&mut input).ok()?;
            let mut out = Vec::with_capacity(size);
            // One byte more than stated: a frame that unpacks to more is refused.
            decoder.take(size as u64 + 1).read_to_end(&mut out).ok()?;
            (out.len() == size).then_some(out)
        }
        Packing::Lz4 { len } => {
            let block = payload.get(..len)?;
            // An LZ4 block unpacks to at most about 255 times its length: a larger stated
            // size is a lie, refused before anything is allocated for it.
            if size
                > len
                    .saturating_mul(LZ4_MAX_RATIO)
                    .saturating_add(LZ4_MAX_RATIO)
            {
                return None;
            }
            let mut out = vec![0; size];
            // A block that would write past `size` is an error, one that ends short too.
            let n = lz4_flex::block::decompress_into(block, &mut out).ok()?;
            (n == size).then_some(out)
        }
    }
}

/// The payload of the first entry of `kind` in a fatbin, uncompressed (`packed` false) or
/// compressed and unpacked (`packed` true): after the 16-byte header `{u32 magic, u16
/// version, u16 header size, u64 body size}`, entries `{u16 kind, u16 version, u32 header
/// size, u64 payload size, …, u64 flags at 40, …, u64 unpacked size at 56, …}` each
/// followed by its payload.
fn fatbin_entry(image: &[u8], want: u16, packed: bool) -> Option<Cow<'_, [u8]>> {
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
        let flags = if header >= 48 { u32_at(at + 40)? } else { 0 };
        let packing = if flags & FATBIN_ZSTD != 0 {
            Some(Packing::Zstd)
        } else if flags & FATBIN_LZ4 != 0 {
            Some(Packing::Lz4 {
                len: u32_at(at + FATBIN_PACKED_LEN_AT)? as usize,
            })
        } else {
            None
        };
        if kind == want && packing.is_some() == packed {
            let payload = image.get(start..stop)?;
            let Some(packing) = packing else {
                return Some(Cow::Borrowed(payload));
            };
            let size = if header >= FATBIN_UNPACKED_SIZE_AT + 8 {
                u64_at(at + FATBIN_UNPACKED_SIZE_AT)?
            } else {
                0
            };
            if let Some(v) = unpack(payload, packing, size) {
                return Some(Cow::Owned(v));
            }
        }
        if stop <= at {
            return None;
        }
        at = stop;
    }
    None
}

/// The first uncompressed PTX entry of a fatbin, else its first compressed one unpacked.
pub fn fatbin_ptx(image: &[u8]) -> Option<Cow<'_, [u8]>> {
    fatbin_entry(image, FATBIN_PTX, false).or_else(|| fatbin_entry(image, FATBIN_PTX, true))
}

/// The PTX text of an image (a PTX module, or a fatbin's PTX entry), without its NULs.
pub fn ptx_text(image: &[u8]) -> Result<Cow<'_, str>, ImageError> {
    if !is_fatbin(image) {
        return ptx_str(image).map(Cow::Borrowed);
    }
    match fatbin_ptx(image).ok_or(ImageError::NoPtx)? {
        Cow::Borrowed(b) => ptx_str(b).map(Cow::Borrowed),
        Cow::Owned(v) => ptx_str(&v).map(|t| Cow::Owned(t.to_owned())),
    }
}

/// Bytes as PTX text: UTF-8 with `.version` and `.target`, less trailing NULs.
fn ptx_str(text: &[u8]) -> Result<&str, ImageError> {
    // The NUL that ends the text, and a fatbin entry's padding.
    let len = text.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&text[..len]).map_err(|_| ImageError::NotPtx)?;
    if !text.contains(".version") || !text.contains(".target") {
        return Err(ImageError::NotPtx);
    }
    Ok(text)
}

fn is_fatbin(image: &[u8]) -> bool {
    image
        .get(..4)
        .is_some_and(|m| u32::from_le_bytes([m[0], m[1], m[2], m[3]]) == FATBIN_MAGIC)
}

fn is_elf(image: &[u8]) -> bool {
    image.starts_with(b"\x7fELF")
}

/// The names of the variables an image defines at module scope in the global and
/// constant state spaces (`.extern` declarations are defined elsewhere: left out).
pub fn module_variables(image: &[u8]) -> Result<Vec<String>, ImageError> {
    if is_elf(image) {
        return elf_variables(image);
    }
    if is_fatbin(image) {
        // Whatever can be read without unpacking first.
        for packed in [false, true] {
            if let Some(ptx) = fatbin_entry(image, FATBIN_PTX, packed) {
                return ptx_variables(ptx_str(&ptx)?);
            }
            if let Some(cubin) = fatbin_entry(image, FATBIN_ELF, packed) {
                return elf_variables(&cubin);
            }
        }
        return Err(ImageError::NoPtx);
    }
    ptx_variables(ptx_str(image)?)
}

/// The variables PTX text declares at module scope.
fn ptx_variables(text: &str) -> Result<Vec<String>, ImageError> {
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

/// The variables of a cubin: `OBJECT` symbols in sections holding device variables
/// (`.nv.global`, `.nv.global.init`) or user constants (`.nv.constant*` but bank 0, the
/// kernels' parameters).
fn elf_variables(elf: &[u8]) -> Result<Vec<String>, ImageError> {
    let bad = ImageError::BadElf;
    // `n` bytes at `base + off`, every offset checked (they come from the image).
    let bytes = |base: usize, off: usize, n: usize| -> Result<&[u8], ImageError> {
        let start = base.checked_add(off).ok_or(bad("offset"))?;
        let end = start.checked_add(n).ok_or(bad("offset"))?;
        elf.get(start..end).ok_or(bad("truncated"))
    };
    let u16_at = |base: usize, off: usize| -> Result<u16, ImageError> {
        let b = bytes(base, off, 2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |base: usize, off: usize| -> Result<u32, ImageError> {
        let b = bytes(base, off, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |base: usize, off: usize| -> Result<usize, ImageError> {
        let b = bytes(base, off, 8)?;
        let v = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        usize::try_from(v).map_err(|_| bad("offset"))
    };
    // ELF64, little-endian.
    if elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err(bad("not a little-endian ELF64"));
    }
    let (shoff, shentsize) = (u64_at(0, 0x28)?, usize::from(u16_at(0, 0x3a)?));
    let (shnum, shstrndx) = (usize::from(u16_at(0, 0x3c)?), usize::from(u16_at(0, 0x3e)?));
    if shentsize < 64 {
        return Err(bad("section header size"));
    }
    let section = |i: usize| -> Result<usize, ImageError> {
        if i >= shnum {
            return Err(bad("section index"));
        }
        shoff
            .checked_add(i.checked_mul(shentsize).ok_or(bad("section index"))?)
            .ok_or(bad("section offset"))
    };
    // A NUL-terminated name at `off` of the string table of section `strtab`.
    let name_in = |strtab: usize, off: usize| -> Result<&str, ImageError> {
        let h = section(strtab)?;
        let (start, size) = (u64_at(h, 24)?, u64_at(h, 32)?);
        let table = start
            .checked_add(size)
            .and_then(|end| elf.get(start..end))
            .ok_or(bad("string table"))?;
        let s = table.get(off..).ok_or(bad("name offset"))?;
        let end = s
            .iter()
            .position(|&b| b == 0)
            .ok_or(bad("unterminated name"))?;
        std::str::from_utf8(&s[..end]).map_err(|_| bad("name"))
    };
    let mut names = Vec::new();
    for i in 0..shnum {
        let h = section(i)?;
        if u32_at(h, 4)? != 2 {
            continue; // not SHT_SYMTAB
        }
        let (start, size, link) = (u64_at(h, 24)?, u64_at(h, 32)?, u32_at(h, 40)? as usize);
        let syms = start
            .checked_add(size)
            .and_then(|end| elf.get(start..end))
            .ok_or(bad("symbol table"))?;
        for sym in syms.chunks_exact(24) {
            let (st_name, info) = (u32::from_le_bytes([sym[0], sym[1], sym[2], sym[3]]), sym[4]);
            let shndx = usize::from(u16::from_le_bytes([sym[6], sym[7]]));
            if info & 0xf != 1 || shndx == 0 || shndx >= shnum {
                continue; // not an OBJECT defined in a section
            }
            let sh_name = u32_at(section(shndx)?, 0)? as usize;
            let holder = name_in(shstrndx, sh_name)?;
            let variable = holder.starts_with(".nv.global")
                || (holder.starts_with(".nv.constant") && !holder.starts_with(".nv.constant0"));
            if !variable {
                continue;
            }
            let name = name_in(link, st_name as usize)?;
            if crate::module::valid_symbol(name.as_bytes()) && !names.iter().any(|n| n == name) {
                names.push(name.to_string());
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
        assert!(matches!(
            module_variables(b"\x7fELF\x02\x01"),
            Err(ImageError::BadElf(_))
        ));
        assert_eq!(module_variables(b"garbage"), Err(ImageError::NotPtx));
    }

    /// nvcc 13.0's fatbin of `guest-driver/libcudart/tests/cu/matmul.cu` (its default:
    /// the PTX compressed with zstd, the sm_75 cubin not): the variable comes from the
    /// cubin; the PTX unpacks to the size its header states and declares the same.
    #[test]
    fn lists_an_nvcc_fatbins_variables_from_its_cubin_and_its_packed_ptx() {
        let f = include_bytes!("../tests/data/matmul_sm75.fatbin");
        assert!(
            fatbin_entry(f, FATBIN_PTX, false).is_none(),
            "its PTX is compressed"
        );
        assert_eq!(module_variables(f).unwrap(), ["calls"]);
        let cubin = fatbin_entry(f, FATBIN_ELF, false).unwrap();
        assert_eq!(module_variables(&cubin).unwrap(), ["calls"]);
        // Every truncation of the cubin gives an answer, not a panic.
        for n in 0..cubin.len() {
            let _ = module_variables(&cubin[..n]);
        }
        let ptx = fatbin_ptx(f).expect("the PTX unpacks");
        assert!(matches!(ptx, Cow::Owned(_)));
        assert_eq!(ptx.len(), 3091, "the size its entry's header states");
        let text = ptx_text(f).unwrap();
        assert!(text.contains(".visible .entry"), "{text}");
        assert_eq!(ptx_variables(&text).unwrap(), ["calls"]);
    }

    /// The fatbin above with its cubin entry taken out: every entry compressed (as
    /// `nvcc -Xfatbin -compress-all` writes it), its variables come from the unpacked
    /// PTX. A stated size that is off, a frame cut short or flipped bits are refused, and
    /// no size over the cap is believed.
    #[test]
    fn an_all_compressed_fatbin_is_read_through_its_unpacked_ptx() {
        let f = include_bytes!("../tests/data/matmul_sm75.fatbin");
        let packed = ptx_only(f);
        assert_eq!(module_variables(&packed).unwrap(), ["calls"]);
        // The PTX entry's header is at 16 (the cubin is gone); its unpacked size at 56.
        let size_at = 16 + FATBIN_UNPACKED_SIZE_AT;
        for wrong in [0u64, 3090, 3092, MAX_UNPACKED + 1, u64::MAX] {
            let mut b = packed.clone();
            b[size_at..size_at + 8].copy_from_slice(&wrong.to_le_bytes());
            assert_eq!(module_variables(&b), Err(ImageError::NoPtx), "size {wrong}");
        }
        let body = 16 + 80;
        for cut in [body, body + 4, body + 100, packed.len() - 8] {
            let mut b = packed.clone();
            b.truncate(cut);
            assert!(module_variables(&b).is_err(), "cut at {cut}");
        }
        for i in (body + 4..packed.len()).step_by(37) {
            let mut b = packed.clone();
            b[i] ^= 0x5a;
            let _ = module_variables(&b);
        }
    }

    /// nvcc 13.0's fatbin of the same program (`nvcc -fatbin -arch=sm_75
    /// --compress-mode=speed -Xfatbin -compress-all matmul.cu`, on the H100 machine,
    /// 2026-11-27): its cubin and its PTX are LZ4 blocks, each unpacked to the size its
    /// header states. A stated size or length that
    /// is off, a cut block or flipped bits are refused or read safely.
    #[test]
    fn an_lz4_packed_fatbin_is_read_through_its_unpacked_entries() {
        let f = include_bytes!("../tests/data/matmul_sm75_lz4.fatbin");
        assert!(fatbin_entry(f, FATBIN_PTX, false).is_none());
        assert!(fatbin_entry(f, FATBIN_ELF, false).is_none());
        assert_eq!(module_variables(f).unwrap(), ["calls"]);
        let cubin = fatbin_entry(f, FATBIN_ELF, true).expect("the cubin unpacks");
        assert_eq!(cubin.len(), 8032, "the size its entry's header states");
        assert!(cubin.starts_with(b"\x7fELF"));
        assert_eq!(module_variables(&cubin).unwrap(), ["calls"]);
        let text = ptx_text(f).unwrap();
        assert!(text.contains(".visible .entry"), "{text}");
        assert_eq!(ptx_variables(&text).unwrap(), ["calls"]);

        // The cubin is the first entry: its header at 16.
        let (len_at, size_at) = (16 + FATBIN_PACKED_LEN_AT, 16 + FATBIN_UNPACKED_SIZE_AT);
        let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let payload = u32_at(f, 16 + 8) as usize;
        let packed_len = u32_at(f, len_at) as usize;
        assert!(packed_len <= payload);
        for wrong in [0u64, 8031, 8033, MAX_UNPACKED + 1, u64::MAX] {
            let mut b = f.to_vec();
            b[size_at..size_at + 8].copy_from_slice(&wrong.to_le_bytes());
            assert!(fatbin_entry(&b, FATBIN_ELF, true).is_none(), "size {wrong}");
        }
        // A stated size the block cannot reach is refused before any allocation: 8032
        // bytes take more than 20 bytes of LZ4 (the cubin's payload starts at 80).
        assert_eq!(unpack(&f[80..], Packing::Lz4 { len: 20 }, 8032), None);
        assert_eq!(unpack(&[0x00], Packing::Lz4 { len: 1 }, MAX_UNPACKED), None);
        for wrong in [0u32, 1, packed_len as u32 - 1, payload as u32 + 1, u32::MAX] {
            let mut b = f.to_vec();
            b[len_at..len_at + 4].copy_from_slice(&wrong.to_le_bytes());
            assert!(
                fatbin_entry(&b, FATBIN_ELF, true).is_none(),
                "length {wrong}"
            );
        }
        let body = 16 + 80;
        for cut in [body, body + 4, body + 100, f.len() - 8] {
            let mut b = f.to_vec();
            b.truncate(cut);
            let _ = module_variables(&b);
        }
        for i in (body..f.len()).step_by(23) {
            let mut b = f.to_vec();
            b[i] ^= 0x5a;
            let _ = module_variables(&b);
        }
    }

    /// `image` with only its PTX entries, the fatbin header's body size to match.
    fn ptx_only(image: &[u8]) -> Vec<u8> {
        let u32_at = |o: usize| u32::from_le_bytes(image[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(image[o..o + 8].try_into().unwrap());
        let mut out = image[..16].to_vec();
        let mut at = 16;
        while at + 16 <= image.len() {
            let stop = at + u32_at(at + 4) as usize + u64_at(at + 8) as usize;
            if u16::from_le_bytes([image[at], image[at + 1]]) == FATBIN_PTX {
                out.extend_from_slice(&image[at..stop.min(image.len())]);
            }
            at = stop;
        }
        let body = (out.len() - 16) as u64;
        out[8..16].copy_from_slice(&body.to_le_bytes());
        out
    }

    /// Found by the fuzzer: section offsets near the top of the address space.
    #[test]
    fn section_offsets_that_overflow_are_refused() {
        let mut b = b"\x7fELF\x02\x01\x7fEL".to_vec();
        b.resize(135, 0xff);
        assert!(matches!(module_variables(&b), Err(ImageError::BadElf(_))));
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_give_an_answer(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = module_variables(&b);
            let mut elf = b"\x7fELF\x02\x01".to_vec();
            elf.extend_from_slice(&b);
            let _ = module_variables(&elf);
            let mut f = fatbin(&b);
            f.truncate(b.len() / 2 + 8);
            let _ = module_variables(&f);
        }
    }
}
