//! The backend's seccomp filters per thread role (`--seccomp kill|log|off`, default kill),
//! built on `vgpu-sandbox`.
//!
//! | role | threads | installed by |
//! |---|---|---|
//! | `BackendProcess` | the whole process | `main`, before the GPU opens and any thread starts |
//! | `BackendMain` | the main thread | `main`, once every socket is bound and thread started |
//! | `VmServe` | `vgpu-vm-NAME` and what it starts: the vhost-user thread `vgpu-NAME`, `vring_worker`, `vgpu-reap-NAME`, `vgpu-state-NAME` | `serve_loop`, first thing |
//! | `Api` | `vgpu-api`, `vgpu-api-conn`, `vgpu-api-sampler` | `accept_loop`, `sampler_loop` |
//! | `Scheduler` | `vgpu-sched` | its `thread_main` |
//! | `VramManager` | `vgpu-vram` | its `thread_main` |
//! | `GpuEngine` | `sim-pfifo`, `sim-copy`, `cuda-pfifo` | host-shim, first thing in each |
//! | `GpuWorker` | every thread of a GPU worker process (`vgpu-backend worker`, `--gpu-workers`) | the worker: before it opens the GPU (`sim`, `cuda-fake`), after (`cuda`), on all threads at once; rules in `gpu-worker/src/sandbox.rs` |
//!
//! With `--gpu-workers` the backend never calls the CUDA driver itself: its roles are the
//! `sim` ones (every open refused), and the workers, each with its own filter, are started
//! by the launcher process (`vgpu_gpu_worker::launcher`), started before the process
//! filter; no role of the backend allows starting a process. `BackendMain` may `wait4`
//! (only the caller's children: the launcher, at shutdown).
//!
//! Filters stack: a thread is held to the process filter, to those of the thread that
//! started it, and to its own. So the process filter is the union of every role plus what
//! startup does once, and a role that starts threads of another role allows what they
//! need (`Api` restarts the scheduler). The vhost-user-backend crate starts its threads
//! itself, so they get `VmServe` by inheritance. Opening files is refused everywhere with
//! `EACCES` (not a kill: glibc probes a sysfs file the first time malloc wants a new
//! arena). The `cuda` GPU widens every role by the driver's needs (`vgpu_sandbox::cuda`).

mod roles;

use vgpu_host_shim::GpuChoice;
use vgpu_sandbox::blocks::open_refused;
use vgpu_sandbox::cuda;
use vgpu_sandbox::{Mode, Plan, Role, Rules, SandboxError};

/// The backend's roles.
pub const ROLES: [Role; 7] = [
    Role::BackendProcess,
    Role::BackendMain,
    Role::VmServe,
    Role::Api,
    Role::Scheduler,
    Role::VramManager,
    Role::GpuEngine,
];

/// The allow-list of `role` on `gpu`, and the syscalls in it that fail with `EACCES`.
pub fn role_rules(role: Role, gpu: GpuChoice) -> Option<(Rules, Rules)> {
    let sim = roles::sim_rules(role)?;
    Some(match gpu {
        GpuChoice::Sim => (sim, open_refused()),
        // The driver opens device nodes and files: nothing is refused softly.
        GpuChoice::Cuda { .. } => (sim.union(&cuda::driver()), Rules::new()),
    })
}

/// The backend's plan: every role's filters in `mode`.
pub fn plan(mode: Mode, gpu: GpuChoice) -> Result<Plan, SandboxError> {
    let mut plan = Plan::new(mode);
    for role in ROLES {
        if let Some((allow, refuse)) = role_rules(role, gpu) {
            plan.add(role, &allow, &refuse)?;
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests;
