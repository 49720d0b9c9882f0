//! `vgpu-gpu-worker`: one VM's GPU in a process of its own (issue 30,
//! `docs/design/gpu-workers.md`).
//!
//! Two CUDA contexts of one process share one GPU address space, and one fault in either
//! kills both; two processes are isolated. So each VM's GPU work runs in a worker
//! process: [`server::serve`] is the worker's side (it serves any [`vgpu_host_shim::Gpu`]:
//! the `cuda` GPU, its CPU fake in CI, or the sim), [`client::WorkerGpu`] the backend's
//! (a `Gpu` whose calls are commands on the worker's socket). The messages are
//! `vgpu-worker-wire`'s; the transport is [`socket`] (frames and fds over a
//! `SOCK_SEQPACKET` pair).

pub mod cli;
pub mod client;
mod guest_ram;
pub mod launcher;
mod mapping;
pub mod pool;
pub mod sandbox;
pub mod server;
pub mod socket;
pub mod turn;

pub use client::spawn::{WorkerProgram, COMMAND_FD, EVENT_FD, TURN_FD};
pub use client::{Ids, LossKind, StartError, WorkerGpu, WorkerOptions};
pub use pool::{Granularity, PoolConfig, PoolStats, VmWorker, VmWorkerStats, WorkerPool};
pub use server::{serve, ServeError, ServeOptions, EXIT_GPU_LOST};
pub use turn::TurnSlots;
