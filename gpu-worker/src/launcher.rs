//! The worker launcher: a small process a backend starts before its seccomp filters go
//! on, which alone starts (forks and execs) GPU workers afterwards. Under the filters no
//! thread of the backend may start a process, so this is the only way a sandboxed backend
//! gets workers (`docs/design/gpu-workers.md`, "The launcher").
//!
//! - **Started** by [`start_process_launcher`] as `PROGRAM worker-launcher` (the backend's
//!   own binary; `vgpu-gpu-worker launcher` in tests) with its socket to the backend as
//!   fd 3, nothing else of the backend's, and SIGKILL when the backend's main thread ends.
//!   The worker it runs (program, subcommand, `--gpu`, `--seccomp`) is fixed on its own
//!   command line; a request only adds the per-VM flags, and the worker's parser refuses a
//!   second `--gpu` or `--seccomp`: a backend taken over by a guest cannot make it run an
//!   unsandboxed worker or anything else.
//! - **A start** is one `SOCK_SEQPACKET` message: `S` and the extra arguments
//!   (NUL-separated), with the GPU turn's page if any. The launcher creates the worker's
//!   sockets, forks and execs it as [`crate::client::spawn`] does (fds 3/4/5, everything
//!   above close-on-exec, SIGKILL when the launcher ends) and answers with its pid and
//!   three fds: the backend's ends of the command and event sockets and the worker's
//!   **status socket**.
//! - **The status socket** carries the worker's end: the launcher, its parent, reaps it
//!   (a pidfd per worker wakes it) and sends the 4-byte wait status, so the backend tells
//!   a GPU fault (exit 75) from a crash as before. Any message the other way kills the
//!   worker; the backend closing it (a dropped handle) kills it too.
//! - **The backend's end** (its socket reads end of file: it exited, crashed or stops)
//!   makes the launcher kill and reap every worker and exit; a backend killed outright
//!   takes the launcher with it (parent-death signal), and each worker dies with the
//!   launcher the same way. No worker outlives its backend, none is left a zombie.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use log::{error, warn};

use crate::client::spawn::{
    cloexec_from, fork_worker, status_from_raw, Started, WorkerProcess, WorkerProgram,
};
use crate::socket;

/// The launcher's socket to the backend.
pub const LAUNCHER_FD: RawFd = 3;
/// Arguments one start may add.
const MAX_EXTRA_ARGS: usize = 32;
/// Flags only the launcher's own command line may give the worker.
const FIXED_FLAGS: [&str; 2] = ["--gpu", "--seccomp"];
/// How long a start or a wait for a worker's end may take before the launcher is deemed
/// hung (a worker's exec takes milliseconds; a killed worker ends at once).
const LAUNCHER_PATIENCE: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------
// The backend's side.

/// The backend's handle on its launcher process.
pub struct LauncherClient {
    /// What the launcher runs (requests must start with it).
    worker: WorkerProgram,
    sock: Mutex<OwnedFd>,
    process: Mutex<Option<Child>>,
}

static CLIENT: OnceLock<LauncherClient> = OnceLock::new();

/// The launcher this process started, if it did: workers then start through it.
pub fn client() -> Option<&'static LauncherClient> {
    CLIENT.get()
}

/// Starts the launcher process: `launcher` with `launcher_args` (e.g. this binary and
/// `worker-launcher`), then the program and arguments of `worker`, which is all it will
/// ever run. Call it from a thread that lives as long as the process (the main thread),
/// before any seccomp filter forbids starting processes; once per process.
pub fn start_process_launcher(
    launcher: &Path,
    launcher_args: &[String],
    worker: &WorkerProgram,
) -> io::Result<u32> {
    let (ours, theirs) = socket::pair()?;
    let fd = theirs.as_raw_fd();
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    let mut c = Command::new(launcher);
    c.args(launcher_args)
        .arg(&worker.program)
        .args(&worker.args)
        .stdin(Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (fcntl, dup2, prctl, getppid, close_range) on fds it
    // owns there.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(move || {
            let copy = libc::fcntl(fd, libc::F_DUPFD, 16);
            if copy < 0
                || libc::dup2(copy, LAUNCHER_FD) < 0
                || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
            {
                return Err(io::Error::last_os_error());
            }
            libc::close(copy);
            cloexec_from(LAUNCHER_FD + 1);
            if libc::getppid() != parent {
                return Err(io::Error::from(io::ErrorKind::BrokenPipe));
            }
            Ok(())
        });
    }
    let child = c.spawn()?;
    drop(theirs);
    let pid = child.id();
    CLIENT
        .set(LauncherClient {
            worker: worker.clone(),
            sock: Mutex::new(ours),
            process: Mutex::new(Some(child)),
        })
        .map_err(|_| io::Error::other("a worker launcher runs already"))?;
    Ok(pid)
}

/// Stops the launcher this process started (it kills what workers are left and exits)
/// and reaps it; nothing if there is none.
pub fn stop_process_launcher() {
    let Some(l) = client() else {
        return;
    };
    {
        let sock = lock(&l.sock);
        // SAFETY: shutdown(2) on a socket this handle owns.
        unsafe { libc::shutdown(sock.as_raw_fd(), libc::SHUT_WR) };
    }
    let Some(mut child) = lock(&l.process).take() else {
        return;
    };
    let deadline = Instant::now() + LAUNCHER_PATIENCE;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return,
            Ok(Some(st)) => {
                warn!("the GPU worker launcher ended with {st}");
                return;
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                // It dies with this process (its parent-death signal).
                warn!("the GPU worker launcher did not stop");
                return;
            }
            Err(e) => {
                warn!("the GPU worker launcher: {e}");
                return;
            }
        }
    }
}

impl LauncherClient {
    /// Starts `prog` (which must be the launcher's worker plus extra arguments) with the
    /// turn page `turn` as its fd 5.
    pub fn start(&self, prog: &WorkerProgram, turn: Option<RawFd>) -> io::Result<Started> {
        let extra = prog
            .args
            .strip_prefix(self.worker.args.as_slice())
            .filter(|_| prog.program == self.worker.program)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "the worker launcher runs {} {:?} only",
                        self.worker.program.display(),
                        self.worker.args
                    ),
                )
            })?;
        // Never empty (an empty message reads as end of file).
        let frame = format!("S{}", extra.join("\0"));
        let fds: Vec<RawFd> = turn.into_iter().collect();
        let sock = lock(&self.sock);
        socket::send(sock.as_fd(), frame.as_bytes(), &fds)?;
        socket::set_recv_timeout(sock.as_fd(), Some(LAUNCHER_PATIENCE))?;
        let got = socket::recv(sock.as_fd())?
            .ok_or_else(|| io::Error::other("the GPU worker launcher is gone"))?;
        drop(sock);
        let (kind, rest) = got.frame.split_at(got.frame.len().min(2));
        match kind {
            b"ok" if rest.len() == 4 && got.fds.len() == 3 => {
                let pid = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                let mut fds = got.fds.into_iter();
                let (Some(cmd), Some(events), Some(status)) = (fds.next(), fds.next(), fds.next())
                else {
                    return Err(io::Error::other("the launcher's answer lacks its fds"));
                };
                Ok(Started {
                    process: WorkerProcess::Launched(Launched {
                        pid,
                        status,
                        ended: None,
                    }),
                    cmd,
                    events,
                })
            }
            b"er" => Err(io::Error::other(format!(
                "the GPU worker launcher: {}",
                String::from_utf8_lossy(rest)
            ))),
            _ => Err(io::Error::other("the GPU worker launcher answered garbage")),
        }
    }
}

/// A worker the launcher started: its pid and status socket.
pub struct Launched {
    pid: u32,
    status: OwnedFd,
    ended: Option<ExitStatus>,
}

impl Launched {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Asks the launcher to SIGKILL it (nothing once it has ended).
    pub fn kill(&mut self) {
        if self.ended.is_none() {
            let _ = socket::send(self.status.as_fd(), b"k", &[]);
        }
    }

    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.receive(libc::MSG_DONTWAIT)
    }

    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        let deadline = Instant::now() + LAUNCHER_PATIENCE;
        loop {
            if let Some(st) = self.receive(0)? {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the launcher never reported the worker's end",
                ));
            }
        }
    }

    /// Reads the worker's wait status off its status socket (`flags`: `MSG_DONTWAIT` or
    /// 0, which waits at most a second). End of file without a status: the launcher is
    /// gone, and the worker with it (its parent-death signal).
    fn receive(&mut self, flags: libc::c_int) -> io::Result<Option<ExitStatus>> {
        if let Some(st) = self.ended {
            return Ok(Some(st));
        }
        if flags == 0 && !readable(self.status.as_fd(), Duration::from_secs(1))? {
            return Ok(None);
        }
        let mut buf = [0u8; 8];
        // SAFETY: recv(2) into a local buffer of the length given.
        let n = unsafe {
            libc::recv(
                self.status.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                flags,
            )
        };
        let st = match n {
            4 => status_from_raw(i32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]])),
            0 => status_from_raw(libc::SIGKILL),
            n if n < 0 => {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                    // The launcher closed its end with our kill request unread: the
                    // error comes once, before the status queued ahead of it.
                    io::ErrorKind::ConnectionReset => self.receive(flags),
                    _ => Err(e),
                };
            }
            _ => return Err(io::Error::other("a bad status from the launcher")),
        };
        self.ended = Some(st);
        Ok(Some(st))
    }
}

/// Whether `fd` becomes readable (or hung up) within `t`.
fn readable(fd: BorrowedFd<'_>, t: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = t.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: poll(2) on one pollfd that lives here.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(n > 0)
}

// ---------------------------------------------------------------------------------------
// The launcher's side.

/// A worker the launcher runs.
struct Running {
    child: Child,
    /// Readable once the worker has ended.
    pidfd: OwnedFd,
    /// Our end of its status socket; `None` once the backend let go of it.
    status: Option<OwnedFd>,
}

/// The launcher's `main`: `args` are the worker's program and fixed arguments (what
/// follows `worker-launcher` on the command line).
pub fn main_with(args: impl IntoIterator<Item = String>) -> ExitCode {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .try_init();
    let mut args = args.into_iter();
    let Some(program) = args.next() else {
        error!("worker-launcher: no worker program given");
        return ExitCode::FAILURE;
    };
    let worker = WorkerProgram {
        program: PathBuf::from(program),
        args: args.collect(),
    };
    // SAFETY: the backend started this process with its socket as fd 3
    // (`start_process_launcher`); nothing else here owns it.
    let ctrl = unsafe { OwnedFd::from_raw_fd(LAUNCHER_FD) };
    // Never handed on to a worker.
    // SAFETY: fcntl on the fd just taken.
    unsafe { libc::fcntl(ctrl.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    // The backend decides when its workers end (a terminal's SIGINT or a service
    // manager's SIGTERM reaches the whole group): the launcher goes when the backend
    // does. Workers start with an empty mask (std resets it).
    block_stop_signals();
    // The launcher needs no capability (a worker opens the GPU's device nodes as this
    // user): none are handed on.
    if let Err(e) = vgpu_sandbox::privileges::drop_all() {
        error!("worker-launcher: {e}");
        return ExitCode::FAILURE;
    }
    match serve(&worker, ctrl) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("worker-launcher: {e}");
            ExitCode::FAILURE
        }
    }
}

fn block_stop_signals() {
    // SAFETY: `set` is a local sigset_t initialised by sigemptyset before use; the calls
    // change only this (single) thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Serves start requests until the backend's socket reads end of file, then kills and
/// reaps every worker left.
fn serve(worker: &WorkerProgram, ctrl: OwnedFd) -> io::Result<()> {
    let mut running: HashMap<u32, Running> = HashMap::new();
    let result = serve_loop(worker, &ctrl, &mut running);
    for r in running.values_mut() {
        let _ = r.child.kill();
    }
    for (_, mut r) in running.drain() {
        if let Ok(st) = r.child.wait() {
            report(&mut r, st);
        }
    }
    result
}

fn serve_loop(
    worker: &WorkerProgram,
    ctrl: &OwnedFd,
    running: &mut HashMap<u32, Running>,
) -> io::Result<()> {
    loop {
        // What to watch: the backend's socket, then per worker its pidfd and status socket.
        let mut polls = vec![pollfd(ctrl.as_raw_fd())];
        let mut who = Vec::new();
        for (pid, r) in running.iter() {
            polls.push(pollfd(r.pidfd.as_raw_fd()));
            who.push((*pid, false));
            if let Some(s) = &r.status {
                polls.push(pollfd(s.as_raw_fd()));
                who.push((*pid, true));
            }
        }
        // SAFETY: poll(2) on a vector of pollfds that lives across the call.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        for (p, (pid, is_status)) in polls[1..].iter().zip(who) {
            if p.revents == 0 {
                continue;
            }
            let Some(r) = running.get_mut(&pid) else {
                continue;
            };
            if is_status {
                on_status(r);
            } else if let Ok(Some(st)) = r.child.try_wait() {
                report(r, st);
                running.remove(&pid);
            }
        }
        if polls[0].revents != 0 {
            let Some(req) = socket::recv(ctrl.as_fd())? else {
                return Ok(());
            };
            let answer = match start_one(worker, &req.frame, &req.fds) {
                Ok((pid, r, fds)) => {
                    let sent = socket::send(
                        ctrl.as_fd(),
                        &[b"ok".as_slice(), &pid.to_le_bytes()].concat(),
                        &fds.iter().map(AsRawFd::as_raw_fd).collect::<Vec<_>>(),
                    );
                    running.insert(pid, r);
                    sent
                }
                Err(e) => socket::send(ctrl.as_fd(), format!("er{e}").as_bytes(), &[]),
            };
            answer?;
        }
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// A message or end of file on a worker's status socket: the backend wants it gone.
fn on_status(r: &mut Running) {
    let Some(s) = &r.status else {
        return;
    };
    let mut buf = [0u8; 8];
    // SAFETY: recv(2) into a local buffer of the length given.
    let n = unsafe { libc::recv(s.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    let _ = r.child.kill();
    if n == 0 {
        // The backend let go of it: nobody to tell.
        r.status = None;
    }
}

/// Tells the backend how a worker ended.
fn report(r: &mut Running, st: ExitStatus) {
    use std::os::unix::process::ExitStatusExt;
    if let Some(s) = r.status.take() {
        let _ = socket::send(s.as_fd(), &st.into_raw().to_le_bytes(), &[]);
        // Kill requests left unread would make the close reset the backend's end.
        let mut buf = [0u8; 8];
        // SAFETY: recv(2) into a local buffer of the length given, without waiting.
        while unsafe {
            libc::recv(
                s.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        } > 0
        {}
    }
}

/// Starts one worker for a request: `frame` holds the extra arguments, `fds` the turn
/// page if any. Returns its pid, what the launcher keeps, and what goes to the backend.
fn start_one(
    worker: &WorkerProgram,
    frame: &[u8],
    fds: &[OwnedFd],
) -> Result<(u32, Running, [OwnedFd; 3]), String> {
    let frame = frame
        .strip_prefix(b"S")
        .ok_or_else(|| "not a start request".to_string())?;
    let text = std::str::from_utf8(frame).map_err(|_| "arguments not UTF-8".to_string())?;
    let extra: Vec<String> = if text.is_empty() {
        Vec::new()
    } else {
        text.split('\0').map(str::to_string).collect()
    };
    if extra.len() > MAX_EXTRA_ARGS {
        return Err(format!("{} arguments", extra.len()));
    }
    if let Some(a) = extra
        .iter()
        .find(|a| FIXED_FLAGS.iter().any(|f| a.starts_with(f)))
    {
        return Err(format!("{a} is the launcher's to give"));
    }
    if fds.len() > 1 {
        return Err(format!("{} fds", fds.len()));
    }
    let args: Vec<String> = worker.args.iter().cloned().chain(extra).collect();
    let turn = fds.first().map(AsRawFd::as_raw_fd);
    let (child, cmd, events) =
        fork_worker(&worker.program, &args, turn).map_err(|e| format!("starting: {e}"))?;
    let pid = child.id();
    let (status_ours, status_theirs) = socket::pair().map_err(|e| e.to_string())?;
    // SAFETY: pidfd_open(2) on our own child, not yet reaped (so the pid is its own).
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        let e = io::Error::last_os_error();
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("pidfd_open: {e}"));
    }
    // SAFETY: pidfd_open returned a new fd (close-on-exec by default) that we now own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    Ok((
        pid,
        Running {
            child,
            pidfd,
            status: Some(status_ours),
        },
        [cmd, events, status_theirs],
    ))
}
