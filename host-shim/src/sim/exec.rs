//! Executing GP entries' methods: the part shared by the PFIFO's inline compute engine
//! and the copy engine thread (fetching them is [`crate::fifo::fetch`]'s).

use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_protocol::method::Method;
use vgpu_protocol::{ErrorCode, KernelArgs};

use super::channel::SimChannel;
use crate::clock::now_ns;
use crate::fifo::control_pages::add;
use crate::fifo::fetch::launch_args;
use crate::gpu_view::{CopyError, GpuView};
use crate::kernels::{run_kernel, KernelError, KernelMemory};
use crate::shared_mem::SharedMem;

/// Which engine a piece of work needs next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Compute,
    Copy,
    /// Only cheap host-side methods (semaphores, refs, notifies): run by the PFIFO itself.
    None,
}

/// The decoded methods of one GP entry and how far they have run.
#[derive(Debug)]
pub struct WorkItem {
    pub methods: Vec<Method>,
    pub pc: usize,
}

impl WorkItem {
    /// Entries are routed whole: to compute if they launch anything, else to the copy
    /// engine if they copy, else to no engine.
    pub fn engine(&self) -> EngineKind {
        let rest = self.methods.get(self.pc..).unwrap_or(&[]);
        if rest.iter().any(|m| matches!(m, Method::Launch { .. })) {
            EngineKind::Compute
        } else if rest.iter().any(|m| matches!(m, Method::Copy { .. })) {
            EngineKind::Copy
        } else {
            EngineKind::None
        }
    }
}

/// How a run of a work item ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Every method ran.
    Done,
    /// A semaphore acquire is not yet satisfied; retry later from the same method.
    Stalled,
    /// A spin kernel started: the engine is busy for `ns`, then the item continues.
    Spin { ns: u64 },
    /// The channel must stop with this error.
    Fault(ErrorCode, u64),
    /// The channel was killed or destroyed while the item ran.
    Aborted,
    /// (`host_prefix` only) the next method needs an engine.
    Ready,
}

/// Runs the host-side methods at the head of `item` (semaphores, refs, notifies) up to
/// the first method that needs an engine. The PFIFO does this before handing an entry to
/// the copy engine, so a semaphore wait never bounces between the two threads.
pub fn host_prefix(ch: &SimChannel, vram: &SharedMem, item: &mut WorkItem) -> Step {
    let head = item.methods[item.pc.min(item.methods.len())..]
        .iter()
        .position(|m| matches!(m, Method::Launch { .. } | Method::Copy { .. }))
        .map(|i| item.pc + i)
        .unwrap_or(item.methods.len());
    let mut prefix = WorkItem {
        methods: item.methods[..head].to_vec(),
        pc: item.pc,
    };
    let step = run(ch, vram, &mut prefix, &ch.core.stopped);
    item.pc = prefix.pc;
    match step {
        Step::Done if head < item.methods.len() => Step::Ready,
        other => other,
    }
}

/// Runs `item` from its current method until it finishes, stalls, starts a spin or fails.
pub fn run(ch: &SimChannel, vram: &SharedMem, item: &mut WorkItem, abort: &AtomicBool) -> Step {
    let mut view = GpuView::new(&ch.core.space, Some(vram));
    while let Some(m) = item.methods.get(item.pc).cloned() {
        if ch.core.is_stopped() || abort.load(Ordering::Relaxed) {
            return Step::Aborted;
        }
        match m {
            Method::Nop => {}
            // The sim runs builtin kernels only: a guest's module function cannot exist
            // here (MODULE_LOAD is refused), and its launch says which GPU runs them.
            Method::LaunchFunction(l) => {
                return Step::Fault(ErrorCode::ModulesNeedCudaGpu, l.function.into())
            }
            Method::SetRef { value } => ch.core.set_ref(value),
            Method::Notify { token } => ch.core.notify(token),
            Method::SemRelease {
                va,
                value,
                timestamp,
            } => {
                // The timestamp goes first, so whoever sees the value sees its timestamp.
                if timestamp {
                    let at = va.wrapping_add(8);
                    if let Err(f) = view.write(at, &now_ns().to_le_bytes()) {
                        return Step::Fault(ErrorCode::MmuFault, f.va);
                    }
                }
                if let Err(f) = view.write(va, &value.to_le_bytes()) {
                    return Step::Fault(ErrorCode::MmuFault, f.va);
                }
            }
            Method::SemAcquire { va, value, mode } => {
                let mut b = [0u8; 4];
                if let Err(f) = view.read(va, &mut b) {
                    return Step::Fault(ErrorCode::MmuFault, f.va);
                }
                if !mode.satisfied(u32::from_le_bytes(b), value) {
                    return Step::Stalled;
                }
            }
            Method::Launch {
                kernel,
                args_va,
                args_len,
                ..
            } => {
                let args =
                    match launch_args(kernel, args_va, args_len, &mut |va, b| view.read(va, b)) {
                        Ok(a) => a,
                        Err((code, info)) => return Step::Fault(code, info),
                    };
                add(&ch.core.kernels, 1);
                if let KernelArgs::Spin { ns } = args {
                    item.pc += 1;
                    return Step::Spin { ns };
                }
                match run_kernel(&args, &mut view, abort, &now_ns) {
                    Ok(()) => {}
                    Err(KernelError::Fault(f)) => return Step::Fault(ErrorCode::MmuFault, f.va),
                    Err(KernelError::TooLarge(_)) => {
                        return Step::Fault(ErrorCode::BadKernelArgs, args_va)
                    }
                    Err(KernelError::Aborted) => return Step::Aborted,
                }
            }
            Method::Copy { src, dst, len } => match view.copy(dst, src, len, abort) {
                Ok(()) => add(&ch.core.copies, 1),
                Err(CopyError::Fault(f)) => return Step::Fault(ErrorCode::MmuFault, f.va),
                Err(CopyError::Aborted) => return Step::Aborted,
            },
        }
        item.pc += 1;
    }
    Step::Done
}
