//! Push-buffer methods: the commands a channel executes.
//!
//! A push buffer is a sequence of little-endian 32-bit words. Each method is one header
//! word — bits 0..8 the opcode, bits 8..16 the number of argument words that follow,
//! bits 16..32 zero — followed by exactly that many argument words. Each opcode has a
//! fixed argument count; a header that disagrees is malformed.

use crate::kernel::KernelId;
use crate::module::{
    check_launch, FunctionLaunch, Reloc, MAX_PARAM_BYTES, MAX_RELOCS, RELOC_WRITE,
};
use thiserror::Error;

/// Opcodes.
pub mod op {
    pub const NOP: u8 = 0x00;
    pub const LAUNCH: u8 = 0x01;
    pub const COPY: u8 = 0x02;
    pub const SEM_RELEASE: u8 = 0x03;
    pub const SEM_ACQUIRE: u8 = 0x04;
    pub const SET_REF: u8 = 0x05;
    pub const NOTIFY: u8 = 0x06;
    /// Launch a function of a guest-loaded module (issue 31): fixed arguments, then a
    /// data tail (the parameter buffer and its relocations) the arguments size.
    pub const LAUNCH_FUNCTION: u8 = 0x07;
}

/// Words of one relocation in a `LAUNCH_FUNCTION` tail: offset, flags, extent low, high.
pub const RELOC_WORDS: usize = 4;

/// `SEM_RELEASE` flag: also write the GPU's 64-bit nanosecond clock at `va + 8`.
pub const SEM_RELEASE_TIMESTAMP: u32 = 1;

/// How `SEM_ACQUIRE` compares the semaphore with its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SemaphoreMode {
    /// Proceed when the semaphore equals the value.
    Equal = 0,
    /// Proceed when the semaphore is at or after the value (wrapping compare).
    AtLeast = 1,
}

/// A decoded method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    Nop,
    /// Run a builtin kernel on a compute engine. `args_va`/`args_len` name the argument
    /// block in GPU memory (see [`crate::kernel::KernelArgs`]).
    Launch {
        kernel: KernelId,
        grid: [u32; 3],
        args_va: u64,
        args_len: u32,
    },
    /// DMA `len` bytes between two GPU virtual ranges (copy engine).
    Copy {
        src: u64,
        dst: u64,
        len: u64,
    },
    /// Write `value` to the 4-byte semaphore at `va` once all earlier work is done.
    SemRelease {
        va: u64,
        value: u32,
        timestamp: bool,
    },
    /// Stall the channel until the semaphore at `va` satisfies `mode` against `value`.
    SemAcquire {
        va: u64,
        value: u32,
        mode: SemaphoreMode,
    },
    /// Write `value` to the control page's REF field.
    SetRef {
        value: u32,
    },
    /// Raise a notify event (an interrupt to the channel's owner) carrying `token`.
    Notify {
        token: u32,
    },
    /// Run a function of a module the channel's context loaded (see
    /// [`crate::module`]); the parameter buffer travels inline.
    LaunchFunction(Box<FunctionLaunch>),
}

/// Why a method was rejected. `offset` is the word offset of the header in the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum MethodError {
    #[error("word {offset}: unknown opcode {opcode:#x}")]
    UnknownOpcode { offset: usize, opcode: u8 },
    #[error("word {offset}: reserved header bits set ({header:#x})")]
    ReservedBits { offset: usize, header: u32 },
    #[error(
        "word {offset}: opcode {opcode:#x} takes {expected} argument words, header says {got}"
    )]
    WrongArgCount {
        offset: usize,
        opcode: u8,
        expected: u8,
        got: u8,
    },
    #[error("word {offset}: method runs past the end of the push buffer")]
    Truncated { offset: usize },
    #[error("word {offset}: unknown kernel id {id}")]
    UnknownKernel { offset: usize, id: u32 },
    #[error("word {offset}: bad semaphore (address {va:#x}, mode {mode})")]
    BadSemaphore { offset: usize, va: u64, mode: u32 },
    #[error("word {offset}: reserved flags {flags:#x}")]
    ReservedFlags { offset: usize, flags: u32 },
    #[error("word {offset}: launch grid {grid:?} is empty or too large")]
    BadGrid { offset: usize, grid: [u32; 3] },
    #[error("word {offset}: function launch: bad {what}")]
    BadFunctionLaunch { offset: usize, what: &'static str },
}

impl MethodError {
    /// Word offset of the offending method header.
    pub fn offset(&self) -> usize {
        match *self {
            MethodError::UnknownOpcode { offset, .. }
            | MethodError::ReservedBits { offset, .. }
            | MethodError::WrongArgCount { offset, .. }
            | MethodError::Truncated { offset }
            | MethodError::UnknownKernel { offset, .. }
            | MethodError::BadSemaphore { offset, .. }
            | MethodError::ReservedFlags { offset, .. }
            | MethodError::BadGrid { offset, .. }
            | MethodError::BadFunctionLaunch { offset, .. } => offset,
        }
    }
}

/// Largest number of threads one launch may name (product of the grid).
pub const MAX_GRID_THREADS: u64 = 1 << 31;

fn arg_count(opcode: u8) -> Option<u8> {
    Some(match opcode {
        op::NOP => 0,
        op::LAUNCH => 7,
        op::COPY => 6,
        op::SEM_RELEASE => 4,
        op::SEM_ACQUIRE => 4,
        op::SET_REF => 1,
        op::NOTIFY => 1,
        op::LAUNCH_FUNCTION => 10,
        _ => return None,
    })
}

fn header(opcode: u8) -> u32 {
    // Every opcode has a known count; `arg_count` is total over the opcodes we emit.
    let n = arg_count(opcode).unwrap_or(0);
    opcode as u32 | (n as u32) << 8
}

fn lo(v: u64) -> u32 {
    v as u32
}

fn hi(v: u64) -> u32 {
    (v >> 32) as u32
}

fn join(lo: u32, hi: u32) -> u64 {
    lo as u64 | (hi as u64) << 32
}

impl Method {
    /// Appends the method's words to `out`.
    pub fn encode_into(&self, out: &mut Vec<u32>) {
        match *self {
            Method::Nop => out.push(header(op::NOP)),
            Method::Launch {
                kernel,
                grid,
                args_va,
                args_len,
            } => out.extend_from_slice(&[
                header(op::LAUNCH),
                kernel as u32,
                grid[0],
                grid[1],
                grid[2],
                lo(args_va),
                hi(args_va),
                args_len,
            ]),
            Method::Copy { src, dst, len } => out.extend_from_slice(&[
                header(op::COPY),
                lo(src),
                hi(src),
                lo(dst),
                hi(dst),
                lo(len),
                hi(len),
            ]),
            Method::SemRelease {
                va,
                value,
                timestamp,
            } => out.extend_from_slice(&[
                header(op::SEM_RELEASE),
                lo(va),
                hi(va),
                value,
                if timestamp { SEM_RELEASE_TIMESTAMP } else { 0 },
            ]),
            Method::SemAcquire { va, value, mode } => out.extend_from_slice(&[
                header(op::SEM_ACQUIRE),
                lo(va),
                hi(va),
                value,
                mode as u32,
            ]),
            Method::SetRef { value } => out.extend_from_slice(&[header(op::SET_REF), value]),
            Method::Notify { token } => out.extend_from_slice(&[header(op::NOTIFY), token]),
            Method::LaunchFunction(ref l) => encode_function_launch(l, out),
        }
    }

    /// Encoded length in words.
    pub fn len_words(&self) -> usize {
        let opcode = match self {
            Method::Nop => op::NOP,
            Method::Launch { .. } => op::LAUNCH,
            Method::Copy { .. } => op::COPY,
            Method::SemRelease { .. } => op::SEM_RELEASE,
            Method::SemAcquire { .. } => op::SEM_ACQUIRE,
            Method::SetRef { .. } => op::SET_REF,
            Method::Notify { .. } => op::NOTIFY,
            Method::LaunchFunction(l) => {
                return 1 + 10 + l.params.len().div_ceil(4) + l.relocs.len() * RELOC_WORDS
            }
        };
        1 + arg_count(opcode).unwrap_or(0) as usize
    }

    /// Decodes the method at word `offset` of `words`; returns it and the offset of the next.
    pub fn decode(words: &[u32], offset: usize) -> Result<(Method, usize), MethodError> {
        let header = *words.get(offset).ok_or(MethodError::Truncated { offset })?;
        if header >> 16 != 0 {
            return Err(MethodError::ReservedBits { offset, header });
        }
        let opcode = header as u8;
        let got = (header >> 8) as u8;
        let expected = arg_count(opcode).ok_or(MethodError::UnknownOpcode { offset, opcode })?;
        if got != expected {
            return Err(MethodError::WrongArgCount {
                offset,
                opcode,
                expected,
                got,
            });
        }
        let start = offset + 1;
        let end = start + expected as usize;
        let a = words
            .get(start..end)
            .ok_or(MethodError::Truncated { offset })?;
        if opcode == op::LAUNCH_FUNCTION {
            return decode_function_launch(words, offset, a);
        }
        let m = match opcode {
            op::NOP => Method::Nop,
            op::LAUNCH => {
                let kernel = KernelId::from_u32(a[0])
                    .ok_or(MethodError::UnknownKernel { offset, id: a[0] })?;
                let grid = [a[1], a[2], a[3]];
                let threads = grid
                    .iter()
                    .try_fold(1u64, |acc, &g| acc.checked_mul(g as u64));
                if threads.is_none_or(|t| t == 0 || t > MAX_GRID_THREADS) {
                    return Err(MethodError::BadGrid { offset, grid });
                }
                Method::Launch {
                    kernel,
                    grid,
                    args_va: join(a[4], a[5]),
                    args_len: a[6],
                }
            }
            op::COPY => Method::Copy {
                src: join(a[0], a[1]),
                dst: join(a[2], a[3]),
                len: join(a[4], a[5]),
            },
            op::SEM_RELEASE => {
                let va = join(a[0], a[1]);
                let flags = a[3];
                if flags & !SEM_RELEASE_TIMESTAMP != 0 {
                    return Err(MethodError::ReservedFlags { offset, flags });
                }
                let timestamp = flags & SEM_RELEASE_TIMESTAMP != 0;
                let align = if timestamp { 8 } else { 4 };
                if !va.is_multiple_of(align) {
                    return Err(MethodError::BadSemaphore {
                        offset,
                        va,
                        mode: 0,
                    });
                }
                Method::SemRelease {
                    va,
                    value: a[2],
                    timestamp,
                }
            }
            op::SEM_ACQUIRE => {
                let va = join(a[0], a[1]);
                let mode = match a[3] {
                    0 => SemaphoreMode::Equal,
                    1 => SemaphoreMode::AtLeast,
                    m => {
                        return Err(MethodError::BadSemaphore {
                            offset,
                            va,
                            mode: m,
                        })
                    }
                };
                if !va.is_multiple_of(4) {
                    return Err(MethodError::BadSemaphore {
                        offset,
                        va,
                        mode: a[3],
                    });
                }
                Method::SemAcquire {
                    va,
                    value: a[2],
                    mode,
                }
            }
            op::SET_REF => Method::SetRef { value: a[0] },
            op::NOTIFY => Method::Notify { token: a[0] },
            // `arg_count` accepted the opcode, so it is one of the above.
            _ => return Err(MethodError::UnknownOpcode { offset, opcode }),
        };
        Ok((m, end))
    }
}

fn encode_function_launch(l: &FunctionLaunch, out: &mut Vec<u32>) {
    out.extend_from_slice(&[
        header(op::LAUNCH_FUNCTION),
        l.function,
        l.grid[0],
        l.grid[1],
        l.grid[2],
        l.block[0],
        l.block[1],
        l.block[2],
        l.shared_mem,
        l.params.len() as u32,
        l.relocs.len() as u32,
    ]);
    for chunk in l.params.chunks(4) {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        out.push(u32::from_le_bytes(w));
    }
    for r in &l.relocs {
        let flags = if r.write { RELOC_WRITE } else { 0 };
        out.extend_from_slice(&[r.offset, flags, lo(r.extent), hi(r.extent)]);
    }
}

/// `LAUNCH_FUNCTION` at `offset`, whose ten fixed arguments are `a`: reads the data tail
/// and checks the launch's shape. Padding bytes must be zero (one encoding per launch).
fn decode_function_launch(
    words: &[u32],
    offset: usize,
    a: &[u32],
) -> Result<(Method, usize), MethodError> {
    let bad = |what| MethodError::BadFunctionLaunch { offset, what };
    let (param_len, reloc_count) = (a[8], a[9]);
    if param_len > MAX_PARAM_BYTES {
        return Err(bad("parameter bytes"));
    }
    if reloc_count > MAX_RELOCS {
        return Err(bad("relocation count"));
    }
    let param_words = (param_len as usize).div_ceil(4);
    let tail_start = offset + 1 + a.len();
    let tail_len = param_words + reloc_count as usize * RELOC_WORDS;
    let tail = words
        .get(tail_start..tail_start + tail_len)
        .ok_or(MethodError::Truncated { offset })?;
    let mut params: Vec<u8> = tail[..param_words]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    if params[param_len as usize..].iter().any(|&b| b != 0) {
        return Err(bad("parameter padding"));
    }
    params.truncate(param_len as usize);
    let mut relocs = Vec::with_capacity(reloc_count as usize);
    for r in tail[param_words..].chunks_exact(RELOC_WORDS) {
        if r[1] & !RELOC_WRITE != 0 {
            return Err(bad("relocation flags"));
        }
        relocs.push(Reloc {
            offset: r[0],
            write: r[1] & RELOC_WRITE != 0,
            extent: join(r[2], r[3]),
        });
    }
    let l = FunctionLaunch {
        function: a[0],
        grid: [a[1], a[2], a[3]],
        block: [a[4], a[5], a[6]],
        shared_mem: a[7],
        params,
        relocs,
    };
    check_launch(&l).map_err(bad)?;
    Ok((Method::LaunchFunction(Box::new(l)), tail_start + tail_len))
}

impl SemaphoreMode {
    /// Whether a semaphore holding `current` satisfies an acquire of `value`.
    pub fn satisfied(self, current: u32, value: u32) -> bool {
        match self {
            SemaphoreMode::Equal => current == value,
            SemaphoreMode::AtLeast => (current.wrapping_sub(value) as i32) >= 0,
        }
    }
}

/// Iterates the methods of one push-buffer segment, stopping at the first error.
pub struct MethodDecoder<'a> {
    words: &'a [u32],
    offset: usize,
    failed: bool,
}

impl<'a> MethodDecoder<'a> {
    pub fn new(words: &'a [u32]) -> Self {
        MethodDecoder {
            words,
            offset: 0,
            failed: false,
        }
    }
}

impl Iterator for MethodDecoder<'_> {
    type Item = Result<Method, MethodError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.offset >= self.words.len() {
            return None;
        }
        match Method::decode(self.words, self.offset) {
            Ok((m, next)) => {
                self.offset = next;
                Some(Ok(m))
            }
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

/// Decodes a whole segment, all or nothing.
pub fn decode_all(words: &[u32]) -> Result<Vec<Method>, MethodError> {
    MethodDecoder::new(words).collect()
}

/// [`decode_all`] into `out`, emptied first (a front end reuses one buffer for every
/// entry); on an error `out` holds what came before it.
pub fn decode_into(words: &[u32], out: &mut Vec<Method>) -> Result<(), MethodError> {
    out.clear();
    for m in MethodDecoder::new(words) {
        out.push(m?);
    }
    Ok(())
}

/// Encodes a list of methods into push-buffer words.
pub fn encode_all(methods: &[Method]) -> Vec<u32> {
    let mut out = Vec::with_capacity(methods.iter().map(Method::len_words).sum());
    for m in methods {
        m.encode_into(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_method() -> impl Strategy<Value = Method> {
        let kernel = proptest::sample::select(KernelId::ALL.to_vec());
        prop_oneof![
            Just(Method::Nop),
            (
                kernel,
                1u32..64,
                1u32..64,
                1u32..64,
                any::<u64>(),
                any::<u32>()
            )
                .prop_map(|(kernel, x, y, z, args_va, args_len)| Method::Launch {
                    kernel,
                    grid: [x, y, z],
                    args_va,
                    args_len
                }),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(src, dst, len)| Method::Copy {
                src,
                dst,
                len
            }),
            (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(va, value, timestamp)| {
                Method::SemRelease {
                    va: va & !7,
                    value,
                    timestamp,
                }
            }),
            (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(va, value, eq)| {
                Method::SemAcquire {
                    va: va & !3,
                    value,
                    mode: if eq {
                        SemaphoreMode::Equal
                    } else {
                        SemaphoreMode::AtLeast
                    },
                }
            }),
            any::<u32>().prop_map(|value| Method::SetRef { value }),
            any::<u32>().prop_map(|token| Method::Notify { token }),
            any_function_launch(),
        ]
    }

    pub(crate) fn any_function_launch() -> impl Strategy<Value = Method> {
        (
            any::<u32>(),
            (1u32..70000, 1u32..100, 1u32..100),
            (1u32..32, 1u32..32, 1u32..2),
            0..=crate::module::MAX_SHARED_MEM,
            proptest::collection::vec(any::<u8>(), 0..64),
            proptest::collection::vec((any::<bool>(), 1u64..u64::MAX), 0..4),
        )
            .prop_map(|(function, grid, block, shared_mem, params, relocs)| {
                // Relocations at the first 8-aligned slots the buffer has.
                let relocs = relocs
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| (i + 1) * 8 <= params.len())
                    .map(|(i, (write, extent))| Reloc {
                        offset: i as u32 * 8,
                        write,
                        extent,
                    })
                    .collect();
                Method::LaunchFunction(Box::new(FunctionLaunch {
                    function,
                    grid: [grid.0, grid.1, grid.2],
                    block: [block.0, block.1, block.2],
                    shared_mem,
                    params,
                    relocs,
                }))
            })
    }

    proptest! {
        #[test]
        fn round_trip(methods in proptest::collection::vec(any_method(), 0..16)) {
            let words = encode_all(&methods);
            prop_assert_eq!(words.len(), methods.iter().map(Method::len_words).sum::<usize>());
            prop_assert_eq!(decode_all(&words), Ok(methods.clone()));
            let mut out = vec![Method::Nop; 3];
            prop_assert_eq!(decode_into(&words, &mut out), Ok(()));
            prop_assert_eq!(out, methods);
        }

        #[test]
        fn arbitrary_words_never_panic(words in proptest::collection::vec(any::<u32>(), 0..64)) {
            // Whatever decodes must re-encode to the same words.
            let mut off = 0;
            for r in MethodDecoder::new(&words) {
                match r {
                    Ok(m) => {
                        let mut out = Vec::new();
                        m.encode_into(&mut out);
                        prop_assert_eq!(&out[..], &words[off..off + out.len()]);
                        off += out.len();
                    }
                    Err(e) => prop_assert_eq!(e.offset(), off),
                }
            }
        }
    }

    #[test]
    fn rejects_each_malformation() {
        let e = |w: &[u32]| decode_all(w).unwrap_err();
        assert!(matches!(
            e(&[0xff]),
            MethodError::UnknownOpcode { opcode: 0xff, .. }
        ));
        assert!(matches!(e(&[0x1_0000]), MethodError::ReservedBits { .. }));
        assert!(matches!(e(&[0x0005]), MethodError::WrongArgCount { .. }));
        assert!(matches!(
            e(&[0x0205, 1, 2]),
            MethodError::WrongArgCount { .. }
        ));
        assert!(matches!(e(&[0x0100]), MethodError::WrongArgCount { .. }));
        assert!(matches!(e(&[0x0106]), MethodError::Truncated { .. }));
        assert!(matches!(
            e(&[0x0701, 999, 1, 1, 1, 0, 0, 0]),
            MethodError::UnknownKernel { id: 999, .. }
        ));
        assert!(matches!(
            e(&[0x0701, 0, 0, 1, 1, 0, 0, 0]),
            MethodError::BadGrid { .. }
        ));
        assert!(matches!(
            e(&[0x0701, 0, 65536, 65536, 1, 0, 0, 0]),
            MethodError::BadGrid { .. }
        ));
        assert!(matches!(
            e(&[0x0403, 2, 0, 0, 0]),
            MethodError::BadSemaphore { .. }
        ));
        assert!(matches!(
            e(&[0x0403, 4, 0, 0, 1]),
            MethodError::BadSemaphore { .. }
        ));
        assert!(matches!(
            e(&[0x0403, 8, 0, 0, 2]),
            MethodError::ReservedFlags { .. }
        ));
        assert!(matches!(
            e(&[0x0404, 8, 0, 0, 2]),
            MethodError::BadSemaphore { .. }
        ));
        // The error carries the offset of the bad method, not of the first.
        assert_eq!(e(&[0, 0, 0xff]).offset(), 2);
    }

    #[test]
    fn function_launch_tails_are_checked() {
        let head = |params: u32, relocs: u32| vec![0x0a07, 5, 1, 1, 1, 32, 1, 1, 0, params, relocs];
        let e = |w: &[u32]| decode_all(w).unwrap_err();
        // Parameters that lie about their size run past the push buffer.
        assert!(matches!(e(&head(8, 0)), MethodError::Truncated { .. }));
        let mut w = head(4097, 0);
        w.extend(std::iter::repeat_n(0, 1025));
        assert!(matches!(
            e(&w),
            MethodError::BadFunctionLaunch {
                what: "parameter bytes",
                ..
            }
        ));
        let mut w = head(3, 0);
        w.push(0xff00_0000);
        assert!(matches!(
            e(&w),
            MethodError::BadFunctionLaunch {
                what: "parameter padding",
                ..
            }
        ));
        let mut w = head(8, 1);
        w.extend([0, 0, 0, 2, 1, 0]);
        assert!(matches!(
            e(&w),
            MethodError::BadFunctionLaunch {
                what: "relocation flags",
                ..
            }
        ));
        let mut w = head(8, 1);
        w.extend([0, 0, 4, 1, 1, 0]);
        assert!(matches!(
            e(&w),
            MethodError::BadFunctionLaunch {
                what: "relocation",
                ..
            }
        ));
        let mut w = head(8, 1);
        w.extend([7, 0, 0, 1, 1, 0]);
        let (m, next) = Method::decode(&w, 0).unwrap();
        assert_eq!(next, w.len());
        let Method::LaunchFunction(l) = m else {
            panic!("{m:?}")
        };
        assert_eq!((l.function, l.params[0], l.relocs[0].write), (5, 7, true));
        let mut w = head(0, 0);
        w[5] = 2048;
        assert!(matches!(
            e(&w),
            MethodError::BadFunctionLaunch { what: "block", .. }
        ));
    }

    #[test]
    fn semaphore_compare_wraps() {
        assert!(SemaphoreMode::AtLeast.satisfied(5, 5));
        assert!(SemaphoreMode::AtLeast.satisfied(1, u32::MAX));
        assert!(!SemaphoreMode::AtLeast.satisfied(u32::MAX, 1));
        assert!(SemaphoreMode::Equal.satisfied(7, 7));
        assert!(!SemaphoreMode::Equal.satisfied(8, 7));
    }
}
