//! `vgpu-bench` suites: one module per suite, each returning its figures.

pub mod sim;
pub mod virt;
