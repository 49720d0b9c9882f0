//! Control-queue requests (driver → device) and their replies, and event-queue events
//! (device → driver). Every request names the guest process (PID) it acts for; objects
//! a process creates belong to it, and a request naming another process's object fails.
//!
//! Wire format, little-endian:
//! - request: header `{ op: u32, pid: u32, ctx: u32, reserved: u32 = 0 }` then the op's
//!   body (fixed layout, below); trailing bytes are an error.
//! - reply: `{ status: u32 (ErrorCode), len: u32 }` then `len` bytes of the op's result.
//! - event: 24 bytes `{ kind: u32, channel: u32, value: u32, reserved: u32, info: u64 }`.

use thiserror::Error;

use crate::module::{
    valid_symbol, ParamInfo, MAX_FUNCTION_PARAMS, MAX_MODULE_BYTES, PARAMS_UNKNOWN,
};
use crate::ErrorCode;

/// Opcodes.
pub mod op {
    pub const GET_INFO: u32 = 1;
    pub const CREATE_CONTEXT: u32 = 2;
    pub const DESTROY_CONTEXT: u32 = 3;
    pub const ALLOC_VRAM: u32 = 4;
    pub const FREE_MEM: u32 = 5;
    pub const MAP_VRAM: u32 = 6;
    pub const MAP_GUEST: u32 = 7;
    pub const UNMAP: u32 = 8;
    pub const MAP_APERTURE: u32 = 9;
    pub const UNMAP_APERTURE: u32 = 10;
    pub const CREATE_CHANNEL: u32 = 11;
    pub const DESTROY_CHANNEL: u32 = 12;
    pub const GET_STATS: u32 = 13;
    /// API-remoting baseline: the host stores GP_PUT for the guest.
    pub const SUBMIT: u32 = 14;
    /// Forwarded mode: the channel's GPU-written control-page fields, read by the host.
    pub const CHANNEL_STATUS: u32 = 15;
    /// Loads a module image from guest RAM into the context (issue 31).
    pub const MODULE_LOAD: u32 = 16;
    pub const MODULE_UNLOAD: u32 = 17;
    /// A module function by name: its id for `LAUNCH_FUNCTION` and its parameter layout.
    pub const FUNCTION_GET: u32 = 18;
    /// A module global by name: its device address and size.
    pub const GLOBAL_GET: u32 = 19;
    /// The real GPU's device attributes (CUDA's numbering), as the host reports them.
    pub const GET_ATTRIBUTES: u32 = 20;
    /// Copies guest RAM into a module global (`cuMemcpyHtoD` at its address).
    pub const GLOBAL_WRITE: u32 = 21;
    /// Copies a module global into guest RAM (`cuMemcpyDtoH` at its address).
    pub const GLOBAL_READ: u32 = 22;
}

/// Most bytes one GLOBAL_WRITE or GLOBAL_READ moves (a larger copy is several requests).
pub const MAX_GLOBAL_COPY_BYTES: u64 = 16 << 20;
/// Most guest RAM ranges one GLOBAL_WRITE or GLOBAL_READ names (with the longest name,
/// the request stays within [`MAX_REQUEST_SIZE`]).
pub const MAX_GLOBAL_COPY_RANGES: usize = 256;

/// Most attributes one GET_ATTRIBUTES reply carries.
pub const MAX_ATTRIBUTES: usize = 128;

pub const HEADER_SIZE: usize = 16;
pub const REPLY_HEADER_SIZE: usize = 8;
/// Most scatter-gather ranges one MAP_GUEST may carry.
pub const MAX_SG_ENTRIES: usize = 512;
/// Largest valid request.
pub const MAX_REQUEST_SIZE: usize = HEADER_SIZE + 24 + MAX_SG_ENTRIES * 16;
/// Largest reply payload: a FUNCTION_GET reply describing every parameter.
pub const MAX_REPLY_SIZE: usize = REPLY_HEADER_SIZE + 16 + MAX_FUNCTION_PARAMS * 8;

/// Page size codes in requests.
pub const PAGE_4K: u32 = 0;
pub const PAGE_64K: u32 = 1;
pub const PAGE_2M: u32 = 2;

/// Mapping flag: read-only for the GPU.
pub const MAP_READ_ONLY: u32 = 1;

/// A guest-physical range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestRange {
    pub gpa: u64,
    pub len: u64,
}

/// A decoded request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    GetInfo,
    CreateContext,
    DestroyContext,
    AllocVram {
        size: u64,
        align: u64,
    },
    FreeMem {
        mem: u32,
    },
    MapVram {
        mem: u32,
        flags: u32,
        va: u64,
        page: u32,
    },
    MapGuest {
        va: u64,
        page: u32,
        flags: u32,
        ranges: Vec<GuestRange>,
    },
    Unmap {
        va: u64,
    },
    MapAperture {
        mem: u32,
    },
    UnmapAperture {
        mem: u32,
    },
    CreateChannel {
        gp_ring_va: u64,
        gp_entries: u32,
    },
    DestroyChannel {
        channel: u32,
    },
    GetStats,
    /// The GPU's device attributes: `(attribute, value)` pairs, CUDA's
    /// `CUdevice_attribute` numbering.
    GetAttributes,
    /// The API-remoting baseline: the device stores `gp_put` into the channel's control
    /// page on the guest's behalf. The direct path (a plain store) is what vgpu is for;
    /// this exists so benchmarks can measure what it saves.
    Submit {
        channel: u32,
        gp_put: u32,
    },
    /// Forwarded mode (no shared-memory region): the channel's `GP_GET`, `REF`,
    /// `NOTIFY_SEQ`, `ERROR` and `ERROR_INFO`, read from its control page by the device.
    ChannelStatus {
        channel: u32,
    },
    /// Loads the module image held by `ranges` of guest RAM (read once, at most
    /// [`MAX_MODULE_BYTES`] in all).
    ModuleLoad {
        ranges: Vec<GuestRange>,
    },
    ModuleUnload {
        module: u32,
    },
    FunctionGet {
        module: u32,
        name: Vec<u8>,
    },
    GlobalGet {
        module: u32,
        name: Vec<u8>,
    },
    /// Copies the bytes of `ranges` of guest RAM (read once) to `offset` of `module`'s
    /// global `name`.
    GlobalWrite(GlobalCopy),
    /// Copies `offset` onwards of `module`'s global `name` into `ranges` of guest RAM.
    GlobalRead(GlobalCopy),
}

/// A copy between guest RAM and a module global: GLOBAL_WRITE and GLOBAL_READ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalCopy {
    pub module: u32,
    pub name: Vec<u8>,
    /// Where in the global the copy starts.
    pub offset: u64,
    /// Guest RAM, in order; 1..=[`MAX_GLOBAL_COPY_RANGES`] ranges, none empty, at most
    /// [`MAX_GLOBAL_COPY_BYTES`] in all.
    pub ranges: Vec<GuestRange>,
}

impl GlobalCopy {
    /// The bytes the copy moves: its ranges' total.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The total length of a global copy's ranges: 1..=[`MAX_GLOBAL_COPY_BYTES`], no range
/// empty.
pub fn global_copy_len(ranges: &[GuestRange]) -> Result<u64, RequestError> {
    if ranges.is_empty() || ranges.len() > MAX_GLOBAL_COPY_RANGES {
        return Err(RequestError::BadSgCount(ranges.len() as u32));
    }
    let mut total = 0u64;
    for g in ranges {
        if g.len == 0 {
            return Err(RequestError::CopySize(0));
        }
        total = total.saturating_add(g.len);
    }
    if total > MAX_GLOBAL_COPY_BYTES {
        return Err(RequestError::CopySize(total));
    }
    Ok(total)
}

/// A request: who asks (`pid`), in which context (`ctx`, 0 where none applies), what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub pid: u32,
    pub ctx: u32,
    pub op: Op,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum RequestError {
    #[error("request shorter than its layout ({0} bytes)")]
    Truncated(usize),
    #[error("request has {0} trailing bytes")]
    Trailing(usize),
    #[error("unknown opcode {0}")]
    UnknownOp(u32),
    #[error("reserved field not zero")]
    Reserved,
    #[error("bad scatter-gather count {0}")]
    BadSgCount(u32),
    #[error("bad page size code {0}")]
    BadPage(u32),
    #[error("unknown flags {0:#x}")]
    BadFlags(u32),
    #[error("module image of {0} bytes is empty or over the limit")]
    ModuleSize(u64),
    #[error("bad symbol name")]
    BadName,
    #[error("global copy of {0} bytes is empty or over the limit")]
    CopySize(u64),
}

impl RequestError {
    pub fn code(&self) -> ErrorCode {
        match self {
            RequestError::UnknownOp(_) => ErrorCode::Unsupported,
            RequestError::ModuleSize(n) | RequestError::CopySize(n) if *n > 0 => {
                ErrorCode::LimitExceeded
            }
            _ => ErrorCode::InvalidArgument,
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], RequestError> {
        let s = self
            .b
            .get(self.at..self.at + N)
            .ok_or(RequestError::Truncated(self.b.len()))?;
        self.at += N;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }
    fn u32(&mut self) -> Result<u32, RequestError> {
        Ok(u32::from_le_bytes(self.take::<4>()?))
    }
    fn u64(&mut self) -> Result<u64, RequestError> {
        Ok(u64::from_le_bytes(self.take::<8>()?))
    }
    fn zero32(&mut self) -> Result<(), RequestError> {
        match self.u32()? {
            0 => Ok(()),
            _ => Err(RequestError::Reserved),
        }
    }
}

/// Reads `count` scatter-gather ranges (1..=[`MAX_SG_ENTRIES`]).
fn read_ranges(r: &mut Reader<'_>, count: u32) -> Result<Vec<GuestRange>, RequestError> {
    if count == 0 || count as usize > MAX_SG_ENTRIES {
        return Err(RequestError::BadSgCount(count));
    }
    let mut ranges = Vec::with_capacity(count as usize);
    for _ in 0..count {
        ranges.push(GuestRange {
            gpa: r.u64()?,
            len: r.u64()?,
        });
    }
    Ok(ranges)
}

/// Reads a module id and a symbol name (`name_len` then the bytes).
fn read_symbol(r: &mut Reader<'_>) -> Result<(u32, Vec<u8>), RequestError> {
    let module = r.u32()?;
    let len = r.u32()? as usize;
    Ok((module, read_name(r, len)?))
}

/// Reads `len` bytes of a symbol name.
fn read_name(r: &mut Reader<'_>, len: usize) -> Result<Vec<u8>, RequestError> {
    if len > crate::module::MAX_SYMBOL_LEN {
        return Err(RequestError::BadName);
    }
    let name =
        r.b.get(r.at..r.at + len)
            .ok_or(RequestError::Truncated(r.b.len()))?
            .to_vec();
    r.at += len;
    if !valid_symbol(&name) {
        return Err(RequestError::BadName);
    }
    Ok(name)
}

/// Reads a GLOBAL_WRITE or GLOBAL_READ body: `module, name_len, offset, count, 0`, the
/// name, then `count` ranges.
fn read_global_copy(r: &mut Reader<'_>) -> Result<GlobalCopy, RequestError> {
    let module = r.u32()?;
    let len = r.u32()? as usize;
    let offset = r.u64()?;
    let count = r.u32()?;
    r.zero32()?;
    let name = read_name(r, len)?;
    if count == 0 || count as usize > MAX_GLOBAL_COPY_RANGES {
        return Err(RequestError::BadSgCount(count));
    }
    let ranges = read_ranges(r, count)?;
    let total = global_copy_len(&ranges)?;
    if offset.checked_add(total).is_none() {
        return Err(RequestError::CopySize(total));
    }
    Ok(GlobalCopy {
        module,
        name,
        offset,
        ranges,
    })
}

/// The total length of a module image's ranges, within [`MAX_MODULE_BYTES`].
pub fn module_len(ranges: &[GuestRange]) -> Result<u64, RequestError> {
    let mut total = 0u64;
    for g in ranges {
        if g.len == 0 {
            return Err(RequestError::ModuleSize(0));
        }
        total = total.saturating_add(g.len);
    }
    if total == 0 || total > MAX_MODULE_BYTES {
        return Err(RequestError::ModuleSize(total));
    }
    Ok(total)
}

fn check_page(page: u32) -> Result<u32, RequestError> {
    if page <= PAGE_2M {
        Ok(page)
    } else {
        Err(RequestError::BadPage(page))
    }
}

fn check_flags(flags: u32) -> Result<u32, RequestError> {
    if flags & !MAP_READ_ONLY == 0 {
        Ok(flags)
    } else {
        Err(RequestError::BadFlags(flags))
    }
}

impl Request {
    pub fn opcode(&self) -> u32 {
        match self.op {
            Op::GetInfo => op::GET_INFO,
            Op::CreateContext => op::CREATE_CONTEXT,
            Op::DestroyContext => op::DESTROY_CONTEXT,
            Op::AllocVram { .. } => op::ALLOC_VRAM,
            Op::FreeMem { .. } => op::FREE_MEM,
            Op::MapVram { .. } => op::MAP_VRAM,
            Op::MapGuest { .. } => op::MAP_GUEST,
            Op::Unmap { .. } => op::UNMAP,
            Op::MapAperture { .. } => op::MAP_APERTURE,
            Op::UnmapAperture { .. } => op::UNMAP_APERTURE,
            Op::CreateChannel { .. } => op::CREATE_CHANNEL,
            Op::DestroyChannel { .. } => op::DESTROY_CHANNEL,
            Op::GetStats => op::GET_STATS,
            Op::GetAttributes => op::GET_ATTRIBUTES,
            Op::Submit { .. } => op::SUBMIT,
            Op::ChannelStatus { .. } => op::CHANNEL_STATUS,
            Op::ModuleLoad { .. } => op::MODULE_LOAD,
            Op::ModuleUnload { .. } => op::MODULE_UNLOAD,
            Op::FunctionGet { .. } => op::FUNCTION_GET,
            Op::GlobalGet { .. } => op::GLOBAL_GET,
            Op::GlobalWrite(_) => op::GLOBAL_WRITE,
            Op::GlobalRead(_) => op::GLOBAL_READ,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(64);
        let p32 = |o: &mut Vec<u8>, v: u32| o.extend_from_slice(&v.to_le_bytes());
        let p64 = |o: &mut Vec<u8>, v: u64| o.extend_from_slice(&v.to_le_bytes());
        p32(&mut o, self.opcode());
        p32(&mut o, self.pid);
        p32(&mut o, self.ctx);
        p32(&mut o, 0);
        match &self.op {
            Op::GetInfo
            | Op::CreateContext
            | Op::DestroyContext
            | Op::GetStats
            | Op::GetAttributes => {}
            Op::AllocVram { size, align } => {
                p64(&mut o, *size);
                p64(&mut o, *align);
            }
            Op::FreeMem { mem } | Op::MapAperture { mem } | Op::UnmapAperture { mem } => {
                p32(&mut o, *mem);
                p32(&mut o, 0);
            }
            Op::MapVram {
                mem,
                flags,
                va,
                page,
            } => {
                p32(&mut o, *mem);
                p32(&mut o, *flags);
                p64(&mut o, *va);
                p32(&mut o, *page);
                p32(&mut o, 0);
            }
            Op::MapGuest {
                va,
                page,
                flags,
                ranges,
            } => {
                p64(&mut o, *va);
                p32(&mut o, *page);
                p32(&mut o, *flags);
                p32(&mut o, ranges.len() as u32);
                p32(&mut o, 0);
                for r in ranges {
                    p64(&mut o, r.gpa);
                    p64(&mut o, r.len);
                }
            }
            Op::Unmap { va } => p64(&mut o, *va),
            Op::CreateChannel {
                gp_ring_va,
                gp_entries,
            } => {
                p64(&mut o, *gp_ring_va);
                p32(&mut o, *gp_entries);
                p32(&mut o, 0);
            }
            Op::DestroyChannel { channel } | Op::ChannelStatus { channel } => {
                p32(&mut o, *channel);
                p32(&mut o, 0);
            }
            Op::Submit { channel, gp_put } => {
                p32(&mut o, *channel);
                p32(&mut o, *gp_put);
            }
            Op::ModuleLoad { ranges } => {
                p32(&mut o, ranges.len() as u32);
                p32(&mut o, 0);
                for r in ranges {
                    p64(&mut o, r.gpa);
                    p64(&mut o, r.len);
                }
            }
            Op::ModuleUnload { module } => {
                p32(&mut o, *module);
                p32(&mut o, 0);
            }
            Op::FunctionGet { module, name } | Op::GlobalGet { module, name } => {
                p32(&mut o, *module);
                p32(&mut o, name.len() as u32);
                o.extend_from_slice(name);
            }
            Op::GlobalWrite(c) | Op::GlobalRead(c) => {
                p32(&mut o, c.module);
                p32(&mut o, c.name.len() as u32);
                p64(&mut o, c.offset);
                p32(&mut o, c.ranges.len() as u32);
                p32(&mut o, 0);
                o.extend_from_slice(&c.name);
                for r in &c.ranges {
                    p64(&mut o, r.gpa);
                    p64(&mut o, r.len);
                }
            }
        }
        o
    }

    /// Decodes a request read from guest memory. Rejects anything that is not exactly one
    /// well-formed request.
    pub fn decode(b: &[u8]) -> Result<Self, RequestError> {
        if b.len() > MAX_REQUEST_SIZE {
            return Err(RequestError::Trailing(b.len() - MAX_REQUEST_SIZE));
        }
        let mut r = Reader { b, at: 0 };
        let opcode = r.u32()?;
        let pid = r.u32()?;
        let ctx = r.u32()?;
        r.zero32()?;
        let op = match opcode {
            op::GET_INFO => Op::GetInfo,
            op::CREATE_CONTEXT => Op::CreateContext,
            op::DESTROY_CONTEXT => Op::DestroyContext,
            op::GET_STATS => Op::GetStats,
            op::GET_ATTRIBUTES => Op::GetAttributes,
            op::ALLOC_VRAM => Op::AllocVram {
                size: r.u64()?,
                align: r.u64()?,
            },
            op::FREE_MEM | op::MAP_APERTURE | op::UNMAP_APERTURE => {
                let mem = r.u32()?;
                r.zero32()?;
                match opcode {
                    op::FREE_MEM => Op::FreeMem { mem },
                    op::MAP_APERTURE => Op::MapAperture { mem },
                    _ => Op::UnmapAperture { mem },
                }
            }
            op::MAP_VRAM => {
                let mem = r.u32()?;
                let flags = check_flags(r.u32()?)?;
                let va = r.u64()?;
                let page = check_page(r.u32()?)?;
                r.zero32()?;
                Op::MapVram {
                    mem,
                    flags,
                    va,
                    page,
                }
            }
            op::MAP_GUEST => {
                let va = r.u64()?;
                let page = check_page(r.u32()?)?;
                let flags = check_flags(r.u32()?)?;
                let count = r.u32()?;
                r.zero32()?;
                let ranges = read_ranges(&mut r, count)?;
                Op::MapGuest {
                    va,
                    page,
                    flags,
                    ranges,
                }
            }
            op::UNMAP => Op::Unmap { va: r.u64()? },
            op::CREATE_CHANNEL => {
                let gp_ring_va = r.u64()?;
                let gp_entries = r.u32()?;
                r.zero32()?;
                Op::CreateChannel {
                    gp_ring_va,
                    gp_entries,
                }
            }
            op::DESTROY_CHANNEL | op::CHANNEL_STATUS => {
                let channel = r.u32()?;
                r.zero32()?;
                if opcode == op::DESTROY_CHANNEL {
                    Op::DestroyChannel { channel }
                } else {
                    Op::ChannelStatus { channel }
                }
            }
            op::SUBMIT => Op::Submit {
                channel: r.u32()?,
                gp_put: r.u32()?,
            },
            op::MODULE_LOAD => {
                let count = r.u32()?;
                r.zero32()?;
                let ranges = read_ranges(&mut r, count)?;
                module_len(&ranges)?;
                Op::ModuleLoad { ranges }
            }
            op::MODULE_UNLOAD => {
                let module = r.u32()?;
                r.zero32()?;
                Op::ModuleUnload { module }
            }
            op::FUNCTION_GET => {
                let (module, name) = read_symbol(&mut r)?;
                Op::FunctionGet { module, name }
            }
            op::GLOBAL_GET => {
                let (module, name) = read_symbol(&mut r)?;
                Op::GlobalGet { module, name }
            }
            op::GLOBAL_WRITE | op::GLOBAL_READ => {
                let copy = read_global_copy(&mut r)?;
                if opcode == op::GLOBAL_WRITE {
                    Op::GlobalWrite(copy)
                } else {
                    Op::GlobalRead(copy)
                }
            }
            other => return Err(RequestError::UnknownOp(other)),
        };
        if r.at != b.len() {
            return Err(RequestError::Trailing(b.len() - r.at));
        }
        Ok(Request { pid, ctx, op })
    }
}

/// Successful reply payloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyBody {
    Empty,
    Info(InfoReply),
    Context {
        ctx: u32,
        /// The huge-page slot the context's runtime should start its 2 MiB-page buffers
        /// in ([`crate::mem::HUGE_SLOTS`]); `None`: no preference (the runtime picks one
        /// at random). On the wire: slot + 1, 0 for none.
        huge_slot: Option<u32>,
    },
    Mem {
        mem: u32,
        size: u64,
    },
    Aperture {
        offset: u64,
    },
    Channel {
        channel: u32,
        slot: u32,
    },
    Stats(StatsReply),
    ChannelStatus(ChannelStatusReply),
    Module {
        module: u32,
    },
    Function(FunctionReply),
    Global {
        addr: u64,
        size: u64,
    },
    /// GET_ATTRIBUTES: at most [`MAX_ATTRIBUTES`] `(attribute, value)` pairs.
    Attributes(Vec<(u32, i32)>),
}

/// FUNCTION_GET result: the function's id and, when the GPU knows it, the layout of its
/// parameter buffer (`params: None` is sent as `param_count` = [`PARAMS_UNKNOWN`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionReply {
    pub function: u32,
    /// At most [`MAX_FUNCTION_PARAMS`] entries.
    pub params: Option<Vec<ParamInfo>>,
}

/// CHANNEL_STATUS result: the GPU-written fields of the channel's control page
/// (protocol.md §2), and the `GP_PUT` the GPU sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChannelStatusReply {
    pub gp_put: u32,
    pub gp_get: u32,
    pub reference: u32,
    pub notify_seq: u32,
    pub error: u32,
    pub error_info: u64,
}

/// GET_INFO result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfoReply {
    pub version: u32,
    pub compute_engines: u32,
    pub vram_bytes: u64,
    pub channel_slots: u32,
    pub max_contexts: u32,
}

/// GET_STATS result: this VM's usage and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsReply {
    pub contexts: u32,
    pub channels: u32,
    pub vram_bytes: u64,
    pub mapped_guest_bytes: u64,
    pub aperture_bytes: u64,
    pub vram_limit: u64,
}

fn put32(o: &mut Vec<u8>, v: u32) {
    o.extend_from_slice(&v.to_le_bytes());
}
fn put64(o: &mut Vec<u8>, v: u64) {
    o.extend_from_slice(&v.to_le_bytes());
}

/// Encodes a reply: status and payload.
pub fn encode_reply(result: Result<ReplyBody, ErrorCode>) -> Vec<u8> {
    let mut body = Vec::new();
    let status = match result {
        Ok(b) => {
            match b {
                ReplyBody::Empty => {}
                ReplyBody::Info(i) => {
                    put32(&mut body, i.version);
                    put32(&mut body, i.compute_engines);
                    put64(&mut body, i.vram_bytes);
                    put32(&mut body, i.channel_slots);
                    put32(&mut body, i.max_contexts);
                }
                ReplyBody::Context { ctx, huge_slot } => {
                    put32(&mut body, ctx);
                    put32(&mut body, crate::mem::huge_slot_to_wire(huge_slot));
                }
                ReplyBody::Mem { mem, size } => {
                    put32(&mut body, mem);
                    put32(&mut body, 0);
                    put64(&mut body, size);
                }
                ReplyBody::Aperture { offset } => put64(&mut body, offset),
                ReplyBody::Channel { channel, slot } => {
                    put32(&mut body, channel);
                    put32(&mut body, slot);
                }
                ReplyBody::Stats(s) => {
                    put32(&mut body, s.contexts);
                    put32(&mut body, s.channels);
                    put64(&mut body, s.vram_bytes);
                    put64(&mut body, s.mapped_guest_bytes);
                    put64(&mut body, s.aperture_bytes);
                    put64(&mut body, s.vram_limit);
                }
                ReplyBody::Module { module } => {
                    put32(&mut body, module);
                    put32(&mut body, 0);
                }
                ReplyBody::Function(f) => {
                    put32(&mut body, f.function);
                    match &f.params {
                        Some(p) => {
                            put32(&mut body, p.len() as u32);
                            put32(&mut body, crate::module::param_bytes(p) as u32);
                        }
                        None => {
                            put32(&mut body, PARAMS_UNKNOWN);
                            put32(&mut body, 0);
                        }
                    }
                    put32(&mut body, 0);
                    for p in f.params.iter().flatten() {
                        put32(&mut body, p.offset);
                        put32(&mut body, p.size);
                    }
                }
                ReplyBody::Global { addr, size } => {
                    put64(&mut body, addr);
                    put64(&mut body, size);
                }
                ReplyBody::Attributes(pairs) => {
                    let n = pairs.len().min(MAX_ATTRIBUTES);
                    put32(&mut body, n as u32);
                    put32(&mut body, 0);
                    for (attr, value) in &pairs[..n] {
                        put32(&mut body, *attr);
                        put32(&mut body, *value as u32);
                    }
                }
                ReplyBody::ChannelStatus(c) => {
                    put32(&mut body, c.gp_put);
                    put32(&mut body, c.gp_get);
                    put32(&mut body, c.reference);
                    put32(&mut body, c.notify_seq);
                    put32(&mut body, c.error);
                    put32(&mut body, 0);
                    put64(&mut body, c.error_info);
                }
            }
            ErrorCode::Ok
        }
        Err(code) => code,
    };
    let mut o = Vec::with_capacity(REPLY_HEADER_SIZE + body.len());
    put32(&mut o, status.as_u32());
    put32(&mut o, body.len() as u32);
    o.extend_from_slice(&body);
    o
}

/// Decodes a reply to a request with opcode `opcode` (driver side).
pub fn decode_reply(opcode: u32, b: &[u8]) -> Result<Result<ReplyBody, ErrorCode>, RequestError> {
    let mut r = Reader { b, at: 0 };
    let status = r.u32()?;
    let len = r.u32()? as usize;
    if b.len() < REPLY_HEADER_SIZE + len {
        return Err(RequestError::Truncated(b.len()));
    }
    let code = ErrorCode::from_u32(status).map_err(|_| RequestError::Reserved)?;
    if code != ErrorCode::Ok {
        return Ok(Err(code));
    }
    let body = match opcode {
        op::GET_INFO => ReplyBody::Info(InfoReply {
            version: r.u32()?,
            compute_engines: r.u32()?,
            vram_bytes: r.u64()?,
            channel_slots: r.u32()?,
            max_contexts: r.u32()?,
        }),
        op::CREATE_CONTEXT => {
            let ctx = r.u32()?;
            let huge_slot = crate::mem::huge_slot_from_wire(r.u32()?);
            ReplyBody::Context { ctx, huge_slot }
        }
        op::ALLOC_VRAM => {
            let mem = r.u32()?;
            r.u32()?;
            ReplyBody::Mem {
                mem,
                size: r.u64()?,
            }
        }
        op::MAP_APERTURE => ReplyBody::Aperture { offset: r.u64()? },
        op::CREATE_CHANNEL => ReplyBody::Channel {
            channel: r.u32()?,
            slot: r.u32()?,
        },
        op::GET_STATS => ReplyBody::Stats(StatsReply {
            contexts: r.u32()?,
            channels: r.u32()?,
            vram_bytes: r.u64()?,
            mapped_guest_bytes: r.u64()?,
            aperture_bytes: r.u64()?,
            vram_limit: r.u64()?,
        }),
        op::CHANNEL_STATUS => {
            let gp_put = r.u32()?;
            let gp_get = r.u32()?;
            let reference = r.u32()?;
            let notify_seq = r.u32()?;
            let error = r.u32()?;
            r.u32()?;
            ReplyBody::ChannelStatus(ChannelStatusReply {
                gp_put,
                gp_get,
                reference,
                notify_seq,
                error,
                error_info: r.u64()?,
            })
        }
        op::MODULE_LOAD => {
            let module = r.u32()?;
            r.u32()?;
            ReplyBody::Module { module }
        }
        op::FUNCTION_GET => {
            let function = r.u32()?;
            let count = r.u32()?;
            r.u32()?;
            r.u32()?;
            let params = if count == PARAMS_UNKNOWN {
                None
            } else {
                if count as usize > MAX_FUNCTION_PARAMS {
                    return Err(RequestError::Reserved);
                }
                let mut p = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    p.push(ParamInfo {
                        offset: r.u32()?,
                        size: r.u32()?,
                    });
                }
                Some(p)
            };
            ReplyBody::Function(FunctionReply { function, params })
        }
        op::GLOBAL_GET => ReplyBody::Global {
            addr: r.u64()?,
            size: r.u64()?,
        },
        op::GET_ATTRIBUTES => {
            let count = r.u32()? as usize;
            r.u32()?;
            if count > MAX_ATTRIBUTES {
                return Err(RequestError::Reserved);
            }
            let mut pairs = Vec::with_capacity(count);
            for _ in 0..count {
                pairs.push((r.u32()?, r.u32()? as i32));
            }
            ReplyBody::Attributes(pairs)
        }
        _ => ReplyBody::Empty,
    };
    Ok(Ok(body))
}

/// Event kinds.
pub mod event {
    pub const NOTIFY: u32 = 1;
    pub const CHANNEL_ERROR: u32 = 2;
    /// The channel's `REF` reached the armed `REF_WAKE` (value: `REF` as the GPU saw it);
    /// a wake-up only: the waiter re-reads the control page.
    pub const FENCE: u32 = 3;
}

pub const EVENT_SIZE: usize = 24;

/// An event-queue event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: u32,
    pub channel: u32,
    /// Notify token, the ErrorCode of a channel error, or a fence event's REF.
    pub value: u32,
    pub info: u64,
}

impl Event {
    pub fn encode(&self) -> [u8; EVENT_SIZE] {
        let mut b = [0u8; EVENT_SIZE];
        b[0..4].copy_from_slice(&self.kind.to_le_bytes());
        b[4..8].copy_from_slice(&self.channel.to_le_bytes());
        b[8..12].copy_from_slice(&self.value.to_le_bytes());
        b[16..24].copy_from_slice(&self.info.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        let mut r = Reader { b, at: 0 };
        let kind = r.u32().ok()?;
        let channel = r.u32().ok()?;
        let value = r.u32().ok()?;
        r.u32().ok()?;
        let info = r.u64().ok()?;
        Some(Event {
            kind,
            channel,
            value,
            info,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_op() -> impl Strategy<Value = Op> {
        let range = (any::<u64>(), any::<u64>()).prop_map(|(gpa, len)| GuestRange { gpa, len });
        prop_oneof![
            Just(Op::GetInfo),
            Just(Op::CreateContext),
            Just(Op::DestroyContext),
            Just(Op::GetStats),
            Just(Op::GetAttributes),
            (any::<u64>(), any::<u64>()).prop_map(|(size, align)| Op::AllocVram { size, align }),
            any::<u32>().prop_map(|mem| Op::FreeMem { mem }),
            any::<u32>().prop_map(|mem| Op::MapAperture { mem }),
            any::<u32>().prop_map(|mem| Op::UnmapAperture { mem }),
            (any::<u32>(), 0..=1u32, any::<u64>(), 0..=2u32).prop_map(|(mem, flags, va, page)| {
                Op::MapVram {
                    mem,
                    flags,
                    va,
                    page,
                }
            }),
            (
                any::<u64>(),
                0..=2u32,
                0..=1u32,
                proptest::collection::vec(range, 1..8)
            )
                .prop_map(|(va, page, flags, ranges)| Op::MapGuest {
                    va,
                    page,
                    flags,
                    ranges
                }),
            any::<u64>().prop_map(|va| Op::Unmap { va }),
            (any::<u64>(), any::<u32>()).prop_map(|(gp_ring_va, gp_entries)| Op::CreateChannel {
                gp_ring_va,
                gp_entries
            }),
            any::<u32>().prop_map(|channel| Op::DestroyChannel { channel }),
            (any::<u32>(), any::<u32>())
                .prop_map(|(channel, gp_put)| Op::Submit { channel, gp_put }),
            any::<u32>().prop_map(|channel| Op::ChannelStatus { channel }),
            proptest::collection::vec(
                (any::<u64>(), 1u64..1 << 20).prop_map(|(gpa, len)| GuestRange { gpa, len }),
                1..8
            )
            .prop_map(|ranges| Op::ModuleLoad { ranges }),
            any::<u32>().prop_map(|module| Op::ModuleUnload { module }),
            (any::<u32>(), "[!-~]{1,40}").prop_map(|(module, n)| Op::FunctionGet {
                module,
                name: n.into_bytes()
            }),
            (any::<u32>(), "[!-~]{1,40}").prop_map(|(module, n)| Op::GlobalGet {
                module,
                name: n.into_bytes()
            }),
            (
                any::<u32>(),
                "[!-~]{1,40}",
                0u64..1 << 40,
                proptest::collection::vec((any::<u64>(), 1u64..1 << 16), 1..8),
                any::<bool>()
            )
                .prop_map(|(module, n, offset, rs, write)| {
                    let copy = GlobalCopy {
                        module,
                        name: n.into_bytes(),
                        offset,
                        ranges: rs
                            .into_iter()
                            .map(|(gpa, len)| GuestRange { gpa, len })
                            .collect(),
                    };
                    if write {
                        Op::GlobalWrite(copy)
                    } else {
                        Op::GlobalRead(copy)
                    }
                }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(pid in any::<u32>(), ctx in any::<u32>(), op in any_op()) {
            let r = Request { pid, ctx, op };
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..128)) {
            if let Ok(r) = Request::decode(&b) {
                prop_assert_eq!(r.encode(), b);
            }
        }

        #[test]
        fn replies_round_trip(mem in any::<u32>(), size in any::<u64>()) {
            let b = encode_reply(Ok(ReplyBody::Mem { mem, size }));
            prop_assert_eq!(decode_reply(op::ALLOC_VRAM, &b), Ok(Ok(ReplyBody::Mem { mem, size })));
        }

        #[test]
        fn function_replies_round_trip(
            function in any::<u32>(),
            params in proptest::option::of(proptest::collection::vec(
                (0u32..4096, 1u32..16).prop_map(|(offset, size)| ParamInfo { offset, size }),
                0..=MAX_FUNCTION_PARAMS,
            )),
        ) {
            let f = ReplyBody::Function(FunctionReply { function, params });
            let b = encode_reply(Ok(f.clone()));
            prop_assert!(b.len() <= MAX_REPLY_SIZE);
            prop_assert_eq!(decode_reply(op::FUNCTION_GET, &b), Ok(Ok(f)));
        }

        #[test]
        fn attribute_replies_round_trip(
            pairs in proptest::collection::vec((any::<u32>(), any::<i32>()), 0..=MAX_ATTRIBUTES),
        ) {
            let a = ReplyBody::Attributes(pairs);
            let b = encode_reply(Ok(a.clone()));
            prop_assert!(b.len() <= MAX_REPLY_SIZE);
            prop_assert_eq!(decode_reply(op::GET_ATTRIBUTES, &b), Ok(Ok(a)));
        }

        #[test]
        fn arbitrary_replies_never_panic(
            opcode in 0u32..24,
            b in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let _ = decode_reply(opcode, &b);
        }
    }

    #[test]
    fn rejects_malformed() {
        let good = Request {
            pid: 1,
            ctx: 2,
            op: Op::FreeMem { mem: 3 },
        }
        .encode();
        assert_eq!(
            Request::decode(&good[..20]),
            Err(RequestError::Truncated(20))
        );
        let mut extra = good.clone();
        extra.push(0);
        assert_eq!(Request::decode(&extra), Err(RequestError::Trailing(1)));
        let mut reserved = good.clone();
        reserved[12] = 1;
        assert_eq!(Request::decode(&reserved), Err(RequestError::Reserved));
        let mut unknown = good.clone();
        unknown[0] = 99;
        assert_eq!(Request::decode(&unknown), Err(RequestError::UnknownOp(99)));
        assert_eq!(RequestError::UnknownOp(99).code(), ErrorCode::Unsupported);
        let sg = |count: u32| {
            let mut v = Request {
                pid: 0,
                ctx: 0,
                op: Op::Unmap { va: 0 },
            }
            .encode();
            v[0] = op::MAP_GUEST as u8;
            v.truncate(16);
            v.extend_from_slice(&0u64.to_le_bytes());
            v.extend_from_slice(&0u32.to_le_bytes());
            v.extend_from_slice(&0u32.to_le_bytes());
            v.extend_from_slice(&count.to_le_bytes());
            v.extend_from_slice(&0u32.to_le_bytes());
            v
        };
        assert_eq!(Request::decode(&sg(0)), Err(RequestError::BadSgCount(0)));
        assert_eq!(
            Request::decode(&sg(513)),
            Err(RequestError::BadSgCount(513))
        );
        assert_eq!(Request::decode(&sg(1)), Err(RequestError::Truncated(40)));
        let bad_page = Request {
            pid: 0,
            ctx: 0,
            op: Op::MapVram {
                mem: 0,
                flags: 0,
                va: 0,
                page: 3,
            },
        }
        .encode();
        assert_eq!(Request::decode(&bad_page), Err(RequestError::BadPage(3)));
        let bad_flags = Request {
            pid: 0,
            ctx: 0,
            op: Op::MapVram {
                mem: 0,
                flags: 2,
                va: 0,
                page: 0,
            },
        }
        .encode();
        assert_eq!(Request::decode(&bad_flags), Err(RequestError::BadFlags(2)));
        assert_eq!(
            Request::decode(&vec![0; MAX_REQUEST_SIZE + 1]),
            Err(RequestError::Trailing(1))
        );
    }

    #[test]
    fn module_requests_are_checked() {
        let load = |ranges: Vec<GuestRange>| {
            Request::decode(
                &Request {
                    pid: 1,
                    ctx: 1,
                    op: Op::ModuleLoad { ranges },
                }
                .encode(),
            )
        };
        let r = |gpa, len| GuestRange { gpa, len };
        assert!(load(vec![r(0, 100)]).is_ok());
        assert_eq!(load(vec![r(0, 0)]), Err(RequestError::ModuleSize(0)));
        let over = load(vec![r(0, MAX_MODULE_BYTES), r(0, 1)]).unwrap_err();
        assert_eq!(over, RequestError::ModuleSize(MAX_MODULE_BYTES + 1));
        assert_eq!(over.code(), ErrorCode::LimitExceeded);
        assert_eq!(
            load(vec![r(0, u64::MAX), r(0, u64::MAX)])
                .unwrap_err()
                .code(),
            ErrorCode::LimitExceeded
        );
        assert_eq!(load(vec![]), Err(RequestError::BadSgCount(0)));
        let get = |name: &[u8]| {
            Request::decode(
                &Request {
                    pid: 1,
                    ctx: 1,
                    op: Op::FunctionGet {
                        module: 1,
                        name: name.to_vec(),
                    },
                }
                .encode(),
            )
        };
        assert!(get(b"vgpu_test_vadd_u32").is_ok());
        assert_eq!(get(b""), Err(RequestError::BadName));
        assert_eq!(get(b"a\0b"), Err(RequestError::BadName));
        assert_eq!(get(&[b'x'; 513]), Err(RequestError::BadName));
        // A name length that runs past the request.
        let mut lying = Request {
            pid: 1,
            ctx: 1,
            op: Op::GlobalGet {
                module: 1,
                name: b"g".to_vec(),
            },
        }
        .encode();
        lying[20] = 8;
        assert_eq!(Request::decode(&lying), Err(RequestError::Truncated(25)));
    }

    #[test]
    fn global_copies_are_bounded() {
        let r = |gpa, len| GuestRange { gpa, len };
        let copy = |offset, name: &[u8], ranges: Vec<GuestRange>| {
            Request::decode(
                &Request {
                    pid: 1,
                    ctx: 1,
                    op: Op::GlobalWrite(GlobalCopy {
                        module: 1,
                        name: name.to_vec(),
                        offset,
                        ranges,
                    }),
                }
                .encode(),
            )
        };
        assert!(copy(8, b"g", vec![r(0x1000, 4)]).is_ok());
        assert_eq!(
            copy(0, b"g", vec![r(0, MAX_GLOBAL_COPY_BYTES)])
                .unwrap()
                .op
                .clone(),
            Op::GlobalWrite(GlobalCopy {
                module: 1,
                name: b"g".to_vec(),
                offset: 0,
                ranges: vec![r(0, MAX_GLOBAL_COPY_BYTES)],
            })
        );
        let over = copy(0, b"g", vec![r(0, MAX_GLOBAL_COPY_BYTES), r(0, 1)]).unwrap_err();
        assert_eq!(over, RequestError::CopySize(MAX_GLOBAL_COPY_BYTES + 1));
        assert_eq!(over.code(), ErrorCode::LimitExceeded);
        assert_eq!(
            copy(0, b"g", vec![r(0, u64::MAX), r(0, u64::MAX)])
                .unwrap_err()
                .code(),
            ErrorCode::LimitExceeded
        );
        assert_eq!(copy(0, b"g", vec![r(0, 0)]), Err(RequestError::CopySize(0)));
        assert_eq!(copy(0, b"g", vec![]), Err(RequestError::BadSgCount(0)));
        let many = vec![r(0, 1); MAX_GLOBAL_COPY_RANGES + 1];
        assert_eq!(
            copy(0, b"g", many),
            Err(RequestError::BadSgCount(MAX_GLOBAL_COPY_RANGES as u32 + 1))
        );
        // The longest name with the most ranges still fits one request.
        let name = [b'n'; crate::module::MAX_SYMBOL_LEN];
        assert!(copy(0, &name, vec![r(0, 1); MAX_GLOBAL_COPY_RANGES]).is_ok());
        assert_eq!(copy(0, b"", vec![r(0, 1)]), Err(RequestError::BadName));
        assert_eq!(
            copy(u64::MAX, b"g", vec![r(0, 2)]),
            Err(RequestError::CopySize(2))
        );
        // A name length or range count that runs past the request.
        let mut lying = Request {
            pid: 1,
            ctx: 1,
            op: Op::GlobalRead(GlobalCopy {
                module: 1,
                name: b"g".to_vec(),
                offset: 0,
                ranges: vec![r(0, 1)],
            }),
        }
        .encode();
        lying[32] = 2;
        assert_eq!(Request::decode(&lying), Err(RequestError::Truncated(57)));
    }

    #[test]
    fn events_round_trip() {
        let e = Event {
            kind: event::CHANNEL_ERROR,
            channel: 7,
            value: 8,
            info: 0xdead,
        };
        assert_eq!(Event::decode(&e.encode()), Some(e));
        assert_eq!(Event::decode(&[0; 23]), None);
    }
}
