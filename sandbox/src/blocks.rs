//! Building blocks of the role rule sets: what a Rust thread needs to exist, and groups
//! of syscalls by purpose. Syscall numbers are the target's (`libc::SYS_*`).

use libc::c_long;

use crate::rules::{Arg, Rules};

/// `ioctl` requests any thread may make on its own fds.
pub const FIONBIO: u64 = 0x5421;
pub const FIOCLEX: u64 = 0x5451;
/// Terminal queries (`isatty`, window size) a logger may make on stderr.
pub const TCGETS: u64 = 0x5401;
pub const TIOCGWINSZ: u64 = 0x5413;

/// `PR_SET_NAME`: a thread naming itself (std does at start).
const PR_SET_NAME: u64 = 15;
/// `PR_SET_TIMERSLACK`: a polling thread asking for its short sleeps to end on time.
const PR_SET_TIMERSLACK: u64 = 29;
/// `PR_SET_NO_NEW_PRIVS`, which seccompiler sets before each filter it installs.
const PR_SET_NO_NEW_PRIVS: u64 = 38;
/// `SECCOMP_SET_MODE_FILTER`: adding a filter (which can only take permissions away).
const SECCOMP_SET_MODE_FILTER: u64 = 1;

const FCNTL_CMDS: [c_long; 6] = [
    libc::F_GETFD as c_long,
    libc::F_SETFD as c_long,
    libc::F_GETFL as c_long,
    libc::F_SETFL as c_long,
    libc::F_DUPFD_CLOEXEC as c_long,
    libc::F_GET_SEALS as c_long,
];

/// What every thread of ours needs: memory (never executable), futexes and sleeps,
/// clocks, randomness, logging and I/O on fds it already holds, signal masks, starting
/// and ending threads (`clone` only with `CLONE_THREAD`: no new processes), naming
/// itself, stacking seccomp filters, and signals to its own process only (`abort`).
///
/// Not here, hence refused everywhere this is the only block: opening files, new sockets,
/// `execve`, `ptrace`, `kill` of others, mounting, BPF, `perf_event_open`, `io_uring`,
/// `userfaultfd`, keyrings, module loading, `prctl` beyond naming.
pub fn thread_basics() -> Rules {
    let pid = std::process::id() as u64;
    let no_exec = || vec![Arg::masked32(2, libc::PROT_EXEC as u64, 0)];
    let mut r = Rules::new()
        .allow(&[
            libc::SYS_brk,
            libc::SYS_munmap,
            libc::SYS_mremap,
            libc::SYS_madvise,
            libc::SYS_futex,
            libc::SYS_sched_yield,
            libc::SYS_nanosleep,
            libc::SYS_clock_nanosleep,
            libc::SYS_clock_gettime,
            libc::SYS_clock_getres,
            libc::SYS_gettimeofday,
            libc::SYS_getrandom,
            libc::SYS_getpid,
            libc::SYS_gettid,
            libc::SYS_read,
            libc::SYS_readv,
            libc::SYS_write,
            libc::SYS_writev,
            libc::SYS_close,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_rt_sigreturn,
            libc::SYS_rt_sigprocmask,
            libc::SYS_sigaltstack,
            libc::SYS_restart_syscall,
            libc::SYS_set_robust_list,
            libc::SYS_rseq,
            libc::SYS_sched_getaffinity,
            // glibc starts threads with clone3, whose flags a filter cannot read (they are
            // behind a pointer); the plain `clone` fallback is held to CLONE_THREAD.
            libc::SYS_clone3,
        ])
        .allow_if(libc::SYS_mmap, no_exec())
        .allow_if(libc::SYS_mprotect, no_exec())
        .allow_if(
            libc::SYS_clone,
            vec![Arg::masked32(
                0,
                libc::CLONE_THREAD as u64,
                libc::CLONE_THREAD as u64,
            )],
        )
        .allow_if(libc::SYS_prctl, vec![Arg::eq32(0, PR_SET_NAME)])
        .allow_if(libc::SYS_prctl, vec![Arg::eq32(0, PR_SET_TIMERSLACK)])
        // A thread entering its role stacks its filters over those it inherited.
        .allow_if(libc::SYS_prctl, vec![Arg::eq32(0, PR_SET_NO_NEW_PRIVS)])
        .allow_if(
            libc::SYS_seccomp,
            vec![Arg::eq32(0, SECCOMP_SET_MODE_FILTER)],
        )
        .allow_if(libc::SYS_tgkill, vec![Arg::eq32(0, pid)])
        // musl's abort signals the thread with tkill, which names no process.
        .allow_if(libc::SYS_tkill, vec![Arg::eq32(1, libc::SIGABRT as u64)])
        .allow_if(libc::SYS_ioctl, vec![Arg::eq32(1, FIONBIO)])
        .allow_if(libc::SYS_ioctl, vec![Arg::eq32(1, FIOCLEX)])
        .allow_if(libc::SYS_ioctl, vec![Arg::eq32(1, TCGETS)])
        .allow_if(libc::SYS_ioctl, vec![Arg::eq32(1, TIOCGWINSZ)]);
    for cmd in FCNTL_CMDS {
        r = r.allow_if(libc::SYS_fcntl, vec![Arg::eq32(1, cmd as u64)]);
    }
    r
}

/// Unix-socket I/O on sockets a thread holds (messages with fds, timeouts, shutdown),
/// and waiting on fds.
pub fn socket_io() -> Rules {
    Rules::new()
        .allow(&[
            libc::SYS_sendmsg,
            libc::SYS_recvmsg,
            libc::SYS_sendto,
            libc::SYS_recvfrom,
            libc::SYS_shutdown,
            libc::SYS_getsockopt,
            libc::SYS_ppoll,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_poll,
        ])
        .allow_if(
            libc::SYS_setsockopt,
            vec![Arg::eq32(1, libc::SOL_SOCKET as u64)],
        )
}

/// Accepting connections on a listening socket bound at startup.
pub fn socket_accept() -> Rules {
    Rules::new().allow(&[libc::SYS_accept4, libc::SYS_accept])
}

/// Connecting to a unix socket by path (no other socket family).
pub fn unix_connect() -> Rules {
    Rules::new()
        .allow_if(libc::SYS_socket, vec![Arg::eq32(0, libc::AF_UNIX as u64)])
        .allow(&[libc::SYS_connect])
}

/// eventfds and epoll.
pub fn events() -> Rules {
    Rules::new().allow(&[
        libc::SYS_eventfd2,
        libc::SYS_epoll_create1,
        libc::SYS_epoll_ctl,
        libc::SYS_epoll_pwait,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_epoll_wait,
    ])
}

/// Anonymous shared memory: memfds (VRAM swap stores, shadow pages), sized and sealed.
/// glibc 2.33 and later implement `fstat` as `newfstatat(fd, "", AT_EMPTY_PATH)`, so
/// `newfstatat` is allowed with `AT_EMPTY_PATH` only (a filter cannot read the path: with
/// a non-empty one this would still stat by path, which reveals metadata, never data).
pub fn memfd() -> Rules {
    Rules::new()
        .allow(&[
            libc::SYS_memfd_create,
            libc::SYS_ftruncate,
            libc::SYS_fallocate,
            libc::SYS_fstat,
        ])
        .allow_if(
            libc::SYS_newfstatat,
            vec![Arg::masked32(
                3,
                libc::AT_EMPTY_PATH as u64,
                libc::AT_EMPTY_PATH as u64,
            )],
        )
        .allow_if(
            libc::SYS_fcntl,
            vec![Arg::eq32(1, libc::F_ADD_SEALS as u64)],
        )
}

/// Removing a file by path (a socket at shutdown).
pub fn unlink() -> Rules {
    Rules::new().allow(&[
        libc::SYS_unlinkat,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_unlink,
    ])
}

/// Opening files by path: allowed by the allow-list but failed with `EACCES` by
/// [`Plan`](crate::Plan)'s second filter, because libraries probe files (glibc's malloc
/// reads `/sys/devices/system/cpu/online` the first time it needs another arena) and
/// must see an error there, not a dead process.
pub fn open_refused() -> Rules {
    Rules::new().allow(&[
        libc::SYS_openat,
        #[cfg(target_arch = "x86_64")]
        libc::SYS_open,
    ])
}
