//! What each thread role of the backend may do (on the `sim` GPU; `cuda.rs` adds the
//! driver's needs). The roles and the threads that hold them are listed in `mod.rs`.

use vgpu_sandbox::blocks::{
    events, memfd, open_refused, socket_accept, socket_io, thread_basics, unix_connect, unlink,
};
use vgpu_sandbox::{Arg, Role, Rules};

/// A GPU engine thread: runs guest work on memory it already maps, sleeps, wakes the
/// vring worker through an eventfd. Nothing else: no sockets, no new mappings of files,
/// no memfds.
pub fn gpu_engine() -> Rules {
    thread_basics()
}

/// The GPU scheduler: shadows and unshadows channels (SHMEM_MAP/UNMAP messages with fds
/// over a VM's backend-request channel, shadow pages from memfds), reads counters.
pub fn scheduler() -> Rules {
    thread_basics().union(&socket_io()).union(&memfd())
}

/// The VRAM manager: moves chunks between VRAM and a VM's swap memfd, pausing channels and
/// remapping apertures through SHMEM_MAP.
pub fn vram_manager() -> Rules {
    thread_basics().union(&socket_io()).union(&memfd())
}

/// The control API: accepts on its socket (bound at startup), serves HTTP on the
/// connections, pauses and drains VMs (SHMEM_MAP), and restarts the scheduler, whose
/// thread it starts and which inherits its filters (hence the scheduler's rules).
pub fn api() -> Rules {
    thread_basics()
        .union(&socket_accept())
        .union(&socket_io())
        .union(&scheduler())
}

/// A VM's socket thread and the threads it starts (vhost-user messages, the vring worker
/// that handles guest requests, the reaper, device-state transfers): accepts on the VM's
/// socket (bound at startup), vhost-user messages with fds, maps guest memory and the
/// VRAM/control-page fds it holds, eventfds and epoll, swap memfds, and removes its
/// socket when the backend stops.
pub fn vm_serve() -> Rules {
    thread_basics()
        .union(&socket_accept())
        .union(&socket_io())
        .union(&events())
        .union(&memfd())
        .union(&unlink())
}

/// The main thread once serving: waits for SIGINT/SIGTERM, then shuts down — wakes the
/// listeners by connecting to their sockets, shuts connections down, removes the API
/// socket, joins the threads and tears the VMs' GPU state down — and, with GPU workers,
/// reaps the worker launcher, its child (`wait4` reaches only the caller's children).
pub fn backend_main() -> Rules {
    thread_basics()
        .union(&Rules::new().allow(&[libc::SYS_rt_sigtimedwait, libc::SYS_wait4]))
        .union(&unix_connect())
        .union(&socket_io())
        .union(&unlink())
}

/// The whole process, installed before the GPU opens and the first thread starts: every
/// role's rules and what startup does once — create the socket directories, bind and
/// listen on unix sockets (and set their mode), create the GPU's memfds. The backend's
/// own threads then narrow it to their role; only threads it does not own (a GPU driver's)
/// keep it.
pub fn backend_process() -> Rules {
    let startup = Rules::new()
        .allow(&[
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_mkdirat,
            libc::SYS_fchmodat,
            libc::SYS_fchmod,
            libc::SYS_newfstatat,
            libc::SYS_statx,
            libc::SYS_rt_sigtimedwait,
            // glibc installs its internal signal handlers at the first pthread_create.
            libc::SYS_rt_sigaction,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_mkdir,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_chmod,
            // Rust's std on musl (the rig's static binary) stats paths with these.
            #[cfg(target_arch = "x86_64")]
            libc::SYS_stat,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_lstat,
        ])
        .allow_if(libc::SYS_socket, vec![Arg::eq32(0, libc::AF_UNIX as u64)]);
    [
        gpu_engine(),
        scheduler(),
        vram_manager(),
        api(),
        vm_serve(),
        backend_main(),
    ]
    .iter()
    .fold(startup, |acc, r| acc.union(r))
}

/// The allow-list of `role` on the `sim` GPU, with the opens every thread may attempt
/// (they fail with `EACCES`).
pub fn sim_rules(role: Role) -> Option<Rules> {
    let r = match role {
        Role::BackendProcess => backend_process(),
        Role::BackendMain => backend_main(),
        Role::VmServe => vm_serve(),
        Role::Api => api(),
        Role::Scheduler => scheduler(),
        Role::VramManager => vram_manager(),
        Role::GpuEngine => gpu_engine(),
        Role::GpuWorker
        | Role::VmmMain
        | Role::Vcpu
        | Role::VmmBackendReq
        | Role::VmmIrq
        | Role::VmmMigration => return None,
    };
    Some(r.union(&open_refused()))
}
