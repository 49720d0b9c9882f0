//! `vgpu-gpu-worker`: serves one VM's GPU to `vgpu-backend` from a process of its own
//! (`vgpu-backend worker` is the same program). Not meant to be run by hand.

fn main() -> std::process::ExitCode {
    vgpu_gpu_worker::cli::main_with(std::env::args())
}
