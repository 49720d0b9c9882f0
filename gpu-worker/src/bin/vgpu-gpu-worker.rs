//! `vgpu-gpu-worker`: serves one VM's GPU to `vgpu-backend` from a process of its own
//! (`vgpu-backend worker` is the same program). Not meant to be run by hand.
//! `vgpu-gpu-worker launcher PROGRAM ARGS...` is the worker launcher
//! (`vgpu-backend worker-launcher`), for tests of the launcher without the backend.

fn main() -> std::process::ExitCode {
    if std::env::args().nth(1).as_deref() == Some("launcher") {
        return vgpu_gpu_worker::launcher::main_with(std::env::args().skip(2));
    }
    vgpu_gpu_worker::cli::main_with(std::env::args())
}
