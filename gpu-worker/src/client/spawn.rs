//! Starting a worker process: two socket pairs, the child's ends as fds 3 and 4, and a
//! parent-death signal so no worker outlives its starter.
//!
//! Two ways: a backend under seccomp (none of its threads may start a process) asks the
//! launcher process it started before its filters went on ([`crate::launcher`]); without
//! one (in-process tests and benchmarks) workers are forked here by one launcher thread.
//! Linux sends the parent-death signal when the *thread* that forked the child ends, not
//! the process: a worker forked by a VM's request thread would die with that thread (at
//! the VM's disconnect), hence one thread that lives as long as the process.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

use crate::socket;

/// The fd a worker reads commands from (and answers on).
pub const COMMAND_FD: i32 = 3;
/// The fd a worker sends events on.
pub const EVENT_FD: i32 = 4;
/// The GPU turn's page, when the worker has a slot in it (`--turn-slot`).
pub const TURN_FD: i32 = 5;

/// `close_range(2)`'s flag that marks the range close-on-exec (Linux 5.11).
const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
/// Without `close_range`, the fds below this are marked one by one.
const FALLBACK_FD_LIMIT: i32 = 65_536;

/// What to run.
#[derive(Debug, Clone)]
pub struct WorkerProgram {
    pub program: PathBuf,
    pub args: Vec<String>,
}

/// A started worker: the process and the backend's ends of its sockets.
pub struct Started {
    pub process: WorkerProcess,
    pub cmd: OwnedFd,
    pub events: OwnedFd,
}

/// A worker process: our child, or the launcher process's (then its end comes as a
/// message on the worker's status socket, and killing it is a message the other way).
pub enum WorkerProcess {
    Child(Child),
    Launched(crate::launcher::Launched),
}

impl WorkerProcess {
    pub fn id(&self) -> u32 {
        match self {
            WorkerProcess::Child(c) => c.id(),
            WorkerProcess::Launched(l) => l.pid(),
        }
    }

    /// Sends SIGKILL (no error once it has ended).
    pub fn kill(&mut self) {
        match self {
            WorkerProcess::Child(c) => {
                let _ = c.kill();
            }
            WorkerProcess::Launched(l) => l.kill(),
        }
    }

    /// Its status once it has ended (and been reaped).
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match self {
            WorkerProcess::Child(c) => c.try_wait(),
            WorkerProcess::Launched(l) => l.try_wait(),
        }
    }

    /// Waits for its end.
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match self {
            WorkerProcess::Child(c) => c.wait(),
            WorkerProcess::Launched(l) => l.wait(),
        }
    }
}

/// A wait status as the launcher reports it.
pub(crate) fn status_from_raw(raw: i32) -> ExitStatus {
    ExitStatus::from_raw(raw)
}

type Job = (
    WorkerProgram,
    Option<RawFd>,
    Sender<std::io::Result<Started>>,
);

/// The launcher thread's queue (`None` if it could not be started).
static LAUNCHER: OnceLock<Option<Mutex<Sender<Job>>>> = OnceLock::new();

fn launcher() -> Option<&'static Mutex<Sender<Job>>> {
    LAUNCHER
        .get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name("gpu-worker-launcher".into())
                .spawn(move || {
                    for (prog, turn, reply) in rx {
                        let _ = reply.send(start_here(&prog, turn));
                    }
                });
            match spawned {
                Ok(_) => Some(Mutex::new(tx)),
                Err(e) => {
                    log::warn!("no launcher thread ({e}): workers die with their starter");
                    None
                }
            }
        })
        .as_ref()
}

/// Starts `prog` with its command socket as fd 3, its event socket as fd 4 and, if given,
/// the turn page `turn` (which must stay open until this returns) as fd 5, forked by the
/// launcher process if this process started one, else by the launcher thread.
pub fn start(prog: &WorkerProgram, turn: Option<RawFd>) -> std::io::Result<Started> {
    if let Some(l) = crate::launcher::client() {
        return l.start(prog, turn);
    }
    let Some(l) = launcher() else {
        return start_here(prog, turn);
    };
    let (tx, rx) = channel();
    l.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((prog.clone(), turn, tx))
        .map_err(|_| std::io::Error::other("the launcher thread is gone"))?;
    rx.recv()
        .map_err(|_| std::io::Error::other("the launcher thread is gone"))?
}

/// Starts `prog` from this thread.
fn start_here(prog: &WorkerProgram, turn: Option<RawFd>) -> std::io::Result<Started> {
    let (child, cmd, events) = fork_worker(&prog.program, &prog.args, turn)?;
    Ok(Started {
        process: WorkerProcess::Child(child),
        cmd,
        events,
    })
}

/// Forks and execs `program` with `args`, its command socket as fd 3, its event socket as
/// fd 4, `turn` as fd 5, nothing else of ours open, and SIGKILL when the forking thread
/// ends; returns it and our ends of its sockets.
pub(crate) fn fork_worker(
    program: &std::path::Path,
    args: &[String],
    turn: Option<RawFd>,
) -> std::io::Result<(Child, OwnedFd, OwnedFd)> {
    let (cmd, cmd_child) = socket::pair()?;
    let (events, events_child) = socket::pair()?;
    let (a, b) = (cmd_child.as_raw_fd(), events_child.as_raw_fd());
    let mut c = Command::new(program);
    // No JIT cache on the host's disk: a guest module's PTX compiled by the driver would
    // otherwise be written under $HOME/.nv (a file system the worker's filter keeps it
    // from creating directories in, and guest bytes that would outlive the VM).
    c.args(args)
        .stdin(Stdio::null())
        .env("CUDA_CACHE_DISABLE", "1");
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (fcntl, dup2, prctl, getppid, close_range) on fds it
    // owns there.
    unsafe {
        c.pre_exec(move || {
            // Copies above 3..=5 first, so no dup2 overwrites another's source.
            let a2 = libc::fcntl(a, libc::F_DUPFD, 16);
            let b2 = libc::fcntl(b, libc::F_DUPFD, 16);
            let t2 = turn.map_or(0, |t| libc::fcntl(t, libc::F_DUPFD, 16));
            if a2 < 0
                || b2 < 0
                || t2 < 0
                || libc::dup2(a2, COMMAND_FD) < 0
                || libc::dup2(b2, EVENT_FD) < 0
                || (turn.is_some() && libc::dup2(t2, TURN_FD) < 0)
                || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(a2);
            libc::close(b2);
            if turn.is_some() {
                libc::close(t2);
            }
            // Nothing else of the backend crosses into the worker: another VM's guest
            // memory, sockets or a migration's state pipe opened without CLOEXEC would
            // otherwise be inherited (a leaked pipe end also keeps its reader from ever
            // seeing the end of the stream). Marked close-on-exec rather than closed,
            // so std's own exec-error pipe still works.
            cloexec_from(if turn.is_some() { TURN_FD + 1 } else { TURN_FD });
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
    Ok((child, cmd, events))
}

/// Marks every fd from `first` up close-on-exec (between fork and exec: async-signal-safe).
pub(crate) fn cloexec_from(first: i32) {
    // SAFETY: close_range and fcntl with integer arguments; they change only fd flags.
    unsafe {
        if libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        ) != 0
        {
            for fd in first..FALLBACK_FD_LIMIT {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags >= 0 {
                    libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
                }
            }
        }
    }
}
