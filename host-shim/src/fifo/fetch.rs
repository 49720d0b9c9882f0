//! Fetching and decoding GP entries: what both GPUs' front ends do before they run or
//! plan an entry's methods.

use vgpu_protocol::gp::GP_ENTRY_SIZE;
use vgpu_protocol::method::{decode_into, Method};
use vgpu_protocol::{counter_after, counter_distance, ControlPage, ErrorCode, GpEntry};
use vgpu_protocol::{KernelArgs, KernelId};

use super::channel_core::ChannelCore;
use crate::gpu_view::GpuView;
use crate::kernels::{KernelMemory, MemFault};
use crate::shared_mem::SharedMem;

/// Push buffers up to this size are fetched into stack buffers.
const SMALL_PB_BYTES: usize = 256;

/// Why a channel must stop: the error and its info (a faulting address, say).
pub type FetchError = (ErrorCode, u64);

/// Reads guest memory at a GPU virtual address (a channel's view of its address space).
pub type ArgReader<'a> = dyn FnMut(u64, &mut [u8]) -> Result<(), MemFault> + 'a;

impl ChannelCore {
    /// Fetches GP entry `next` if GP_PUT is past it, and notes the activity. `completed`
    /// is the front end's own count of completed entries (never the page's GP_GET, which
    /// the guest can write): more outstanding entries than the ring holds mean the
    /// application overwrote work that had not run yet. `vram` is the VRAM the front end
    /// can read (`None`: rings and push buffers must be in system memory).
    pub fn fetch_next(
        &self,
        next: u32,
        completed: u32,
        vram: Option<&SharedMem>,
    ) -> Result<Option<Vec<Method>>, FetchError> {
        let mut methods = Vec::new();
        Ok(self
            .fetch_next_into(next, completed, vram, &mut methods)?
            .then_some(methods))
    }

    /// [`ChannelCore::fetch_next`] into `methods` (emptied first; a front end reuses one
    /// buffer for every entry): whether there was an entry.
    pub fn fetch_next_into(
        &self,
        next: u32,
        completed: u32,
        vram: Option<&SharedMem>,
        methods: &mut Vec<Method>,
    ) -> Result<bool, FetchError> {
        let put = self.load(ControlPage::GP_PUT);
        if !counter_after(put, next) {
            return Ok(false);
        }
        if counter_distance(completed, put) > self.cfg.gp_entries {
            return Err((ErrorCode::BadGpEntry, put as u64));
        }
        self.fetch(vram, next, methods)?;
        self.note_activity();
        Ok(true)
    }

    /// Reads and decodes GP entry number `seq` of the channel's ring and its push buffer
    /// into `methods`.
    fn fetch(
        &self,
        vram: Option<&SharedMem>,
        seq: u32,
        methods: &mut Vec<Method>,
    ) -> Result<(), FetchError> {
        let mut view = GpuView::new(&self.space, vram);
        let index = (seq % self.cfg.gp_entries) as u64;
        let entry_va = self.cfg.gp_ring_va + index * GP_ENTRY_SIZE as u64;
        let mut raw = [0u8; GP_ENTRY_SIZE];
        view.read(entry_va, &mut raw)
            .map_err(|f| (ErrorCode::MmuFault, f.va))?;
        let entry = GpEntry::decode(&raw).map_err(|_| (ErrorCode::BadGpEntry, entry_va))?;
        // Most push buffers are a launch and a fence: read and convert them on the stack
        // (two allocations fewer per entry, on the front end's path to every launch).
        let len = entry.len_bytes() as usize;
        let (mut small_bytes, mut big_bytes) = ([0u8; SMALL_PB_BYTES], Vec::new());
        let bytes: &mut [u8] = if len <= SMALL_PB_BYTES {
            &mut small_bytes[..len]
        } else {
            big_bytes.resize(len, 0);
            &mut big_bytes
        };
        view.read(entry.pb_va, bytes)
            .map_err(|f| (ErrorCode::MmuFault, f.va))?;
        let (mut small_words, mut big_words) = ([0u32; SMALL_PB_BYTES / 4], Vec::new());
        let words: &mut [u32] = if len <= SMALL_PB_BYTES {
            &mut small_words[..len / 4]
        } else {
            big_words.resize(len / 4, 0);
            &mut big_words
        };
        for (w, c) in words.iter_mut().zip(bytes.chunks_exact(4)) {
            *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        decode_into(words, methods)
            .map_err(|e| (ErrorCode::BadMethod, entry.pb_va + e.offset() as u64 * 4))
    }
}

/// Reads and decodes a LAUNCH's argument block of `args_len` bytes at `args_va` through
/// `read` (the channel's view of its memory).
pub fn launch_args(
    kernel: KernelId,
    args_va: u64,
    args_len: u32,
    read: &mut ArgReader<'_>,
) -> Result<KernelArgs, FetchError> {
    if args_len as usize != KernelArgs::encoded_len(kernel) {
        return Err((ErrorCode::BadKernelArgs, args_va));
    }
    let mut raw = [0u8; 64];
    let raw = &mut raw[..args_len as usize];
    read(args_va, raw).map_err(|f| (ErrorCode::MmuFault, f.va))?;
    KernelArgs::decode(kernel, raw).map_err(|_| (ErrorCode::BadKernelArgs, args_va))
}
