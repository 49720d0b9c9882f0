//! `libcuda.so.1` for guests: the CUDA driver API over the vgpu guest runtime
//! (issue 31). A CUDA program built against NVIDIA's `cuda.h` runs with this library on
//! its library path instead of NVIDIA's: its contexts, memory, modules, launches, streams
//! and events become the runtime's contexts, buffers, modules, push-buffer launches,
//! channels and semaphores, which reach the host through `/dev/vgpu` in a VM (or, in
//! host-side tests, a loopback VM of the library's own: `VGPU_LOOPBACK_SOCKET`).
//!
//! What is covered and what is not: docs/guest-cuda.md. Every entry point a program may
//! link that is not covered exists and returns `CUDA_ERROR_NOT_SUPPORTED`, logging its
//! name once (`VGPU_CUDA_LOG` sets the log level).

mod allocs;
mod driver;
pub mod entry;
mod errors;
mod image;
pub mod types;

pub use entry::proc::lookup;
