//! What the NVIDIA driver (libcuda, loaded at run time) may do in any thread that calls
//! it. In `vgpu-backend --gpu cuda` (in-process GPU) the engine thread, the vring workers
//! (requests become driver calls), the scheduler (counters), the VRAM manager (copies),
//! the API and the main thread (teardown) all call the driver; in a GPU worker
//! (`--gpu-workers`) every thread of the worker may. The driver starts threads of its own.
//!
//! It is the set such drivers are known to use — ioctls and mmaps on `/dev/nvidia*`
//! (request numbers are the driver's private ABI, so not filtered), opening device nodes
//! and `/proc` files, executable mappings of the libraries it loads and of JIT-compiled
//! code, NUMA policy, and its own threads — plus what `--seccomp log` on the H100 (driver
//! 580) showed the driver also calls at start: `prlimit64`, `dup`, `symlink`, `fcntl` and
//! `getcwd`
//! (2026-11-24; without them `kill` ended the daemon with SIGSYS before the GPU opened).
//! Verified there: start, the control API, and SIGTERM in `kill` mode; guest work
//! through the daemon on the GPU is not yet (run `--seccomp log` and read
//! `dmesg | grep 'type=1326'` when adding a path).

use crate::blocks::{events, socket_io, unix_connect};
use crate::{Arg, Rules};

/// The driver's set: [`driver_calls`], eventfds/epoll, unix-socket I/O, and connecting to
/// a unix socket by path (what such drivers are known to use: the persistence daemon's
/// socket).
pub fn driver() -> Rules {
    driver_calls()
        .union(&events())
        .union(&socket_io())
        .union(&unix_connect())
}

/// What the driver calls besides sockets and events: a GPU worker, which installs its
/// filter after the driver opened the GPU, does without new sockets (with `connect` by
/// path it could reach the backend's control API).
pub fn driver_calls() -> Rules {
    Rules::new()
        .allow(&[
            libc::SYS_ioctl,
            libc::SYS_mmap,
            libc::SYS_mprotect,
            libc::SYS_openat,
            libc::SYS_close,
            libc::SYS_fstat,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_readlinkat,
            libc::SYS_lseek,
            libc::SYS_pread64,
            libc::SYS_getdents64,
            libc::SYS_uname,
            libc::SYS_sysinfo,
            libc::SYS_sched_setaffinity,
            libc::SYS_sched_get_priority_min,
            libc::SYS_sched_get_priority_max,
            libc::SYS_sched_setscheduler,
            libc::SYS_get_mempolicy,
            libc::SYS_set_mempolicy,
            libc::SYS_mbind,
            libc::SYS_mlock,
            libc::SYS_munlock,
            libc::SYS_mincore,
            libc::SYS_pipe2,
            libc::SYS_getuid,
            libc::SYS_geteuid,
            libc::SYS_getgid,
            libc::SYS_getegid,
            libc::SYS_getppid,
            libc::SYS_rt_sigaction,
            libc::SYS_flock,
            libc::SYS_unlinkat,
            libc::SYS_memfd_create,
            libc::SYS_ftruncate,
            libc::SYS_fallocate,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_open,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_stat,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_readlink,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_access,
            // Seen on the H100 (driver 580) in log mode (prlimit64 below).
            libc::SYS_fcntl,
            libc::SYS_getcwd,
            libc::SYS_dup,
            libc::SYS_dup3,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_symlink,
            libc::SYS_symlinkat,
        ])
        // Its own limits only (pid 0).
        .allow_if(libc::SYS_prlimit64, vec![Arg::eq32(0, 0)])
}
