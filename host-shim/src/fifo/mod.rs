//! `fifo`: the front-end core both GPUs share.
//!
//! Guests drive the `sim` and the `cuda` GPU the same way: they store GP_PUT into a
//! channel's control page, and the GPU's front end fetches and decodes GP entries from the
//! channel's address space. What does not depend on how the entries then run lives here.

pub mod channel_core;
pub mod control_pages;
pub mod fetch;
pub mod tables;
