//! `vgpu-vmm`'s seccomp filters per thread role (`--seccomp kill|log|off`, default kill),
//! built on `vgpu-sandbox`.
//!
//! | role | threads | installed by |
//! |---|---|---|
//! | `VmmMain` | the main thread once the VM is set up | `main`, before `LinuxVm::run` |
//! | `Vcpu` | `vcpuN` | the vCPU thread, first thing |
//! | `VmmBackendReq` | `vu-backend-req` (SHMEM_MAP/UNMAP into the BAR window) | that thread |
//! | `VmmIrq` | `vgpu-intx` (INTx forwarding, backend hang-up watch, reconnect), `vu-req-timeout` (request deadlines) | that thread |
//!
//! Setup (kernel and initrd files, `/dev/kvm`, guest RAM memfds, the backend socket)
//! happens before any filter. Threads inherit the filters of the thread that starts them:
//! a vCPU may bring up the device again after a guest reset, starting a backend-request
//! and an interrupt thread, so `Vcpu` allows what those need, and `VmmMain` (which starts
//! the vCPUs) what a vCPU needs. ioctls are held to KVM's (type 0xAE) and two fd flags.

use vgpu_sandbox::blocks::{
    events, open_refused, socket_accept, socket_io, thread_basics, unix_connect,
};
use vgpu_sandbox::{Arg, Mode, Plan, Role, Rules, SandboxError};

/// KVM's ioctl type (`KVMIO`), bits 8..15 of a request number.
const KVMIO: u64 = 0xAE;

/// The VMM's roles.
pub const ROLES: [Role; 5] = [
    Role::VmmMain,
    Role::Vcpu,
    Role::VmmBackendReq,
    Role::VmmIrq,
    Role::VmmMigration,
];

/// Any KVM ioctl: on the VM fd (memslots for the moving BAR window, ioeventfds, irqfds,
/// GSI routes, IRQ lines) and on the vCPU fds (KVM_RUN, register reads for diagnostics).
fn kvm_ioctls() -> Rules {
    Rules::new().allow_if(libc::SYS_ioctl, vec![Arg::masked32(1, 0xff00, KVMIO << 8)])
}

/// The backend-request thread: receives SHMEM_MAP/UNMAP with fds, maps them into the BAR
/// window (`MAP_FIXED`, never executable), acks.
pub fn backend_req() -> Rules {
    thread_basics().union(&socket_io()).union(&events())
}

/// The interrupt thread: waits on call eventfds and the socket's hang-up, writes irqfds;
/// after a hang-up it reconnects to the backend: a unix socket by path, the
/// backend-request channel (a unix socket pair) and the threads a connection starts.
pub fn irq() -> Rules {
    thread_basics()
        .union(&socket_io())
        .union(&events())
        .union(&reconnect())
}

/// A new vhost-user connection: `socket`/`socketpair` only for `AF_UNIX`, `connect`.
fn reconnect() -> Rules {
    unix_connect().allow_if(
        libc::SYS_socketpair,
        vec![vgpu_sandbox::Arg::eq32(0, libc::AF_UNIX as u64)],
    )
}

/// A vCPU: KVM_RUN and device emulation — serial output, the virtio-pci transport, the
/// vhost-user frontend's messages (with fds) at activation and reset, BAR moves (KVM
/// memslots, ioeventfds, irqfds, MSI routes), stores waiting for write-protected window
/// pages (futex), and the threads device bring-up starts.
pub fn vcpu() -> Rules {
    thread_basics()
        .union(&kvm_ioctls())
        .union(&socket_io())
        .union(&events())
        .union(&backend_req())
        .union(&irq())
        .union(&kick())
}

/// Kicking a vCPU out of KVM_RUN: the kick signal to one of our threads (glibc's
/// `pthread_kill` is a `tgkill` to our own process, in the basics; musl's, in the static
/// binary of the rig, a `tkill`, held to the kick signal).
fn kick() -> Rules {
    Rules::new().allow_if(libc::SYS_tkill, vec![Arg::eq32(1, libc::SIGRTMIN() as u64)])
}

/// The main thread while the VM runs: starts the vCPUs, waits, kicks them (a signal to
/// its own threads), reports.
pub fn vmm_main() -> Rules {
    thread_basics().union(&vcpu()).union(&kick())
}

/// The allow-list of `role`, with the opens every thread may attempt (they fail with
/// `EACCES`).
/// Live migration: what a vCPU thread does (KVM ioctls, the vhost-user connection), plus
/// accepting on the control socket or the incoming address (both bound before the
/// sandbox), connecting to a destination by unix socket or TCP, and the pipes of the
/// device-state transfer.
pub fn migration() -> Rules {
    vcpu()
        .union(&socket_accept())
        .union(&kick())
        .allow_if(libc::SYS_socket, vec![Arg::eq32(0, libc::AF_INET as u64)])
        .allow_if(libc::SYS_socket, vec![Arg::eq32(0, libc::AF_INET6 as u64)])
        .allow(&[libc::SYS_pipe2, libc::SYS_connect])
        // `TcpStream::set_nodelay` on the stream to the destination (the socket-level
        // options of `socket_io` do not cover IPPROTO_TCP).
        .allow_if(
            libc::SYS_setsockopt,
            vec![
                Arg::eq32(1, libc::IPPROTO_TCP as u64),
                Arg::eq32(2, libc::TCP_NODELAY as u64),
            ],
        )
}

pub fn rules(role: Role) -> Option<Rules> {
    let r = match role {
        Role::VmmMain => vmm_main(),
        Role::Vcpu => vcpu(),
        Role::VmmBackendReq => backend_req(),
        Role::VmmIrq => irq(),
        Role::VmmMigration => migration(),
        _ => return None,
    };
    Some(r.union(&open_refused()))
}

/// The VMM's plan: every role's filters in `mode`.
pub fn plan(mode: Mode) -> Result<Plan, SandboxError> {
    let mut plan = Plan::new(mode);
    for role in ROLES {
        if let Some(allow) = rules(role) {
            plan.add(role, &allow, &open_refused())?;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use vgpu_sandbox::child::{run_in_child, ChildEnd};

    use super::*;

    #[test]
    fn every_role_compiles_and_parents_cover_children() {
        for mode in [Mode::Kill, Mode::Log] {
            let p = plan(mode).expect("plan");
            for role in ROLES {
                assert!(!p.programs(role).is_empty(), "{role} {mode}");
            }
        }
        let r = |role| rules(role).expect("a VMM role");
        assert!(r(Role::VmmMain).covers(&r(Role::Vcpu)));
        for child in [Role::VmmBackendReq, Role::VmmIrq] {
            assert!(r(Role::Vcpu).covers(&r(child)), "{child}");
        }
        for role in ROLES {
            for nr in [
                libc::SYS_execve,
                libc::SYS_ptrace,
                libc::SYS_bind,
                libc::SYS_listen,
                libc::SYS_kill,
            ] {
                assert!(!r(role).mentions(nr), "{role}: {nr}");
            }
            // Sockets only of the unix family (reconnecting to the backend).
            assert!(!r(role).allows_always(libc::SYS_socket), "{role}");
            assert!(!r(role).allows_always(libc::SYS_socketpair), "{role}");
            assert!(!r(role).allows_always(libc::SYS_ioctl), "{role}");
        }
        // Only vCPUs (and main, which starts them) reach KVM.
        for role in [Role::VmmBackendReq, Role::VmmIrq] {
            assert!(!r(role).covers(&kvm_ioctls()), "{role}");
        }
    }

    /// In a child under `role` (kill mode): an ioctl with request `req` on fd -1 (EBADF
    /// when allowed).
    fn ioctl_under(role: Role, req: u64) -> ChildEnd {
        let p = plan(Mode::Kill).expect("plan");
        run_in_child(|| {
            if p.apply(role).is_err() {
                return 2;
            }
            // SAFETY: an ioctl on an invalid fd touches no memory.
            unsafe { libc::ioctl(-1, req as libc::c_ulong, 0) };
            0
        })
        .expect("fork")
    }

    /// What the control socket's thread does to send a VM to another host, under its
    /// filter: a TCP connection with TCP_NODELAY, a message. (Found missing by the rig's
    /// first migration over TCP: the source died of SIGSYS in `set_nodelay`.)
    #[test]
    fn the_migration_thread_may_connect_over_tcp() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let addr = l.local_addr().expect("addr");
        let peer = std::thread::spawn(move || {
            let (mut c, _) = l.accept().expect("accept");
            let mut b = [0u8; 4];
            c.read_exact(&mut b).map(|()| b)
        });
        let p = plan(Mode::Kill).expect("plan");
        let end = run_in_child(|| {
            if p.apply(Role::VmmMigration).is_err() {
                return 2;
            }
            let Ok(mut s) = std::net::TcpStream::connect(addr) else {
                return 3;
            };
            if s.set_nodelay(true).is_err() || s.write_all(b"vgpu").is_err() {
                return 4;
            }
            0
        })
        .expect("fork");
        assert_eq!(end, ChildEnd::Exited(0));
        assert_eq!(&peer.join().expect("peer").expect("read"), b"vgpu");
    }

    #[test]
    fn only_kvm_ioctls_pass_on_a_vcpu() {
        const KVM_RUN: u64 = 0xAE80;
        const TIOCSTI: u64 = 0x5412;
        assert_eq!(ioctl_under(Role::Vcpu, KVM_RUN), ChildEnd::Exited(0));
        assert_eq!(
            ioctl_under(Role::Vcpu, TIOCSTI),
            ChildEnd::Signaled(libc::SIGSYS)
        );
        assert_eq!(
            ioctl_under(Role::VmmBackendReq, KVM_RUN),
            ChildEnd::Signaled(libc::SIGSYS)
        );
    }
}
