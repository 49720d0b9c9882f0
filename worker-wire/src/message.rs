//! The commands, replies and events, as values.

use vgpu_protocol::mem::PageSize;
use vgpu_protocol::module::ParamInfo;
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
/// them unique across workers and restarts); the worker maps them to its own. Module and
/// function ids are the backend's too, scoped by their context, and the worker's GPU
/// uses them as they are (a `LAUNCH_FUNCTION` names the function id the guest was given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// First message: the version the backend speaks, and this worker's number.
    Hello {
        worker: u32,
    },
    /// A piece of the VM's RAM: one fd (memfd) mapped from `fd_offset`, seen by the
    /// guest at `gpa`.
    AddGuestRegion {
        gpa: u64,
        len: u64,
        fd_offset: u64,
    },
    /// Forgets every guest RAM region (a new memory table: the VM reconnected); refused
    /// while a context lives.
    ClearGuestRegions,
    /// The buffer host reads and writes of VRAM pass through: one fd (memfd), `len` bytes.
    CopyBuffer {
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
    /// Bytes of VRAM not allocated (answered with `Bytes`).
    VramFree,
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
    /// Host memory of the context's page tables (answered with `Bytes`).
    PageTableBytes {
        ctx: u32,
    },
    /// What mapping `va..va+size` with pages of `page` would add to the page tables
    /// (answered with `Bytes`; 0 for a range the GPU would refuse).
    MapCost {
        ctx: u32,
        va: u64,
        size: u64,
        page: PageSize,
    },
    /// The HAL's sysram hint: `addr..addr+len` of the VM's RAM is about to be mapped
    /// (`prepare`), or no longer (`!prepare`).
    SysramHint {
        ctx: u32,
        addr: u64,
        len: u64,
        prepare: bool,
    },
    /// A channel (answered with `Channel`: its slot in the control pages and the
    /// counters page).
    CreateChannel {
        ctx: u32,
        ch: u32,
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
    /// Look at the channel now instead of at the next poll.
    Doorbell {
        ch: u32,
    },
    /// Stop (`hold`) or resume fetching the channel's new GP entries (`Gpu::hold_fetch`);
    /// answered with `Bytes`: 1 if the worker's GPU can, else 0.
    HoldFetch {
        ch: u32,
        hold: bool,
    },
    /// With the channel's fetch held, whether what it fetched has completed
    /// (`Gpu::fetched_done`); answered with `Bytes`: 0 not held, 1 not yet, 2 done.
    FetchedDone {
        ch: u32,
    },
    /// Copies `len` bytes from VRAM at `vram_offset` into the copy buffer at
    /// `buf_offset` (a host read), or back (`to_vram`, a host write).
    Copy {
        vram_offset: u64,
        buf_offset: u64,
        len: u64,
        to_vram: bool,
    },
    /// Ends the worker after it released everything.
    Shutdown,
    /// Loads a guest's module image: `len` bytes of the sealed memfd sent with the
    /// command (the backend's one copy of the guest's bytes).
    ModuleLoad {
        ctx: u32,
        module: u32,
        len: u64,
    },
    ModuleUnload {
        ctx: u32,
        module: u32,
    },
    /// Binds `function` to the function `name` of `module` (answered with `Function`).
    FunctionGet {
        ctx: u32,
        module: u32,
        function: u32,
        name: Vec<u8>,
    },
    /// A global of `module` (answered with `Global`).
    GlobalGet {
        ctx: u32,
        module: u32,
        name: Vec<u8>,
    },
    /// Copies `len` bytes at `offset` of `module`'s variable `name` into the copy
    /// buffer's start (a migration saving it), or back (`to_variable`: restoring it).
    VariableCopy {
        ctx: u32,
        module: u32,
        name: Vec<u8>,
        offset: u64,
        len: u64,
        to_variable: bool,
    },
}

/// The worker's replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Ok,
    /// `Hello`'s answer: the GPU's shape, and two fds: the channels' control pages
    /// (`control_pages_len` bytes, a 4 KiB page per slot) and the counters page
    /// (`counters_len` bytes, a record per slot, see `crate::counters`).
    Hello {
        vram_bytes: u64,
        max_channels: u32,
        max_contexts: u32,
        compute_engines: u32,
        control_pages_len: u64,
        counters_len: u64,
        /// The GPU's device attributes for guests (`Gpu::device_attributes`), at most
        /// `vgpu_protocol::request::MAX_ATTRIBUTES`.
        attributes: Vec<(u32, i32)>,
    },
    /// `AllocVram`'s answer.
    Vram {
        offset: u64,
        len: u64,
    },
    /// A byte count (`VramFree`, `PageTableBytes`, `MapCost`).
    Bytes {
        n: u64,
    },
    /// `CreateChannel`'s answer: the channel's slot.
    Channel {
        slot: u32,
    },
    /// Refused or failed, with the code a guest would see.
    Error {
        code: ErrorCode,
    },
    /// `FunctionGet`'s answer: the parameter layout, when the GPU knows it.
    Function {
        params: Option<Vec<ParamInfo>>,
    },
    /// `GlobalGet`'s answer.
    Global {
        addr: u64,
        size: u64,
    },
}

/// What the worker tells the backend unasked, on its event socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A channel's `NOTIFY` method ran.
    Notify { ch: u32, token: u32 },
    /// A channel faulted and stopped.
    Error { ch: u32, code: ErrorCode, info: u64 },
    /// A channel's REF reached the value its sleeping waiter armed.
    Fence { ch: u32, reference: u32 },
}
