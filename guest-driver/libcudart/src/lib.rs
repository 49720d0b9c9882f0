//! `libcudart.so` for guests: the CUDA runtime API (issue 31), so that programs built
//! with `nvcc -cudart shared` run unmodified in a vgpu guest. It implements the calls
//! nvcc's generated code makes (fatbin, kernel and variable registration, `<<<>>>`'s
//! call configuration and `cudaLaunchKernel`) and the runtime calls a basic program
//! makes, on the driver API of whichever `libcuda.so.1` the loader finds — vgpu's guest
//! library in a VM (docs/guest-cuda.md says what is covered).

mod cu;
pub mod entry;
mod errors;
mod registry;

/// Turns on logging to stderr once (`VGPU_CUDART_LOG`, default `warn`).
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let env = env_logger::Env::new().filter_or("VGPU_CUDART_LOG", "warn");
        // A program that set up a logger of its own keeps it.
        let _ = env_logger::Builder::from_env(env).try_init();
    });
}
