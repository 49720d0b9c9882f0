//! The filters of every role of a process, installed once, and a thread entering its role.

use std::collections::HashMap;
use std::sync::OnceLock;

use log::{debug, error};
use seccompiler::BpfProgram;

use crate::{Mode, Role, Rules, SandboxError};

/// The compiled filters of each role, in one mode.
#[derive(Debug)]
pub struct Plan {
    mode: Mode,
    filters: HashMap<Role, Vec<BpfProgram>>,
}

static PLAN: OnceLock<Plan> = OnceLock::new();

impl Plan {
    pub fn new(mode: Mode) -> Plan {
        Plan {
            mode,
            filters: HashMap::new(),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Adds `role`'s filters: `allow` is its allow-list; the syscalls of `refuse` (which
    /// `allow` must also allow) fail with `EACCES` instead of running. In [`Mode::Off`]
    /// nothing is compiled.
    pub fn add(&mut self, role: Role, allow: &Rules, refuse: &Rules) -> Result<(), SandboxError> {
        if self.mode == Mode::Off {
            return Ok(());
        }
        let mut progs = vec![allow.compile(role, self.mode)?];
        if refuse.syscalls().next().is_some() {
            progs.push(refuse.compile_errno(role, libc::EACCES)?);
        }
        self.filters.insert(role, progs);
        Ok(())
    }

    /// The compiled filters of `role` (none for a role not added, or in `Off`).
    pub fn programs(&self, role: Role) -> &[BpfProgram] {
        self.filters.get(&role).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Installs `role`'s filters on the calling thread (and so on the threads it starts
    /// afterwards). Sets `PR_SET_NO_NEW_PRIVS`, which seccomp requires of a process
    /// without `CAP_SYS_ADMIN`.
    pub fn apply(&self, role: Role) -> Result<(), SandboxError> {
        for p in self.programs(role) {
            seccompiler::apply_filter(p)
                .map_err(|source| SandboxError::Install { role, source })?;
        }
        Ok(())
    }

    /// Installs `role`'s filters on every thread of the process at once
    /// (`SECCOMP_FILTER_FLAG_TSYNC`): for a process whose threads were started by code it
    /// does not own (the CUDA driver's, at `cuInit`) before the filters could go on.
    pub fn apply_all_threads(&self, role: Role) -> Result<(), SandboxError> {
        for p in self.programs(role) {
            seccompiler::apply_filter_all_threads(p)
                .map_err(|source| SandboxError::Install { role, source })?;
        }
        Ok(())
    }
}

/// Makes `plan` the process's, for [`enter`]. Once per process.
pub fn install_plan(plan: Plan) -> Result<&'static Plan, SandboxError> {
    PLAN.set(plan).map_err(|_| SandboxError::PlanInstalled)?;
    PLAN.get().ok_or(SandboxError::PlanInstalled)
}

/// The mode of the installed plan, if any.
pub fn installed_mode() -> Option<Mode> {
    PLAN.get().map(Plan::mode)
}

/// The calling thread takes on `role`'s filters from the installed plan; without a plan
/// (a backend embedded in a test) nothing happens. A filter that cannot be installed
/// ends the process: running unconfined when confinement was asked for is worse.
pub fn enter(role: Role) {
    let Some(plan) = PLAN.get() else {
        return;
    };
    match plan.apply(role) {
        Ok(()) => debug!(
            "seccomp: thread {:?} entered role {role}",
            std::thread::current().name()
        ),
        Err(e) => {
            error!("{e}");
            std::process::abort();
        }
    }
}
