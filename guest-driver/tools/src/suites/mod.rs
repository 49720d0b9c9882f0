//! `vgpu-bench` suites: one module per suite, each returning its figures.

pub mod api;
pub mod cuda;
pub mod guest;
pub mod measure;
pub mod sched;
pub mod sim;
pub mod swap;
pub mod virt;
