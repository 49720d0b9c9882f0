//! `vgpu-bench` suites: one module per suite, each returning its figures.

pub mod api;
pub mod measure;
pub mod sim;
pub mod virt;
