//! What the NVIDIA driver (libcuda, loaded at run time) may do in any thread that calls
//! it. With `--gpu cuda` the engine thread, the vring workers (requests become driver
//! calls), the scheduler (counters), the VRAM manager (copies), the API and the main
//! thread (teardown) all call the driver, and the driver starts threads of its own.
//!
//! Not verified on a GPU: this machine has none. It is the set such drivers are known to
//! use — ioctls and mmaps on `/dev/nvidia*` (request numbers are the driver's private
//! ABI, so not filtered), opening device nodes and `/proc` files, executable mappings of
//! the libraries it loads and of JIT-compiled code, NUMA policy, and its own threads.
//! Run `--gpu cuda --seccomp log` on the GPU machine and read the kernel log
//! (`dmesg | grep 'type=1326'`) for anything missing before relying on `kill` there.

use vgpu_sandbox::blocks::{events, socket_io, unix_connect};
use vgpu_sandbox::Rules;

pub fn driver() -> Rules {
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
        ])
        .union(&events())
        .union(&socket_io())
        .union(&unix_connect())
}
