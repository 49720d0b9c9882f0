//! Guest-supplied modules (issue 31): the limits of the module requests and of a
//! `LAUNCH_FUNCTION` method, and the launch itself as a value. The design and the reasons
//! for every limit are in `docs/design/guest-modules.md`.

/// Largest module image a guest may load (PTX text, cubin or fatbin).
pub const MAX_MODULE_BYTES: u64 = 32 << 20;
/// Most modules one context may hold at once.
pub const MAX_MODULES_PER_CONTEXT: usize = 64;
/// Longest function or global name, bytes.
pub const MAX_SYMBOL_LEN: usize = 512;
/// Most parameters a FUNCTION_GET reply describes.
pub const MAX_FUNCTION_PARAMS: usize = 128;
/// `param_count` of a FUNCTION_GET reply when the GPU cannot tell the layout: the guest
/// supplies the parameter buffer's size itself.
pub const PARAMS_UNKNOWN: u32 = u32::MAX;
/// Largest parameter buffer of one launch (the classic CUDA limit).
pub const MAX_PARAM_BYTES: u32 = 4096;
/// Most relocated pointer parameters of one launch.
pub const MAX_RELOCS: u32 = 64;
/// Largest dynamic shared memory of one launch, bytes.
pub const MAX_SHARED_MEM: u32 = 256 << 10;
/// Most threads of one block (every current NVIDIA GPU's limit).
pub const MAX_BLOCK_THREADS: u64 = 1024;
/// Largest block z dimension.
pub const MAX_BLOCK_Z: u32 = 64;
/// Largest grid x dimension.
pub const MAX_GRID_X: u32 = i32::MAX as u32;
/// Largest grid y and z dimensions.
pub const MAX_GRID_YZ: u32 = 65535;
/// Relocation flag: the kernel writes through the pointer.
pub const RELOC_WRITE: u32 = 1;

/// Whether `name` is a valid function or global name: 1..=[`MAX_SYMBOL_LEN`] bytes of
/// printable ASCII (no spaces, no NUL).
pub fn valid_symbol(name: &[u8]) -> bool {
    !name.is_empty() && name.len() <= MAX_SYMBOL_LEN && name.iter().all(|b| b.is_ascii_graphic())
}

/// One parameter of a function, as the driver lays it out in the parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    pub offset: u32,
    pub size: u32,
}

/// The bytes a parameter buffer of `params` must have: the end of the last parameter.
pub fn param_bytes(params: &[ParamInfo]) -> u64 {
    params
        .iter()
        .map(|p| u64::from(p.offset) + u64::from(p.size))
        .max()
        .unwrap_or(0)
}

/// A pointer parameter the GPU translates: the 8 bytes at `offset` of the parameter
/// buffer hold a GPU virtual address of the channel's context, and the kernel may touch
/// `extent` bytes from it (written if `write`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reloc {
    pub offset: u32,
    pub write: bool,
    pub extent: u64,
}

/// A launch of a module function (`LAUNCH_FUNCTION`), decoded and checked for shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionLaunch {
    /// The function id FUNCTION_GET returned.
    pub function: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub shared_mem: u32,
    /// The parameter buffer as the kernel receives it (after relocation).
    pub params: Vec<u8>,
    /// In increasing offset order, non-overlapping.
    pub relocs: Vec<Reloc>,
}

/// Why a launch's shape was refused.
pub fn check_launch(l: &FunctionLaunch) -> Result<(), &'static str> {
    let [gx, gy, gz] = l.grid;
    if gx == 0 || gy == 0 || gz == 0 || gx > MAX_GRID_X || gy > MAX_GRID_YZ || gz > MAX_GRID_YZ {
        return Err("grid");
    }
    let [bx, by, bz] = l.block;
    // Three u32s can overflow a u64's product: saturate (the limit refuses it anyway).
    let threads = u64::from(bx)
        .saturating_mul(u64::from(by))
        .saturating_mul(u64::from(bz));
    if threads == 0 || threads > MAX_BLOCK_THREADS || bz > MAX_BLOCK_Z {
        return Err("block");
    }
    if l.shared_mem > MAX_SHARED_MEM {
        return Err("shared memory");
    }
    if l.params.len() > MAX_PARAM_BYTES as usize {
        return Err("parameter bytes");
    }
    if l.relocs.len() > MAX_RELOCS as usize {
        return Err("relocation count");
    }
    let mut end = 0u64;
    for r in &l.relocs {
        let at = u64::from(r.offset);
        if !at.is_multiple_of(8) || at < end || at + 8 > l.params.len() as u64 || r.extent == 0 {
            return Err("relocation");
        }
        end = at + 8;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> FunctionLaunch {
        FunctionLaunch {
            function: 1,
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_mem: 0,
            params: vec![0; 16],
            relocs: vec![Reloc {
                offset: 8,
                write: true,
                extent: 4,
            }],
        }
    }

    #[test]
    fn shapes_are_checked() {
        assert_eq!(check_launch(&launch()), Ok(()));
        let bad = |f: fn(&mut FunctionLaunch)| {
            let mut l = launch();
            f(&mut l);
            check_launch(&l).unwrap_err()
        };
        assert_eq!(bad(|l| l.grid = [0, 1, 1]), "grid");
        assert_eq!(bad(|l| l.grid = [1, 65536, 1]), "grid");
        assert_eq!(bad(|l| l.block = [1025, 1, 1]), "block");
        assert_eq!(bad(|l| l.block = [1, 1, 65]), "block");
        // A product past u64 (the fuzzer's find) is refused, not an overflow.
        assert_eq!(bad(|l| l.block = [u32::MAX; 3]), "block");
        assert_eq!(bad(|l| l.shared_mem = MAX_SHARED_MEM + 1), "shared memory");
        assert_eq!(bad(|l| l.params = vec![0; 4097]), "parameter bytes");
        assert_eq!(bad(|l| l.relocs[0].offset = 4), "relocation");
        assert_eq!(bad(|l| l.relocs[0].offset = 16), "relocation");
        assert_eq!(bad(|l| l.relocs[0].extent = 0), "relocation");
        assert_eq!(bad(|l| l.relocs.push(l.relocs[0])), "relocation");
    }

    #[test]
    fn symbols() {
        assert!(valid_symbol(b"_Z3addPfS_"));
        assert!(!valid_symbol(b""));
        assert!(!valid_symbol(b"a b"));
        assert!(!valid_symbol(b"a\0"));
        assert!(!valid_symbol(&[b'a'; MAX_SYMBOL_LEN + 1]));
        assert!(valid_symbol(&[b'a'; MAX_SYMBOL_LEN]));
    }
}
