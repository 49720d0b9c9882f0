//! Guest modules end to end (issue 31): the `vgpu-backend` binary as a process with a GPU
//! worker per VM (`--gpu cuda --gpu-workers`, the workers on the CPU test device
//! `cuda-fake`: `--test-worker-gpu`; on the real GPU with `VGPU_WORKER_GPU=cuda` and
//! `VGPU_BACKEND_BIN`, as `ci/device/run.sh run modules` does), loopback VMs over the real
//! vhost-user socket, guest
//! processes on the runtime's loopback transport. A PTX vector add runs on guest buffers
//! and is verified; a module global is read back; a kernel writing a wild pointer loses
//! its VM's worker while another VM keeps running verified work; hostile requests and push
//! buffers get their codes and the backend stays up. On the `sim`, MODULE_LOAD gets the
//! error that says which GPU runs modules.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_guest::{Arg, Context, Device, Error, ErrorCode};
use vgpu_loopback::LoopbackVm;
use vgpu_protocol::request::{decode_reply, GuestRange, Op, ReplyBody, Request};
use vgpu_test_support::BackendLauncher;
use vgpu_vmm::reconnect::FaultPolicy;

const PTX: &str = include_str!("../../host-shim/tests/data/test_module.ptx");
const N: u32 = 4096;
const PATIENCE: Duration = Duration::from_secs(60);

fn launcher(tag: &str, gpu: &str, args: &[&str]) -> BackendLauncher {
    let body = format!(
        "[gpu]\nmodel = \"{gpu}\"\nvram_mib = 64\n[[vm]]\nname = \"a\"\n[[vm]]\nname = \"b\"\n"
    );
    BackendLauncher::new(tag, &body)
        .bin(env!("CARGO_BIN_EXE_vgpu-backend"))
        .args(args)
}

/// The backend with a worker per VM: on the fake device, or on the real GPU when
/// `VGPU_WORKER_GPU` says `cuda`.
fn workers(tag: &str) -> BackendLauncher {
    launcher(tag, "cuda", &vgpu_test_support::gpu_worker_args())
}

/// One raw request: its reply's status and body.
fn raw(vm: &LoopbackVm, pid: u32, ctx: u32, op: Op) -> Result<ReplyBody, ErrorCode> {
    let req = Request { pid, ctx, op };
    let reply = vm.request(&req.encode()).expect("a reply");
    decode_reply(req.opcode(), &reply).expect("a well-formed reply")
}

/// `c = a + b` over `n` u32 in VRAM through the module's kernel, checked on the CPU.
/// Submits what `ch` has pending and expects the channel to fault with `code`.
fn expect_fault(ch: &mut vgpu_guest::Channel, code: ErrorCode) {
    let f = ch.submit().unwrap();
    let r = ch.wait_timeout(f, PATIENCE);
    assert!(
        matches!(r, Err(Error::ChannelFault { code: c, .. }) if c == code),
        "{r:?}, expected a {code:?} fault"
    );
}

fn vadd_round(ctx: &Context, f: &vgpu_guest::Function, seed: u32) -> Result<bool, Error> {
    let bytes = u64::from(N) * 4;
    let (a, b, c) = (
        ctx.alloc_vram(bytes)?,
        ctx.alloc_vram(bytes)?,
        ctx.alloc_vram(bytes)?,
    );
    let va: Vec<u32> = (0..N).map(|i| i.wrapping_mul(seed) ^ 0x55).collect();
    let vb: Vec<u32> = (0..N)
        .map(|i| (u32::MAX - i * 7).wrapping_add(seed))
        .collect();
    a.write_u32(0, &va)?;
    b.write_u32(0, &vb)?;
    let mut ch = ctx.create_channel()?;
    ch.launch_function(
        f,
        [N.div_ceil(256), 1, 1],
        [256, 1, 1],
        &[
            Arg::Buffer(&a, false),
            Arg::Buffer(&b, false),
            Arg::Buffer(&c, true),
            Arg::U32(N),
        ],
    )?;
    let fence = ch.submit()?;
    ch.wait_timeout(fence, PATIENCE)?;
    let got = c.read_u32_vec(0, N as usize)?;
    Ok(got
        .iter()
        .zip(va.iter().zip(&vb))
        .all(|(c, (a, b))| *c == a.wrapping_add(*b)))
}

#[test]
fn module_kernels_run_on_guest_buffers_through_a_worker() {
    let l = workers("modules-e2e");
    let mut backend = l.start();
    let vm = backend.connect("a", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 100).expect("device");
    let ctx = dev.create_context().expect("context");
    let module = ctx
        .load_module(PTX.as_bytes())
        .expect("the PTX module loads");
    let vadd = module.function("vgpu_test_vadd_u32").expect("vadd");
    // The fake always knows the layout; a real driver does from CUDA 12.4.
    if let Some(params) = &vadd.params {
        let layout: Vec<(u32, u32)> = params.iter().map(|p| (p.offset, p.size)).collect();
        assert_eq!(layout, [(0, 8), (8, 8), (16, 8), (24, 4)]);
    }
    for seed in 1..4 {
        assert!(
            vadd_round(&ctx, &vadd, seed).expect("vadd runs"),
            "seed {seed}"
        );
    }

    // f32 on host buffers (guest RAM), parameters packed by the runtime.
    let fadd = module.function("vgpu_test_vadd_f32").expect("vadd_f32");
    let bytes = u64::from(N) * 4;
    let (a, b, c) = (
        ctx.alloc_host(bytes).unwrap(),
        ctx.alloc_host(bytes).unwrap(),
        ctx.alloc_host(bytes).unwrap(),
    );
    let fa: Vec<f32> = (0..N).map(|i| i as f32 * 0.25).collect();
    let fb: Vec<f32> = (0..N).map(|i| 3.0 - i as f32).collect();
    a.write_f32(0, &fa).unwrap();
    b.write_f32(0, &fb).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    let args = [
        Arg::Buffer(&a, false),
        Arg::Buffer(&b, false),
        Arg::Buffer(&c, true),
        Arg::U32(N),
    ];
    ch.launch_function(&fadd, [N / 256, 1, 1], [256, 1, 1], &args)
        .unwrap();
    {
        let f = ch.submit().unwrap();
        ch.wait_timeout(f, PATIENCE)
    }
    .unwrap();
    let want: Vec<f32> = fa.iter().zip(&fb).map(|(x, y)| x + y).collect();
    assert_eq!(c.read_f32_vec(0, N as usize).unwrap(), want);

    // A global: its address and size, set by one kernel, read through its raw address.
    let g = module.global("vgpu_test_counter").expect("the global");
    assert_eq!(g.size, 4);
    let set = module.function("vgpu_test_set_global").unwrap();
    let copy = module.function("vgpu_test_copy_u32").unwrap();
    let out = ctx.alloc_vram(4096).unwrap();
    ch.launch_function(&set, [1, 1, 1], [1, 1, 1], &[Arg::U32(0xc0ffee)])
        .unwrap();
    ch.launch_function(
        &copy,
        [1, 1, 1],
        [1, 1, 1],
        &[Arg::Buffer(&out, true), Arg::U64(g.addr), Arg::U32(1)],
    )
    .unwrap();
    {
        let f = ch.submit().unwrap();
        ch.wait_timeout(f, PATIENCE)
    }
    .unwrap();
    assert_eq!(out.read_u32_vec(0, 1).unwrap(), [0xc0ffee]);

    // Unloaded: its functions are gone (a launch of one faults the channel).
    module.unload().expect("unload");
    let mut ch2 = ctx.create_channel().unwrap();
    ch2.launch_function(&set, [1, 1, 1], [1, 1, 1], &[Arg::U32(1)])
        .unwrap();
    expect_fault(&mut ch2, ErrorCode::BadKernel);
    backend.alive().expect("the backend is up");
    vm.disconnect();
}

#[test]
fn hostile_module_requests_get_their_codes_and_the_backend_stays_up() {
    let l = workers("modules-hostile");
    let mut backend = l.start();
    let vm = backend.connect("a", FaultPolicy::default());
    let ReplyBody::Context { ctx, .. } = raw(&vm, 7, 0, Op::CreateContext).unwrap() else {
        panic!("no context");
    };
    let load = |ranges| raw(&vm, 7, ctx, Op::ModuleLoad { ranges });
    // Oversized: more than 32 MiB in all (refused before a byte is read).
    let r = |gpa, len| GuestRange { gpa, len };
    assert_eq!(
        load(vec![r(0, 16 << 20), r(16 << 20, (16 << 20) + 1)]),
        Err(ErrorCode::LimitExceeded)
    );
    // Outside guest RAM, and a range list that lies about its count.
    assert_eq!(
        load(vec![r(1 << 40, 4096)]),
        Err(ErrorCode::InvalidArgument)
    );
    let mut lying = Request {
        pid: 7,
        ctx,
        op: Op::ModuleLoad {
            ranges: vec![r(0, 4096)],
        },
    }
    .encode();
    lying[16] = 2;
    let reply = vm.request(&lying).unwrap();
    assert_eq!(
        decode_reply(vgpu_protocol::request::op::MODULE_LOAD, &reply).unwrap(),
        Err(ErrorCode::InvalidArgument)
    );
    // Garbage and truncated images, through guest RAM: the driver (here the fake)
    // refuses them.
    let dev = Device::loopback(vm.clone(), 8).unwrap();
    let c8 = dev.create_context().unwrap();
    let code = |e: Error| match e {
        Error::Device(c) => c,
        e => panic!("{e}"),
    };
    assert_eq!(
        code(c8.load_module(&[0xa5; 5000]).unwrap_err()),
        ErrorCode::BadModule
    );
    assert_eq!(
        code(
            c8.load_module(&PTX.as_bytes()[..PTX.len() / 2])
                .unwrap_err()
        ),
        ErrorCode::BadModule
    );
    let m = c8.load_module(PTX.as_bytes()).unwrap();
    assert_eq!(
        code(m.function("no_such_kernel").unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(code(m.global("no_such").unwrap_err()), ErrorCode::NotFound);
    // A bad name never reaches the GPU.
    assert_eq!(
        raw(
            &vm,
            8,
            c8.handle().0 as u32,
            Op::FunctionGet {
                module: m.id(),
                name: b"has space".to_vec()
            }
        ),
        Err(ErrorCode::InvalidArgument)
    );
    // Another process's module (whatever context it names), and another context's.
    let fget = |pid, ctx| {
        raw(
            &vm,
            pid,
            ctx,
            Op::FunctionGet {
                module: m.id(),
                name: b"vgpu_test_vadd_u32".to_vec(),
            },
        )
    };
    assert_eq!(fget(7, ctx), Err(ErrorCode::PermissionDenied));
    let c8b = dev.create_context().unwrap();
    assert_eq!(fget(8, c8b.handle().0 as u32), Err(ErrorCode::NotFound));
    assert_eq!(
        fget(9, c8.handle().0 as u32),
        Err(ErrorCode::PermissionDenied)
    );
    // An unknown function id in a push buffer.
    let vadd = m.function("vgpu_test_vadd_u32").unwrap();
    let bogus = vgpu_guest::Function {
        id: vadd.id + 1000,
        params: None,
    };
    let mut ch = c8.create_channel().unwrap();
    ch.launch_function(&bogus, [1, 1, 1], [1, 1, 1], &[Arg::U32(1)])
        .unwrap();
    expect_fault(&mut ch, ErrorCode::BadKernel);
    // Another context's function, on this one's channel.
    let other = c8b.load_module(PTX.as_bytes()).unwrap();
    let theirs = other.function("vgpu_test_set_global").unwrap();
    let mut ch = c8.create_channel().unwrap();
    ch.launch_function(&theirs, [1, 1, 1], [1, 1, 1], &[Arg::U32(1)])
        .unwrap();
    expect_fault(&mut ch, ErrorCode::BadKernel);
    // A parameter buffer that lies about its size: 4 KiB claimed, 8 bytes there.
    let mut ch = c8.create_channel().unwrap();
    ch.push_raw_words(&[0x0a07, vadd.id, 1, 1, 1, 1, 1, 1, 0, 4096, 0, 0, 0])
        .unwrap();
    expect_fault(&mut ch, ErrorCode::BadMethod);
    // A buffer of the wrong size for the function's layout (24 bytes, not 28).
    let buf = c8.alloc_vram(4096).unwrap();
    let mut short = vadd.clone();
    short.params = None;
    let mut ch = c8.create_channel().unwrap();
    ch.launch_function(
        &short,
        [1, 1, 1],
        [1, 1, 1],
        &[
            Arg::Buffer(&buf, false),
            Arg::Buffer(&buf, false),
            Arg::Buffer(&buf, true),
        ],
    )
    .unwrap();
    expect_fault(&mut ch, ErrorCode::BadKernelArgs);
    // The VM still runs verified module work, and the backend is up.
    assert!(vadd_round(&c8, &vadd, 9).unwrap());
    backend.alive().expect("the backend is up");
    assert!(!backend.log().contains("panicked"), "a thread panicked");
    vm.disconnect();
}

/// Verified vector adds on `ctx` until `stop`: (rounds verified, what failed).
fn verify_until(
    ctx: Context,
    module: vgpu_guest::Module,
    stop: Arc<AtomicBool>,
    first_seed: u32,
) -> std::thread::JoinHandle<(u32, Vec<String>)> {
    std::thread::spawn(move || {
        let f = module.function("vgpu_test_vadd_u32").unwrap();
        let (mut ok, mut bad) = (0u32, Vec::new());
        let mut seed = first_seed;
        while !stop.load(Ordering::Relaxed) {
            match vadd_round(&ctx, &f, seed) {
                Ok(true) => ok += 1,
                other => bad.push(format!("{other:?}")),
            }
            seed += 1;
        }
        (ok, bad)
    })
}

/// Launches the module's wild write on `ctx` and expects its context lost for good: the
/// channel says so (whoever notices first: the worker's stream, or the backend when the
/// worker exits), and then its requests fail with DeviceLost.
fn wild_write_loses(ctx: &Context, module: &vgpu_guest::Module) {
    let wild = module.function("vgpu_test_wild_write").unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.launch_function(&wild, [1, 1, 1], [1, 1, 1], &[Arg::U64(0x10)])
        .unwrap();
    let r = {
        let f = ch.submit().unwrap();
        ch.wait_timeout(f, PATIENCE)
    };
    assert!(
        matches!(
            r,
            Err(Error::ChannelFault {
                code: ErrorCode::DeviceLost,
                ..
            }) | Err(Error::DeviceLost)
        ),
        "the wild write faults: {r:?}"
    );
    let t = Instant::now();
    loop {
        match ctx.alloc_vram(4096) {
            Err(Error::Device(ErrorCode::DeviceLost)) | Err(Error::DeviceLost) => break,
            other => {
                assert!(
                    t.elapsed() < PATIENCE,
                    "the faulted worker still answers: {other:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Stops a [`verify_until`] loop and expects it clean, with at least `min` rounds.
fn expect_clean(who: &str, stop: &AtomicBool, run: std::thread::JoinHandle<(u32, Vec<String>)>) {
    stop.store(true, Ordering::Relaxed);
    let (ok, bad) = run.join().unwrap();
    assert!(
        bad.is_empty(),
        "{who} failed {} rounds: {:?}",
        bad.len(),
        bad
    );
    assert!(ok >= 2, "{who} ran {ok} rounds");
}

#[test]
fn a_wild_module_kernel_loses_its_vms_worker_and_no_other() {
    let l = workers("modules-wild");
    let backend = l.start();
    let (vm_a, vm_b) = (
        backend.connect("a", FaultPolicy::default()),
        backend.connect("b", FaultPolicy::default()),
    );
    let (dev_a, dev_b) = (
        Device::loopback(vm_a.clone(), 10).unwrap(),
        Device::loopback(vm_b.clone(), 20).unwrap(),
    );
    let (ctx_a, ctx_b) = (
        dev_a.create_context().unwrap(),
        dev_b.create_context().unwrap(),
    );
    let (ma, mb) = (
        ctx_a.load_module(PTX.as_bytes()).unwrap(),
        ctx_b.load_module(PTX.as_bytes()).unwrap(),
    );
    let vadd_b = mb.function("vgpu_test_vadd_u32").unwrap();
    assert!(vadd_round(&ctx_b, &vadd_b, 1).unwrap());

    // b keeps verifying while a's kernel writes a wild pointer.
    let stop = Arc::new(AtomicBool::new(false));
    let b_loop = verify_until(ctx_b, mb, stop.clone(), 2);
    std::thread::sleep(Duration::from_millis(200));
    wild_write_loses(&ctx_a, &ma);
    std::thread::sleep(Duration::from_millis(300));
    expect_clean("VM b", &stop, b_loop);
    let log = backend.log().to_lowercase();
    assert!(log.contains("illegal"), "the worker's log says why");
    drop(ma);
    vm_a.disconnect();
    vm_b.disconnect();
}

/// With a worker per guest process (`--gpu-workers=process`), a wild kernel costs only
/// its own process: another process of the same VM, verifying module kernels the whole
/// time, runs on (as another VM does), and the faulting process's next context works.
#[test]
fn with_a_worker_per_process_a_wild_kernel_spares_its_vms_other_process() {
    let args: Vec<&str> = vgpu_test_support::gpu_worker_args()
        .into_iter()
        .map(|a| match a {
            "--gpu-workers" => "--gpu-workers=process",
            other => other,
        })
        .collect();
    let l = launcher("modules-wild-proc", "cuda", &args);
    let backend = l.start();
    let (vm_a, vm_b) = (
        backend.connect("a", FaultPolicy::default()),
        backend.connect("b", FaultPolicy::default()),
    );
    let (a10, a11, b20) = (
        Device::loopback(vm_a.clone(), 10).unwrap(),
        Device::loopback(vm_a.clone(), 11).unwrap(),
        Device::loopback(vm_b.clone(), 20).unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let mut loops = Vec::new();
    for (who, dev, seed) in [("VM a process 11", &a11, 3), ("VM b", &b20, 4)] {
        let ctx = dev.create_context().unwrap();
        let m = ctx.load_module(PTX.as_bytes()).unwrap();
        let f = m.function("vgpu_test_vadd_u32").unwrap();
        assert!(vadd_round(&ctx, &f, seed).unwrap(), "{who}'s first round");
        loops.push((who, verify_until(ctx, m, stop.clone(), seed + 1)));
    }
    let ctx10 = a10.create_context().unwrap();
    let m10 = ctx10.load_module(PTX.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    wild_write_loses(&ctx10, &m10);
    drop(m10);
    drop(ctx10);
    // The faulting process goes on with a new context, on a new worker.
    let ctx10 = a10.create_context().unwrap();
    let m10 = ctx10.load_module(PTX.as_bytes()).unwrap();
    let f10 = m10.function("vgpu_test_vadd_u32").unwrap();
    assert!(
        vadd_round(&ctx10, &f10, 9).unwrap(),
        "process 10 after its fault"
    );
    std::thread::sleep(Duration::from_millis(300));
    for (who, run) in loops {
        expect_clean(who, &stop, run);
    }
    drop(m10);
    vm_a.disconnect();
    vm_b.disconnect();
}

#[test]
fn the_sim_refuses_module_loads_saying_which_gpu_runs_them() {
    let l = launcher("modules-sim", "sim", &["--seccomp", "off"]);
    let backend = l.start();
    let vm = backend.connect("a", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 1).unwrap();
    let ctx = dev.create_context().unwrap();
    let r = ctx.load_module(PTX.as_bytes());
    assert!(
        matches!(r, Err(Error::Device(ErrorCode::ModulesNeedCudaGpu))),
        "{r:?}"
    );
    // Its push buffers cannot launch one either.
    let f = vgpu_guest::Function {
        id: 1,
        params: None,
    };
    let mut ch = ctx.create_channel().unwrap();
    ch.launch_function(&f, [1, 1, 1], [1, 1, 1], &[]).unwrap();
    expect_fault(&mut ch, ErrorCode::ModulesNeedCudaGpu);
    vm.disconnect();
}

/// On a real GPU (`VGPU_WORKER_GPU=cuda`): the `cuda` GPU in the backend's own process
/// (`--gpu-workers=off`), one CUDA context for every VM, refuses module loads and says
/// what would run them.
#[test]
fn the_in_process_cuda_gpu_refuses_module_loads() {
    if !std::env::var("VGPU_WORKER_GPU").is_ok_and(|g| g == "cuda" || g.starts_with("cuda:")) {
        eprintln!("SKIPPED: VGPU_WORKER_GPU does not name a real GPU");
        return;
    }
    let l = launcher(
        "modules-inproc",
        "cuda",
        &["--gpu-workers=off", "--seccomp", "off"],
    );
    let backend = l.start();
    let vm = backend.connect("a", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 1).unwrap();
    let ctx = dev.create_context().unwrap();
    let r = ctx.load_module(PTX.as_bytes());
    assert!(
        matches!(r, Err(Error::Device(ErrorCode::ModulesNeedWorker))),
        "{r:?}"
    );
    vm.disconnect();
}

/// A linked list of `nodes` in a 4 MiB buffer (2 MiB pages: identity-addressed), walked
/// by a kernel handed its head as a plain number; returns the values' sum.
fn chase_sum(ctx: &Context, chase: &vgpu_guest::Function, nodes: u32) -> (u64, u32) {
    let list = ctx.alloc_vram(4 << 20).expect("the list's buffer");
    list.write(0, &vgpu_test_support::pointer_list(list.gpu_va(), nodes))
        .expect("the list");
    let out = ctx.alloc_vram(4096).expect("a buffer");
    let mut ch = ctx.create_channel().expect("a channel");
    let args = [
        Arg::U64(list.gpu_va()),
        Arg::Buffer(&out, true),
        Arg::U32(nodes),
    ];
    ch.launch_function(chase, [1, 1, 1], [1, 1, 1], &args)
        .expect("chase");
    let f = ch.submit().expect("submit");
    ch.wait_timeout(f, PATIENCE).expect("the walk ends");
    (list.gpu_va(), out.read_u32_vec(0, 1).expect("read")[0])
}

/// Identity addressing for several contexts of one VM (one worker, one device address
/// space): the backend names each context a huge-page slot none of the VM's others
/// uses, so the processes' 2 MiB-page buffers never want the same device addresses and
/// stored pointers work in every one of them (with slots picked at random, 1 pair in
/// 96 collided and the later context's buffers were translated only).
#[test]
fn a_vms_contexts_get_huge_slots_of_their_own_and_all_chase_pointers() {
    use vgpu_protocol::mem::huge_slot_of;
    const NODES: u32 = 3000;
    let want = vgpu_test_support::pointer_list_sum(NODES);
    let l = workers("modules-slots");
    let backend = l.start();
    let vm = backend.connect("a", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 300).expect("device");
    let mut ctxs: Vec<Context> = (0..3)
        .map(|_| dev.create_context().expect("context"))
        .collect();
    let mut slots = Vec::new();
    for ctx in &ctxs {
        let module = ctx.load_module(PTX.as_bytes()).expect("the module loads");
        let chase = module.function("vgpu_test_chase").expect("chase");
        let (va, sum) = chase_sum(ctx, &chase, NODES);
        assert_eq!(sum, want, "a walk through stored pointers at {va:#x}");
        slots.push(huge_slot_of(va).expect("a huge-page address"));
    }
    assert_eq!(slots, [0, 1, 2], "one slot per context, none shared");
    // A destroyed context's slot is handed out again; other VMs count their own.
    drop(ctxs.remove(1));
    let again = dev.create_context().expect("context");
    let buf = again.alloc_vram(2 << 20).expect("a huge-page buffer");
    assert_eq!(huge_slot_of(buf.gpu_va()), Some(1));
    let vm_b = backend.connect("b", FaultPolicy::default());
    assert!(matches!(
        raw(&vm_b, 9, 0, Op::CreateContext),
        Ok(ReplyBody::Context {
            huge_slot: Some(0),
            ..
        })
    ));
}
