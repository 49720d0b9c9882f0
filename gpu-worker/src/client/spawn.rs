//! Starting a worker process: two socket pairs, the child's ends as fds 3 and 4, and a
//! parent-death signal so no worker outlives its backend.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::socket;

/// The fd a worker reads commands from (and answers on).
pub const COMMAND_FD: i32 = 3;
/// The fd a worker sends events on.
pub const EVENT_FD: i32 = 4;

/// What to run.
#[derive(Debug, Clone)]
pub struct WorkerProgram {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// A started worker: the process and the backend's ends of its sockets.
pub struct Started {
    pub child: Child,
    pub cmd: OwnedFd,
    pub events: OwnedFd,
}

/// Starts `prog` with its command socket as fd 3 and its event socket as fd 4.
pub fn start(prog: &WorkerProgram) -> std::io::Result<Started> {
    let (cmd, cmd_child) = socket::pair()?;
    let (events, events_child) = socket::pair()?;
    let (a, b) = (cmd_child.as_raw_fd(), events_child.as_raw_fd());
    let mut c = Command::new(&prog.program);
    c.args(&prog.args).stdin(Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (fcntl, dup2, prctl, getppid) on fds it owns there.
    unsafe {
        c.pre_exec(move || {
            // Copies above 3 and 4 first, so neither dup2 overwrites the other's source.
            let a2 = libc::fcntl(a, libc::F_DUPFD, 16);
            let b2 = libc::fcntl(b, libc::F_DUPFD, 16);
            if a2 < 0
                || b2 < 0
                || libc::dup2(a2, COMMAND_FD) < 0
                || libc::dup2(b2, EVENT_FD) < 0
                || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(a2);
            libc::close(b2);
            // The parent may have died before the signal was armed.
            if libc::getppid() == 1 {
                return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
            }
            Ok(())
        });
    }
    let child = c.spawn()?;
    // The child's ends live on only in the child: its exit is our end of file.
    drop((cmd_child, events_child));
    Ok(Started { child, cmd, events })
}
