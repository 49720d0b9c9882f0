//! The `vgpu-backend` binary as a child process: what the tests of the daemon itself
//! (sandboxing, restarts, a hung or killed backend) need and an in-process [`crate::Host`]
//! cannot give.
//!
//! A [`BackendLauncher`] owns a private directory and a config body; each
//! [`BackendLauncher::start`] writes `<dir>/backend.toml` (`socket_dir` = the directory,
//! then the body) and starts a [`BackendProcess`] on it, so a test restarts the backend on
//! the same sockets by starting again. The process's stderr is appended to
//! `<dir>/backend.log` (every process of a launcher in one file) and shown when something
//! fails. The directory is removed when the launcher is dropped, unless the test is
//! failing (then its log stays for a look).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vgpu_backend::api::client::ApiClient;
use vgpu_loopback::{LoopbackConfig, LoopbackVm};
use vgpu_vmm::reconnect::FaultPolicy;

use crate::{connect_retry_with, temp_dir, DEFAULT_VM_MEM};

/// Liveness bound for waiting on a backend process (its API, its sockets, a signal taking
/// effect): never a performance target.
pub const PROCESS_PATIENCE: Duration = Duration::from_secs(60);

/// How long [`BackendProcess::terminate`] waits for the exit after SIGTERM.
pub const TERMINATE_TIMEOUT: Duration = Duration::from_secs(10);

/// Lines of the log a failure message shows.
const LOG_TAIL_LINES: usize = 40;

/// The backend binary: `VGPU_BACKEND_BIN` (another build, e.g. the static musl one the
/// nested rig runs), else `built` (a test of the `vgpu-backend` crate passes
/// `env!("CARGO_BIN_EXE_vgpu-backend")`), else `vgpu-backend` in the target directory of
/// the running test (`target/<profile>/deps/..`), which must have been built.
pub fn backend_bin(built: Option<&Path>) -> PathBuf {
    if let Some(p) = std::env::var_os("VGPU_BACKEND_BIN") {
        return PathBuf::from(p);
    }
    if let Some(p) = built {
        return p.to_path_buf();
    }
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = profile_dir.join("vgpu-backend");
    assert!(
        bin.exists(),
        "{} missing: build it first (cargo build --release -p vgpu-backend) or set \
         VGPU_BACKEND_BIN",
        bin.display()
    );
    bin
}

/// The flags after `--config` of a backend whose `cuda` GPU runs a worker per VM
/// (`--gpu-workers`): on the CPU test device, or on the real GPU when `VGPU_WORKER_GPU`
/// says `cuda` (as `ci/device/run.sh` does). The sandbox stays the default
/// (`--seccomp kill`, backend and workers).
pub fn gpu_worker_args() -> Vec<&'static str> {
    let real =
        std::env::var("VGPU_WORKER_GPU").is_ok_and(|g| g.starts_with("cuda:") || g == "cuda");
    let mut args = vec!["--gpu-workers"];
    if !real {
        args.extend(["--test-worker-gpu", "cuda-fake"]);
    }
    args
}

/// How to start the backend binary, and the directory its processes share.
pub struct BackendLauncher {
    bin: PathBuf,
    dir: PathBuf,
    body: String,
    api: bool,
    args: Vec<String>,
    rust_log: String,
}

impl BackendLauncher {
    /// A launcher with a fresh directory named after `tag`; `body` is the config after
    /// `socket_dir` (`[gpu]`, `[scheduler]`, `[[vm]]`, …). The binary is
    /// [`backend_bin`]`(None)` unless [`Self::bin`] says otherwise; `RUST_LOG=info`.
    pub fn new(tag: &str, body: &str) -> Self {
        BackendLauncher {
            bin: PathBuf::new(),
            dir: temp_dir(tag),
            body: body.to_string(),
            api: false,
            args: Vec::new(),
            rust_log: "info".into(),
        }
    }

    /// The binary the test's own crate built (`VGPU_BACKEND_BIN` still wins).
    pub fn bin(mut self, built: &str) -> Self {
        self.bin = PathBuf::from(built);
        self
    }

    /// Serves the control API on `<dir>/api.sock` (see [`BackendProcess::api`]).
    pub fn with_api(mut self) -> Self {
        self.api = true;
        self
    }

    /// Flags after `--config`.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args = args.iter().map(|a| a.to_string()).collect();
        self
    }

    /// `RUST_LOG` of the process.
    pub fn rust_log(mut self, filter: &str) -> Self {
        self.rust_log = filter.into();
        self
    }

    /// The directory of the sockets, the config and the log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes the config and starts a process on it.
    pub fn start(&self) -> BackendProcess {
        let cfg = self.dir.join("backend.toml");
        let mut text = format!("socket_dir = \"{}\"\n{}", self.dir.display(), self.body);
        if self.api {
            // A table may follow `[[vm]]` entries: it starts a new one.
            text += &format!("\n[api]\nsocket = \"{}\"\n", self.api_socket().display());
        }
        std::fs::write(&cfg, text).expect("backend config");
        let log_path = self.dir.join("backend.log");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("backend log");
        let bin = backend_bin((!self.bin.as_os_str().is_empty()).then_some(self.bin.as_path()));
        let child = Command::new(&bin)
            .arg("--config")
            .arg(&cfg)
            .args(&self.args)
            .env("RUST_LOG", &self.rust_log)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        BackendProcess {
            child,
            dir: self.dir.clone(),
            log: log_path,
        }
    }

    fn api_socket(&self) -> PathBuf {
        self.dir.join("api.sock")
    }
}

impl Drop for BackendLauncher {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// One running backend process; SIGKILLed and reaped on drop.
pub struct BackendProcess {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
}

impl BackendProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The vhost-user socket of `vm`.
    pub fn socket(&self, vm: &str) -> PathBuf {
        self.dir.join(format!("{vm}.sock"))
    }

    /// Everything the launcher's processes logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last lines of [`Self::log`].
    pub fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    /// `Ok` while the process runs; how it ended otherwise (a seccomp kill ends it with
    /// SIGSYS), with the log's tail.
    pub fn alive(&mut self) -> Result<(), String> {
        match self.child.try_wait().expect("try_wait") {
            None => Ok(()),
            Some(st) => Err(format!("backend died: {st:?}\n{}", self.log_tail())),
        }
    }

    /// A client of the control API (the launcher's [`BackendLauncher::with_api`]) once it
    /// answers; panics if the process exits first or it never does.
    pub fn api(&mut self) -> ApiClient {
        let c = ApiClient::new(self.dir.join("api.sock"));
        let t0 = Instant::now();
        loop {
            match c.info() {
                Ok(_) => return c,
                Err(e) if t0.elapsed() > PROCESS_PATIENCE => {
                    panic!("backend API: {e}\n{}", self.log_tail())
                }
                Err(_) => {
                    if let Err(e) = self.alive() {
                        panic!("before its API answered: {e}");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// A loopback VM (the default guest RAM) connected as `vm`'s VMM with `faults`,
    /// retrying while the backend does not listen yet.
    pub fn connect(&self, vm: &str, faults: FaultPolicy) -> Arc<LoopbackVm> {
        let cfg = LoopbackConfig::with_mem(DEFAULT_VM_MEM);
        connect_retry_with(&self.socket(vm), cfg, faults, PROCESS_PATIENCE)
            .unwrap_or_else(|e| panic!("connect {vm}: {e}\n{}", self.log_tail()))
    }

    /// What each open fd of the process points at, sorted.
    pub fn fd_targets(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|p| p.display().to_string())
            .collect();
        v.sort();
        v
    }

    /// Sends `sig` to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid, which stays ours until it is reaped.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({sig})");
    }

    /// SIGSTOP, returning once every thread has stopped (the signal is asynchronous: a
    /// thread could otherwise still answer a request).
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let tasks = PathBuf::from(format!("/proc/{}/task", self.pid()));
        let t0 = Instant::now();
        loop {
            let all_stopped = std::fs::read_dir(&tasks)
                .expect("task list")
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
                .all(|stat| {
                    // "pid (comm) S ...": the state follows the last ')'.
                    stat.rsplit_once(')')
                        .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
                });
            if all_stopped {
                return;
            }
            assert!(t0.elapsed() < PROCESS_PATIENCE, "backend does not stop");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        self.signal(libc::SIGKILL);
        self.child.wait().expect("wait");
    }

    /// SIGTERM, then the exit status within [`TERMINATE_TIMEOUT`] (a panic otherwise).
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            if t0.elapsed() > TERMINATE_TIMEOUT {
                let _ = self.child.kill();
                panic!("backend did not stop on SIGTERM\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for BackendProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
