//! The GPU clock: CLOCK_MONOTONIC in nanoseconds, comparable across processes on one host.

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

/// CPU time consumed by the calling thread, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as above; CLOCK_THREAD_CPUTIME_ID always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Waits until `deadline_ns`: sleeps while far away, spins for the last stretch so that
/// timed kernels end within a few microseconds of their deadline without burning a core.
pub fn sleep_until(deadline_ns: u64, spin_window_ns: u64) {
    loop {
        let now = now_ns();
        if now >= deadline_ns {
            return;
        }
        let left = deadline_ns - now;
        if left > spin_window_ns {
            std::thread::sleep(std::time::Duration::from_nanos(left - spin_window_ns));
        } else {
            std::hint::spin_loop();
        }
    }
}
