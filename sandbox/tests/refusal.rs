//! The filters refuse what they do not list, in a forked child: killed by SIGSYS in
//! `kill` mode, logged and run in `log` mode, `EACCES` for the refused opens.

use vgpu_sandbox::blocks::{open_refused, thread_basics};
use vgpu_sandbox::child::{run_in_child, ChildEnd};
use vgpu_sandbox::{privileges, Mode, Plan, Role};

/// A plan with only the thread basics (and opens refused) as role `GpuEngine`.
fn basics(mode: Mode) -> Plan {
    let mut plan = Plan::new(mode);
    let allow = thread_basics().union(&open_refused());
    plan.add(Role::GpuEngine, &allow, &open_refused())
        .expect("compile");
    plan
}

/// Installs the plan's `GpuEngine` filters in a child, then runs `call`; the child exits
/// 0 when the call returned a value `ok` accepts, 1 otherwise, 2 if the filter did not go
/// in.
fn try_in_child(plan: &Plan, call: fn() -> i64, ok: fn(i64) -> bool) -> ChildEnd {
    run_in_child(|| {
        if plan.apply(Role::GpuEngine).is_err() {
            return 2;
        }
        if ok(call()) {
            0
        } else {
            1
        }
    })
    .expect("fork")
}

fn inet_socket() -> i64 {
    // SAFETY: socket(2) with integer arguments.
    unsafe { i64::from(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0)) }
}

fn exec_true() -> i64 {
    let path = c"/bin/true";
    let argv = [path.as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null()];
    // SAFETY: NUL-terminated path, argv and envp arrays that outlive the call.
    unsafe { i64::from(libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr())) }
}

fn ptrace_me() -> i64 {
    // SAFETY: PTRACE_TRACEME takes no pointers.
    unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) }
}

fn fork_process() -> i64 {
    // SAFETY: a raw clone(SIGCHLD) is a fork; the child (if any) exits at once.
    let pid = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) };
    if pid == 0 {
        // SAFETY: ends the grandchild without touching anything.
        unsafe { libc::_exit(0) };
    }
    pid
}

fn exec_mapping() -> i64 {
    // SAFETY: an anonymous private mapping; nothing refers to it afterwards.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        -1
    } else {
        0
    }
}

fn open_passwd() -> i64 {
    // SAFETY: a NUL-terminated path; the fd (if any) dies with the child.
    let fd = unsafe { libc::open(c"/etc/passwd".as_ptr(), libc::O_RDONLY) };
    if fd < 0 {
        -i64::from(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        i64::from(fd)
    }
}

fn getpid() -> i64 {
    // SAFETY: no arguments.
    unsafe { i64::from(libc::getpid()) }
}

const SIGSYS: ChildEnd = ChildEnd::Signaled(libc::SIGSYS);

#[test]
fn kill_mode_kills_on_syscalls_outside_the_list() {
    let plan = basics(Mode::Kill);
    for (name, call) in [
        ("socket(AF_INET)", inet_socket as fn() -> i64),
        ("execve", exec_true),
        ("ptrace", ptrace_me),
        ("clone without CLONE_THREAD", fork_process),
        ("mmap PROT_EXEC", exec_mapping),
    ] {
        assert_eq!(try_in_child(&plan, call, |_| true), SIGSYS, "{name}");
    }
}

#[test]
fn listed_syscalls_run_and_opens_fail_with_eacces() {
    let plan = basics(Mode::Kill);
    assert_eq!(try_in_child(&plan, getpid, |r| r > 0), ChildEnd::Exited(0));
    assert_eq!(
        try_in_child(&plan, open_passwd, |r| r == -i64::from(libc::EACCES)),
        ChildEnd::Exited(0)
    );
    // A thread starts and ends under the filter (clone3, stack mapping, naming).
    let started = || {
        std::thread::Builder::new()
            .name("under-filter".into())
            .spawn(|| 7)
            .ok()
            .and_then(|h| h.join().ok())
            .map_or(-1, i64::from)
    };
    assert_eq!(
        run_in_child(|| {
            if plan.apply(Role::GpuEngine).is_err() {
                return 2;
            }
            i32::from(started() != 7)
        })
        .expect("fork"),
        ChildEnd::Exited(0)
    );
}

#[test]
fn log_mode_lets_the_call_run() {
    let plan = basics(Mode::Log);
    assert_eq!(
        try_in_child(&plan, inet_socket, |fd| fd >= 0),
        ChildEnd::Exited(0)
    );
    // The refused opens stay refused: log mode changes only what is outside the list.
    assert_eq!(
        try_in_child(&plan, open_passwd, |r| r == -i64::from(libc::EACCES)),
        ChildEnd::Exited(0)
    );
}

#[test]
fn off_mode_compiles_nothing() {
    let plan = basics(Mode::Off);
    assert!(plan.programs(Role::GpuEngine).is_empty());
}

#[test]
fn capabilities_are_dropped() {
    let end = run_in_child(|| {
        let had = match privileges::current() {
            Ok((e, p, _)) => e | p != 0,
            Err(_) => return 10,
        };
        match privileges::drop_all() {
            Ok(dropped) if dropped == had => {}
            _ => return 11,
        }
        match privileges::current() {
            Ok((0, 0, 0)) => {}
            _ => return 12,
        }
        // With caps to begin with (root), the bounding set is empty too.
        if had && (0..41).any(privileges::in_bounding_set) {
            return 13;
        }
        0
    })
    .expect("fork");
    assert_eq!(end, ChildEnd::Exited(0));
}
