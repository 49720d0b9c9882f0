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

/// Asks that the calling thread's timed sleeps end within about a microsecond of their
/// time instead of Linux's default 50 µs of slack: a poller that naps 10 µs would
/// otherwise nap 60 (measured: the slack was most of a small kernel's loop overhead).
pub fn tight_timer_slack() {
    const SLACK_NS: libc::c_ulong = 1_000;
    // SAFETY: prctl with integer arguments only; it changes this thread's timer slack.
    let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, SLACK_NS, 0, 0, 0) };
    if rc != 0 {
        log::debug!("PR_SET_TIMERSLACK: {}", std::io::Error::last_os_error());
    }
}
