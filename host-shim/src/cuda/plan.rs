//! Turning one GP entry's decoded methods into stream operations, with every address a
//! guest names checked against the issuing context's mappings first.
//!
//! This is the isolation boundary of the `cuda` GPU: all tenants share one CUDA context
//! (one address space on the device), so a kernel may only ever see device pointers that
//! this module produced from the issuing context's page tables. An operand that is not
//! fully mapped (or is read-only but written) faults the channel before anything is issued.

use std::sync::Arc;

use vgpu_protocol::kernel::KernelArgs;
use vgpu_protocol::method::Method;
use vgpu_protocol::module::{param_bytes, FunctionLaunch, ParamInfo};
use vgpu_protocol::{ErrorCode, SemaphoreMode};

use crate::fifo::fetch::launch_args;
use crate::kernels::{FaultKind, MemFault, MAX_RESIDENT_BYTES};

/// One operation on a channel's stream. Addresses are device pointers (for the real
/// device: unified virtual addresses of registered host memory or device memory).
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// A builtin kernel with pointer fields already translated.
    Launch(KernelArgs),
    /// A builtin kernel that also writes its GP entry's REF once it has ended (the
    /// kernel's fence signal, `kernels.cu`): one driver call where a launch and a REF
    /// write would take two. A device may issue it as the two.
    LaunchSignal(KernelArgs, Signal),
    /// An asynchronous copy of non-overlapping ranges.
    Copy { dst: u64, src: u64, len: u64 },
    /// Writes the GPU clock (host CLOCK_MONOTONIC scale) as u64 at `ptr`.
    Timestamp { ptr: u64 },
    /// A stream memory write of a 32-bit value (SEM_RELEASE).
    WriteValue { ptr: u64, value: u32 },
    /// A stream memory wait (SEM_ACQUIRE): the stream stalls on the GPU until satisfied.
    WaitValue {
        ptr: u64,
        value: u32,
        mode: SemaphoreMode,
    },
    /// A guest module's function (the device's handle), its parameter buffer relocated.
    LaunchFunction {
        func: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem: u32,
        params: Arc<[u8]>,
    },
}

/// A function a context bound for `LAUNCH_FUNCTION`: the device's handle and, when known,
/// its parameter layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundFunction {
    pub handle: u64,
    pub params: Option<Vec<ParamInfo>>,
}

/// A kernel's fence signal: `value` into the channel's REF at `ptr` once every block of
/// the kernel is done, counted on the channel's word `count` (device memory, 0 between
/// kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signal {
    pub ptr: u64,
    pub value: u32,
    pub count: u64,
}

/// A REF write owed to a stream: `value` into the channel's REF at `ptr`, once the work
/// issued before it has completed (a kernel too large to signal itself leaves one; the
/// next builtin kernel does it as it starts, else a stream write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefWrite {
    pub ptr: u64,
    pub value: u32,
}

/// What the front end does on the host once the entry's stream work has completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostAction {
    SetRef(u32),
    Notify(u32),
}

/// One GP entry ready to issue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub ops: Vec<Op>,
    /// Applied in order when the entry completes.
    pub host: Vec<HostAction>,
    pub kernels: u64,
    pub copies: u64,
    /// The entry waits on a semaphore: the front end issues nothing after it until it
    /// completes, so a stuck wait never has guest work queued behind it.
    pub waits: bool,
    /// How many of `ops` are the channel's own REF writes (not guest work: they do not
    /// make the entry count as running on the GPU).
    pub ref_writes: usize,
}

/// Resolves a context's GPU virtual ranges to device pointers.
pub trait Translate {
    /// The device pieces behind `va..va+len`, in address order (adjacent pieces merged),
    /// which must all be mapped (writable if `write`). `len` is at least 1. One piece when
    /// the range is contiguous in device memory; several when its chunks lie apart (VRAM
    /// allocated piecewise, chunks swapped to host memory).
    fn runs(&self, va: u64, len: u64, write: bool) -> Result<Vec<(u64, u64)>, MemFault>;
    /// A per-channel device buffer of at least `len` bytes for staging, or `None` if it
    /// cannot be had. Every call may return the same buffer: one entry's users must ask
    /// once for all they need.
    fn scratch(&self, len: u64) -> Option<u64>;
    /// Where the GPU itself may write the channel's REF (its control page, registered
    /// with the device), or `None` for the front end to store it at completion.
    fn ref_ptr(&self) -> Option<u64> {
        None
    }
    /// The channel's block counter for kernels' fence signals (a zeroed word of device
    /// memory), or `None`: REF is then written by a stream write after the kernel.
    fn signal_count(&self) -> Option<u64> {
        None
    }
    /// Whether `va..va+len` is mapped in the device's own address space at the guest's
    /// address (`super::identity`): a module launch's pointer then passes unchanged.
    fn identity(&self, va: u64, len: u64, write: bool) -> bool {
        let _ = (va, len, write);
        false
    }
    /// The function the issuing context bound to `id` (guest modules), if any.
    fn function(&self, id: u32) -> Option<BoundFunction> {
        let _ = id;
        None
    }
}

/// Reads a launch's argument block from guest memory.
pub use crate::fifo::fetch::ArgReader;

/// Why an entry cannot run: the channel faults with `code` and `info`.
pub type PlanError = (ErrorCode, u64);

fn fault(f: MemFault) -> PlanError {
    (ErrorCode::MmuFault, f.va)
}

fn wrap(va: u64, write: bool) -> PlanError {
    fault(MemFault {
        va,
        write,
        kind: FaultKind::NotMapped,
    })
}

/// `count` f32 elements from `base` in bytes, or the sim's wrap fault.
fn f32_bytes(base: u64, count: u64, write: bool) -> Result<u64, PlanError> {
    count.checked_mul(4).ok_or(wrap(base, write))
}

/// The pieces of one operand; empty operands have none.
fn pieces(t: &dyn Translate, va: u64, len: u64, write: bool) -> Result<Vec<(u64, u64)>, PlanError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if va.checked_add(len).is_none() {
        return Err(wrap(va, write));
    }
    t.runs(va, len, write).map_err(fault)
}

/// Translates an operand that must be contiguous (semaphores, timestamps); empty ones get
/// pointer 0.
fn operand(t: &dyn Translate, va: u64, len: u64, write: bool) -> Result<u64, PlanError> {
    match pieces(t, va, len, write)?.as_slice() {
        [] => Ok(0),
        [(p, _)] => Ok(*p),
        [_, (p, _), ..] => Err(fault(MemFault {
            va: va.saturating_add(len.min(*p)),
            write,
            kind: FaultKind::BadTarget,
        })),
    }
}

/// Alignment of bounce regions in scratch.
const BOUNCE_ALIGN: u64 = 256;

/// A launch's operands. Kernels take flat pointers, so an operand whose memory is in
/// several pieces is *bounced*: gathered into the channel's scratch before the kernel and,
/// if the kernel writes it, scattered back after it (all on the channel's stream, so in
/// order). An operand inside a range already bounced uses that copy (e.g. saxpy with
/// `x == y`). Resolution runs twice: once to measure the scratch needed, once with it.
struct Operands<'a> {
    t: &'a dyn Translate,
    /// Scratch base in the second pass; `None` while measuring.
    base: Option<u64>,
    used: u64,
    bounces: Vec<Bounce>,
    /// Operands used in place: (va, len).
    direct: Vec<(u64, u64)>,
    /// Copies that must follow the gathers (a stencil's source snapshot).
    pre: Vec<Op>,
}

struct Bounce {
    va: u64,
    len: u64,
    ptr: u64,
    write: bool,
    runs: Vec<(u64, u64)>,
}

fn ranges_overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0.saturating_add(b.1) && b.0 < a.0.saturating_add(a.1)
}

impl<'a> Operands<'a> {
    fn new(t: &'a dyn Translate, base: Option<u64>) -> Self {
        Operands {
            t,
            base,
            used: 0,
            bounces: Vec::new(),
            direct: Vec::new(),
            pre: Vec::new(),
        }
    }

    /// `len` bytes of scratch (a placeholder while measuring).
    fn take(&mut self, len: u64) -> u64 {
        let off = self.used.next_multiple_of(BOUNCE_ALIGN);
        self.used = off + len;
        self.base.map_or(0, |b| b + off)
    }

    fn operand(&mut self, va: u64, len: u64, write: bool) -> Result<u64, PlanError> {
        let runs = pieces(self.t, va, len, write)?;
        if runs.is_empty() {
            return Ok(0);
        }
        if let Some(b) = self
            .bounces
            .iter_mut()
            .find(|b| va >= b.va && va + len <= b.va + b.len)
        {
            b.write |= write;
            return Ok(b.ptr + (va - b.va));
        }
        if let [(p, _)] = runs.as_slice() {
            self.direct.push((va, len));
            return Ok(*p);
        }
        let ptr = self.take(len);
        log::debug!(
            "bouncing operand {va:#x}+{len:#x} ({} pieces) through scratch",
            runs.len()
        );
        self.bounces.push(Bounce {
            va,
            len,
            ptr,
            write,
            runs,
        });
        Ok(ptr)
    }

    /// An operand used in place that overlaps a bounced one, or two bounced operands
    /// overlapping without one containing the other, would see (or leave) different copies
    /// of the same bytes: such a launch faults rather than compute something else.
    fn check_overlaps(&self) -> Result<(), PlanError> {
        let clash = |va: u64| {
            Err(fault(MemFault {
                va,
                write: true,
                kind: FaultKind::BadTarget,
            }))
        };
        for (i, b) in self.bounces.iter().enumerate() {
            if let Some(d) = self
                .direct
                .iter()
                .find(|&&d| ranges_overlap(d, (b.va, b.len)))
            {
                return clash(d.0.max(b.va));
            }
            if let Some(o) = self.bounces[i + 1..]
                .iter()
                .find(|o| ranges_overlap((o.va, o.len), (b.va, b.len)))
            {
                return clash(o.va.max(b.va));
            }
        }
        Ok(())
    }

    /// The gathers (then the other preparatory copies) and the scatters.
    fn into_copies(self) -> (Vec<Op>, Vec<Op>) {
        let (mut pre, mut post) = (Vec::new(), Vec::new());
        for b in &self.bounces {
            let mut off = 0;
            for &(ptr, n) in &b.runs {
                pre.push(Op::Copy {
                    dst: b.ptr + off,
                    src: ptr,
                    len: n,
                });
                if b.write {
                    post.push(Op::Copy {
                        dst: ptr,
                        src: b.ptr + off,
                        len: n,
                    });
                }
                off += n;
            }
        }
        pre.extend(self.pre);
        (pre, post)
    }
}

fn overlaps(a: u64, b: u64, len: u64) -> bool {
    a < b.saturating_add(len) && b < a.saturating_add(len)
}

/// memmove of `len` bytes between device pointers: one copy when the ranges are apart,
/// else pieces staged through scratch in the order that reads every source byte before
/// it can be overwritten (backwards when `dst > src`).
fn memmove(
    t: &dyn Translate,
    ops: &mut Vec<Op>,
    dst: u64,
    src: u64,
    len: u64,
) -> Result<(), PlanError> {
    if len == 0 || dst == src {
        return Ok(());
    }
    if !overlaps(dst, src, len) {
        ops.push(Op::Copy { dst, src, len });
        return Ok(());
    }
    const STAGE: u64 = 64 << 20;
    let piece = len.min(STAGE);
    let scratch = t.scratch(piece).ok_or((ErrorCode::Internal, dst))?;
    let pieces = len.div_ceil(piece);
    for i in 0..pieces {
        let idx = if dst > src { pieces - 1 - i } else { i };
        let off = idx * piece;
        let n = piece.min(len - off);
        ops.push(Op::Copy {
            dst: scratch,
            src: src + off,
            len: n,
        });
        ops.push(Op::Copy {
            dst: dst + off,
            src: scratch,
            len: n,
        });
    }
    Ok(())
}

/// Copies between the pieces of two ranges of equal total length, pairwise.
fn zip_copies(ops: &mut Vec<Op>, dst: &[(u64, u64)], src: &[(u64, u64)]) {
    let (mut di, mut si) = (dst.iter().copied(), src.iter().copied());
    let (mut d, mut s) = (di.next(), si.next());
    while let (Some((dp, dn)), Some((sp, sn))) = (d, s) {
        let n = dn.min(sn);
        ops.push(Op::Copy {
            dst: dp,
            src: sp,
            len: n,
        });
        d = if dn > n {
            Some((dp + n, dn - n))
        } else {
            di.next()
        };
        s = if sn > n {
            Some((sp + n, sn - n))
        } else {
            si.next()
        };
    }
}

/// A memmove of `len` bytes between GPU virtual ranges (COPY, the memcpy kernel):
/// contiguous operands move directly; pieces pair up; overlapping pieced ranges go through
/// scratch whole (every source byte is read before any is written).
fn copy_va(
    t: &dyn Translate,
    ops: &mut Vec<Op>,
    dst: u64,
    src: u64,
    len: u64,
) -> Result<(), PlanError> {
    let sr = pieces(t, src, len, false)?;
    let dr = pieces(t, dst, len, true)?;
    match (sr.as_slice(), dr.as_slice()) {
        ([], _) | (_, []) => Ok(()),
        ([(s, _)], [(d, _)]) => memmove(t, ops, *d, *s, len),
        _ if !overlaps(dst, src, len) => {
            zip_copies(ops, &dr, &sr);
            Ok(())
        }
        _ => {
            let tmp = t.scratch(len).ok_or((ErrorCode::BadKernelArgs, src))?;
            zip_copies(ops, &[(tmp, len)], &sr);
            zip_copies(ops, &dr, &[(tmp, len)]);
            Ok(())
        }
    }
}

/// Translates a launch's arguments, with the same footprints and limits as the sim's
/// kernels (`crate::kernels`), so a launch faults on the cuda GPU exactly when it would
/// on the sim.
fn launch(t: &dyn Translate, args: KernelArgs, plan: &mut Plan) -> Result<(), PlanError> {
    match args {
        KernelArgs::Memcpy { dst, src, len } => {
            plan.kernels += 1;
            return copy_va(t, &mut plan.ops, dst, src, len);
        }
        KernelArgs::Timestamp { dst } => {
            plan.kernels += 1;
            plan.ops.push(Op::Timestamp {
                ptr: operand(t, dst, 8, true)?,
            });
            return Ok(());
        }
        _ => {}
    }
    let mut ops = Operands::new(t, None);
    let mut resolved = resolve(&mut ops, args)?;
    if ops.used > 0 {
        let need = ops.used;
        let base = t.scratch(need).ok_or((
            ErrorCode::BadKernelArgs,
            ops.bounces.first().map_or(0, |b| b.va),
        ))?;
        ops = Operands::new(t, Some(base));
        resolved = resolve(&mut ops, args)?;
        if ops.used > need {
            return Err((ErrorCode::Internal, 0));
        }
    }
    ops.check_overlaps()?;
    let (pre, post) = ops.into_copies();
    plan.kernels += 1;
    plan.ops.extend(pre);
    plan.ops.push(Op::Launch(resolved));
    plan.ops.extend(post);
    Ok(())
}

/// The launch's arguments with every pointer field resolved through `o`.
fn resolve(o: &mut Operands<'_>, args: KernelArgs) -> Result<KernelArgs, PlanError> {
    let too_large = |va| (ErrorCode::BadKernelArgs, va);
    Ok(match args {
        KernelArgs::Empty
        | KernelArgs::Spin { .. }
        | KernelArgs::Memcpy { .. }
        | KernelArgs::Timestamp { .. } => args,
        KernelArgs::Memset { dst, len, pattern } => KernelArgs::Memset {
            dst: o.operand(dst, len, true)?,
            len,
            pattern,
        },
        KernelArgs::Saxpy { x, y, n, a } => {
            let len = f32_bytes(x, n, false)?;
            KernelArgs::Saxpy {
                x: o.operand(x, len, false)?,
                y: o.operand(y, len, true)?,
                n,
                a,
            }
        }
        KernelArgs::Sgemm {
            a,
            b,
            c,
            m,
            n,
            k,
            alpha,
            beta,
        } => {
            let (m64, n64, k64) = (u64::from(m), u64::from(n), u64::from(k));
            let b_len = (k64 * n64)
                .checked_mul(4)
                .filter(|&l| l <= MAX_RESIDENT_BYTES)
                .ok_or(too_large(b))?;
            let a_len = f32_bytes(a, m64 * k64, false)?;
            let c_len = f32_bytes(c, m64 * n64, true)?;
            KernelArgs::Sgemm {
                a: o.operand(a, a_len, false)?,
                b: o.operand(b, b_len, false)?,
                c: o.operand(c, c_len, true)?,
                m,
                n,
                k,
                alpha,
                beta,
            }
        }
        KernelArgs::ReduceSum { src, n, dst } => {
            let len = f32_bytes(src, n, false)?;
            KernelArgs::ReduceSum {
                src: o.operand(src, len, false)?,
                n,
                dst: o.operand(dst, 4, true)?,
            }
        }
        KernelArgs::Checksum { src, len, dst } => KernelArgs::Checksum {
            src: o.operand(src, len, false)?,
            len,
            dst: o.operand(dst, 8, true)?,
        },
        KernelArgs::Stencil2d {
            src,
            dst,
            width,
            height,
            c_center,
            c_neighbor,
        } => {
            let row = u64::from(width) * 4;
            if row.saturating_mul(4) > MAX_RESIDENT_BYTES {
                return Err(too_large(src));
            }
            let len = row.checked_mul(height.into()).ok_or(wrap(src, false))?;
            let s = o.operand(src, len, false)?;
            let d = o.operand(dst, len, true)?;
            // Overlapping grids behave as if the source were copied first (as on the sim).
            let s = if len > 0 && overlaps(s, d, len) {
                let tmp = o.take(len);
                o.pre.push(Op::Copy {
                    dst: tmp,
                    src: s,
                    len,
                });
                tmp
            } else {
                s
            };
            KernelArgs::Stencil2d {
                src: s,
                dst: d,
                width,
                height,
                c_center,
                c_neighbor,
            }
        }
    })
}

/// Plans a module function's launch: the function must be bound in the issuing context,
/// the parameter buffer must match its layout when known, and every relocated pointer is
/// translated like a builtin kernel's operand and must be one contiguous device piece.
fn launch_function(
    t: &dyn Translate,
    l: &FunctionLaunch,
    plan: &mut Plan,
) -> Result<(), PlanError> {
    let f = t
        .function(l.function)
        .ok_or((ErrorCode::BadKernel, l.function.into()))?;
    let bad_args = (ErrorCode::BadKernelArgs, u64::from(l.function));
    if let Some(layout) = &f.params {
        if param_bytes(layout) != l.params.len() as u64 {
            return Err(bad_args);
        }
        // A relocation replaces a whole 8-byte parameter, never part of one.
        if l.relocs
            .iter()
            .any(|r| !layout.iter().any(|p| p.offset == r.offset && p.size == 8))
        {
            return Err(bad_args);
        }
    }
    let mut params = l.params.clone();
    for r in &l.relocs {
        let at = r.offset as usize;
        let field = params.get_mut(at..at + 8).ok_or(bad_args)?;
        let va = u64::from_le_bytes(field.try_into().map_err(|_| bad_args)?);
        // Checked through the page tables either way (a fault names the guest's address).
        let runs = t.runs(va, r.extent, r.write).map_err(fault)?;
        if t.identity(va, r.extent, r.write) {
            continue;
        }
        // Pieces that follow each other in the device's address space (host memory
        // registered piece by piece, say) are one range to a kernel.
        let contiguous = runs.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0);
        match runs.first() {
            Some(&(ptr, _)) if contiguous => field.copy_from_slice(&ptr.to_le_bytes()),
            // Pieced in device memory: a kernel indexing from one pointer cannot follow.
            _ => return Err((ErrorCode::BadKernelArgs, va)),
        }
    }
    plan.kernels += 1;
    plan.ops.push(Op::LaunchFunction {
        func: f.handle,
        grid: l.grid,
        block: l.block,
        shared_mem: l.shared_mem,
        params: params.into(),
    });
    Ok(())
}

/// Plans one GP entry. `read_args` fetches a launch's argument block from guest memory.
pub fn plan_entry(
    methods: &[Method],
    t: &dyn Translate,
    read_args: &mut ArgReader<'_>,
) -> Result<Plan, PlanError> {
    let mut plan = Plan::default();
    plan_entry_into(methods, t, read_args, &mut plan)?;
    Ok(plan)
}

/// [`plan_entry`] into `plan`, emptied first: a front end reuses one plan's buffers for
/// every entry (two allocations fewer per entry on its path to every launch). On an
/// error `plan` holds a part of the entry, which must not be issued.
pub fn plan_entry_into(
    methods: &[Method],
    t: &dyn Translate,
    read_args: &mut ArgReader<'_>,
    plan: &mut Plan,
) -> Result<(), PlanError> {
    let (mut ops, mut host) = (
        std::mem::take(&mut plan.ops),
        std::mem::take(&mut plan.host),
    );
    ops.clear();
    host.clear();
    *plan = Plan {
        ops,
        host,
        ..Plan::default()
    };
    for m in methods {
        match *m {
            Method::Nop => {}
            Method::LaunchFunction(ref l) => launch_function(t, l, plan)?,
            // On the GPU, REF moves as soon as the stream gets there, whatever entries
            // share the completion mark (a guest waiting on an entry's fence must not wait
            // for the whole batch).
            Method::SetRef { value } => match t.ref_ptr() {
                // Right after a kernel: the kernel writes it (one driver call fewer).
                Some(ptr) => {
                    let after_kernel = match plan.ops.last() {
                        Some(Op::Launch(args)) => Some(*args),
                        _ => None,
                    };
                    match after_kernel.and_then(|a| t.signal_count().map(|c| (a, c))) {
                        Some((args, count)) => {
                            if let Some(last) = plan.ops.last_mut() {
                                *last = Op::LaunchSignal(args, Signal { ptr, value, count });
                            }
                        }
                        _ => {
                            plan.ops.push(Op::WriteValue { ptr, value });
                            plan.ref_writes += 1;
                        }
                    }
                }
                None => plan.host.push(HostAction::SetRef(value)),
            },
            Method::Notify { token } => plan.host.push(HostAction::Notify(token)),
            Method::SemRelease {
                va,
                value,
                timestamp,
            } => {
                if timestamp {
                    let at = va.checked_add(8).ok_or(wrap(va, true))?;
                    plan.ops.push(Op::Timestamp {
                        ptr: operand(t, at, 8, true)?,
                    });
                }
                plan.ops.push(Op::WriteValue {
                    ptr: operand(t, va, 4, true)?,
                    value,
                });
            }
            Method::SemAcquire { va, value, mode } => {
                plan.ops.push(Op::WaitValue {
                    ptr: operand(t, va, 4, false)?,
                    value,
                    mode,
                });
                plan.waits = true;
            }
            Method::Launch {
                kernel,
                args_va,
                args_len,
                ..
            } => {
                let args = launch_args(kernel, args_va, args_len, read_args)?;
                debug_assert_eq!(args.kernel(), kernel);
                launch(t, args, plan)?;
            }
            Method::Copy { src, dst, len } => {
                copy_va(t, &mut plan.ops, dst, src, len)?;
                plan.copies += 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use vgpu_protocol::KernelId;

    /// Two tenants' worth of mappings: `va..va+len` → device `dev..`, optionally read-only.
    struct Fake {
        maps: Vec<(u64, u64, u64, bool)>,
        scratch: Cell<u64>,
        /// The channel's REF and signal counter as the device sees them.
        signal: Option<(u64, u64)>,
    }

    impl Translate for Fake {
        fn runs(&self, va: u64, len: u64, write: bool) -> Result<Vec<(u64, u64)>, MemFault> {
            let mut out: Vec<(u64, u64)> = Vec::new();
            let mut at = va;
            while at < va + len {
                let &(base, size, dev, ro) = self
                    .maps
                    .iter()
                    .find(|m| at >= m.0 && at < m.0 + m.1)
                    .ok_or(MemFault {
                        va: at,
                        write,
                        kind: FaultKind::NotMapped,
                    })?;
                if write && ro {
                    return Err(MemFault {
                        va: at,
                        write,
                        kind: FaultKind::ReadOnly,
                    });
                }
                let n = (base + size - at).min(va + len - at);
                let p = dev + (at - base);
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == p => last.1 += n,
                    _ => out.push((p, n)),
                }
                at += n;
            }
            Ok(out)
        }
        fn scratch(&self, len: u64) -> Option<u64> {
            self.scratch.set(len);
            Some(0xdead_0000)
        }
        fn ref_ptr(&self) -> Option<u64> {
            self.signal.map(|s| s.0)
        }
        fn signal_count(&self) -> Option<u64> {
            self.signal.map(|s| s.1)
        }
    }

    fn fake() -> Fake {
        Fake {
            maps: vec![
                (0x10_0000, 0x10_0000, 0xa000_0000, false),
                (0x40_0000, 0x1000, 0xb000_0000, true),
            ],
            scratch: Cell::new(0),
            signal: None,
        }
    }

    fn args_reader(args: KernelArgs) -> impl FnMut(u64, &mut [u8]) -> Result<(), MemFault> {
        move |_va, buf: &mut [u8]| {
            buf.copy_from_slice(&args.encode());
            Ok(())
        }
    }

    fn launch_of(args: KernelArgs) -> Method {
        Method::Launch {
            kernel: args.kernel(),
            grid: [1, 1, 1],
            args_va: 0x10_0000,
            args_len: KernelArgs::encoded_len(args.kernel()) as u32,
        }
    }

    #[test]
    fn saxpy_pointers_are_translated() {
        let args = KernelArgs::Saxpy {
            x: 0x10_0000,
            y: 0x10_8000,
            n: 1024,
            a: 2.0,
        };
        let p = plan_entry(&[launch_of(args)], &fake(), &mut args_reader(args)).unwrap();
        assert_eq!(
            p.ops,
            vec![Op::Launch(KernelArgs::Saxpy {
                x: 0xa000_0000,
                y: 0xa000_8000,
                n: 1024,
                a: 2.0
            })]
        );
        assert_eq!(p.kernels, 1);
    }

    /// A plan reused for the next entry (the front end's) holds that entry alone: the
    /// same as a fresh one, whatever the last entry left in it.
    #[test]
    fn a_reused_plan_holds_the_next_entry_alone() {
        let args = KernelArgs::Saxpy {
            x: 0x10_0000,
            y: 0x10_8000,
            n: 1024,
            a: 2.0,
        };
        let t = Fake {
            signal: Some((0xf000_0010, 0xe000_0000)),
            ..fake()
        };
        let copy = Method::Copy {
            src: 0x10_0000,
            dst: 0x10_8000,
            len: 64,
        };
        let entries = [
            vec![
                copy.clone(),
                Method::SetRef { value: 1 },
                Method::Notify { token: 9 },
            ],
            vec![launch_of(args), Method::SetRef { value: 2 }],
            vec![Method::Nop],
        ];
        let mut reused = Plan::default();
        for methods in &entries {
            let fresh = plan_entry(methods, &t, &mut args_reader(args)).unwrap();
            plan_entry_into(methods, &t, &mut args_reader(args), &mut reused).unwrap();
            assert_eq!(reused, fresh, "{methods:?}");
        }
        assert!(reused.ops.is_empty() && reused.host.is_empty());
    }

    #[test]
    fn a_fence_right_after_a_kernel_is_the_kernels_signal() {
        let args = KernelArgs::Saxpy {
            x: 0x10_0000,
            y: 0x10_8000,
            n: 1024,
            a: 2.0,
        };
        let t = Fake {
            signal: Some((0xf000_0010, 0xe000_0000)),
            ..fake()
        };
        let resolved = KernelArgs::Saxpy {
            x: 0xa000_0000,
            y: 0xa000_8000,
            n: 1024,
            a: 2.0,
        };
        let launched = Op::Launch(resolved);
        let fence = Method::SetRef { value: 7 };
        let p = plan_entry(
            &[launch_of(args), fence.clone()],
            &t,
            &mut args_reader(args),
        )
        .unwrap();
        let signal = Signal {
            ptr: 0xf000_0010,
            value: 7,
            count: 0xe000_0000,
        };
        assert_eq!(p.ops, vec![Op::LaunchSignal(resolved, signal)]);
        assert_eq!((p.kernels, p.ref_writes), (1, 0));
        // After a copy (or with nothing before it), REF is a stream write of its own.
        let copy = Method::Copy {
            src: 0x10_0000,
            dst: 0x10_8000,
            len: 64,
        };
        let p = plan_entry(&[copy, fence.clone()], &t, &mut args_reader(args)).unwrap();
        assert_eq!(
            p.ops.last(),
            Some(&Op::WriteValue {
                ptr: 0xf000_0010,
                value: 7
            })
        );
        assert_eq!(p.ref_writes, 1);
        // Without a counter the kernel cannot signal: launch, then the write.
        let t = Fake {
            signal: None,
            ..fake()
        };
        let p = plan_entry(&[launch_of(args), fence], &t, &mut args_reader(args)).unwrap();
        assert_eq!(p.ops, vec![launched]);
        assert_eq!(p.host, vec![HostAction::SetRef(7)]);
    }

    #[test]
    fn an_operand_reaching_past_the_mapping_faults_at_its_start() {
        // y's last element lies one element past the mapping.
        let args = KernelArgs::Saxpy {
            x: 0x10_0000,
            y: 0x1f_f000,
            n: 1025,
            a: 2.0,
        };
        let e = plan_entry(&[launch_of(args)], &fake(), &mut args_reader(args)).unwrap_err();
        assert_eq!(e.0, ErrorCode::MmuFault);
    }

    #[test]
    fn another_tenants_address_is_refused_and_nothing_is_planned() {
        // 0x8000_0000 is mapped only in some other context, not in `fake()`.
        let args = KernelArgs::Memset {
            dst: 0x8000_0000,
            len: 16,
            pattern: 7,
        };
        let e = plan_entry(&[launch_of(args)], &fake(), &mut args_reader(args)).unwrap_err();
        assert_eq!(e, (ErrorCode::MmuFault, 0x8000_0000));
        let copy = Method::Copy {
            src: 0x10_0000,
            dst: 0x8000_0000,
            len: 4,
        };
        let e = plan_entry(&[copy], &fake(), &mut args_reader(args)).unwrap_err();
        assert_eq!(e, (ErrorCode::MmuFault, 0x8000_0000));
    }

    #[test]
    fn writes_to_read_only_mappings_fault_but_reads_pass() {
        let rel = Method::SemRelease {
            va: 0x40_0000,
            value: 1,
            timestamp: false,
        };
        assert_eq!(
            plan_entry(&[rel], &fake(), &mut args_reader(KernelArgs::Empty)).unwrap_err(),
            (ErrorCode::MmuFault, 0x40_0000)
        );
        let acq = Method::SemAcquire {
            va: 0x40_0000,
            value: 3,
            mode: SemaphoreMode::AtLeast,
        };
        let p = plan_entry(&[acq], &fake(), &mut args_reader(KernelArgs::Empty)).unwrap();
        assert_eq!(
            p.ops,
            vec![Op::WaitValue {
                ptr: 0xb000_0000,
                value: 3,
                mode: SemaphoreMode::AtLeast
            }]
        );
        assert!(p.waits);
    }

    #[test]
    fn release_with_timestamp_writes_the_clock_before_the_value() {
        let rel = Method::SemRelease {
            va: 0x10_0100,
            value: 9,
            timestamp: true,
        };
        let p = plan_entry(
            &[
                rel,
                Method::SetRef { value: 5 },
                Method::Notify { token: 2 },
            ],
            &fake(),
            &mut args_reader(KernelArgs::Empty),
        )
        .unwrap();
        assert_eq!(
            p.ops,
            vec![
                Op::Timestamp { ptr: 0xa000_0108 },
                Op::WriteValue {
                    ptr: 0xa000_0100,
                    value: 9
                }
            ]
        );
        assert_eq!(p.host, vec![HostAction::SetRef(5), HostAction::Notify(2)]);
        assert!(!p.waits);
    }

    #[test]
    fn overlapping_copies_are_staged_backwards_when_moving_up() {
        let copy = Method::Copy {
            src: 0x10_0000,
            dst: 0x10_0004,
            len: 0x100,
        };
        let f = fake();
        let p = plan_entry(&[copy], &f, &mut args_reader(KernelArgs::Empty)).unwrap();
        assert_eq!(
            p.ops,
            vec![
                Op::Copy {
                    dst: 0xdead_0000,
                    src: 0xa000_0000,
                    len: 0x100
                },
                Op::Copy {
                    dst: 0xa000_0004,
                    src: 0xdead_0000,
                    len: 0x100
                }
            ]
        );
        assert_eq!(f.scratch.get(), 0x100);
        assert_eq!(p.copies, 1);
    }

    #[test]
    fn disjoint_copies_are_one_op_and_empty_ones_none() {
        let f = fake();
        let r = &mut args_reader(KernelArgs::Empty);
        let copy = |len| Method::Copy {
            src: 0x10_0000,
            dst: 0x18_0000,
            len,
        };
        let p = plan_entry(&[copy(0x1000)], &f, r).unwrap();
        assert_eq!(
            p.ops,
            vec![Op::Copy {
                dst: 0xa008_0000,
                src: 0xa000_0000,
                len: 0x1000
            }]
        );
        // A zero-length copy names no memory at all, even at unmapped addresses.
        let empty = Method::Copy {
            src: 0x9999_0000,
            dst: 0x8888_0000,
            len: 0,
        };
        assert!(plan_entry(&[empty], &f, r).unwrap().ops.is_empty());
    }

    #[test]
    fn sgemm_limits_match_the_sim() {
        let args = KernelArgs::Sgemm {
            a: 0x10_0000,
            b: 0x10_0000,
            c: 0x10_0000,
            m: 1,
            n: 8192,
            k: 4096,
            alpha: 1.0,
            beta: 0.0,
        };
        let e = plan_entry(&[launch_of(args)], &fake(), &mut args_reader(args)).unwrap_err();
        assert_eq!(e.0, ErrorCode::BadKernelArgs);
    }

    #[test]
    fn in_place_stencil_reads_a_staged_copy() {
        let args = KernelArgs::Stencil2d {
            src: 0x10_0000,
            dst: 0x10_0000,
            width: 16,
            height: 16,
            c_center: 0.5,
            c_neighbor: 0.125,
        };
        let p = plan_entry(&[launch_of(args)], &fake(), &mut args_reader(args)).unwrap();
        assert_eq!(p.ops.len(), 2);
        assert_eq!(
            p.ops[0],
            Op::Copy {
                dst: 0xdead_0000,
                src: 0xa000_0000,
                len: 1024
            }
        );
        assert!(matches!(
            p.ops[1],
            Op::Launch(KernelArgs::Stencil2d {
                src: 0xdead_0000,
                dst: 0xa000_0000,
                ..
            })
        ));
    }

    #[test]
    fn wrong_argument_length_is_refused() {
        let m = Method::Launch {
            kernel: KernelId::Saxpy,
            grid: [1, 1, 1],
            args_va: 0x10_0000,
            args_len: 8,
        };
        let e = plan_entry(&[m], &fake(), &mut args_reader(KernelArgs::Empty)).unwrap_err();
        assert_eq!(e, (ErrorCode::BadKernelArgs, 0x10_0000));
    }

    /// A buffer whose two halves lie apart in device memory (chunks allocated apart, or
    /// one swapped to host memory), and a contiguous one.
    fn split() -> Fake {
        Fake {
            maps: vec![
                (0x10_0000, 0x1000, 0xa000_0000, false),
                (0x10_1000, 0x1000, 0xc000_0000, false),
                (0x20_0000, 0x2000, 0xd000_0000, false),
                (0x40_0000, 0x1000, 0xb000_0000, true),
            ],
            scratch: Cell::new(0),
            signal: None,
        }
    }

    #[test]
    fn a_pieced_operand_is_bounced_through_scratch() {
        // y (written) is pieced: gathered before the kernel and scattered back after it.
        let args = KernelArgs::Saxpy {
            x: 0x20_0000,
            y: 0x10_0000,
            n: 2048,
            a: 2.0,
        };
        let t = split();
        let p = plan_entry(&[launch_of(args)], &t, &mut args_reader(args)).unwrap();
        let s = 0xdead_0000;
        assert_eq!(
            p.ops,
            vec![
                Op::Copy {
                    dst: s,
                    src: 0xa000_0000,
                    len: 0x1000
                },
                Op::Copy {
                    dst: s + 0x1000,
                    src: 0xc000_0000,
                    len: 0x1000
                },
                Op::Launch(KernelArgs::Saxpy {
                    x: 0xd000_0000,
                    y: s,
                    n: 2048,
                    a: 2.0,
                }),
                Op::Copy {
                    dst: 0xa000_0000,
                    src: s,
                    len: 0x1000
                },
                Op::Copy {
                    dst: 0xc000_0000,
                    src: s + 0x1000,
                    len: 0x1000
                },
            ]
        );
        assert_eq!(t.scratch.get(), 0x2000);
    }

    #[test]
    fn a_bounced_operand_overlapping_another_faults() {
        let args = KernelArgs::Saxpy {
            x: 0x10_0800,
            y: 0x10_0000,
            n: 1024,
            a: 2.0,
        };
        let e = plan_entry(&[launch_of(args)], &split(), &mut args_reader(args)).unwrap_err();
        assert_eq!(e.0, ErrorCode::MmuFault);
    }

    #[test]
    fn copies_between_pieced_ranges_pair_their_pieces() {
        let m = Method::Copy {
            src: 0x10_0000,
            dst: 0x20_0800,
            len: 0x1800,
        };
        let p = plan_entry(&[m], &split(), &mut args_reader(KernelArgs::Empty)).unwrap();
        assert_eq!(
            p.ops,
            vec![
                Op::Copy {
                    dst: 0xd000_0800,
                    src: 0xa000_0000,
                    len: 0x1000
                },
                Op::Copy {
                    dst: 0xd000_1800,
                    src: 0xc000_0000,
                    len: 0x800
                },
            ]
        );
    }

    #[test]
    fn the_same_pieced_range_twice_is_bounced_once() {
        // saxpy in place (x == y) over a pieced range: one gather, one scatter.
        let args = KernelArgs::Saxpy {
            x: 0x10_0000,
            y: 0x10_0000,
            n: 2048,
            a: 0.5,
        };
        let t = split();
        let p = plan_entry(&[launch_of(args)], &t, &mut args_reader(args)).unwrap();
        let s = 0xdead_0000;
        let launch = Op::Launch(KernelArgs::Saxpy {
            x: s,
            y: s,
            n: 2048,
            a: 0.5,
        });
        assert_eq!(p.ops.len(), 5, "{:?}", p.ops);
        assert_eq!(p.ops[2], launch);
        assert_eq!(
            p.ops[4],
            Op::Copy {
                dst: 0xc000_0000,
                src: s + 0x1000,
                len: 0x1000
            }
        );
        assert_eq!(t.scratch.get(), 0x2000);
    }
}
