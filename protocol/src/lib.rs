//! `vgpu-protocol`: the wire formats shared by the guest, the backend and the GPU model.
//!
//! Everything here is plain data and pure functions: no I/O, no allocation on the
//! decode paths of per-submission data. Beside the wire formats it holds what both sides
//! compute alike: page sizes and mapping flags (`mem`), the range allocator of VRAM and
//! GPU virtual addresses (`range`) and the builtin kernels' CPU references (`reference`). Every decoder takes untrusted bytes and either
//! returns a value or an error; none of them panics (checked by property tests and a
//! cargo-fuzz target in `protocol/fuzz`).

pub mod channel;
pub mod device;
pub mod error;
pub mod gp;
pub mod kernel;
pub mod mem;
pub mod method;
pub mod migration;
pub mod module;
pub mod module_image;
pub mod range;
pub mod reference;
pub mod request;

pub use channel::ControlPage;
pub use error::ErrorCode;
pub use gp::GpEntry;
pub use kernel::{KernelArgs, KernelId};
pub use mem::{MapFlags, PageSize};
pub use method::{Method, MethodDecoder, SemaphoreMode};

/// Protocol version, written by the GPU into every control page and reported by
/// device info. Bump the major part on any incompatible layout change.
pub const PROTOCOL_VERSION: u32 = 0x0001_0000;

/// Size of a channel control page and of the GPU's small page.
pub const PAGE_SIZE: u64 = 4096;

/// Compares two wrapping 32-bit submission counters: true when `a` is ahead of `b`.
///
/// GP_PUT and GP_GET are free-running counters; the ring index is the counter modulo the
/// ring size. Counters are compared relative to each other so that wrap-around at 2^32
/// is harmless as long as fewer than 2^31 entries are outstanding.
pub fn counter_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// Whether wrapping counter `now` has reached `target` (is at or past it): a fence's
/// test, REF against the fence value.
pub fn counter_reached(now: u32, target: u32) -> bool {
    (now.wrapping_sub(target) as i32) >= 0
}

/// Number of entries between `from` and `to` (wrapping), `to` assumed not behind `from`.
pub fn counter_distance(from: u32, to: u32) -> u32 {
    to.wrapping_sub(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_wrap() {
        assert!(counter_after(1, 0));
        assert!(counter_after(0, u32::MAX));
        assert!(!counter_after(u32::MAX, 0));
        assert!(!counter_after(5, 5));
        assert_eq!(counter_distance(u32::MAX, 2), 3);
    }
}
