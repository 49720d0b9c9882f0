//! `vgpu-bench` suites: one module per suite, each returning its figures. The guest
//! suite is the guest tools' (`vgpu-guest-bench` runs it in a VM).

pub mod api;
pub mod cuda;
pub mod flood;
pub mod migrate;
pub mod scale;
pub mod sched;
pub mod sim;
pub mod swap;
pub mod virt;

pub use vgpu_guest_tools::bench as guest;
pub use vgpu_guest_tools::measure;
