//! `vgpu-smoke`'s checks, written against the public runtime API so they run over every
//! transport: every builtin kernel on VRAM and on host (guest-RAM) buffers, the copy
//! engine, a fault, and — where the transport has a driver — blocking waits woken by
//! notify events and by the GPU's fence wake-up. Every result is compared with the CPU reference
//! (`vgpu_protocol::reference`; the builtin kernels are bit-identical to it).

use std::time::{Duration, Instant};

use vgpu_guest::workloads::XorShift;
use vgpu_guest::{Buffer, Channel, Context, Device, Error, ErrorCode, KernelArgs, MemKind};
use vgpu_protocol::reference;

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    /// `None`: passed; `Some(reason)`: failed.
    pub failure: Option<String>,
    /// Not applicable on this transport (counts as neither pass nor fail).
    pub skipped: bool,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.failure.is_none() && !self.skipped
    }
}

type R = Result<(), String>;

fn e2s(e: Error) -> String {
    e.to_string()
}

fn mismatch<T: std::fmt::Debug>(what: &str, i: usize, got: T, want: T) -> String {
    format!("{what}: element {i}: got {got:?}, want {want:?}")
}

fn bytes_of_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn same_f32(what: &str, got: &[f32], want: &[f32]) -> R {
    let (g, w) = (bytes_of_f32(got), bytes_of_f32(want));
    match g.iter().zip(&w).position(|(a, b)| a != b) {
        Some(i) => Err(mismatch(what, i, got[i], want[i])),
        None if g.len() != w.len() => Err(format!("{what}: length differs")),
        None => Ok(()),
    }
}

fn same_bytes(what: &str, got: &[u8], want: &[u8]) -> R {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => Err(mismatch(what, i, got[i], want[i])),
        None if got.len() != want.len() => Err(format!("{what}: length differs")),
        None => Ok(()),
    }
}

struct Env {
    ctx: Context,
    ch: Channel,
    kind: MemKind,
    rng: XorShift,
}

impl Env {
    fn buf(&self, bytes: u64) -> Result<Buffer, String> {
        self.ctx.alloc(self.kind, bytes).map_err(e2s)
    }

    fn run(&mut self, args: &KernelArgs) -> R {
        self.ch.launch(args, [1, 1, 1]).map_err(e2s)?;
        let f = self.ch.submit().map_err(e2s)?;
        self.ch
            .wait_timeout(f, Duration::from_secs(60))
            .map_err(e2s)
    }

    fn empty(&mut self) -> R {
        self.run(&KernelArgs::Empty)
    }

    fn spin(&mut self) -> R {
        let t = Instant::now();
        self.run(&KernelArgs::Spin { ns: 2_000_000 })?;
        // A spin kernel occupies its engine for its whole length.
        if t.elapsed() < Duration::from_millis(2) {
            return Err(format!("2 ms spin finished after {:?}", t.elapsed()));
        }
        Ok(())
    }

    fn memset(&mut self) -> R {
        let n = 16 << 10;
        let b = self.buf(n * 4)?;
        b.fill(0, n * 4, 0x11).map_err(e2s)?;
        let args = KernelArgs::Memset {
            dst: b.gpu_va() + 64,
            len: n * 4 - 128,
            pattern: 0xdead_beef,
        };
        self.run(&args)?;
        let got = b.read_u32_vec(0, n as usize).map_err(e2s)?;
        for (i, &v) in got.iter().enumerate() {
            let inside = (16..n as usize - 16).contains(&i);
            let want = if inside { 0xdead_beef } else { 0x1111_1111 };
            if v != want {
                return Err(mismatch("memset", i, v, want));
            }
        }
        Ok(())
    }

    fn memcpy(&mut self) -> R {
        let len = 40_000usize;
        let data = self.rng.bytes(len);
        let src = self.buf(len as u64)?;
        let dst = self.buf(len as u64)?;
        src.write(0, &data).map_err(e2s)?;
        self.run(&KernelArgs::Memcpy {
            dst: dst.gpu_va(),
            src: src.gpu_va(),
            len: len as u64,
        })?;
        let mut got = vec![0u8; len];
        dst.read(0, &mut got).map_err(e2s)?;
        same_bytes("memcpy", &got, &data)
    }

    fn saxpy(&mut self) -> R {
        let n = 10_000usize;
        let x = self.rng.f32_vec(n);
        let mut y = self.rng.f32_vec(n);
        let (bx, by) = (self.buf(n as u64 * 4)?, self.buf(n as u64 * 4)?);
        bx.write_f32(0, &x).map_err(e2s)?;
        by.write_f32(0, &y).map_err(e2s)?;
        self.run(&KernelArgs::Saxpy {
            x: bx.gpu_va(),
            y: by.gpu_va(),
            n: n as u64,
            a: 1.75,
        })?;
        reference::saxpy(1.75, &x, &mut y);
        same_f32("saxpy", &by.read_f32_vec(0, n).map_err(e2s)?, &y)
    }

    fn sgemm(&mut self) -> R {
        let (m, n, k) = (33usize, 17usize, 29usize);
        let a = self.rng.f32_vec(m * k);
        let b = self.rng.f32_vec(k * n);
        let mut c = self.rng.f32_vec(m * n);
        let ba = self.buf((m * k * 4) as u64)?;
        let bb = self.buf((k * n * 4) as u64)?;
        let bc = self.buf((m * n * 4) as u64)?;
        ba.write_f32(0, &a).map_err(e2s)?;
        bb.write_f32(0, &b).map_err(e2s)?;
        bc.write_f32(0, &c).map_err(e2s)?;
        self.run(&KernelArgs::Sgemm {
            a: ba.gpu_va(),
            b: bb.gpu_va(),
            c: bc.gpu_va(),
            m: m as u32,
            n: n as u32,
            k: k as u32,
            alpha: 0.5,
            beta: -1.25,
        })?;
        reference::sgemm(m, n, k, 0.5, &a, &b, -1.25, &mut c);
        same_f32("sgemm", &bc.read_f32_vec(0, m * n).map_err(e2s)?, &c)
    }

    fn reduce_sum(&mut self) -> R {
        let n = 50_000usize;
        let x = self.rng.f32_vec(n);
        let bx = self.buf(n as u64 * 4)?;
        let out = self.buf(4096)?;
        bx.write_f32(0, &x).map_err(e2s)?;
        self.run(&KernelArgs::ReduceSum {
            src: bx.gpu_va(),
            n: n as u64,
            dst: out.gpu_va() + 12,
        })?;
        let got = out.read_f32_vec(12, 1).map_err(e2s)?;
        same_f32("reduce_sum", &got, &[reference::reduce_sum(&x)])
    }

    fn checksum(&mut self) -> R {
        let len = 100_003usize;
        let data = self.rng.bytes(len);
        let src = self.buf(len as u64)?;
        let out = self.buf(4096)?;
        src.write(0, &data).map_err(e2s)?;
        self.run(&KernelArgs::Checksum {
            src: src.gpu_va(),
            len: len as u64,
            dst: out.gpu_va() + 8,
        })?;
        let (got, want) = (out.read_u64(8).map_err(e2s)?, reference::checksum(&data));
        (got == want)
            .then_some(())
            .ok_or_else(|| format!("checksum: got {got:#x}, want {want:#x}"))
    }

    fn stencil2d(&mut self) -> R {
        let (w, h) = (97usize, 61usize);
        let src = self.rng.f32_vec(w * h);
        let mut want = vec![0f32; w * h];
        let bs = self.buf((w * h * 4) as u64)?;
        let bd = self.buf((w * h * 4) as u64)?;
        bs.write_f32(0, &src).map_err(e2s)?;
        self.run(&KernelArgs::Stencil2d {
            src: bs.gpu_va(),
            dst: bd.gpu_va(),
            width: w as u32,
            height: h as u32,
            c_center: 0.6,
            c_neighbor: 0.1,
        })?;
        reference::stencil2d(w, h, 0.6, 0.1, &src, &mut want);
        same_f32("stencil2d", &bd.read_f32_vec(0, w * h).map_err(e2s)?, &want)
    }

    fn timestamp(&mut self) -> R {
        let out = self.buf(4096)?;
        let first = KernelArgs::Timestamp { dst: out.gpu_va() };
        let second = KernelArgs::Timestamp {
            dst: out.gpu_va() + 8,
        };
        self.ch.launch(&first, [1, 1, 1]).map_err(e2s)?;
        self.ch
            .launch(&KernelArgs::Spin { ns: 100_000 }, [1, 1, 1])
            .map_err(e2s)?;
        self.ch.launch(&second, [1, 1, 1]).map_err(e2s)?;
        let f = self.ch.submit().map_err(e2s)?;
        self.ch
            .wait_timeout(f, Duration::from_secs(60))
            .map_err(e2s)?;
        let (a, b) = (out.read_u64(0).map_err(e2s)?, out.read_u64(8).map_err(e2s)?);
        if a == 0 || b < a + 100_000 {
            return Err(format!("timestamps {a} then {b} around a 100 us spin"));
        }
        Ok(())
    }

    fn copy_engine(&mut self) -> R {
        let len = 3 * 4096 + 123;
        let data = self.rng.bytes(len);
        let src = self.buf(len as u64)?;
        let dst = self.buf(len as u64)?;
        src.write(0, &data).map_err(e2s)?;
        self.ch
            .copy(dst.gpu_va(), src.gpu_va(), len as u64)
            .map_err(e2s)?;
        let f = self.ch.submit().map_err(e2s)?;
        self.ch
            .wait_timeout(f, Duration::from_secs(60))
            .map_err(e2s)?;
        let mut got = vec![0u8; len];
        dst.read(0, &mut got).map_err(e2s)?;
        same_bytes("copy", &got, &data)
    }
}

/// A memcpy from one kind of buffer into the other (VRAM ⇄ guest RAM).
fn mixed_copy(ctx: &Context) -> R {
    let mut ch = ctx.create_channel().map_err(e2s)?;
    let len = 20_000usize;
    let data = XorShift::new(7).bytes(len);
    let vram = ctx.alloc(MemKind::Vram, len as u64).map_err(e2s)?;
    let host = ctx.alloc(MemKind::Host, len as u64).map_err(e2s)?;
    host.write(0, &data).map_err(e2s)?;
    ch.launch(
        &KernelArgs::Memcpy {
            dst: vram.gpu_va(),
            src: host.gpu_va(),
            len: len as u64,
        },
        [1, 1, 1],
    )
    .map_err(e2s)?;
    ch.finish().map_err(e2s)?;
    let mut got = vec![0u8; len];
    vram.read(0, &mut got).map_err(e2s)?;
    same_bytes("host->vram memcpy", &got, &data)
}

/// A kernel writing to an unmapped address faults its channel, and only its channel.
fn fault_is_reported(ctx: &Context) -> R {
    let mut bad = ctx.create_channel().map_err(e2s)?;
    bad.launch(
        &KernelArgs::Memset {
            dst: 0x10_0000, // below every range the runtime maps
            len: 4096,
            pattern: 1,
        },
        [1, 1, 1],
    )
    .map_err(e2s)?;
    let f = bad.submit().map_err(e2s)?;
    match bad.wait_timeout(f, Duration::from_secs(60)) {
        Err(Error::ChannelFault {
            code: ErrorCode::MmuFault,
            ..
        }) => {}
        other => return Err(format!("expected an MMU fault, got {other:?}")),
    }
    let mut good = ctx.create_channel().map_err(e2s)?;
    good.launch(&KernelArgs::Empty, [1, 1, 1]).map_err(e2s)?;
    good.finish().map_err(e2s)
}

/// Freeing a buffer while a queued kernel still targets it: the kernel faults or finishes
/// before the free completes; it never writes into VRAM that was handed to someone else
/// (here: another context's buffer).
fn free_mid_kernel(dev: &Device, ctx: &Context) -> R {
    const LEN: u64 = 1 << 20;
    let mut ch = ctx.create_channel().map_err(e2s)?;
    let victim = ctx.alloc_vram(LEN).map_err(e2s)?;
    // Long enough for the free (two requests) to land while the spin runs, even in a
    // nested VM on a loaded host; the spin sleeps, it costs no CPU.
    ch.launch(&KernelArgs::Spin { ns: 1_000_000_000 }, [1, 1, 1])
        .map_err(e2s)?;
    ch.launch(
        &KernelArgs::Memset {
            dst: victim.gpu_va(),
            len: LEN,
            pattern: 0xbad0_bad0,
        },
        [1, 1, 1],
    )
    .map_err(e2s)?;
    let f = ch.submit().map_err(e2s)?;
    drop(victim);
    let other = dev.create_context().map_err(e2s)?;
    let fresh = other.alloc_vram(LEN).map_err(e2s)?;
    fresh.fill(0, LEN, 0x5a).map_err(e2s)?;
    // Two outcomes are right, and which one comes depends on whether the GPU planned
    // the memset before the free arrived (a free through a GPU worker process takes two
    // socket hops longer): the memset faults (planned after the unmap), or it completes
    // on the buffer before the free does (the GPU drains before freed memory is reused).
    // Wrong is only a write that reaches memory someone else got: checked below.
    match ch.wait_timeout(f, Duration::from_secs(60)) {
        Err(Error::ChannelFault {
            code: ErrorCode::MmuFault,
            ..
        })
        | Ok(()) => {}
        other => {
            return Err(format!(
                "expected an MMU fault or completion, got {other:?}"
            ))
        }
    }
    let mut got = vec![0u8; LEN as usize];
    fresh.read(0, &mut got).map_err(e2s)?;
    match got.iter().position(|&b| b != 0x5a) {
        Some(i) => Err(format!("byte {i} of another context's buffer changed")),
        None => Ok(()),
    }
}

/// Outcome of a check that needs a kernel driver.
enum Blocking {
    Ok,
    Unsupported,
}

/// Sleeps in the driver: on a notify event, and on a fence.
fn blocking_waits(ctx: &Context) -> Result<Blocking, String> {
    let mut ch = ctx.create_channel().map_err(e2s)?;
    ch.launch(&KernelArgs::Spin { ns: 1_000_000 }, [1, 1, 1])
        .map_err(e2s)?;
    ch.notify(0x5eed).map_err(e2s)?;
    let f = ch.submit().map_err(e2s)?;
    match ch.block_on_notify(1, Duration::from_secs(60)) {
        Err(Error::Device(ErrorCode::Unsupported)) => return Ok(Blocking::Unsupported),
        r => r.map_err(|e| format!("notify wait: {e}"))?,
    }
    ch.block_on(f, Duration::from_secs(60))
        .map_err(|e| format!("fence wait: {e}"))?;
    if ch.notify_seq() != 1 {
        return Err(format!("NOTIFY_SEQ {} after one notify", ch.notify_seq()));
    }
    // A fence that does not come in time times out cleanly. The kernel is long (1 s) so
    // that a guest vCPU descheduled for a while (nested virtualization, a loaded host)
    // does not wake up to a finished fence.
    ch.launch(&KernelArgs::Spin { ns: 1_000_000_000 }, [1, 1, 1])
        .map_err(e2s)?;
    let slow = ch.submit().map_err(e2s)?;
    match ch.block_on(slow, Duration::from_millis(5)) {
        Err(Error::Timeout) => {}
        other => return Err(format!("expected a timeout, got {other:?}")),
    }
    // Its plain wait outlasts the naps (10 ms): it arms the page and sleeps in the
    // driver until the GPU's fence wake-up (protocol.md §2.2). A forwarded channel's page
    // is the driver's copy, where nothing arms the GPU: its waits poll.
    let (sleeps, woken) = ch.fence_sleeps();
    ch.wait(slow).map_err(e2s)?;
    let (sleeps, woken) = (ch.fence_sleeps().0 - sleeps, ch.fence_sleeps().1 - woken);
    if !ch.is_forwarded() && (sleeps == 0 || woken == 0) {
        return Err(format!(
            "a 1 s wait slept {sleeps} times in the driver, {woken} ended before their time"
        ));
    }
    Ok(Blocking::Ok)
}

/// Runs every check on `dev`; never stops at the first failure.
pub fn run(dev: &Device, seed: u64) -> Vec<Check> {
    let mut out = Vec::new();
    let mut record = |name: String, r: R| {
        out.push(Check {
            name,
            failure: r.err(),
            skipped: false,
        })
    };
    let ctx = match dev.create_context() {
        Ok(c) => c,
        Err(e) => {
            record("create_context".into(), Err(e2s(e)));
            return out;
        }
    };
    type Step = fn(&mut Env) -> R;
    let steps: [(&str, Step); 11] = [
        ("empty", Env::empty),
        ("spin", Env::spin),
        ("memset", Env::memset),
        ("memcpy", Env::memcpy),
        ("saxpy", Env::saxpy),
        ("sgemm", Env::sgemm),
        ("reduce_sum", Env::reduce_sum),
        ("checksum", Env::checksum),
        ("stencil2d", Env::stencil2d),
        ("timestamp", Env::timestamp),
        ("copy_engine", Env::copy_engine),
    ];
    for (kind, label) in [(MemKind::Vram, "vram"), (MemKind::Host, "host")] {
        let ch = match ctx.create_channel() {
            Ok(c) => c,
            Err(e) => {
                record(format!("{label}/create_channel"), Err(e2s(e)));
                continue;
            }
        };
        let mut env = Env {
            ctx: ctx.clone(),
            ch,
            kind,
            rng: XorShift::new(seed),
        };
        for (name, step) in steps {
            let r = step(&mut env);
            record(format!("{label}/{name}"), r);
        }
    }
    record("mixed/host_to_vram".into(), mixed_copy(&ctx));
    record("fault/mmu".into(), fault_is_reported(&ctx));
    record("fault/free_mid_kernel".into(), free_mid_kernel(dev, &ctx));
    match blocking_waits(&ctx) {
        Ok(Blocking::Ok) => record("wait/notify_and_fence".into(), Ok(())),
        Ok(Blocking::Unsupported) => out.push(Check {
            name: "wait/notify_and_fence".into(),
            failure: None,
            skipped: true,
        }),
        Err(e) => record("wait/notify_and_fence".into(), Err(e)),
    }
    out
}
