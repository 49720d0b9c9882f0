//! What a CUDA context per process costs (issue 30's worker processes): device memory per
//! context and the time a process takes from `cuInit` to a usable primary context.
//!
//! `cargo run --release -p vgpu-host-shim --example cuda_context_cost -- [N]` on a machine
//! with an NVIDIA GPU: the parent takes a context and reads the free device memory, then
//! starts N child processes one after another; each takes the primary context (what
//! `CudaGpu::open` does), reports how long that took and waits; the parent reads the free
//! memory after each. Prints one line per child and a summary.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use cudarc::driver::sys;

fn check(call: &str, r: sys::CUresult) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call}: {r:?}"))
    }
}

/// Initializes the driver and makes device 0's primary context current.
fn primary_context() -> Result<(), String> {
    let mut dev = 0;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: plain driver calls with valid out-pointers; the context stays retained for
    // the process's life (this program never releases it).
    unsafe {
        check("cuInit", sys::cuInit(0))?;
        check("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0))?;
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
        )?;
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
    }
    Ok(())
}

/// Free device memory, bytes (needs a current context).
fn free_bytes() -> Result<u64, String> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; a context is current.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok(free as u64)
}

fn child() -> Result<(), String> {
    let t0 = Instant::now();
    primary_context()?;
    // One tiny allocation, as a worker's first VRAM would be: the context is fully set up.
    let mut p = 0;
    // SAFETY: valid out-pointer; a context is current.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, 4096) })?;
    println!("READY {}", t0.elapsed().as_micros());
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    // Hold the context until the parent closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    Ok(())
}

fn parent(n: usize) -> Result<(), String> {
    primary_context()?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut free = free_bytes()?;
    let mut children = Vec::new();
    let (mut mem, mut start) = (Vec::new(), Vec::new());
    for i in 0..n {
        let mut c = Command::new(&exe)
            .arg("--child")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let out = c.stdout.take().ok_or("no child stdout")?;
        let mut line = String::new();
        BufReader::new(out)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let us: u64 = line
            .strip_prefix("READY ")
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| format!("child {i}: {line:?}"))?;
        let now = free_bytes()?;
        let used = free.saturating_sub(now);
        free = now;
        println!(
            "context {}: {:.1} MiB of device memory, ready after {:.1} ms",
            i + 1,
            used as f64 / (1 << 20) as f64,
            us as f64 / 1e3
        );
        mem.push(used);
        start.push(us);
        children.push(c);
    }
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    mem.sort_unstable();
    start.sort_unstable();
    if let (Some(m), Some(s)) = (mem.get(mem.len() / 2), start.get(start.len() / 2)) {
        println!(
            "median of {n}: {:.1} MiB per context, {:.1} ms from cuInit to a usable context",
            *m as f64 / (1 << 20) as f64,
            *s as f64 / 1e3
        );
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = if args.get(1).map(String::as_str) == Some("--child") {
        child()
    } else {
        let n = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(8);
        parent(n)
    };
    if let Err(e) = r {
        eprintln!("cuda_context_cost: {e}");
        std::process::exit(1);
    }
}
