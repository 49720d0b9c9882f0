//! What the front end needs from a GPU driver, as a trait: the real CUDA device
//! ([`super::driver::CudaDevice`]) and a CPU fake for GPU-free tests
//! ([`super::fake::FakeDevice`]) implement it.

use std::ffi::CStr;

use vgpu_protocol::module::ParamInfo;
use vgpu_protocol::KernelArgs;

use super::error::DeviceError;
use super::plan::{Op, RefWrite};

/// The granule of the VMM API calls ([`Device::create_physical`] and friends): 2 MiB,
/// the H100's allocation granularity and the GPU MMU's huge page.
pub const VM_GRANULE: u64 = 2 << 20;

/// A stream-ordered GPU: streams of operations and completion marks on them.
///
/// Pointers in ops are device pointers the front end obtained from [`Device::register_host`]
/// memory (unified addressing: the device pointer equals the host pointer) or from
/// [`Device::alloc_device`] (VRAM and staging).
pub trait Device: Send + Sync + 'static {
    type Stream: Send + Sync;
    /// A point in a stream: done once everything issued before it has completed.
    type Mark: Send + Sync;

    fn name(&self) -> String;
    /// The device attributes guests are told (`(CUdevice_attribute, value)`).
    fn attributes(&self) -> Vec<(u32, i32)>;
    /// Makes host memory reachable by the device at the same address.
    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), DeviceError>;
    fn unregister_host(&self, ptr: *mut u8) -> Result<(), DeviceError>;
    /// Device memory: the VRAM pool and channels' staging buffers.
    fn alloc_device(&self, len: u64) -> Result<u64, DeviceError>;
    fn free_device(&self, ptr: u64);
    /// Physical memory (the VMM API: `cuMemCreate`): `len` bytes (a multiple of
    /// [`VM_GRANULE`]) of device memory with no address yet; returns its handle.
    fn create_physical(&self, len: u64) -> Result<u64, DeviceError>;
    /// Releases a handle of [`Device::create_physical`]; its memory goes once no mapping
    /// holds it.
    fn release_physical(&self, handle: u64);
    /// Reserves `len` bytes of device address space (a multiple of [`VM_GRANULE`]), at
    /// `hint` when that range is free (0: anywhere); returns where it lies, which callers
    /// compare with `hint`.
    fn reserve_va(&self, hint: u64, len: u64) -> Result<u64, DeviceError>;
    /// Returns a reservation of [`Device::reserve_va`]; nothing may be mapped in it.
    fn free_va(&self, ptr: u64, len: u64);
    /// Maps the whole of physical `handle` (`len` bytes) at `ptr`, inside a reservation,
    /// readable and, if `writable`, writable by the device.
    fn map_physical(
        &self,
        ptr: u64,
        len: u64,
        handle: u64,
        writable: bool,
    ) -> Result<(), DeviceError>;
    /// Unmaps `ptr..ptr+len` (whole mappings of [`Device::map_physical`]); device work
    /// touching the range afterwards faults.
    fn unmap_va(&self, ptr: u64, len: u64) -> Result<(), DeviceError>;
    /// Copies `len` bytes of device memory at `src` to host memory at `dst`, and returns
    /// when they have arrived. Ordered after nothing: callers make sure no stream writes
    /// the range meanwhile.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes and `src..src+len` device memory.
    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), DeviceError>;
    /// Copies host memory at `src` into device memory at `dst`; returns when done.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes of reads and `dst..dst+len` device memory.
    unsafe fn copy_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), DeviceError>;
    /// Several [`Device::copy_to_host`]s, `(dst, src, len)` each, queued together; returns
    /// when all have arrived (also on an error: nothing is left in flight). The default
    /// copies one after the other.
    ///
    /// # Safety
    /// As [`Device::copy_to_host`], for every copy.
    unsafe fn copy_to_host_many(
        &self,
        copies: &[(*mut u8, u64, usize)],
    ) -> Result<(), DeviceError> {
        for &(dst, src, len) in copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_to_host(dst, src, len) }?;
        }
        Ok(())
    }
    /// Several [`Device::copy_from_host`]s, `(dst, src, len)` each, as
    /// [`Device::copy_to_host_many`].
    ///
    /// # Safety
    /// As [`Device::copy_from_host`], for every copy.
    unsafe fn copy_from_host_many(
        &self,
        copies: &[(u64, *const u8, usize)],
    ) -> Result<(), DeviceError> {
        for &(dst, src, len) in copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_from_host(dst, src, len) }?;
        }
        Ok(())
    }
    /// Sets `len` bytes of device memory at `dst` to zero; returns when done.
    fn zero_device(&self, dst: u64, len: usize) -> Result<(), DeviceError>;

    fn create_stream(&self) -> Result<Self::Stream, DeviceError>;
    /// Enqueues one operation; it runs after everything issued earlier on `s`. `prior` is
    /// a REF write the work before it owes, done first (by a builtin kernel itself as it
    /// starts, else by a stream write). Returns the REF write `op` leaves owed: an
    /// [`Op::LaunchSignal`] whose kernel could not signal itself (its grid is over the
    /// signal's block limit); the caller passes it as a later op's `prior`, or stores it
    /// itself once a mark behind it is reached.
    fn issue(
        &self,
        s: &Self::Stream,
        op: &Op,
        prior: Option<RefWrite>,
    ) -> Result<Option<RefWrite>, DeviceError>;
    /// Whether `op` does a `prior` REF write itself (a builtin kernel as it starts) rather
    /// than behind a stream write, which costs the GPU ~2.5 µs between two kernels.
    fn does_prior(&self, op: &Op) -> bool {
        prior_in_kernel(op)
    }
    fn mark(&self, s: &Self::Stream) -> Result<Self::Mark, DeviceError>;
    /// A mark that records no time ([`Device::elapsed_ns`] gives none for it): cheaper on
    /// the GPU (an event with timing between two kernels cost ~1.4 µs of a saxpy loop's
    /// time per kernel, one without nothing measurable: H200, 2026-11-28).
    fn mark_untimed(&self, s: &Self::Stream) -> Result<Self::Mark, DeviceError> {
        self.mark(s)
    }
    /// Whether the mark has been reached (never blocks).
    fn reached(&self, m: &Self::Mark) -> Result<bool, DeviceError>;
    /// GPU time between two reached marks of one stream.
    fn elapsed_ns(&self, from: &Self::Mark, to: &Self::Mark) -> Option<u64>;
    /// Why the context is unusable for good, once a call saw a sticky error
    /// ([`DeviceError::is_context_lost`]); `None` while it works.
    fn lost(&self) -> Option<String>;

    /// A guest's module, loaded into the device's context.
    type Module: Send + Sync;
    /// Loads a module image (PTX text, cubin or fatbin).
    fn module_load(&self, image: &[u8]) -> Result<Self::Module, DeviceError>;
    /// Unloads a module; the caller made sure no queued work uses its functions.
    fn module_unload(&self, m: Self::Module) -> Result<(), DeviceError>;
    /// A function of `m`: the handle [`Op::LaunchFunction`] names (valid while `m` is
    /// loaded) and its parameter layout when the device can tell.
    fn module_function(
        &self,
        m: &Self::Module,
        name: &CStr,
    ) -> Result<(u64, Option<Vec<ParamInfo>>), DeviceError>;
    /// The device address and size of the global `name` of `m`.
    fn module_global(&self, m: &Self::Module, name: &CStr) -> Result<(u64, u64), DeviceError>;
}

/// Whether `op` is a builtin kernel that does a prior REF write as it starts
/// (`kernels.cu`'s `VGPU_PRIOR`): all of them but the stencil, whose 65,536 one-element
/// blocks ran 17 % slower with it (a system-scope release from one block; 4 % slower
/// without the release), and 2 % slower with the prologue alone, never taken (H100,
/// 2026-11-28). Saxpy's loop ran 3 % faster with it.
pub fn prior_in_kernel(op: &Op) -> bool {
    match op {
        Op::Launch(a) | Op::LaunchSignal(a, _) => !matches!(
            a,
            KernelArgs::Stencil2d { .. } | KernelArgs::Memcpy { .. } | KernelArgs::Timestamp { .. }
        ),
        Op::Timestamp { .. } => true,
        _ => false,
    }
}
