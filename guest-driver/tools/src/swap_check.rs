//! `vgpu-smoke --swap`: a guest process's CPU stores through a VRAM buffer's aperture while
//! the backend moves that buffer's chunks between VRAM and the VM's swap store.
//!
//! One thread writes the buffer page by page through its CPU mapping (the aperture in the
//! BAR), each pass with new values, and reads every page back after the pass. Meanwhile the
//! main thread allocates and GPU-fills VRAM beyond the VM's share and frees it again, so
//! the backend's VRAM manager evicts the buffer (its chunks are the VM's coldest: the GPU
//! never touches them) and swaps it back in. During each move the backend holds the chunk's
//! aperture read-only; a store then waits in the VMM (KVM_RUN's EFAULT in `vgpu-vmm`) and
//! lands in the new copy. A lost store shows up as a wrong word in the next read-back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vgpu_guest::{Buffer, Device, KernelArgs};

const PAGE: usize = 4096;
const MIB: u64 = 1 << 20;
/// Pressure allocations are made in pieces of this size.
const PIECE: u64 = 8 * MIB;

/// What the check did.
#[derive(Debug, Clone, Default)]
pub struct SwapCheck {
    /// Complete write + read-back passes over the buffer.
    pub passes: u64,
    /// Pressure rounds (allocate beyond the share, fill, free).
    pub pressure_rounds: u64,
    /// Most pressure bytes held at once.
    pub pressure_peak_bytes: u64,
    /// The first lost or wrong store, if any.
    pub failure: Option<String>,
}

/// The word stored at word `i` of page `page` in pass `pass`.
fn word(pass: u64, page: usize, i: usize) -> u64 {
    (pass << 40) | ((page as u64) << 12) | i as u64
}

/// One pass: writes every page (one page per store sequence), then reads every page back.
fn pass(buf: &Buffer, n: u64) -> Result<(), String> {
    let pages = buf.len() as usize / PAGE;
    let mut page = vec![0u8; PAGE];
    for p in 0..pages {
        for (i, w) in page.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&word(n, p, i).to_le_bytes());
        }
        buf.write((p * PAGE) as u64, &page)
            .map_err(|e| format!("pass {n}: write page {p}: {e}"))?;
    }
    for p in 0..pages {
        buf.read((p * PAGE) as u64, &mut page)
            .map_err(|e| format!("pass {n}: read page {p}: {e}"))?;
        for (i, w) in page.chunks_exact(8).enumerate() {
            let got = u64::from_le_bytes(w.try_into().unwrap_or_default());
            if got != word(n, p, i) {
                return Err(format!(
                    "pass {n}: page {p} word {i}: got {got:#x}, want {:#x} (a store was lost)",
                    word(n, p, i)
                ));
            }
        }
    }
    Ok(())
}

/// Runs for `duration`: a `buffer_mib` MiB buffer written and checked through the CPU while
/// up to `pressure_mib` MiB of GPU-filled VRAM come and go beside it.
pub fn run(dev: &Device, duration: Duration, buffer_mib: u64, pressure_mib: u64) -> SwapCheck {
    let mut out = SwapCheck::default();
    let ctx = match dev.create_context() {
        Ok(c) => c,
        Err(e) => {
            out.failure = Some(format!("create context: {e}"));
            return out;
        }
    };
    let buf = match ctx.alloc_vram(buffer_mib * MIB) {
        Ok(b) => b,
        Err(e) => {
            out.failure = Some(format!("allocate the {buffer_mib} MiB buffer: {e}"));
            return out;
        }
    };
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let stop = &stop;
    let writer = std::thread::scope(|s| {
        // The buffer moves to the writer (its CPU view is not shared between threads).
        let writer = s.spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                if let Err(e) = pass(&buf, n) {
                    return (n - 1, Some(e));
                }
            }
            (n, None)
        });
        let mut ch = ctx.create_channel();
        while t0.elapsed() < duration && !writer.is_finished() {
            let ch = match &mut ch {
                Ok(ch) => ch,
                Err(e) => {
                    out.failure = Some(format!("create channel: {e}"));
                    break;
                }
            };
            let mut held = Vec::new();
            for k in 0..pressure_mib / (PIECE / MIB) {
                // Past the VM's VRAM and swap limits an allocation fails: hold what we got.
                let Ok(b) = ctx.alloc_vram(PIECE) else { break };
                let fill = KernelArgs::Memset {
                    dst: b.gpu_va(),
                    len: PIECE,
                    pattern: k as u32 + 1,
                };
                if let Err(e) = ch.launch(&fill, [1, 1, 1]) {
                    out.failure = Some(format!("launch memset: {e}"));
                    break;
                }
                held.push(b);
            }
            out.pressure_peak_bytes = out.pressure_peak_bytes.max(held.len() as u64 * PIECE);
            if let Err(e) = ch.submit().and_then(|f| ch.wait(f)) {
                out.failure = Some(format!("pressure kernels: {e}"));
                break;
            }
            // Keep the pressure hot for a while, so the VRAM manager exchanges it for the
            // cold buffer, then free it, so the manager brings the buffer back.
            for _ in 0..3 {
                std::thread::sleep(Duration::from_millis(100));
                // One page per 2 MiB chunk: recency is kept per chunk.
                for b in &held {
                    for off in (0..PIECE).step_by(2 << 20) {
                        let touch = KernelArgs::Memset {
                            dst: b.gpu_va() + off,
                            len: PAGE as u64,
                            pattern: 7,
                        };
                        if let Err(e) = ch.launch(&touch, [1, 1, 1]) {
                            out.failure = Some(format!("launch memset: {e}"));
                        }
                    }
                }
                if let Err(e) = ch.submit().and_then(|f| ch.wait(f)) {
                    out.failure = Some(format!("pressure kernels: {e}"));
                }
            }
            drop(held);
            std::thread::sleep(Duration::from_millis(300));
            out.pressure_rounds += 1;
        }
        stop.store(true, Ordering::Relaxed);
        writer.join()
    });
    match writer {
        Ok((passes, failure)) => {
            out.passes = passes;
            if failure.is_some() {
                out.failure = failure;
            }
        }
        Err(_) => out.failure = Some("the writer thread panicked".into()),
    }
    if out.failure.is_none() && out.passes == 0 {
        out.failure = Some("no pass completed".into());
    }
    out
}
