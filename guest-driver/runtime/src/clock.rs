//! The clock the runtime stamps submissions with: CLOCK_MONOTONIC in nanoseconds. On a
//! host it is the GPU clock (`vgpu_host_shim::clock`), so host-side benchmarks can time
//! a store to GP_PUT against the kernel start the GPU reports; in a VM it is the guest's.

/// Nanoseconds of CLOCK_MONOTONIC.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
