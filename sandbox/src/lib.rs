//! `vgpu-sandbox`: seccomp filters per **thread role** and privilege dropping, shared by
//! `vgpu-backend` and `vgpu-vmm` (built with rust-vmm's `seccompiler`, as Firecracker and
//! Cloud Hypervisor do).
//!
//! The mechanism lives here; each binary says what its roles may do (the rule sets in
//! `vgpu-backend/src/sandbox/` and `vmm/src/sandbox/`):
//!
//! - [`Rules`]: an allow-list of syscalls, some with argument conditions, built from the
//!   building blocks in [`blocks`] and combined by union;
//! - [`Plan`]: the compiled filters of every [`Role`] in one [`Mode`], installed once per
//!   process ([`install_plan`]) before the threads that use it start;
//! - [`enter`]: a thread takes its role's filters on itself. Code that owns a thread calls
//!   it first thing in the thread; without a plan (tests, benchmarks that embed a backend
//!   in-process) it does nothing. Threads started later inherit the filters of the thread
//!   that starts them, and filters stack (a syscall must pass every one), so a role that
//!   starts threads allows what its children need;
//! - [`privileges`]: `PR_SET_NO_NEW_PRIVS` and dropping capabilities;
//! - [`child`]: runs a closure in a forked child and reports how it ended — how the tests
//!   show that a filter refuses a syscall.

pub mod blocks;
pub mod child;
pub mod cuda;
mod plan;
pub mod privileges;
mod rules;

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

pub use plan::{enter, install_plan, installed_mode, Plan};
pub use rules::{Arg, Rules};

/// Errors of building or installing filters, or of dropping privileges.
#[derive(Debug, Error)]
pub enum SandboxError {
    #[error("seccomp filter of {role}: {source}")]
    Compile {
        role: Role,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("installing the seccomp filter of {role}: {source}")]
    Install {
        role: Role,
        #[source]
        source: seccompiler::Error,
    },
    #[error("a sandbox plan is installed already")]
    PlanInstalled,
    #[error("unsupported architecture {0} (filters are built for x86_64 and aarch64)")]
    Arch(String),
    #[error("{what}: {source}")]
    Privileges {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid seccomp mode {0:?} (kill, log or off)")]
    Mode(String),
}

/// What a filter does with a syscall outside its role's allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Kill the whole process (`SECCOMP_RET_KILL_PROCESS`: it ends as if by SIGSYS, and the
    /// kernel logs the syscall).
    #[default]
    Kill,
    /// Log the syscall and let it run (`SECCOMP_RET_LOG`): for finding what a new code path
    /// or driver needs.
    Log,
    /// No filters.
    Off,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Kill => "kill",
            Mode::Log => "log",
            Mode::Off => "off",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = SandboxError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kill" => Ok(Mode::Kill),
            "log" => Ok(Mode::Log),
            "off" => Ok(Mode::Off),
            _ => Err(SandboxError::Mode(s.to_string())),
        }
    }
}

/// The thread roles of both binaries; a [`Plan`] holds filters for those its binary has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// `vgpu-backend`'s whole process, installed by the main thread before it starts any
    /// other: what threads the backend does not own (a GPU driver's) are held to.
    BackendProcess,
    /// `vgpu-backend`'s main thread once serving: waits for a signal, shuts down.
    BackendMain,
    /// A VM's socket thread (`vgpu-vm-NAME`) and the threads it starts: the vhost-user
    /// message thread, the vring worker (guest requests), the reaper, device-state
    /// transfers.
    VmServe,
    /// The control API's threads (accept, connections, sampler).
    Api,
    /// The GPU scheduler's thread.
    Scheduler,
    /// The VRAM manager's thread.
    VramManager,
    /// A GPU's engine threads (`sim-pfifo`, `sim-copy`, `cuda-pfifo`).
    GpuEngine,
    /// A GPU worker process (`vgpu-backend worker`, `vgpu-gpu-worker`): every thread of
    /// it, the CUDA driver's included (installed on all threads at once).
    GpuWorker,
    /// `vgpu-vmm`'s main thread once the VM is set up: starts and stops the vCPUs.
    VmmMain,
    /// A vCPU thread of `vgpu-vmm` (KVM_RUN, device emulation).
    Vcpu,
    /// `vgpu-vmm`'s backend-request thread (SHMEM_MAP/UNMAP into the BAR window).
    VmmBackendReq,
    /// `vgpu-vmm`'s interrupt thread (INTx fallback, backend hang-up watch).
    VmmIrq,
    /// `vgpu-vmm`'s live migration: the control socket's thread on a source (it sends
    /// the VM), the main thread of a destination while it receives one.
    VmmMigration,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The architecture the filters are compiled for: this process's.
pub fn target_arch() -> Result<seccompiler::TargetArch, SandboxError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|_| SandboxError::Arch(std::env::consts::ARCH.to_string()))
}
