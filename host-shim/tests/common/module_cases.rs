//! Guest modules (issue 31) through the HAL, as a guest drives them: the module requests
//! as HAL calls, launches as `LAUNCH_FUNCTION`s in push buffers. The PTX below is real:
//! a real GPU's driver JIT-compiles it (no nvcc needed), and the fake device recognises
//! its entry names (a test device, see `cuda/fake_modules.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_host_shim::*;
use vgpu_protocol::module::{FunctionLaunch, Reloc};
use vgpu_protocol::{ErrorCode, Method};

use super::*;

/// The test module (`tests/data/test_module.ptx`): vector adds over u32 and f32, a global
/// and a kernel that writes it, a copy, and a kernel that writes wherever its pointer
/// says.
pub const TEST_PTX: &str = include_str!("../data/test_module.ptx");

/// Elements of the vector adds.
pub const N: u32 = 1000;
const A_OFF: u64 = DATA_OFF;
const B_OFF: u64 = DATA_OFF + 0x1_0000;
const C_OFF: u64 = DATA_OFF + 0x2_0000;

/// A parameter buffer from 8-byte pointers then 4-byte scalars, with a relocation for
/// every pointer (`writes[i]`: the kernel writes through pointer `i`).
pub fn launch(function: u32, ptrs: &[(u64, u64, bool)], scalars: &[u32], threads: u32) -> Method {
    let mut params = Vec::new();
    let mut relocs = Vec::new();
    for &(va, extent, write) in ptrs {
        relocs.push(Reloc {
            offset: params.len() as u32,
            write,
            extent,
        });
        params.extend(va.to_le_bytes());
    }
    for s in scalars {
        params.extend(s.to_le_bytes());
    }
    Method::LaunchFunction(Box::new(FunctionLaunch {
        function,
        grid: [threads.div_ceil(256).max(1), 1, 1],
        block: [256, 1, 1],
        shared_mem: 0,
        params,
        relocs,
    }))
}

fn words(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Loads the test module into `p`'s context as module 1.
pub fn load<G: Gpu + ?Sized + 'static>(p: &Proc<G>) {
    p.gpu
        .module_load(p.ctx, 1, TEST_PTX.as_bytes())
        .expect("the test module loads");
}

/// Vector adds over u32 and f32 in guest memory, through relocated pointers.
pub fn module_vector_adds<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    load(&p);
    let layout = gpu
        .function_get(p.ctx, 1, "vgpu_test_vadd_u32", 10)
        .expect("vadd_u32 found");
    if let Some(l) = &layout {
        let got: Vec<(u32, u32)> = l.iter().map(|q| (q.offset, q.size)).collect();
        assert_eq!(got, [(0, 8), (8, 8), (16, 8), (24, 4)]);
    }
    gpu.function_get(p.ctx, 1, "vgpu_test_vadd_f32", 11)
        .expect("vadd_f32 found");
    let a: Vec<u32> = (0..N).map(|i| i * 3 + 1).collect();
    let b: Vec<u32> = (0..N).map(|i| u32::MAX - i).collect();
    p.poke(A_OFF, &words(&a));
    p.poke(B_OFF, &words(&b));
    let mut ch = p.channel(0);
    let bytes = u64::from(N) * 4;
    let v = |off| (SYS_VA + off, bytes, off == C_OFF);
    ch.submit(&[launch(10, &[v(A_OFF), v(B_OFF), v(C_OFF)], &[N], N)]);
    ch.wait_idle(Duration::from_secs(30))
        .expect("vadd_u32 runs");
    let c = u32s(&p.peek(C_OFF, bytes as usize));
    let want: Vec<u32> = a.iter().zip(&b).map(|(x, y)| x.wrapping_add(*y)).collect();
    assert_eq!(c, want, "u32 vector add");

    let fa: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let fb: Vec<f32> = (0..N).map(|i| 1000.0 - i as f32).collect();
    p.poke(
        A_OFF,
        &words(&fa.iter().map(|f| f.to_bits()).collect::<Vec<_>>()),
    );
    p.poke(
        B_OFF,
        &words(&fb.iter().map(|f| f.to_bits()).collect::<Vec<_>>()),
    );
    ch.submit(&[launch(11, &[v(A_OFF), v(B_OFF), v(C_OFF)], &[N], N)]);
    ch.wait_idle(Duration::from_secs(30))
        .expect("vadd_f32 runs");
    let c: Vec<f32> = u32s(&p.peek(C_OFF, bytes as usize))
        .into_iter()
        .map(f32::from_bits)
        .collect();
    let want: Vec<f32> = fa.iter().zip(&fb).map(|(x, y)| x + y).collect();
    assert_eq!(c, want, "f32 vector add");
    gpu.module_unload(p.ctx, 1).expect("unloads");
    // Its functions went with it.
    ch.submit(&[launch(10, &[v(A_OFF), v(B_OFF), v(C_OFF)], &[N], N)]);
    assert_eq!(
        ch.wait_idle(Duration::from_secs(30)),
        Err(ErrorCode::BadKernel)
    );
    gpu.destroy_context(p.ctx).unwrap();
}

/// A module global: its address and size, written by one kernel and read back by another
/// through its raw device address (no relocation: it is a device address already).
pub fn module_global_round_trip<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    load(&p);
    let g = gpu
        .global_get(p.ctx, 1, "vgpu_test_counter")
        .expect("the global");
    assert_eq!(g.size, 4);
    assert_ne!(g.addr, 0);
    gpu.function_get(p.ctx, 1, "vgpu_test_set_global", 1)
        .unwrap();
    gpu.function_get(p.ctx, 1, "vgpu_test_copy_u32", 2).unwrap();
    let mut ch = p.channel(0);
    let mut copy = launch(2, &[(SYS_VA + C_OFF, 4, true)], &[], 1);
    if let Method::LaunchFunction(l) = &mut copy {
        l.params.extend(g.addr.to_le_bytes());
        l.params.extend(1u32.to_le_bytes());
    }
    ch.submit(&[launch(1, &[], &[0x5eed_1234], 1), copy]);
    ch.wait_idle(Duration::from_secs(30))
        .expect("set and copy run");
    assert_eq!(u32s(&p.peek(C_OFF, 4)), [0x5eed_1234]);
    assert_eq!(
        gpu.global_get(p.ctx, 1, "no_such_global")
            .unwrap_err()
            .code(),
        ErrorCode::NotFound
    );
    gpu.destroy_context(p.ctx).unwrap();
}

/// Hostile uses: each gets its code, nothing runs, and the GPU keeps working.
pub fn module_hostile_inputs<G: Gpu + ?Sized + 'static>(gpu: &Arc<G>) {
    let p = Proc::new(gpu, SYS_BASE);
    let code = |r: Result<(), HalError>| r.unwrap_err().code();
    assert_eq!(
        code(gpu.module_load(p.ctx, 1, b"this is not a module")),
        ErrorCode::BadModule
    );
    let cut = &TEST_PTX.as_bytes()[..TEST_PTX.len() / 2];
    assert_eq!(code(gpu.module_load(p.ctx, 1, cut)), ErrorCode::BadModule);
    load(&p);
    assert_eq!(
        gpu.function_get(p.ctx, 1, "no_such_function", 1)
            .unwrap_err()
            .code(),
        ErrorCode::NotFound
    );
    gpu.function_get(p.ctx, 1, "vgpu_test_vadd_u32", 1).unwrap();
    // Another context does not see this one's module or function.
    let q = Proc::new(gpu, SYS_BASE + SYS_LEN as u64);
    assert_eq!(
        gpu.function_get(q.ctx, 1, "vgpu_test_vadd_u32", 1)
            .unwrap_err()
            .code(),
        ErrorCode::NotFound
    );
    let mut qch = q.channel(0);
    let bytes = u64::from(N) * 4;
    let v = |off| (SYS_VA + off, bytes, off == C_OFF);
    qch.submit(&[launch(1, &[v(A_OFF), v(B_OFF), v(C_OFF)], &[N], N)]);
    assert_eq!(
        qch.wait_idle(Duration::from_secs(30)),
        Err(ErrorCode::BadKernel)
    );
    // A parameter buffer of the wrong size for the function (24 bytes, the layout says
    // 28). One that lies about its own size fails at decode (`BadMethod`, protocol tests).
    let mut ch = p.channel(0);
    let short = launch(1, &[v(A_OFF), v(B_OFF), v(C_OFF)], &[], N);
    if gpu
        .function_get(p.ctx, 1, "vgpu_test_vadd_f32", 2)
        .unwrap()
        .is_some()
    {
        ch.submit(&[short]);
        assert_eq!(
            ch.wait_idle(Duration::from_secs(30)),
            Err(ErrorCode::BadKernelArgs)
        );
        ch = p.channel(1);
    }
    // A pointer into nothing the context mapped: the MMU refuses it before any launch.
    let c_before = p.peek(C_OFF, 16);
    ch.submit(&[launch(
        1,
        &[v(A_OFF), (0x7000_0000_0000, 64, false), v(C_OFF)],
        &[N],
        N,
    )]);
    assert_eq!(
        ch.wait_idle(Duration::from_secs(30)),
        Err(ErrorCode::MmuFault)
    );
    assert_eq!(p.peek(C_OFF, 16), c_before, "nothing ran");
    // The GPU still runs good work.
    let mut ok = p.channel(2);
    ok.submit(&[launch(1, &[v(A_OFF), v(B_OFF), v(C_OFF)], &[N], N)]);
    ok.wait_idle(Duration::from_secs(30))
        .expect("good work after hostile work");
    assert!(gpu.lost().is_none());
    gpu.destroy_context(q.ctx).unwrap();
    gpu.destroy_context(p.ctx).unwrap();
}

/// A kernel that writes a wild pointer (passed raw, no relocation) loses the GPU's
/// context: the channel stops with an error and `lost` says the GPU is gone (in process:
/// `Gpu::lost`; a worker exits then, and its VM gets `DeviceLost`).
pub fn module_wild_write_loses_the_context<G: Gpu + ?Sized + 'static>(
    gpu: &Arc<G>,
    lost: &dyn Fn() -> bool,
) {
    let p = Proc::new(gpu, SYS_BASE);
    load(&p);
    gpu.function_get(p.ctx, 1, "vgpu_test_wild_write", 1)
        .unwrap();
    let mut ch = p.channel(0);
    let mut wild = launch(1, &[], &[], 1);
    if let Method::LaunchFunction(l) = &mut wild {
        l.params.extend(0x10u64.to_le_bytes());
    }
    ch.submit(&[wild]);
    assert!(
        ch.wait_idle(Duration::from_secs(30)).is_err(),
        "the wild write faults"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lost() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(lost(), "the context is lost");
}
