//! The commands and replies, as values.

use vgpu_protocol::mem::PageSize;
use vgpu_protocol::ErrorCode;

/// What a mapping points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Byte offset in the worker's VRAM.
    Vram { offset: u64 },
    /// Guest-physical address in the VM's RAM (a region sent with `AddGuestRegion`).
    Sysram { addr: u64 },
}

/// Where a migrated channel continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    pub gp_get: u32,
    pub reference: u32,
    pub notify_seq: u32,
    /// The error the channel had stopped on.
    pub error: Option<(ErrorCode, u64)>,
}

/// The backend's commands. Ids of contexts and channels are the backend's (it keeps
/// them unique across workers and restarts); the worker maps them to its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// First message: the version the backend speaks, and this worker's number.
    Hello {
        worker: u32,
    },
    /// The channels' control pages: one fd (memfd), `len` bytes.
    ControlPages {
        len: u64,
    },
    /// A piece of the VM's RAM: one fd (memfd) mapped from `fd_offset`, seen by the
    /// guest at `gpa`.
    AddGuestRegion {
        gpa: u64,
        len: u64,
        fd_offset: u64,
    },
    /// The VM's swap store for VRAM moves: one fd (memfd), `len` bytes.
    SwapStore {
        len: u64,
    },
    CreateContext {
        ctx: u32,
    },
    DestroyContext {
        ctx: u32,
    },
    AllocVram {
        size: u64,
        align: u64,
    },
    FreeVram {
        offset: u64,
    },
    Map {
        ctx: u32,
        va: u64,
        size: u64,
        target: Target,
        page: PageSize,
        read_only: bool,
    },
    Unmap {
        ctx: u32,
        va: u64,
        size: u64,
    },
    Remap {
        ctx: u32,
        va: u64,
        size: u64,
        target: Target,
    },
    InvalidateTlb {
        ctx: u32,
    },
    /// A channel whose control page is slot `slot` of the control pages.
    CreateChannel {
        ctx: u32,
        ch: u32,
        slot: u32,
        gp_ring_va: u64,
        gp_entries: u32,
        resume: Option<Resume>,
    },
    DestroyChannel {
        ch: u32,
    },
    KillChannel {
        ch: u32,
        code: ErrorCode,
    },
    /// Copies `len` bytes from VRAM at `vram_offset` into the swap store at
    /// `store_offset` (an eviction), or back (`to_vram`, a swap-in).
    MoveChunk {
        vram_offset: u64,
        store_offset: u64,
        len: u64,
        to_vram: bool,
    },
    /// Stops fetching from every channel (migration, a device reset) / goes on.
    Pause,
    Resume,
    /// Ends the worker after it released everything.
    Shutdown,
}

/// The worker's replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Ok,
    /// `Hello`'s answer: the GPU's VRAM and the worker's VRAM aperture (one fd: a memfd
    /// the VMM maps into the guest's BAR), `aperture_len` bytes.
    Hello {
        vram_bytes: u64,
        aperture_len: u64,
    },
    /// `AllocVram`'s answer.
    Vram {
        offset: u64,
        len: u64,
    },
    /// Refused or failed, with the code a guest would see.
    Error {
        code: ErrorCode,
    },
}
