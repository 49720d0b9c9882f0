use vgpu_sandbox::child::{run_in_child, ChildEnd};

use super::*;

const SIM: GpuChoice = GpuChoice::Sim;
const CUDA: GpuChoice = GpuChoice::Cuda { index: 0 };

fn allow(role: Role, gpu: GpuChoice) -> Rules {
    role_rules(role, gpu).expect("a backend role").0
}

#[test]
fn every_role_compiles_for_this_arch_in_both_modes() {
    for gpu in [SIM, CUDA] {
        for mode in [Mode::Kill, Mode::Log] {
            let p = plan(mode, gpu).expect("plan");
            for role in ROLES {
                assert!(!p.programs(role).is_empty(), "{role} {mode} {gpu}");
            }
        }
        assert!(plan(Mode::Off, gpu)
            .expect("plan")
            .programs(Role::VmServe)
            .is_empty());
    }
    assert!(role_rules(Role::Vcpu, SIM).is_none());
}

#[test]
fn stacked_roles_allow_what_their_threads_need() {
    for gpu in [SIM, CUDA] {
        let process = allow(Role::BackendProcess, gpu);
        for role in ROLES {
            assert!(
                process.covers(&allow(role, gpu)),
                "process ⊇ {role} ({gpu})"
            );
        }
        // The API starts the scheduler's thread.
        assert!(allow(Role::Api, gpu).covers(&allow(Role::Scheduler, gpu)));
    }
}

#[test]
fn sim_roles_leave_out_what_no_thread_needs() {
    let dangerous = [
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_kill,
        libc::SYS_mount,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_init_module,
        libc::SYS_setuid,
        libc::SYS_io_uring_setup,
    ];
    for role in ROLES {
        let r = allow(role, SIM);
        for nr in dangerous {
            assert!(!r.mentions(nr), "{role} allows syscall {nr}");
        }
        // Never an unconditional mmap/mprotect (they may not map executable memory),
        // socket (only AF_UNIX) or ioctl (only FIONBIO/FIOCLEX) on the sim.
        for nr in [
            libc::SYS_mmap,
            libc::SYS_mprotect,
            libc::SYS_socket,
            libc::SYS_ioctl,
        ] {
            assert!(!r.allows_always(nr), "{role}: {nr}");
        }
    }
    // The engine threads, which run guest-built work, have no sockets and no memfds.
    let engine = allow(Role::GpuEngine, SIM);
    for nr in [
        libc::SYS_socket,
        libc::SYS_accept4,
        libc::SYS_sendmsg,
        libc::SYS_connect,
        libc::SYS_memfd_create,
        libc::SYS_bind,
    ] {
        assert!(!engine.mentions(nr), "GpuEngine: {nr}");
    }
    // Only startup binds sockets.
    for role in [Role::VmServe, Role::Api, Role::BackendMain] {
        assert!(!allow(role, SIM).mentions(libc::SYS_bind), "{role}");
    }
}

/// In a child: install `role`'s filters (kill mode, sim), then open an AF_INET socket.
fn inet_socket_under(role: Role) -> ChildEnd {
    let p = plan(Mode::Kill, SIM).expect("plan");
    run_in_child(|| {
        if p.apply(role).is_err() {
            return 2;
        }
        // SAFETY: socket(2) with integer arguments.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        i32::from(fd < 0)
    })
    .expect("fork")
}

#[test]
fn a_syscall_outside_the_role_kills_the_process() {
    for role in ROLES {
        assert_eq!(
            inet_socket_under(role),
            ChildEnd::Signaled(libc::SIGSYS),
            "{role}"
        );
    }
}

#[test]
fn a_unix_socket_is_allowed_where_the_role_connects() {
    let p = plan(Mode::Kill, SIM).expect("plan");
    let unix_socket = |role| {
        run_in_child(|| {
            if p.apply(role).is_err() {
                return 2;
            }
            // SAFETY: socket(2) with integer arguments.
            let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
            i32::from(fd < 0)
        })
        .expect("fork")
    };
    assert_eq!(unix_socket(Role::BackendMain), ChildEnd::Exited(0));
    assert_eq!(
        unix_socket(Role::GpuEngine),
        ChildEnd::Signaled(libc::SIGSYS)
    );
}
