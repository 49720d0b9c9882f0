//! The worker's own seccomp filter (`Role::GpuWorker`, one for every thread of the
//! worker) and its privileges.
//!
//! One role for the whole process, installed on all its threads at once: a worker runs
//! one VM's GPU and nothing else, its threads (the command loop, the counters publisher,
//! the GPU's engine threads, the CUDA driver's own) all touch the same state, and on
//! `cuda` the driver's threads exist before the filter can go on. What it allows:
//!
//! - what a Rust thread needs (`thread_basics`: memory never executable, futexes, clocks,
//!   its own fds, threads but no processes, signals to itself only);
//! - message I/O with fds on the two sockets it was started with, and waiting on them
//!   (`socket_io`); no new socket (not even `AF_UNIX`), no `connect`, no `accept`;
//! - memfds (the control pages, the counters page) and eventfds/epoll (`memfd`, `events`);
//! - on `sim` and `cuda-fake`, opening a file fails with `EACCES` (libraries probe files);
//!   on `cuda` the NVIDIA driver's calls (`vgpu_sandbox::cuda::driver_calls`: it opens
//!   device nodes at any time) are added, but not the driver set's `socket`/`connect`:
//!   the driver connects to its daemon when it opens the GPU, before the filter, and a
//!   worker able to connect by path could reach the backend's control API.
//!
//! Never: `execve`, a new process, `ptrace`, `kill` of another process, sockets of any
//! family on sim/cuda-fake, `mount`, `bpf`, `perf_event_open`, `io_uring`.

use vgpu_sandbox::blocks::{events, memfd, open_refused, socket_io, thread_basics};
use vgpu_sandbox::{cuda, privileges, Mode, Plan, Role, Rules, SandboxError};

/// The GPU a worker runs, as far as its filter is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerGpuKind {
    /// `sim` or `cuda-fake`: all in this process's memory.
    Cpu,
    /// `cuda[:N]`: the NVIDIA driver.
    Cuda,
}

/// The worker's allow-list on `gpu`, and the syscalls in it that fail with `EACCES`.
pub fn worker_rules(gpu: WorkerGpuKind) -> (Rules, Rules) {
    let base = thread_basics()
        // glibc installs its internal signal handlers at the first pthread_create, which
        // here comes after the filter.
        .union(&Rules::new().allow(&[libc::SYS_rt_sigaction]))
        // A guest module's image is read from the sealed memfd the backend sends.
        .union(&Rules::new().allow(&[libc::SYS_pread64]))
        .union(&socket_io())
        .union(&memfd())
        .union(&events());
    match gpu {
        WorkerGpuKind::Cpu => (base.union(&open_refused()), open_refused()),
        WorkerGpuKind::Cuda => (base.union(&cuda::driver_calls()), Rules::new()),
    }
}

/// The worker's plan in `mode`.
pub fn plan(mode: Mode, gpu: WorkerGpuKind) -> Result<Plan, SandboxError> {
    let mut plan = Plan::new(mode);
    let (allow, refuse) = worker_rules(gpu);
    plan.add(Role::GpuWorker, &allow, &refuse)?;
    Ok(plan)
}

/// Drops every capability and installs the worker's filter on every thread of the
/// process (nothing in [`Mode::Off`]).
pub fn confine(mode: Mode, gpu: WorkerGpuKind) -> Result<(), SandboxError> {
    if mode == Mode::Off {
        log::warn!("seccomp: off (no filter; capabilities kept)");
        return Ok(());
    }
    let plan = plan(mode, gpu)?;
    privileges::drop_all()?;
    privileges::no_new_privs()?;
    plan.apply_all_threads(Role::GpuWorker)?;
    log::debug!("seccomp: {mode} (GpuWorker on every thread)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_sandbox::child::{run_in_child, ChildEnd};

    fn in_child_under(gpu: WorkerGpuKind, f: impl FnOnce() -> i32) -> ChildEnd {
        let p = plan(Mode::Kill, gpu).expect("plan");
        run_in_child(|| {
            if p.apply_all_threads(Role::GpuWorker).is_err() {
                return 2;
            }
            f()
        })
        .expect("fork")
    }

    #[test]
    fn the_worker_role_compiles_and_leaves_out_what_no_worker_needs() {
        for gpu in [WorkerGpuKind::Cpu, WorkerGpuKind::Cuda] {
            for mode in [Mode::Kill, Mode::Log] {
                assert!(!plan(mode, gpu)
                    .expect("plan")
                    .programs(Role::GpuWorker)
                    .is_empty());
            }
            let (allow, _) = worker_rules(gpu);
            for nr in [
                libc::SYS_execve,
                libc::SYS_execveat,
                libc::SYS_fork,
                libc::SYS_vfork,
                libc::SYS_ptrace,
                libc::SYS_process_vm_readv,
                libc::SYS_process_vm_writev,
                libc::SYS_kill,
                libc::SYS_mount,
                libc::SYS_bpf,
                libc::SYS_perf_event_open,
                libc::SYS_userfaultfd,
                libc::SYS_setuid,
                libc::SYS_io_uring_setup,
                libc::SYS_accept4,
                libc::SYS_bind,
                libc::SYS_listen,
            ] {
                assert!(!allow.mentions(nr), "{gpu:?} allows syscall {nr}");
            }
            // New processes: clone only with CLONE_THREAD.
            assert!(!allow.allows_always(libc::SYS_clone), "{gpu:?}");
        }
        // No new socket, on the driver neither; off it no executable memory.
        for gpu in [WorkerGpuKind::Cpu, WorkerGpuKind::Cuda] {
            let (allow, _) = worker_rules(gpu);
            for nr in [libc::SYS_socket, libc::SYS_socketpair, libc::SYS_connect] {
                assert!(!allow.mentions(nr), "{gpu:?}: {nr}");
            }
        }
        let (cpu, _) = worker_rules(WorkerGpuKind::Cpu);
        for nr in [libc::SYS_mmap, libc::SYS_mprotect, libc::SYS_ioctl] {
            assert!(!cpu.allows_always(nr), "{nr}");
        }
    }

    #[test]
    fn a_worker_opening_a_socket_is_killed() {
        for gpu in [WorkerGpuKind::Cpu, WorkerGpuKind::Cuda] {
            let end = in_child_under(gpu, || {
                // SAFETY: socket(2) with integer arguments.
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
                i32::from(fd < 0)
            });
            assert_eq!(end, ChildEnd::Signaled(libc::SIGSYS), "{gpu:?}");
        }
    }

    #[test]
    fn a_worker_starting_a_process_is_killed() {
        for gpu in [WorkerGpuKind::Cpu, WorkerGpuKind::Cuda] {
            let end = in_child_under(gpu, || {
                // SAFETY: fork(2); the child (if any) exits at once.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: ends the grandchild at once.
                    unsafe { libc::_exit(0) };
                }
                3
            });
            assert_eq!(end, ChildEnd::Signaled(libc::SIGSYS), "{gpu:?}");
            let end = in_child_under(gpu, || {
                let prog = c"/bin/true";
                let argv = [prog.as_ptr(), std::ptr::null()];
                // SAFETY: execv with a NUL-terminated path and argument vector.
                unsafe { libc::execv(prog.as_ptr(), argv.as_ptr()) };
                3
            });
            assert_eq!(end, ChildEnd::Signaled(libc::SIGSYS), "{gpu:?}");
        }
    }

    #[test]
    fn a_worker_off_the_driver_cannot_open_a_file() {
        let end = in_child_under(WorkerGpuKind::Cpu, || {
            // SAFETY: open(2) of a NUL-terminated path; the fd (if any) dies with the child.
            let fd = unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) };
            let errno = std::io::Error::last_os_error().raw_os_error();
            if fd < 0 && errno == Some(libc::EACCES) {
                0
            } else {
                1
            }
        });
        assert_eq!(end, ChildEnd::Exited(0));
    }
}
