//! Live migration of a loopback VM between two backends (issue 14, first slice), over the
//! real vhost-user sockets: guest processes run the shared workloads (whose results are
//! checked bit-exactly against the CPU references, so a submission lost or run twice
//! fails them) while the VM moves; a stream cut or corrupted on its way is refused by the
//! destination and the VM keeps running on the source.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vgpu_backend::{MigrationPhase, PrecopyConfig, SchedConfig, VgpuBackend, VmLimits};
use vgpu_guest::workloads::throttle::{self, ThrottleConfig};
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Device, KernelArgs};
use vgpu_loopback::{LoopbackVm, StateOrder};
use vgpu_protocol::migration::{DeviceState, MappingTargetRecord, KIND_FULL};
use vgpu_test_support::Host;

const VM: &str = "vm";

/// The backends of the running tests, for a stalled test's report.
static HOSTS: Mutex<Vec<(String, Arc<VgpuBackend>)>> = Mutex::new(Vec::new());

fn host(tag: &str) -> Host {
    host_with(tag, VmLimits::default())
}

fn host_with(tag: &str, limits: VmLimits) -> Host {
    let _ = env_logger::builder().is_test(true).try_init();
    let h = Host::new(&format!("mig-{tag}"), 256 << 20, limits, &[VM]);
    HOSTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((tag.to_string(), h.backend.clone()));
    h
}

/// Guest processes: one per shared workload, each running it over and over (a fresh
/// context each time, so contexts, buffers and channels are created and destroyed
/// around the migration too), plus one that keeps a deep queue of spin kernels so that
/// GP entries are waiting in the ring when the source pauses.
struct Guests {
    stop: Arc<AtomicBool>,
    /// Workload runs completed (all verified).
    runs: Arc<AtomicU64>,
    threads: Vec<JoinHandle<Result<(), String>>>,
}

impl Guests {
    fn start(vm: &Arc<LoopbackVm>) -> Guests {
        let stop = Arc::new(AtomicBool::new(false));
        let runs = Arc::new(AtomicU64::new(0));
        let mut threads = Vec::new();
        for (i, name) in Workload::NAMES.iter().enumerate() {
            let (vm, stop, runs) = (vm.clone(), stop.clone(), runs.clone());
            threads.push(std::thread::spawn(move || -> Result<(), String> {
                let dev = Device::loopback(vm, 100 + i as u32).map_err(|e| e.to_string())?;
                let w = Workload::by_name(name, true).ok_or("no such workload")?;
                while !stop.load(Ordering::Acquire) {
                    let ctx = dev.create_context().map_err(|e| format!("{name}: {e}"))?;
                    let r = w.run(&ctx).map_err(|e| format!("{name}: {e}"))?;
                    if !r.verified && *name != "throttle" {
                        return Err(format!("{name}: not verified"));
                    }
                    runs.fetch_add(1, Ordering::AcqRel);
                }
                Ok(())
            }));
        }
        let (vm2, stop2) = (vm.clone(), stop.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        threads.push(std::thread::spawn(move || -> Result<(), String> {
            let dev = Device::loopback(vm2, 300).map_err(|e| e.to_string())?;
            let ctx = dev.create_context().map_err(|e| e.to_string())?;
            // Two channels that live through every migration.
            let mut chans = [
                ctx.create_channel().map_err(|e| e.to_string())?,
                ctx.create_channel().map_err(|e| e.to_string())?,
            ];
            let _ = ready_tx.send(());
            // Each channel keeps at least one batch queued behind the one that runs, so
            // whenever the source pauses (the pre-copy runs first, at any point of a
            // batch) the drain runs the fetched batch and the guest queues the next one
            // behind the shadow GP_PUT meanwhile. It tops the queues up by looking at
            // the fences rather than waiting on them: a wait past 10 ms sleeps until the
            // device's next event, and while the VM moves no events come (the rings are
            // stopped), so a waiting thread would let its rings run dry for up to a
            // sleep's 20 ms slice.
            let mut pending: [std::collections::VecDeque<vgpu_guest::Fence>; 2] =
                Default::default();
            while !stop2.load(Ordering::Acquire) {
                for (ch, queued) in chans.iter_mut().zip(pending.iter_mut()) {
                    while let Some(&f) = queued.front() {
                        if !ch.is_complete(f).map_err(|e| format!("queue: {e}"))? {
                            break;
                        }
                        queued.pop_front();
                    }
                    while queued.len() < 2 {
                        let mut last = None;
                        for _ in 0..12 {
                            ch.launch(&KernelArgs::Spin { ns: 1_000_000 }, [1, 1, 1])
                                .map_err(|e| e.to_string())?;
                            last = Some(ch.submit().map_err(|e| e.to_string())?);
                        }
                        queued.extend(last);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            for (ch, queued) in chans.iter().zip(pending) {
                for f in queued {
                    ch.wait_timeout(f, Duration::from_secs(60))
                        .map_err(|e| format!("queue: {e}"))?;
                }
            }
            Ok(())
        }));
        ready_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the queue process started");
        Guests {
            stop,
            runs,
            threads,
        }
    }

    /// Waits until `n` more workload runs completed than `since`.
    fn wait_runs(&mut self, since: u64, n: u64) {
        let t0 = Instant::now();
        while self.runs.load(Ordering::Acquire) < since + n {
            if t0.elapsed() > Duration::from_secs(120) {
                let hosts = HOSTS.lock().unwrap_or_else(|e| e.into_inner()).clone();
                for (tag, be) in hosts {
                    eprintln!(
                        "{tag}: paused {:?}, stats {:?}, channels {:?}",
                        be.vm_paused(VM),
                        be.vm_stats(VM),
                        be.vm_channel_info(VM)
                    );
                }
                panic!(
                    "workloads stalled at {} runs",
                    self.runs.load(Ordering::Acquire)
                );
            }
            if let Some(i) = self.threads.iter().position(|t| t.is_finished()) {
                let r = self.threads.swap_remove(i).join();
                panic!("a guest process ended early: {r:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the guest processes and checks that each ended well, within a bound (a
    /// submission lost in the move leaves its process waiting for ever).
    fn finish(mut self) {
        self.stop.store(true, Ordering::Release);
        let t0 = Instant::now();
        while !self.threads.iter().all(|t| t.is_finished()) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "a guest process is stuck (work lost in the migration?)"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for t in std::mem::take(&mut self.threads) {
            t.join().expect("guest thread").expect("guest process");
        }
    }
}

/// A test that fails with its guest processes still running stops them before its
/// backends and VM go (they would touch a BAR whose pages the backends take away), so
/// its own message is what it reports.
impl Drop for Guests {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let t0 = Instant::now();
        while !self.threads.iter().all(|t| t.is_finished())
            && t0.elapsed() < Duration::from_secs(30)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits until `pred` holds for the backend's view of the VM.
fn wait_vm<G: vgpu_host_shim::Gpu + ?Sized>(
    host: &Host<G>,
    pred: impl Fn(&vgpu_backend::VmStats) -> bool,
) -> vgpu_backend::VmStats {
    let t0 = Instant::now();
    loop {
        let s = host.backend.vm_stats(VM).expect("vm");
        if pred(&s) || t0.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The GPU of `host` holds nothing for any VM.
fn assert_gpu_clean(host: &Host, what: &str) {
    let t0 = Instant::now();
    loop {
        let g = host.gpu.stats();
        let clean = g.contexts == 0
            && g.channels == 0
            && g.control_slots_in_use == 0
            && g.vram_allocations == 0;
        if clean {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}: {g:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_running_vm_migrates_between_backends_and_every_workload_completes_bit_exactly() {
    let (a, b) = (host("a"), host("b"));
    let vm = a.connect(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 4);

    let rep = vm.migrate_to(&b.socket(VM)).expect("migration");
    eprintln!("migration: {rep:?}");
    assert!(rep.contexts >= 2 && rep.channels >= 2, "{rep:?}");
    assert!(rep.mems >= 1 && rep.vram_bytes > 0, "{rep:?}");
    assert!(
        rep.queued_entries > 0,
        "entries were waiting in the rings: {rep:?}"
    );

    // The source let the VM go: nothing of it left on its GPU or in its books.
    let s = wait_vm(&a, |s| !s.connected && s.contexts == 0);
    assert!(!s.connected);
    assert_eq!(
        (s.contexts, s.channels, s.vram_bytes, s.aperture_bytes),
        (0, 0, 0, 0)
    );
    assert_gpu_clean(&a, "source after the migration");
    assert_eq!(
        a.backend.vm_paused(VM),
        Some(false),
        "the source's pause ended with it"
    );
    assert!(b.backend.vm_stats(VM).expect("vm").connected);

    // Everything continues on the destination, then moves back to the source.
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    let back = vm.migrate_to(&a.socket(VM)).expect("migration back");
    eprintln!("migration back: {back:?}");
    assert_gpu_clean(&b, "destination after the migration back");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    assert_eq!(b.backend.vm_paused(VM), Some(false));
    drop(vm);
    assert_gpu_clean(&a, "source after the VM ended");
}

/// A backend whose VMs' GPUs are worker processes (issue 30) taking the GPU in turn:
/// `cuda-fake` workers here, `VGPU_WORKER_GPU=cuda` on a GPU.
fn workers_host(tag: &str) -> Host<vgpu_gpu_worker::WorkerPool> {
    workers_host_as(tag, vgpu_gpu_worker::Granularity::Vm)
}

/// As [`workers_host`], with a worker per VM or per guest process.
fn workers_host_as(
    tag: &str,
    granularity: vgpu_gpu_worker::Granularity,
) -> Host<vgpu_gpu_worker::WorkerPool> {
    let _ = env_logger::builder().is_test(true).try_init();
    let pool = vgpu_test_support::worker_pool_from_env_as(256 << 20, granularity);
    let limits = VmLimits {
        vram_bytes: 128 << 20,
        ..VmLimits::default()
    };
    Host::on_workers(&format!("mig-w-{tag}"), pool, limits, &[VM])
}

#[test]
fn a_vm_on_gpu_workers_migrates_between_backends_and_every_workload_completes_bit_exactly() {
    let (a, b) = (workers_host("a"), workers_host("b"));
    let vm = a.connect(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 4);
    let src_pid = a.worker(VM).pid().expect("the source VM's worker runs");

    let rep = vm.migrate_to(&b.socket(VM)).expect("migration");
    eprintln!("migration: {rep:?}");
    assert!(rep.contexts >= 2 && rep.channels >= 2, "{rep:?}");
    assert!(rep.mems >= 1 && rep.vram_bytes > 0, "{rep:?}");
    let s = wait_vm(&a, |s| !s.connected && s.contexts == 0);
    assert_eq!(
        (s.contexts, s.channels, s.vram_bytes),
        (0, 0, 0),
        "the source let the VM go"
    );
    let dst_pid = b
        .worker(VM)
        .pid()
        .expect("the destination VM's worker runs");
    assert_ne!(src_pid, dst_pid, "a worker of the destination's own");

    // Everything continues on the destination's worker, then moves back.
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    let back = vm.migrate_to(&a.socket(VM)).expect("migration back");
    eprintln!("migration back: {back:?}");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    assert_eq!(a.backend.vm_paused(VM), Some(false));
}

/// With a worker per guest process (`--gpu-workers=process`) each process's state is
/// saved from its own worker and restored into a new worker of that process on the
/// destination; the source's workers go with the VM.
#[test]
fn a_vm_on_per_process_workers_migrates_between_backends_and_every_workload_completes_bit_exactly()
{
    use vgpu_gpu_worker::Granularity;
    let (a, b) = (
        workers_host_as("pa", Granularity::Process),
        workers_host_as("pb", Granularity::Process),
    );
    let vm = a.connect(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 4);
    let src = a.worker(VM).workers();
    assert!(src.len() >= 2, "a worker per guest process: {src:?}");

    let rep = vm.migrate_to(&b.socket(VM)).expect("migration");
    eprintln!("migration: {rep:?}");
    assert!(rep.contexts >= 2 && rep.channels >= 2, "{rep:?}");
    let s = wait_vm(&a, |s| !s.connected && s.contexts == 0);
    assert_eq!((s.contexts, s.channels, s.vram_bytes), (0, 0, 0));
    let t = std::time::Instant::now();
    while !a.worker(VM).workers().is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the source's workers stay"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The guests' processes come and go; those with objects have a worker each.
    let dst = b.worker(VM).workers();
    assert!(dst.len() >= 2, "a worker per guest process: {dst:?}");
    assert!(
        dst.iter().all(|d| src.iter().all(|s| s.1 != d.1)),
        "workers of the destination's own"
    );

    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    let back = vm.migrate_to(&a.socket(VM)).expect("migration back");
    eprintln!("migration back: {back:?}");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    assert_eq!(a.backend.vm_paused(VM), Some(false));
}

/// A guest process's own module moves with its VM (issue 31): the image, the value a
/// kernel left in its `__device__` variable, and the function handles, which launch on
/// the destination as before; there and back, beside the shared workloads.
#[test]
fn a_vms_own_module_and_its_variable_move_with_it() {
    use vgpu_guest::{Arg, Context, Function, Module};
    const PTX: &str = include_str!("../../host-shim/tests/data/test_module.ptx");
    const N: u32 = 4096;
    let patience = Duration::from_secs(60);
    let run = |ch: &mut vgpu_guest::Channel| {
        let f = ch.submit().expect("submit");
        ch.wait_timeout(f, patience)
            .expect("the module's kernels run");
    };
    // The variable as a kernel reads it, through the address the GPU gives now (a
    // global's device address is the loaded module's: it changes with the move).
    let variable = |ctx: &Context, m: &Module, copy: &Function| -> u32 {
        let g = m.global("vgpu_test_counter").expect("the variable");
        let out = ctx.alloc_vram(4096).expect("a buffer");
        let mut ch = ctx.create_channel().expect("a channel");
        let args = [Arg::Buffer(&out, true), Arg::U64(g.addr), Arg::U32(1)];
        ch.launch_function(copy, [1, 1, 1], [1, 1, 1], &args)
            .expect("copy");
        run(&mut ch);
        out.read_u32_vec(0, 1).expect("read")[0]
    };
    let vadd_ok = |ctx: &Context, vadd: &Function, seed: u32| -> bool {
        let bytes = u64::from(N) * 4;
        let (x, y, z) = (
            ctx.alloc_vram(bytes).unwrap(),
            ctx.alloc_vram(bytes).unwrap(),
            ctx.alloc_vram(bytes).unwrap(),
        );
        let vx: Vec<u32> = (0..N).map(|i| i.wrapping_mul(seed)).collect();
        let vy: Vec<u32> = (0..N).map(|i| i ^ seed).collect();
        x.write_u32(0, &vx).unwrap();
        y.write_u32(0, &vy).unwrap();
        let mut ch = ctx.create_channel().unwrap();
        let args = [
            Arg::Buffer(&x, false),
            Arg::Buffer(&y, false),
            Arg::Buffer(&z, true),
            Arg::U32(N),
        ];
        ch.launch_function(vadd, [N.div_ceil(256), 1, 1], [256, 1, 1], &args)
            .unwrap();
        run(&mut ch);
        let got = z.read_u32_vec(0, N as usize).unwrap();
        got.iter()
            .zip(vx.iter().zip(&vy))
            .all(|(z, (x, y))| *z == x.wrapping_add(*y))
    };
    // A linked list in one 4 MiB buffer (2 MiB pages: its guest addresses are the
    // device's own), walked by a kernel handed its head as a plain number: the walk
    // follows pointers stored in memory, so it needs identity addressing on whichever
    // backend holds the VM.
    let list_sum = |ctx: &Context, list: &vgpu_guest::Buffer, chase: &Function| -> u32 {
        let out = ctx.alloc_vram(4096).expect("a buffer");
        let mut ch = ctx.create_channel().expect("a channel");
        let args = [
            Arg::U64(list.gpu_va()),
            Arg::Buffer(&out, true),
            Arg::U32(LIST_NODES),
        ];
        ch.launch_function(chase, [1, 1, 1], [1, 1, 1], &args)
            .expect("chase");
        run(&mut ch);
        out.read_u32_vec(0, 1).expect("read")[0]
    };
    const LIST_NODES: u32 = 5000;

    // Guest RAM for the shared workloads' buffers and this process's beside them.
    let mem = 256 << 20;
    let (a, b) = (
        workers_host("ma").with_vm_mem(mem),
        workers_host("mb").with_vm_mem(mem),
    );
    let vm = a.connect(VM);
    let mut guests = Guests::start(&vm);
    let dev = Device::loopback(vm.clone(), 400).expect("device");
    let ctx = dev.create_context().expect("context");
    let module = ctx.load_module(PTX.as_bytes()).expect("the module loads");
    let set = module.function("vgpu_test_set_global").unwrap();
    let copy = module.function("vgpu_test_copy_u32").unwrap();
    let vadd = module.function("vgpu_test_vadd_u32").unwrap();
    let mut ch = ctx.create_channel().unwrap();
    ch.launch_function(&set, [1, 1, 1], [1, 1, 1], &[Arg::U32(0x5eed)])
        .unwrap();
    run(&mut ch);
    assert_eq!(variable(&ctx, &module, &copy), 0x5eed);
    assert!(vadd_ok(&ctx, &vadd, 3));
    let chase = module.function("vgpu_test_chase").unwrap();
    let list = ctx.alloc_vram(4 << 20).expect("the list's buffer");
    list.write(
        0,
        &vgpu_test_support::pointer_list(list.gpu_va(), LIST_NODES),
    )
    .expect("the list");
    let want = vgpu_test_support::pointer_list_sum(LIST_NODES);
    assert_eq!(
        list_sum(&ctx, &list, &chase),
        want,
        "a walk through stored pointers"
    );
    guests.wait_runs(0, 2);

    let rep = vm.migrate_to(&b.socket(VM)).expect("migration");
    eprintln!("migration: {rep:?}");
    assert_eq!(variable(&ctx, &module, &copy), 0x5eed, "the variable moved");
    assert!(vadd_ok(&ctx, &vadd, 5), "the bound function runs there");
    assert_eq!(
        list_sum(&ctx, &list, &chase),
        want,
        "stored pointers still lead through the list there"
    );
    // A new value there, and back.
    ch.launch_function(&set, [1, 1, 1], [1, 1, 1], &[Arg::U32(0xbac)])
        .unwrap();
    run(&mut ch);
    let back = vm.migrate_to(&a.socket(VM)).expect("migration back");
    eprintln!("migration back: {back:?}");
    assert_eq!(
        variable(&ctx, &module, &copy),
        0xbac,
        "the new value moved back"
    );
    assert!(vadd_ok(&ctx, &vadd, 7));
    assert_eq!(list_sum(&ctx, &list, &chase), want, "and back");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 2);
    guests.finish();
    drop(ch);
    module.unload().expect("unload");
}

#[test]
fn a_cut_or_corrupt_state_is_refused_and_the_vm_keeps_running_on_the_source() {
    let (a, b) = (host("src"), host("dst"));
    let vm = a.connect(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 3);

    let cut = vm.migrate_to_filtered(&b.socket(VM), &mut |s: &mut Vec<u8>| {
        let n = s.len() / 2;
        s.truncate(n);
    });
    assert!(cut.is_err(), "a cut stream was accepted");
    let mut first = true;
    let corrupt = vm.migrate_to_filtered(&b.socket(VM), &mut |s: &mut Vec<u8>| {
        if std::mem::take(&mut first) {
            // In the middle: VRAM contents, which only the checksum guards.
            let i = s.len() / 2;
            s[i] ^= 0x40;
        }
    });
    assert!(corrupt.is_err(), "a corrupt stream was accepted");

    // The destination holds nothing; the VM runs on the source, unpaused.
    let s = wait_vm(&b, |s| !s.connected);
    assert_eq!((s.connected, s.contexts, s.channels), (false, 0, 0));
    assert_gpu_clean(&b, "destination after refusing");
    assert!(a.backend.vm_stats(VM).expect("vm").connected);
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    assert_eq!(a.backend.vm_paused(VM), Some(false));

    // Nothing was lost either: the same VM then migrates for real.
    vm.migrate_to(&b.socket(VM))
        .expect("migration after two refusals");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    assert_gpu_clean(&a, "source after the migration");
}

/// A destination whose limits cannot hold the VM (fewer channels) refuses the state
/// before it touches the guest's BAR, frees what it had restored, and the VM runs on.
#[test]
fn a_destination_that_cannot_hold_the_vm_refuses_it_and_the_source_keeps_it() {
    let a = host("full");
    let small = VmLimits {
        max_channels: 1,
        ..VmLimits::default()
    };
    let b = host_with("small", small);
    let vm = a.connect(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 3);
    let r = vm.migrate_to(&b.socket(VM));
    assert!(r.is_err(), "a destination with one channel took {r:?}");
    let s = wait_vm(&b, |s| !s.connected);
    assert_eq!(
        (s.connected, s.contexts, s.channels, s.vram_bytes),
        (false, 0, 0, 0)
    );
    assert_gpu_clean(&b, "destination after refusing");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    assert_eq!(a.backend.vm_paused(VM), Some(false));
    guests.finish();
}

/// VRAM objects partly swapped out to system memory on the source (a GPU too small for
/// the VM, the rest in the VM's swap store) move with their contents: the workloads'
/// buffers come back bit-exact on the destination.
#[test]
fn a_vm_with_vram_swapped_out_migrates_bit_exactly() {
    let _ = env_logger::builder().is_test(true).try_init();
    let limits = VmLimits {
        swap_bytes: 256 << 20,
        ..VmLimits::default()
    };
    let a = Host::new("mig-tiny", 1 << 20, limits, &[VM]);
    let b = host("roomy");
    let vm = a.connect(VM);
    // Ballast bigger than the source GPU: at least its first 2 MiB chunk is swapped out.
    let dev = Device::loopback(vm.clone(), 400).expect("device");
    let ctx = dev.create_context().expect("context");
    let ballast = ctx.alloc_vram(3 << 20).expect("ballast");
    let pattern: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    ballast.write(0, &pattern).expect("write ballast");
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 4);
    let rep = vm.migrate_to(&b.socket(VM)).expect("migration");
    eprintln!("migration with swap: {rep:?}");
    assert!(
        rep.swapped_bytes >= 2 << 20,
        "nothing was swapped out: {rep:?}"
    );
    let mut back_bytes = vec![0u8; pattern.len()];
    ballast.read(0, &mut back_bytes).expect("read ballast");
    assert!(back_bytes == pattern, "the ballast changed in the move");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    let back = vm
        .migrate_to(&a.socket(VM))
        .expect("migration back to the small GPU");
    eprintln!("migration back: {back:?}");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    ballast.read(0, &mut back_bytes).expect("read ballast");
    assert!(
        back_bytes == pattern,
        "the ballast changed in the move back"
    );
    drop((ballast, ctx, dev));
    assert_gpu_clean(&b, "destination after the migration back");
}

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 2 * MIB;

/// A guest process whose GPU keeps writing a 32 MiB VRAM buffer (no CPU view, so only the
/// GPU's write tracking can tell what changed): round `n` stores the value `n` into the
/// first 4 KiB of every chunk, one chunk per launch. Returns the last round it completed.
struct Writer {
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    thread: JoinHandle<Result<(), String>>,
    ready: std::sync::mpsc::Receiver<()>,
}

impl Writer {
    fn start(vm: &Arc<LoopbackVm>, size: u64) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let (tx, ready) = std::sync::mpsc::channel();
        let (vm, stop2, rounds2) = (vm.clone(), stop.clone(), rounds.clone());
        let thread = std::thread::spawn(move || -> Result<(), String> {
            let e = |x: vgpu_guest::Error| x.to_string();
            let dev = Device::loopback(vm, 500).map_err(e)?;
            let ctx = dev.create_context().map_err(e)?;
            let buf = ctx.alloc_vram(size).map_err(e)?;
            let mut ch = ctx.create_channel().map_err(e)?;
            ch.launch(
                &KernelArgs::Memset {
                    dst: buf.gpu_va(),
                    len: size,
                    pattern: 0xfeed_f00d,
                },
                [1, 1, 1],
            )
            .map_err(e)?;
            let f = ch.submit().map_err(e)?;
            ch.wait(f).map_err(e)?;
            let _ = tx.send(());
            let mut n = 0u32;
            while !stop2.load(Ordering::Acquire) {
                n += 1;
                for k in 0..size / CHUNK {
                    ch.launch(
                        &KernelArgs::Memset {
                            dst: buf.gpu_va() + k * CHUNK,
                            len: 4096,
                            pattern: n,
                        },
                        [1, 1, 1],
                    )
                    .map_err(e)?;
                }
                let f = ch.submit().map_err(e)?;
                ch.wait_timeout(f, Duration::from_secs(60)).map_err(e)?;
                rounds2.store(u64::from(n), Ordering::Release);
                std::thread::sleep(Duration::from_millis(2));
            }
            // After the migration: read the buffer back through a second buffer with a
            // CPU view (the written one must stay without, see above) and check it.
            let back = ctx.alloc_vram(size).map_err(e)?;
            ch.launch(
                &KernelArgs::Memcpy {
                    dst: back.gpu_va(),
                    src: buf.gpu_va(),
                    len: size,
                },
                [1, 1, 1],
            )
            .map_err(e)?;
            let f = ch.submit().map_err(e)?;
            ch.wait(f).map_err(e)?;
            let mut got = vec![0u8; size as usize];
            back.read(0, &mut got).map_err(e)?;
            for (k, chunk) in got.chunks(CHUNK as usize).enumerate() {
                let word = |at: usize| {
                    u32::from_le_bytes([chunk[at], chunk[at + 1], chunk[at + 2], chunk[at + 3]])
                };
                if word(0) != n || word(4092) != n {
                    return Err(format!("chunk {k}: last write {n}, found {}", word(0)));
                }
                if word(4096) != 0xfeed_f00d || word(chunk.len() - 4) != 0xfeed_f00d {
                    return Err(format!("chunk {k}: the fill changed"));
                }
            }
            Ok(())
        });
        Writer {
            stop,
            rounds,
            thread,
            ready,
        }
    }

    fn wait_ready(&self) {
        self.ready
            .recv_timeout(Duration::from_secs(60))
            .expect("the writer started");
    }

    fn finish(self) {
        self.stop.store(true, Ordering::Release);
        self.thread
            .join()
            .expect("writer thread")
            .expect("every write arrived");
    }
}

/// A GPU writer runs through the pre-copy: chunks written after they were copied are sent
/// again (the rounds after the first carry them), and after the move every chunk holds
/// the last value written — on the destination.
#[test]
fn writes_made_during_the_precopy_arrive_at_the_destination() {
    let (a, b) = (host("pre-src"), host("pre-dst"));
    // Rounds until nothing is dirty, at most 4: the writer never stops, so all 4 run.
    a.backend.set_precopy(
        VM,
        PrecopyConfig {
            max_rounds: 4,
            stop_below_bytes: 0,
        },
    );
    let vm = a.connect(VM);
    let w = Writer::start(&vm, 32 * MIB);
    w.wait_ready();
    while w.rounds.load(Ordering::Acquire) < 3 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let rep = vm.migrate_to(&b.socket(VM)).expect("migration");
    eprintln!("pre-copy with a writer: {rep:?}");
    let pre: Vec<_> = rep.rounds.iter().filter(|r| !r.last).collect();
    assert!(pre.len() >= 2, "a single pre-copy round: {rep:?}");
    assert!(
        pre[1..].iter().any(|r| r.bytes >= CHUNK),
        "no chunk was sent again although the writer kept writing: {rep:?}"
    );
    let src = a.backend.vm_migration(VM).expect("vm");
    assert_eq!(src.phase, MigrationPhase::Sent);
    assert!(src.write_tracking);
    // The destination resumes on the kick that follows the transfer.
    let t0 = Instant::now();
    let dst = loop {
        let p = b.backend.vm_migration(VM).expect("vm");
        if p.phase == MigrationPhase::Resumed || t0.elapsed() > Duration::from_secs(10) {
            break p;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(dst.phase, MigrationPhase::Resumed);
    assert_eq!(dst.rounds.len(), rep.rounds.len());
    let before = w.rounds.load(Ordering::Acquire);
    while w.rounds.load(Ordering::Acquire) < before + 3 {
        std::thread::sleep(Duration::from_millis(5));
    }
    w.finish();
    assert_gpu_clean(&a, "source after the migration");
}

/// A chunk frame of a later round corrupted on its way: the destination refuses the
/// stream after it had created the objects and applied earlier rounds, frees all of it,
/// and the VM (its writer still running) continues on the source; then it migrates.
#[test]
fn a_corrupt_precopy_round_is_refused_cleanly() {
    let (a, b) = (host("cut-src"), host("cut-dst"));
    a.backend.set_precopy(
        VM,
        PrecopyConfig {
            max_rounds: 3,
            stop_below_bytes: 0,
        },
    );
    let vm = a.connect(VM);
    let w = Writer::start(&vm, 16 * MIB);
    w.wait_ready();
    let mut frames = 0;
    let r = vm.migrate_to_filtered(&b.socket(VM), &mut |f: &mut Vec<u8>| {
        frames += 1;
        // Frame 1 is the objects, 2..=9 the first round's chunks: corrupt one of round 2.
        if frames == 11 && f.len() > 64 {
            let i = f.len() - 16;
            f[i] ^= 1;
        }
    });
    assert!(r.is_err(), "a corrupt round was accepted");
    assert!(frames >= 11, "the stream had only {frames} frames");
    let s = wait_vm(&b, |s| !s.connected);
    assert_eq!((s.connected, s.contexts, s.channels), (false, 0, 0));
    assert_gpu_clean(&b, "destination after refusing a round");
    let failed = b.backend.vm_migration(VM).expect("vm");
    assert_eq!(failed.phase, MigrationPhase::Failed, "{failed:?}");
    assert_eq!(a.backend.vm_paused(VM), Some(false));
    let before = w.rounds.load(Ordering::Acquire);
    while w.rounds.load(Ordering::Acquire) < before + 3 {
        std::thread::sleep(Duration::from_millis(5));
    }
    vm.migrate_to(&b.socket(VM))
        .expect("migration after the refusal");
    w.finish();
    assert_gpu_clean(&a, "source after the migration");
}

/// A guest process running `throttle` (`kernel_ns` kernels, depth 2) until `stop`, as in
/// the `sched_fair` tests: steady work that always wants the GPU.
fn spawn_throttle(
    vm: Arc<LoopbackVm>,
    pid: u32,
    kernel_ns: u64,
    stop: Arc<AtomicBool>,
) -> JoinHandle<u64> {
    std::thread::spawn(move || {
        let dev = Device::loopback(vm, pid).expect("device");
        let ctx = dev.create_context().expect("context");
        let cfg = ThrottleConfig {
            kernel_ns,
            iterations: None,
            depth: 2,
            stop: Some(stop),
        };
        throttle::run(&ctx, &cfg).expect("throttle").iterations
    })
}

/// `vm`'s share of the GPU time `vm` and `other` used on `be` over 2 s, after 300 ms (the
/// `sched_fair` tests' window).
fn share_of(be: &VgpuBackend, vm: &str, other: &str) -> f64 {
    let busy = |n: &str| -> u64 { be.process_busy_ns(n).iter().map(|(_, b)| b).sum() };
    std::thread::sleep(Duration::from_millis(300));
    let (a0, b0) = (busy(vm), busy(other));
    std::thread::sleep(Duration::from_secs(2));
    let (a, b) = (busy(vm) - a0, busy(other) - b0);
    a as f64 / (a + b).max(1) as f64
}

/// Issue 28, item 1: a device-state stream whose full state claims weight 10000 and a
/// 1 TiB VRAM quota (valid CRCs: re-encoded) is loaded, but operator policy stays the
/// destination's: the VM keeps this backend's weight and quota, the migration report
/// names what the stream claimed, and the destination's other VM, both running steady
/// work under the fair scheduler, keeps its half of the GPU (it used to fall to 0.8 %).
#[test]
fn a_stream_cannot_set_its_own_weight_or_quota_on_the_destination() {
    let a = host("policy-src");
    let b = Host::new(
        "mig-policy-dst",
        256 << 20,
        VmLimits::default(),
        &[VM, "other"],
    );
    HOSTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(("policy-dst".into(), b.backend.clone()));
    b.backend
        .start_scheduler(SchedConfig::default())
        .expect("fair");
    let weight = b.backend.vm_weight(VM).expect("vm");
    let quota = b.backend.vram_stats(VM).expect("vm").vm.quota_bytes;
    let stop = Arc::new(AtomicBool::new(false));
    let vm = a.connect(VM);
    let migrated = spawn_throttle(vm.clone(), 1, 1_000_000, stop.clone());
    let other = spawn_throttle(b.connect("other"), 2, 1_000_000, stop.clone());
    std::thread::sleep(Duration::from_millis(200));

    let mut forged = 0;
    let rep = vm
        .migrate_to_filtered(&b.socket(VM), &mut |f: &mut Vec<u8>| {
            let kind = f
                .get(12..16)
                .map(|k| u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
            if kind == Some(KIND_FULL) {
                let mut st = DeviceState::decode(f).expect("a full state");
                st.vm.weight = 10_000;
                st.vm.vram_quota = 1 << 40;
                *f = st.encode();
                forged += 1;
            }
        })
        .expect("the forged stream is loaded");
    eprintln!("migration with a forged policy: {rep:?}");
    assert_eq!(forged, 1, "one full state");

    let got = b.backend.vm_weight(VM).expect("vm");
    let got_quota = b.backend.vram_stats(VM).expect("vm").vm.quota_bytes;
    let p = b.backend.vm_migration(VM).expect("vm").policy;
    let share = share_of(&b.backend, "other", VM);
    println!(
        "destination: weight {got} (its own {weight}), VRAM quota {got_quota} (its own \
         {quota}); the other VM's share {:.1} %; report: {}",
        share * 100.0,
        p.map_or("none".into(), |p| p.note())
    );
    stop.store(true, Ordering::Release);
    assert!(migrated.join().expect("migrated VM's guest") > 0);
    assert!(other.join().expect("other VM's guest") > 0);
    assert_eq!(
        (got, got_quota),
        (weight, quota),
        "the stream set the policy"
    );
    let p = p.expect("the destination reports the stream's policy");
    assert_eq!((p.weight, p.vram_quota), (weight, quota));
    assert_eq!((p.stream_weight, p.stream_vram_quota), (10_000, 1 << 40));
    assert_eq!(p.ignored(), ["weight", "vram_quota"]);
    assert!(
        p.note().contains("stream claimed weight 10000"),
        "{}",
        p.note()
    );
    assert!(
        (share - 0.5).abs() <= 0.10,
        "fair: the other VM's share {:.1} % (want 50 ± 10)",
        share * 100.0
    );
}

/// Cloud Hypervisor's order (v53.0): the destination gets the whole device state right
/// after it connected — before its features and its memory table — so the state's GPU
/// mappings of guest RAM can only be resolved when the table arrives. A forwarded VM
/// (Cloud Hypervisor has no vhost-user SHMEM) moves that way with its work verified, then
/// back in vgpu-vmm's order.
#[test]
fn a_forwarded_vm_migrates_with_its_state_sent_before_the_memory_table() {
    let (a, b) = (host("ch-src"), host("ch-dst"));
    let vm = a.connect_forwarded(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 4);

    let rep = vm
        .migrate_to_ordered(&b.socket(VM), StateOrder::StateFirst, &mut |_| {})
        .expect("migration, state before the memory table");
    eprintln!("migration (state first): {rep:?}");
    assert!(rep.contexts >= 2 && rep.channels >= 2, "{rep:?}");
    assert!(
        rep.guest_mappings > 0,
        "the state maps guest RAM (what waits for the table): {rep:?}"
    );
    let s = wait_vm(&a, |s| !s.connected && s.contexts == 0);
    assert_eq!((s.contexts, s.channels, s.vram_bytes), (0, 0, 0));
    assert_gpu_clean(&a, "source after the migration");
    let st = b.backend.vm_stats(VM).expect("vm");
    assert!(st.connected && st.forwarded, "{st:?}");

    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    vm.migrate_to(&a.socket(VM)).expect("migration back");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    assert_gpu_clean(&b, "destination after the migration back");
}

/// A state sent before the memory table whose guest mappings lie outside the table that
/// then arrives: `CHECK_DEVICE_STATE` accepts it (it decodes), the `SET_MEM_TABLE` is
/// refused with the reason, nothing of it stays on the destination, and the VM keeps
/// running on the source — which can then migrate for real.
#[test]
fn a_state_whose_guest_mappings_miss_the_memory_table_is_refused_at_the_table() {
    let (a, b) = (host("ch-bad-src"), host("ch-bad-dst"));
    let vm = a.connect_forwarded(VM);
    let mut guests = Guests::start(&vm);
    guests.wait_runs(0, 3);

    let mut moved = 0;
    let r = vm.migrate_to_ordered(&b.socket(VM), StateOrder::StateFirst, &mut |f: &mut Vec<
        u8,
    >| {
        if vgpu_protocol::migration::stream_kind(f) != Ok(KIND_FULL) {
            return;
        }
        let mut st = DeviceState::decode(f).expect("a full state");
        for m in &mut st.mappings {
            if let MappingTargetRecord::Guest { ranges } = &mut m.target {
                // 1 TiB up: no RAM there.
                for r in ranges.iter_mut() {
                    r.0 += 1 << 40;
                    moved += 1;
                }
            }
        }
        *f = st.encode();
    });
    assert!(moved > 0, "the state had no guest mapping to move");
    let e = r.expect_err("a state mapping RAM the VM does not have was accepted");
    eprintln!("refused: {e}");
    let p = b.backend.vm_migration(VM).expect("vm");
    assert_eq!(p.phase, MigrationPhase::Failed, "{p:?}");
    assert!(
        p.error.as_deref().is_some_and(|e| e.contains("mapping")),
        "{p:?}"
    );
    let s = wait_vm(&b, |s| !s.connected);
    assert_eq!((s.connected, s.contexts, s.channels), (false, 0, 0));
    assert_gpu_clean(&b, "destination after refusing");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    assert_eq!(a.backend.vm_paused(VM), Some(false));

    vm.migrate_to_ordered(&b.socket(VM), StateOrder::StateFirst, &mut |_| {})
        .expect("migration after the refusal");
    let done = guests.runs.load(Ordering::Acquire);
    guests.wait_runs(done, 6);
    guests.finish();
    assert_gpu_clean(&a, "source after the migration");
}
