//! Loopback fault soak (issue 16). The `vgpu-backend` binary runs as a separate process
//! with two VMs: `s`, a steady tenant whose worker runs verified work the whole time, and
//! `v`, the victim most faults are aimed at. For `VGPU_SOAK_SECS` (default 180) faults
//! are injected at random (seed `VGPU_SOAK_SEED`, printed) and invariants checked after
//! each:
//!
//! * every result verified: workloads against CPU references, and an accumulator that
//!   each submission adds exactly 1 to (its value proves no submission lost or run twice);
//! * other VMs unaffected: the steady VM's worker never sees an error and keeps making
//!   progress (only a backend restart, which every VM sees, starts it over);
//! * objects back to baseline: the victim VM has no processes, channels or VRAM once its
//!   VMM is gone; the backend's open fds return to their count before the fault.
//!
//! Faults: the VMM killed mid-work, a guest process killed with work queued, the backend
//! SIGKILLed and restarted, weight and quota changes over the control API, VRAM pressure
//! beyond the victim's quota (evictions/swap), and the frontend refusing SHMEM_MAP.
//!
//! The backend binary comes from the target directory (`cargo build --release -p
//! vgpu-backend`; `cargo test --workspace` builds it) or `VGPU_BACKEND_BIN`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use vgpu_backend::api::client::ApiClient;
use vgpu_guest::workloads::Workload;
use vgpu_guest::{Buffer, Channel, Context, Device, Error, KernelArgs};
use vgpu_host_shim::kernels::reference;
use vgpu_loopback::LoopbackVm;
use vgpu_test_support::{BackendLauncher, BackendProcess as Backend};
use vgpu_vmm::reconnect::{FaultPolicy, ReconnectPolicy};

/// Liveness bound for anything the soak waits for (never a performance target).
const PATIENCE: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;
/// Elements of an accumulator (one saxpy block).
const ACC_N: u64 = 256;
const DEFAULT_SECS: u64 = 180;
const DEFAULT_SEED: u64 = 0x16_5eed;

/// splitmix64: small, seedable, good enough to pick faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("{name}={v}: not a number"))
        }
        Err(_) => default,
    }
}

/// Starts backend processes on a 32 MiB GPU serving VM `s` (steady) and VM `v` (victim,
/// a 16 MiB quota), both with swap, and the control API.
fn launcher() -> BackendLauncher {
    BackendLauncher::new(
        "fault-soak",
        "[gpu]\nvram_mib = 32\n\
         [scheduler]\npolicy = \"fair\"\ninterval_ms = 10\n\
         [[vm]]\nname = \"s\"\nswap_mib = 64\n\
         [[vm]]\nname = \"v\"\nvram_mib = 16\nswap_mib = 64\n",
    )
    .with_api()
    .rust_log("warn")
}

/// Open fds of the backend process, less its per-VM pools (a VM's shadow-page memfd
/// and swap store, each made on first use and kept while the VM is configured), which
/// are checked to be at most one per VM instead.
fn fds(backend: &Backend) -> Result<usize, String> {
    let t = backend.fd_targets();
    for pool in ["/memfd:vgpu-shadow", "/memfd:vgpu-swap"] {
        let n = t.iter().filter(|p| p.starts_with(pool)).count();
        if n > 2 {
            return Err(format!("{n} × {pool} for 2 VMs"));
        }
    }
    Ok(t.iter()
        .filter(|p| !p.starts_with("/memfd:vgpu-shadow") && !p.starts_with("/memfd:vgpu-swap"))
        .count())
}

fn reconnecting() -> FaultPolicy {
    FaultPolicy {
        reconnect: Some(ReconnectPolicy {
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(500),
            max_attempts: None,
        }),
        request_timeout: Some(Duration::from_secs(30)),
    }
}

/// Polls `f` until it is `Ok` or [`PATIENCE`] has passed (then its last error).
fn settle(mut f: impl FnMut() -> Result<(), String>) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        match f() {
            Ok(()) => return Ok(()),
            Err(e) if t0.elapsed() > PATIENCE => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// An accumulator: `ACC_N` floats that every submission adds exactly 1.0 to.
struct Acc {
    buf: Buffer,
    ones: Buffer,
    ch: Channel,
    expected: u64,
}

impl Acc {
    fn new(ctx: &Context) -> vgpu_guest::Result<Acc> {
        let buf = ctx.alloc_vram(ACC_N * 4)?;
        buf.write_f32(0, &[0.0; ACC_N as usize])?;
        let ones = ctx.alloc_vram(ACC_N * 4)?;
        ones.write_f32(0, &[1.0; ACC_N as usize])?;
        let ch = ctx.create_channel()?;
        Ok(Acc {
            buf,
            ones,
            ch,
            expected: 0,
        })
    }

    /// `k` submissions of one increment each.
    fn add(&mut self, k: u64) -> vgpu_guest::Result<()> {
        let args = KernelArgs::Saxpy {
            x: self.ones.gpu_va(),
            y: self.buf.gpu_va(),
            n: ACC_N,
            a: 1.0,
        };
        let mut last = None;
        for _ in 0..k {
            self.ch.launch(&args, [1, 1, 1])?;
            last = Some(self.ch.submit()?);
            self.expected += 1;
        }
        if let Some(f) = last {
            self.ch.wait(f)?;
        }
        Ok(())
    }

    /// Every element equals the number of submissions made.
    fn check(&self) -> Result<(), String> {
        let got = self
            .buf
            .read_f32_vec(0, ACC_N as usize)
            .map_err(|e| format!("accumulator read: {e}"))?;
        match got.iter().find(|&&v| v != self.expected as f32) {
            None => Ok(()),
            Some(v) => Err(format!(
                "accumulator {v} after {} submissions (lost or run twice)",
                self.expected
            )),
        }
    }
}

fn run_workload(ctx: &Context, name: &str) -> Result<(), String> {
    let r = Workload::by_name(name, true)
        .expect("workload")
        .run(ctx)
        .map_err(|e| format!("{name}: {e}"))?;
    if r.verified {
        Ok(())
    } else {
        Err(format!("{name}: result differs from the CPU reference"))
    }
}

const WORKLOADS: [&str; 4] = ["saxpy", "sgemm", "reduction", "copy_heavy"];

/// The steady tenant: verified work in VM `s` until told to stop; the first error ends it.
#[derive(Default)]
struct Steady {
    runs: AtomicU64,
    submissions: AtomicU64,
    generations: AtomicU64,
    stop: AtomicBool,
    error: Mutex<Option<String>>,
    /// Held for reading per iteration; the soak takes it for writing to quiesce the worker
    /// (fd counts, a backend restart).
    gate: RwLock<()>,
}

impl Steady {
    fn error(&self) -> Option<String> {
        self.error.lock().unwrap().clone()
    }

    fn worker(&self, vm: Arc<LoopbackVm>, seed: u64) {
        let mut rng = Rng(seed);
        let mut state: Option<(u64, Device, Context, Acc)> = None;
        let mut pid = 10;
        while !self.stop.load(Ordering::Acquire) {
            let _g = self.gate.read().unwrap();
            let r = (|| -> Result<(), String> {
                let epoch = vm.epoch();
                if state.as_ref().map(|s| s.0) != Some(epoch) {
                    if let Some((_, _old_dev, old_ctx, _)) = state.take() {
                        // A process of the old backend gets a clear error, never a hang.
                        match old_ctx.create_channel() {
                            Err(Error::DeviceLost) => {}
                            r => return Err(format!("old process after a restart: {r:?}")),
                        }
                    }
                    pid += 1;
                    let dev = Device::loopback(vm.clone(), pid).map_err(|e| e.to_string())?;
                    let ctx = dev.create_context().map_err(|e| e.to_string())?;
                    let acc = Acc::new(&ctx).map_err(|e| e.to_string())?;
                    state = Some((epoch, dev, ctx, acc));
                    self.generations.fetch_add(1, Ordering::Relaxed);
                }
                let (_, _, ctx, acc) = state.as_mut().expect("state");
                run_workload(ctx, WORKLOADS[rng.range(0, 3) as usize])?;
                let k = rng.range(1, 4);
                acc.add(k).map_err(|e| format!("accumulator: {e}"))?;
                acc.check()?;
                self.submissions.fetch_add(k, Ordering::Relaxed);
                Ok(())
            })();
            match r {
                Ok(()) => {
                    self.runs.fetch_add(1, Ordering::Release);
                }
                Err(e) => {
                    *self.error.lock().unwrap() = Some(e);
                    return;
                }
            }
        }
    }

    /// No error, and at least one more verified iteration than `since`.
    fn progressed(&self, since: u64) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            if let Some(e) = self.error() {
                return Err(format!("steady VM: {e}"));
            }
            if self.runs.load(Ordering::Acquire) > since {
                return Ok(());
            }
            if t0.elapsed() > PATIENCE {
                return Err("steady VM made no progress".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Each fault: how often injected, invariant checks made and passed.
#[derive(Default)]
struct Tally {
    rows: BTreeMap<&'static str, (u64, u64, u64)>,
    failures: Vec<String>,
}

impl Tally {
    fn injected(&mut self, fault: &'static str) {
        self.rows.entry(fault).or_default().0 += 1;
    }

    fn check(&mut self, fault: &'static str, what: &str, r: Result<(), String>) {
        let row = self.rows.entry(fault).or_default();
        row.1 += 1;
        match r {
            Ok(()) => row.2 += 1,
            Err(e) => {
                eprintln!("VIOLATION after {fault}: {what}: {e}");
                self.failures.push(format!("{fault}: {what}: {e}"));
            }
        }
    }

    fn print(&self, seed: u64, secs: u64, steady: &Steady) {
        println!("\nfault soak: {secs} s, seed {seed:#x}");
        println!("| fault | injected | checks | passed |");
        println!("|---|---:|---:|---:|");
        for (fault, (n, c, p)) in &self.rows {
            println!("| {fault} | {n} | {c} | {p} |");
        }
        println!(
            "steady VM: {} verified iterations, {} accumulator submissions, {} device generations",
            steady.runs.load(Ordering::Relaxed),
            steady.submissions.load(Ordering::Relaxed),
            steady.generations.load(Ordering::Relaxed)
        );
    }
}

/// VM `v` once its VMM is gone: disconnected, no contexts, channels, VRAM, mapped guest
/// memory or aperture left in the backend, nothing resident or swapped.
fn victim_clean(api: &ApiClient) -> Result<(), String> {
    settle(|| {
        let d = api.vm("v").map_err(|e| format!("vm: {e}"))?;
        let st = api.vm_stats("v").map_err(|e| format!("stats: {e}"))?;
        let u = &d.usage;
        if !d.connected
            && u.contexts == 0
            && u.channels == 0
            && u.vram_bytes == 0
            && u.mapped_guest_bytes == 0
            && u.aperture_bytes == 0
            && st.channels.is_empty()
            && st.vram_resident_bytes == 0
            && st.vram_swapped_bytes == 0
        {
            Ok(())
        } else {
            Err(format!(
                "VM v: connected {}, usage {u:?}, {} channels, {} B resident, {} B swapped",
                d.connected,
                st.channels.len(),
                st.vram_resident_bytes,
                st.vram_swapped_bytes
            ))
        }
    })
}

/// The backend's fd count, with the steady worker quiesced, back to `baseline`.
fn fds_back(backend: &Backend, steady: &Steady, baseline: usize) -> Result<(), String> {
    let _quiet = steady.gate.write().unwrap();
    settle(|| {
        let n = fds(backend)?;
        if n == baseline {
            Ok(())
        } else {
            Err(format!(
                "backend has {n} fds, baseline {baseline}: {:?}",
                backend.fd_targets()
            ))
        }
    })
}

/// The fd baseline: the count once it has not changed for a while, steady worker quiesced.
/// VM `v` is connected once before (with VRAM pressure, not counted), so that what the
/// backend sets up for a VM on first use (swap store, …) is in the baseline.
fn fd_baseline(backend: &Backend, steady: &Steady, api: &ApiClient, rng: &mut Rng) -> usize {
    let mut warm_up = Tally::default();
    fault_vram_pressure(&mut warm_up, rng, backend, api);
    assert!(
        warm_up.failures.is_empty(),
        "warm-up: {:?}",
        warm_up.failures
    );
    victim_clean(api).expect("warm-up VM cleans up");
    let _quiet = steady.gate.write().unwrap();
    let mut last = fds(backend).expect("fds");
    let mut stable_since = Instant::now();
    while stable_since.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(20));
        let n = fds(backend).expect("fds");
        if n != last {
            last = n;
            stable_since = Instant::now();
        }
    }
    last
}

/// Joins a guest thread within [`PATIENCE`]: its result, or an error if it hangs.
fn join_within<T: Send + 'static>(rx: &mpsc::Receiver<T>, what: &str) -> Result<T, String> {
    rx.recv_timeout(PATIENCE)
        .map_err(|_| format!("{what}: no answer within {PATIENCE:?} (hang)"))
}

/// The VMM of VM `v` disconnects abruptly while a guest thread runs workloads and a long
/// kernel is queued: the thread ends with an error, nothing it reported as done is
/// unverified.
fn fault_vmm_kill(t: &mut Tally, rng: &mut Rng, b: &Backend) {
    const F: &str = "vmm_kill";
    let vm = b.connect("v", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 1).expect("device");
    let ctx = dev.create_context().expect("context");
    let mut spin = ctx.create_channel().expect("channel");
    spin.launch(&KernelArgs::Spin { ns: 10_000_000_000 }, [1, 1, 1])
        .expect("launch");
    let fence = spin.submit().expect("submit");
    let (tx, rx) = mpsc::channel();
    let seed = rng.next();
    std::thread::spawn(move || {
        let mut rng = Rng(seed);
        let mut done = 0u64;
        let end = loop {
            match run_workload(&ctx, WORKLOADS[rng.range(0, 3) as usize]) {
                Ok(()) => done += 1,
                Err(e) if e.contains("differs") => break Err(e),
                Err(_) => break Ok(done),
            }
        };
        let waited = spin.wait(fence);
        let _ = tx.send((end, waited.is_err()));
        drop((spin, ctx, dev));
    });
    std::thread::sleep(Duration::from_millis(rng.range(0, 300)));
    t.injected(F);
    vm.disconnect();
    drop(vm);
    let r = join_within(&rx, "guest after its VMM died");
    t.check(
        F,
        "guest sees an error, every finished result verified",
        r.and_then(|(end, spin_failed)| {
            end?;
            if spin_failed {
                Ok(())
            } else {
                Err("a queued 10 s kernel completed on a dead VM".into())
            }
        }),
    );
}

/// A guest process of VM `v` is killed (its device dropped) with kernels queued; a sibling
/// process in the same VM keeps its exact accumulator, and the killed one's objects go.
fn fault_guest_kill(t: &mut Tally, rng: &mut Rng, b: &Backend, api: &ApiClient) {
    const F: &str = "guest_kill";
    let vm = b.connect("v", FaultPolicy::default());
    let sib = Device::loopback(vm.clone(), 2).expect("sibling device");
    let sib_ctx = sib.create_context().expect("sibling context");
    let mut acc = Acc::new(&sib_ctx).expect("accumulator");
    acc.add(rng.range(1, 5)).expect("accumulate");
    t.check(F, "sibling accumulator before", acc.check());

    let victim = Device::loopback(vm.clone(), 1).expect("device");
    let ctx = victim.create_context().expect("context");
    let buf = ctx.alloc_vram(4 * MIB).expect("vram");
    let mut chans = Vec::new();
    for _ in 0..rng.range(1, 3) {
        let mut ch = ctx.create_channel().expect("channel");
        ch.launch(&KernelArgs::Spin { ns: 500_000_000 }, [1, 1, 1])
            .expect("launch");
        for _ in 0..rng.range(1, 8) {
            ch.launch(
                &KernelArgs::Memset {
                    dst: buf.gpu_va(),
                    len: 4 * MIB,
                    pattern: 0xdead_beef,
                },
                [16, 1, 1],
            )
            .expect("launch");
            ch.submit().expect("submit");
        }
        chans.push(ch);
    }
    t.injected(F);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop((chans, buf, ctx, victim));
        let _ = tx.send(());
    });
    t.check(
        F,
        "killed process's teardown returns",
        join_within(&rx, "dropping a busy process"),
    );
    t.check(
        F,
        "killed process's objects freed, sibling's kept",
        settle(|| {
            let st = api.vm_stats("v").map_err(|e| e.to_string())?;
            let usage = api.vm("v").map_err(|e| e.to_string())?.usage;
            let others = st.channels.iter().filter(|c| c.pid != 2).count();
            let sibs = st.channels.iter().filter(|c| c.pid == 2).count();
            let vram: u64 = st
                .vram
                .processes
                .iter()
                .filter(|p| p.pid != 2)
                .map(|p| p.resident_bytes + p.swapped_bytes)
                .sum();
            if others == 0 && sibs == 1 && usage.contexts == 1 && vram == 0 {
                Ok(())
            } else {
                Err(format!(
                    "contexts {}, VRAM of others {vram}, channels {:?}",
                    usage.contexts,
                    st.channels
                        .iter()
                        .map(|c| (c.pid, c.channel))
                        .collect::<Vec<_>>()
                ))
            }
        }),
    );
    let r = acc.add(rng.range(1, 5)).map_err(|e| e.to_string());
    t.check(F, "sibling accumulator after", r.and_then(|()| acc.check()));
    t.check(F, "sibling workload after", run_workload(&sib_ctx, "saxpy"));
    drop((acc, sib_ctx, sib));
    vm.disconnect();
}

/// The backend is SIGKILLed (a process holding a long kernel in the steady VM) and a new
/// one started on the same sockets; the steady VM reconnects and its worker starts over.
fn fault_backend_kill(
    t: &mut Tally,
    backend: &mut Option<Backend>,
    launcher: &BackendLauncher,
    steady: &Steady,
    steady_vm: &Arc<LoopbackVm>,
) -> ApiClient {
    const F: &str = "backend_kill";
    let quiet = steady.gate.write().unwrap();
    let epoch = steady_vm.epoch();
    let old = Device::loopback(steady_vm.clone(), 900).expect("device");
    let ctx = old.create_context().expect("context");
    let mut ch = ctx.create_channel().expect("channel");
    ch.launch(&KernelArgs::Spin { ns: 60_000_000_000 }, [1, 1, 1])
        .expect("launch");
    let fence = ch.submit().expect("submit");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = ch.wait(fence);
        let _ = tx.send(matches!(r, Err(Error::DeviceLost)));
    });
    t.injected(F);
    backend.take().expect("backend").kill();
    t.check(
        F,
        "waiting process gets DeviceLost",
        join_within(&rx, "fence wait across a backend kill").and_then(|lost| {
            if lost {
                Ok(())
            } else {
                Err("not DeviceLost".into())
            }
        }),
    );
    let mut b = launcher.start();
    let api = b.api();
    *backend = Some(b);
    t.check(
        F,
        "steady VM reconnects",
        settle(|| {
            if steady_vm.live_in(epoch + 1) {
                Ok(())
            } else {
                Err(format!("generation {}", steady_vm.epoch()))
            }
        }),
    );
    let r = match ctx.create_channel() {
        Err(Error::DeviceLost) => Ok(()),
        r => Err(format!("old process: {r:?}")),
    };
    t.check(F, "old process gets DeviceLost", r);
    drop((ctx, old, quiet));
    api
}

/// Weight and VRAM quota of the steady VM changed over the control API while it works.
fn fault_api_change(t: &mut Tally, rng: &mut Rng, api: &ApiClient) {
    const F: &str = "weight_quota";
    let weight = rng.range(10, 1000) as u32;
    let quota = rng.range(16, 64) * MIB;
    t.injected(F);
    let r = api
        .set_weight("s", weight)
        .map_err(|e| e.to_string())
        .and_then(|_| api.set_vram_quota("s", quota).map_err(|e| e.to_string()))
        .and_then(|_| api.vm_stats("s").map_err(|e| e.to_string()))
        .and_then(|st| {
            if st.weight == weight && st.vram_quota_bytes == quota {
                Ok(())
            } else {
                Err(format!(
                    "asked weight {weight} quota {quota}, got {} {}",
                    st.weight, st.vram_quota_bytes
                ))
            }
        });
    t.check(F, "API applies weight and quota", r);
}

/// VM `v` allocates beyond its 16 MiB quota: the VRAM manager evicts or spills, and every
/// buffer still reads back what was written, by GPU checksum and through the CPU.
fn fault_vram_pressure(t: &mut Tally, rng: &mut Rng, b: &Backend, api: &ApiClient) {
    const F: &str = "vram_pressure";
    let before = api.vm_stats("v").expect("stats").vram;
    let vm = b.connect("v", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 1).expect("device");
    let ctx = dev.create_context().expect("context");
    let n = rng.range(8, 10) as u8;
    let seed = rng.range(1, 200) as u8;
    t.injected(F);
    let r = (|| -> Result<Result<(), String>, String> {
        let bufs = (0..n)
            .map(|i| {
                let b = ctx.alloc_vram(4 * MIB).map_err(|e| e.to_string())?;
                b.fill(0, 4 * MIB, seed.wrapping_add(i))
                    .map_err(|e| e.to_string())?;
                Ok(b)
            })
            .collect::<Result<Vec<_>, String>>()?;
        run_workload(&ctx, "sgemm")?;
        // Over its quota: the VRAM manager evicts or spills some of it (checked once the
        // buffers are verified).
        let evicted = settle(|| {
            let v = api.vm_stats("v").map_err(|e| e.to_string())?.vram;
            if v.evictions + v.spilled_chunks > before.evictions + before.spilled_chunks {
                Ok(())
            } else {
                Err(format!("no eviction or spill over the quota: {v:?}"))
            }
        });
        let mut ch = ctx.create_channel().map_err(|e| e.to_string())?;
        let sum = ctx.alloc_host(4096).map_err(|e| e.to_string())?;
        for (i, b) in bufs.iter().enumerate() {
            let want = vec![seed.wrapping_add(i as u8); b.len() as usize];
            ch.launch(
                &KernelArgs::Checksum {
                    src: b.gpu_va(),
                    len: b.len(),
                    dst: sum.gpu_va(),
                },
                [1, 1, 1],
            )
            .map_err(|e| e.to_string())?;
            let f = ch.submit().map_err(|e| e.to_string())?;
            ch.wait(f).map_err(|e| e.to_string())?;
            if sum.read_u64(0).map_err(|e| e.to_string())? != reference::checksum(&want) {
                return Err(format!("buffer {i}: GPU checksum differs"));
            }
            let mut got = vec![0u8; want.len()];
            b.read(0, &mut got).map_err(|e| e.to_string())?;
            if got != want {
                return Err(format!("buffer {i}: CPU read differs"));
            }
        }
        Ok(evicted)
    })();
    t.check(
        F,
        "every buffer intact under pressure",
        r.and_then(|evicted| evicted),
    );
    drop((ctx, dev));
    vm.disconnect();
}

/// The frontend of VM `v` refuses SHMEM_MAP: creating a channel fails cleanly (an error,
/// not a lost device), and works again once maps are allowed.
fn fault_refuse_maps(t: &mut Tally, b: &Backend, api: &ApiClient) {
    const F: &str = "refuse_maps";
    let vm = b.connect("v", FaultPolicy::default());
    let dev = Device::loopback(vm.clone(), 1).expect("device");
    let ctx = dev.create_context().expect("context");
    let maps = vm.shmem_maps();
    t.injected(F);
    vm.refuse_maps(true);
    let r = match ctx.create_channel() {
        Ok(_) => Err(format!(
            "channel created with maps refused ({} maps served)",
            vm.shmem_maps() - maps
        )),
        Err(Error::DeviceLost) => Err("DeviceLost for a refused map".into()),
        Err(_) if !vm.is_connected() => Err("the VM was disconnected".into()),
        Err(_) => Ok(()),
    };
    t.check(F, "refused map is a clean error", r);
    t.check(
        F,
        "no channel left behind",
        settle(|| {
            let st = api.vm_stats("v").map_err(|e| e.to_string())?;
            if st.channels.is_empty() {
                Ok(())
            } else {
                Err(format!("{} channels", st.channels.len()))
            }
        }),
    );
    vm.refuse_maps(false);
    t.check(
        F,
        "works again once maps allowed",
        run_workload(&ctx, "saxpy"),
    );
    drop((ctx, dev));
    vm.disconnect();
}

const FAULTS: [&str; 6] = [
    "vmm_kill",
    "guest_kill",
    "backend_kill",
    "weight_quota",
    "vram_pressure",
    "refuse_maps",
];

#[test]
fn fault_soak() {
    let secs = env_u64("VGPU_SOAK_SECS", DEFAULT_SECS);
    let seed = env_u64("VGPU_SOAK_SEED", DEFAULT_SEED);
    println!("fault soak: {secs} s, seed {seed:#x} (VGPU_SOAK_SEED={seed:#x} replays it)");
    let mut rng = Rng(seed);
    let launcher = launcher();
    let mut backend = Some(launcher.start());
    let mut api = backend.as_mut().expect("backend").api();

    let steady = Arc::new(Steady::default());
    let steady_vm = backend
        .as_ref()
        .expect("backend")
        .connect("s", reconnecting());
    let worker = {
        let (s, vm, seed) = (steady.clone(), steady_vm.clone(), rng.next());
        std::thread::spawn(move || s.worker(vm, seed))
    };
    steady.progressed(0).expect("steady VM starts");
    let mut baseline = fd_baseline(backend.as_ref().expect("backend"), &steady, &api, &mut rng);

    let mut t = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(secs);
    // Every kind once first (in order), then at random; backend kills are rarer.
    let mut order: Vec<usize> = (0..FAULTS.len()).rev().collect();
    while Instant::now() < deadline && t.failures.is_empty() {
        let k = if let Some(k) = order.pop() {
            k
        } else {
            let roll = rng.range(0, 19);
            if roll == 0 {
                2
            } else {
                [0, 1, 3, 4, 5][(roll % 5) as usize]
            }
        };
        let fault = FAULTS[k];
        let since = steady.runs.load(Ordering::Acquire);
        match k {
            0 => fault_vmm_kill(&mut t, &mut rng, backend.as_ref().expect("backend")),
            1 => fault_guest_kill(&mut t, &mut rng, backend.as_ref().expect("backend"), &api),
            2 => {
                api = fault_backend_kill(&mut t, &mut backend, &launcher, &steady, &steady_vm);
            }
            3 => fault_api_change(&mut t, &mut rng, &api),
            4 => fault_vram_pressure(&mut t, &mut rng, backend.as_ref().expect("backend"), &api),
            _ => fault_refuse_maps(&mut t, backend.as_ref().expect("backend"), &api),
        }
        let b = backend.as_mut().expect("backend");
        t.check(fault, "backend alive", b.alive());
        t.check(fault, "steady VM unaffected", steady.progressed(since));
        if k == 2 {
            // A new process: its baseline once the steady VM works in it again.
            baseline = fd_baseline(b, &steady, &api, &mut rng);
        } else {
            t.check(fault, "victim VM's objects freed", victim_clean(&api));
            t.check(
                fault,
                "backend fds back to baseline",
                fds_back(b, &steady, baseline),
            );
        }
    }

    steady.stop.store(true, Ordering::Release);
    worker.join().expect("steady worker");
    t.check(
        "end",
        "steady VM never saw an error",
        steady.error().map_or(Ok(()), Err),
    );
    t.print(seed, secs, &steady);
    assert!(
        t.failures.is_empty(),
        "fault soak: {} violations (seed {seed:#x}):\n{}",
        t.failures.len(),
        t.failures.join("\n")
    );
    for f in FAULTS {
        assert!(t.rows.get(f).is_some_and(|r| r.0 > 0), "{f} never injected");
    }
    steady_vm.disconnect();
    drop(backend);
}
