//! The guest tools, built on the `vgpu-guest` runtime only: the `vgpu-smoke` checks
//! (also `--hostile` and `--swap`), the guest benchmark `vgpu-guest-bench`, and the
//! figures, statistics and measuring helpers it shares with the host's `vgpu-bench`
//! (`bench/`), which runs the same guest suite as `vgpu-bench guest`.

pub mod bench;
pub mod hostile;
pub mod measure;
pub mod native;
pub mod report;
pub mod smoke;
pub mod stats;
pub mod swap_check;
