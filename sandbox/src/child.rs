//! Running a closure in a forked child and telling how it ended: how tests show that a
//! filter kills the process on a syscall outside it, without taking the test down.

use std::io;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    Exited(i32),
    Signaled(i32),
}

/// Forks; the child runs `f` and exits with its value (`_exit`, no unwinding into the
/// parent's code); the parent waits and reports. Compile filters before calling: the child
/// of a multi-threaded process should do little beyond installing them and the syscall
/// under test.
pub fn run_in_child(f: impl FnOnce() -> i32) -> io::Result<ChildEnd> {
    // SAFETY: fork has no memory-safety preconditions; the child only runs `f` and
    // `_exit`s, never returning into the caller's frames.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        let code = f();
        // SAFETY: ends the child at once, without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child, writing its status into a local.
        let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
        if rc == pid {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    if libc::WIFSIGNALED(status) {
        Ok(ChildEnd::Signaled(libc::WTERMSIG(status)))
    } else {
        Ok(ChildEnd::Exited(libc::WEXITSTATUS(status)))
    }
}
