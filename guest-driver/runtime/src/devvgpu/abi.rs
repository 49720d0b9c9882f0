//! The `/dev/vgpu` ioctl ABI, mirrored from `guest-driver/kernel/vgpu_ioctl.h`.
//! `tests/ioctl_abi.rs` compiles the header and checks every size, offset and number
//! here against it.

/// ABI version the driver reports in `GET_INFO`.
pub const ABI_VERSION: u32 = 3;
pub const IOCTL_MAGIC: u32 = 0xC6;

pub const PAGE_4K: u32 = 0;
pub const PAGE_64K: u32 = 1;
pub const PAGE_2M: u32 = 2;
pub const MAP_READ_ONLY: u32 = 1;
pub const MAX_USER_MAP: u64 = 1 << 32;
pub const WAIT_FENCE: u32 = 0;
pub const WAIT_NOTIFY: u32 = 1;
/// `Info::flags`: the device has no shared-memory region (forwarded submission).
pub const INFO_FORWARDED: u32 = 1;
pub const MAX_MODULE_BYTES: u64 = 32 << 20;
pub const MAX_SYMBOL_LEN: u32 = 512;
pub const PARAMS_UNKNOWN: u32 = 0xffff_ffff;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ModuleLoad {
    pub ctx: u32,
    pub module: u32,
    pub user_addr: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ModuleArg {
    pub ctx: u32,
    pub module: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct FunctionGet {
    pub ctx: u32,
    pub module: u32,
    pub name_addr: u64,
    pub name_len: u32,
    pub function: u32,
    pub params_addr: u64,
    pub max_params: u32,
    pub param_count: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Attributes {
    pub pairs_addr: u64,
    pub max_pairs: u32,
    pub count: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct GlobalGet {
    pub ctx: u32,
    pub module: u32,
    pub name_addr: u64,
    pub name_len: u32,
    pub reserved: u32,
    pub addr: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    pub abi_version: u32,
    pub protocol_version: u32,
    pub vram_bytes: u64,
    pub compute_engines: u32,
    pub channel_slots: u32,
    pub max_contexts: u32,
    pub flags: u32,
    pub shm_size: u64,
    pub aperture_offset: u64,
    pub aperture_size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub contexts: u32,
    pub channels: u32,
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    pub aperture_bytes: u64,
    pub vram_limit: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ContextArg {
    pub ctx: u32,
    /// CREATE_CONTEXT: the device's huge-page slot + 1 (0: none); DESTROY_CONTEXT ignores it.
    pub huge_slot: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct AllocVram {
    pub ctx: u32,
    pub mem: u32,
    pub size: u64,
    pub align: u64,
    pub alloc_size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MemArg {
    pub ctx: u32,
    pub mem: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MapVram {
    pub ctx: u32,
    pub mem: u32,
    pub va: u64,
    pub page: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MapUser {
    pub ctx: u32,
    pub flags: u32,
    pub va: u64,
    pub user_addr: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Unmap {
    pub ctx: u32,
    pub reserved: u32,
    pub va: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct MapAperture {
    pub ctx: u32,
    pub mem: u32,
    pub offset: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct CreateChannel {
    pub ctx: u32,
    pub gp_entries: u32,
    pub gp_ring_va: u64,
    pub channel: u32,
    pub slot: u32,
    pub offset: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ChannelArg {
    pub ctx: u32,
    pub channel: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Submit {
    pub ctx: u32,
    pub channel: u32,
    pub gp_put: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Wait {
    pub ctx: u32,
    pub channel: u32,
    pub kind: u32,
    pub value: u32,
    pub timeout_ns: u64,
    pub reference: u32,
    pub notify_seq: u32,
    pub error: u32,
    pub notify_token: u32,
    pub error_info: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ChannelStatus {
    pub ctx: u32,
    pub channel: u32,
    pub gp_put: u32,
    pub gp_get: u32,
    pub reference: u32,
    pub notify_seq: u32,
    pub error: u32,
    pub reserved: u32,
    pub error_info: u64,
}

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// Linux's `_IOC(dir, type, nr, size)` (asm-generic layout, as on x86).
pub const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (IOCTL_MAGIC << 8) | nr
}

const fn ior<T>(nr: u32) -> u32 {
    ioc(IOC_READ, nr, std::mem::size_of::<T>())
}

const fn iow<T>(nr: u32) -> u32 {
    ioc(IOC_WRITE, nr, std::mem::size_of::<T>())
}

const fn iowr<T>(nr: u32) -> u32 {
    ioc(IOC_READ | IOC_WRITE, nr, std::mem::size_of::<T>())
}

pub const GET_INFO: u32 = ior::<Info>(0x00);
pub const GET_STATS: u32 = ior::<Stats>(0x01);
pub const CREATE_CONTEXT: u32 = ior::<ContextArg>(0x02);
pub const DESTROY_CONTEXT: u32 = iow::<ContextArg>(0x03);
pub const ALLOC_VRAM: u32 = iowr::<AllocVram>(0x04);
pub const FREE_MEM: u32 = iow::<MemArg>(0x05);
pub const MAP_VRAM: u32 = iow::<MapVram>(0x06);
pub const MAP_USER: u32 = iow::<MapUser>(0x07);
pub const UNMAP: u32 = iow::<Unmap>(0x08);
pub const MAP_APERTURE: u32 = iowr::<MapAperture>(0x09);
pub const UNMAP_APERTURE: u32 = iow::<MemArg>(0x0a);
pub const CREATE_CHANNEL: u32 = iowr::<CreateChannel>(0x0b);
pub const DESTROY_CHANNEL: u32 = iow::<ChannelArg>(0x0c);
pub const SUBMIT: u32 = iow::<Submit>(0x0d);
pub const WAIT: u32 = iowr::<Wait>(0x0e);
pub const CHANNEL_STATUS: u32 = iowr::<ChannelStatus>(0x0f);
pub const MODULE_LOAD: u32 = iowr::<ModuleLoad>(0x10);
pub const MODULE_UNLOAD: u32 = iow::<ModuleArg>(0x11);
pub const FUNCTION_GET: u32 = iowr::<FunctionGet>(0x12);
pub const GLOBAL_GET: u32 = iowr::<GlobalGet>(0x13);
pub const GET_ATTRIBUTES: u32 = iowr::<Attributes>(0x14);
pub const DOORBELL: u32 = ioc(0, 0x15, 0);

/// Every ioctl with its C name (for the ABI test).
pub const IOCTLS: &[(&str, u32)] = &[
    ("VGPU_IOC_GET_INFO", GET_INFO),
    ("VGPU_IOC_GET_STATS", GET_STATS),
    ("VGPU_IOC_CREATE_CONTEXT", CREATE_CONTEXT),
    ("VGPU_IOC_DESTROY_CONTEXT", DESTROY_CONTEXT),
    ("VGPU_IOC_ALLOC_VRAM", ALLOC_VRAM),
    ("VGPU_IOC_FREE_MEM", FREE_MEM),
    ("VGPU_IOC_MAP_VRAM", MAP_VRAM),
    ("VGPU_IOC_MAP_USER", MAP_USER),
    ("VGPU_IOC_UNMAP", UNMAP),
    ("VGPU_IOC_MAP_APERTURE", MAP_APERTURE),
    ("VGPU_IOC_UNMAP_APERTURE", UNMAP_APERTURE),
    ("VGPU_IOC_CREATE_CHANNEL", CREATE_CHANNEL),
    ("VGPU_IOC_DESTROY_CHANNEL", DESTROY_CHANNEL),
    ("VGPU_IOC_SUBMIT", SUBMIT),
    ("VGPU_IOC_WAIT", WAIT),
    ("VGPU_IOC_CHANNEL_STATUS", CHANNEL_STATUS),
    ("VGPU_IOC_MODULE_LOAD", MODULE_LOAD),
    ("VGPU_IOC_MODULE_UNLOAD", MODULE_UNLOAD),
    ("VGPU_IOC_FUNCTION_GET", FUNCTION_GET),
    ("VGPU_IOC_GLOBAL_GET", GLOBAL_GET),
    ("VGPU_IOC_GET_ATTRIBUTES", GET_ATTRIBUTES),
    ("VGPU_IOC_DOORBELL", DOORBELL),
];
