//! Frames: encoding, and decoding that checks every field (see the crate's docs).

use vgpu_protocol::channel::valid_gp_entries;
use vgpu_protocol::gp::GPU_VA_LIMIT;
use vgpu_protocol::mem::PageSize;
use vgpu_protocol::request::MAX_ATTRIBUTES;
use vgpu_protocol::{ErrorCode, PAGE_SIZE};

use crate::message::{Command, Event, Reply, Resume, Target};
use crate::{WireError, HEADER_LEN, MAGIC, MAX_FDS, MAX_PAYLOAD, VERSION};

/// A frame's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u16,
    /// A command's sequence number; a reply carries its command's.
    pub seq: u32,
    pub len: u16,
    /// File descriptors sent with the frame (`SCM_RIGHTS`).
    pub fds: u8,
}

impl Header {
    /// Reads and checks a header (magic, version, payload bound) from the start of `frame`.
    pub fn decode(frame: &[u8]) -> Result<Header, WireError> {
        let h = frame
            .get(..HEADER_LEN)
            .ok_or(WireError::Short(frame.len()))?;
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        let header = Header {
            kind: u16_at(6),
            seq: u32_at(8),
            len: u16_at(12),
            fds: h[14],
        };
        if usize::from(header.len) > MAX_PAYLOAD {
            return Err(WireError::TooLong(u32::from(header.len)));
        }
        if header.fds > MAX_FDS || h[15] != 0 {
            return Err(WireError::Field("header"));
        }
        Ok(header)
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.kind.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.push(self.fds);
        out.push(0);
    }
}

/// Little-endian fields in order.
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A symbol name: its length, then its bytes.
    fn name(&mut self, n: &[u8]) -> &mut Self {
        self.u32(n.len() as u32);
        self.0.extend_from_slice(n);
        self
    }
}

/// Reads fields in order from a payload; `finish` refuses trailing bytes.
struct Reader<'a> {
    rest: &'a [u8],
    kind: u16,
    len: usize,
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let (head, rest) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or(WireError::PayloadSize {
                kind: self.kind,
                want: self.len + N,
                got: self.len,
            })?;
        self.rest = rest;
        self.len += N;
        Ok(*head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// A symbol name, checked as the protocol checks a guest's.
    fn name(&mut self) -> Result<Vec<u8>, WireError> {
        let len = self.u32()? as usize;
        if len > vgpu_protocol::module::MAX_SYMBOL_LEN || len > self.rest.len() {
            return Err(WireError::Field("name"));
        }
        let (name, rest) = self.rest.split_at(len);
        self.rest = rest;
        self.len += len;
        if !vgpu_protocol::module::valid_symbol(name) {
            return Err(WireError::Field("name"));
        }
        Ok(name.to_vec())
    }
    fn bool(&mut self, name: &'static str) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(WireError::Field(name)),
        }
    }
    fn finish(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(WireError::PayloadSize {
                kind: self.kind,
                want: self.len,
                got: self.len + self.rest.len(),
            })
        }
    }
}

const HELLO: u16 = 1;
const ADD_GUEST_REGION: u16 = 2;
const COPY_BUFFER: u16 = 3;
const CREATE_CONTEXT: u16 = 4;
const DESTROY_CONTEXT: u16 = 5;
const ALLOC_VRAM: u16 = 6;
const FREE_VRAM: u16 = 7;
const VRAM_FREE: u16 = 8;
const MAP: u16 = 9;
const UNMAP: u16 = 10;
const REMAP: u16 = 11;
const INVALIDATE_TLB: u16 = 12;
const PAGE_TABLE_BYTES: u16 = 13;
const MAP_COST: u16 = 14;
const SYSRAM_HINT: u16 = 15;
const CREATE_CHANNEL: u16 = 16;
const DESTROY_CHANNEL: u16 = 17;
const KILL_CHANNEL: u16 = 18;
const DOORBELL: u16 = 19;
const COPY: u16 = 20;
const SHUTDOWN: u16 = 21;
const CLEAR_GUEST_REGIONS: u16 = 22;
const MODULE_LOAD: u16 = 23;
const MODULE_UNLOAD: u16 = 24;
const FUNCTION_GET: u16 = 25;
const GLOBAL_GET: u16 = 26;
const VARIABLE_COPY: u16 = 27;
const HOLD_FETCH: u16 = 28;
const FETCHED_DONE: u16 = 29;

const REPLY_OK: u16 = 0x100;
const REPLY_HELLO: u16 = 0x101;
const REPLY_VRAM: u16 = 0x102;
const REPLY_BYTES: u16 = 0x103;
const REPLY_CHANNEL: u16 = 0x104;
const REPLY_ERROR: u16 = 0x105;
const REPLY_FUNCTION: u16 = 0x106;
const REPLY_GLOBAL: u16 = 0x107;

const EVENT_NOTIFY: u16 = 0x200;
const EVENT_ERROR: u16 = 0x201;
const EVENT_FENCE: u16 = 0x202;

/// Largest VRAM size, alignment or swap store a frame may name (1 TiB).
const MAX_BYTES: u64 = 1 << 40;

fn page_aligned(v: u64, name: &'static str) -> Result<u64, WireError> {
    if v.is_multiple_of(PAGE_SIZE) {
        Ok(v)
    } else {
        Err(WireError::Field(name))
    }
}

/// A non-empty, page-aligned byte count of at most [`MAX_BYTES`].
fn length(v: u64, name: &'static str) -> Result<u64, WireError> {
    if v == 0 || v > MAX_BYTES {
        return Err(WireError::Field(name));
    }
    page_aligned(v, name)
}

/// A page-aligned GPU virtual range inside the address space.
fn va_range(va: u64, size: u64) -> Result<(u64, u64), WireError> {
    page_aligned(va, "va")?;
    length(size, "size")?;
    match va.checked_add(size) {
        Some(end) if end <= GPU_VA_LIMIT => Ok((va, size)),
        _ => Err(WireError::Field("va")),
    }
}

/// A context and a range in its address space, as Map, Unmap and Remap start.
fn ctx_range(r: &mut Reader<'_>) -> Result<(u32, u64, u64), WireError> {
    let ctx = r.u32()?;
    let (va, size) = va_range(r.u64()?, r.u64()?)?;
    Ok((ctx, va, size))
}

fn error_code(v: u32) -> Result<ErrorCode, WireError> {
    ErrorCode::from_u32(v).map_err(|_| WireError::Field("code"))
}

fn page_size(v: u8) -> Result<PageSize, WireError> {
    PageSize::ALL
        .get(usize::from(v))
        .copied()
        .ok_or(WireError::Field("page"))
}

fn page_index(p: PageSize) -> u8 {
    match p {
        PageSize::Small4K => 0,
        PageSize::Big64K => 1,
        PageSize::Huge2M => 2,
    }
}

fn put_target(w: &mut Writer, t: Target) {
    match t {
        Target::Vram { offset } => w.u8(0).u64(offset),
        Target::Sysram { addr } => w.u8(1).u64(addr),
    };
}

fn target(r: &mut Reader<'_>) -> Result<Target, WireError> {
    let tag = r.u8()?;
    let at = page_aligned(r.u64()?, "target")?;
    match tag {
        0 if at <= MAX_BYTES => Ok(Target::Vram { offset: at }),
        1 => Ok(Target::Sysram { addr: at }),
        _ => Err(WireError::Field("target")),
    }
}

/// The file descriptors a command's frame carries.
fn command_fds(kind: u16) -> u8 {
    match kind {
        ADD_GUEST_REGION | COPY_BUFFER | MODULE_LOAD => 1,
        _ => 0,
    }
}

fn reply_fds(kind: u16) -> u8 {
    if kind == REPLY_HELLO {
        2
    } else {
        0
    }
}

fn event_fds(_kind: u16) -> u8 {
    0
}

fn frame(kind: u16, seq: u32, fds: u8, payload: Writer) -> Vec<u8> {
    let payload = payload.0;
    debug_assert!(payload.len() <= MAX_PAYLOAD);
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    Header {
        kind,
        seq,
        len: payload.len() as u16,
        fds,
    }
    .encode(&mut out);
    out.extend_from_slice(&payload);
    out
}

/// The frame of command `c` with sequence number `seq`; send it with the fds its kind
/// carries (see [`Command`]).
pub fn encode_command(seq: u32, c: &Command) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    let kind = match c.clone() {
        Command::Hello { worker } => {
            w.u32(worker);
            HELLO
        }
        Command::AddGuestRegion {
            gpa,
            len,
            fd_offset,
        } => {
            w.u64(gpa).u64(len).u64(fd_offset);
            ADD_GUEST_REGION
        }
        Command::ClearGuestRegions => CLEAR_GUEST_REGIONS,
        Command::CopyBuffer { len } => {
            w.u64(len);
            COPY_BUFFER
        }
        Command::CreateContext { ctx } => {
            w.u32(ctx);
            CREATE_CONTEXT
        }
        Command::DestroyContext { ctx } => {
            w.u32(ctx);
            DESTROY_CONTEXT
        }
        Command::AllocVram { size, align } => {
            w.u64(size).u64(align);
            ALLOC_VRAM
        }
        Command::FreeVram { offset } => {
            w.u64(offset);
            FREE_VRAM
        }
        Command::VramFree => VRAM_FREE,
        Command::Map {
            ctx,
            va,
            size,
            target,
            page,
            read_only,
        } => {
            w.u32(ctx).u64(va).u64(size);
            put_target(&mut w, target);
            w.u8(page_index(page)).u8(u8::from(read_only));
            MAP
        }
        Command::Unmap { ctx, va, size } => {
            w.u32(ctx).u64(va).u64(size);
            UNMAP
        }
        Command::Remap {
            ctx,
            va,
            size,
            target,
        } => {
            w.u32(ctx).u64(va).u64(size);
            put_target(&mut w, target);
            REMAP
        }
        Command::InvalidateTlb { ctx } => {
            w.u32(ctx);
            INVALIDATE_TLB
        }
        Command::PageTableBytes { ctx } => {
            w.u32(ctx);
            PAGE_TABLE_BYTES
        }
        Command::MapCost {
            ctx,
            va,
            size,
            page,
        } => {
            w.u32(ctx).u64(va).u64(size).u8(page_index(page));
            MAP_COST
        }
        Command::SysramHint {
            ctx,
            addr,
            len,
            prepare,
        } => {
            w.u32(ctx).u64(addr).u64(len).u8(u8::from(prepare));
            SYSRAM_HINT
        }
        Command::CreateChannel {
            ctx,
            ch,
            gp_ring_va,
            gp_entries,
            resume,
        } => {
            w.u32(ctx).u32(ch).u64(gp_ring_va).u32(gp_entries);
            match resume {
                None => {
                    w.u8(0);
                }
                Some(r) => {
                    w.u8(1).u32(r.gp_get).u32(r.reference).u32(r.notify_seq);
                    match r.error {
                        None => w.u8(0),
                        Some((code, info)) => w.u8(1).u32(code as u32).u64(info),
                    };
                }
            }
            CREATE_CHANNEL
        }
        Command::DestroyChannel { ch } => {
            w.u32(ch);
            DESTROY_CHANNEL
        }
        Command::KillChannel { ch, code } => {
            w.u32(ch).u32(code as u32);
            KILL_CHANNEL
        }
        Command::Doorbell { ch } => {
            w.u32(ch);
            DOORBELL
        }
        Command::HoldFetch { ch, hold } => {
            w.u32(ch).u8(u8::from(hold));
            HOLD_FETCH
        }
        Command::FetchedDone { ch } => {
            w.u32(ch);
            FETCHED_DONE
        }
        Command::Copy {
            vram_offset,
            buf_offset,
            len,
            to_vram,
        } => {
            w.u64(vram_offset)
                .u64(buf_offset)
                .u64(len)
                .u8(u8::from(to_vram));
            COPY
        }
        Command::Shutdown => SHUTDOWN,
        Command::ModuleLoad { ctx, module, len } => {
            w.u32(ctx).u32(module).u64(len);
            MODULE_LOAD
        }
        Command::ModuleUnload { ctx, module } => {
            w.u32(ctx).u32(module);
            MODULE_UNLOAD
        }
        Command::FunctionGet {
            ctx,
            module,
            function,
            name,
        } => {
            w.u32(ctx).u32(module).u32(function).name(&name);
            FUNCTION_GET
        }
        Command::GlobalGet { ctx, module, name } => {
            w.u32(ctx).u32(module).name(&name);
            GLOBAL_GET
        }
        Command::VariableCopy {
            ctx,
            module,
            name,
            offset,
            len,
            to_variable,
        } => {
            w.u32(ctx)
                .u32(module)
                .u64(offset)
                .u64(len)
                .u8(u8::from(to_variable))
                .name(&name);
            VARIABLE_COPY
        }
    };
    frame(kind, seq, command_fds(kind), w)
}

/// Splits `frame` into its header and a reader of its payload, checking the length and
/// the fds the kind must carry (`fds`: how many arrived with it).
fn open<'a>(
    frame: &'a [u8],
    fds: u8,
    want_fds: fn(u16) -> u8,
) -> Result<(Header, Reader<'a>), WireError> {
    let h = Header::decode(frame)?;
    let payload = &frame[HEADER_LEN..];
    if payload.len() != usize::from(h.len) {
        return Err(WireError::Length {
            said: u32::from(h.len),
            got: payload.len(),
        });
    }
    let want = want_fds(h.kind);
    if h.fds != want || fds != want {
        return Err(WireError::Fds {
            kind: h.kind,
            want,
            got: h.fds.max(fds),
        });
    }
    Ok((
        h,
        Reader {
            rest: payload,
            kind: h.kind,
            len: 0,
        },
    ))
}

/// A channel's ring: a valid size, entry-aligned, inside the address space.
fn gp_ring(gp_ring_va: u64, gp_entries: u32) -> Result<(), WireError> {
    if !valid_gp_entries(gp_entries) {
        return Err(WireError::Field("gp_entries"));
    }
    let ring_end = u64::from(gp_entries)
        .checked_mul(vgpu_protocol::gp::GP_ENTRY_SIZE as u64)
        .and_then(|n| gp_ring_va.checked_add(n));
    if !gp_ring_va.is_multiple_of(vgpu_protocol::gp::GP_ENTRY_SIZE as u64)
        || ring_end.is_none_or(|e| e > GPU_VA_LIMIT)
    {
        return Err(WireError::Field("gp_ring_va"));
    }
    Ok(())
}

fn resume(r: &mut Reader<'_>) -> Result<Option<Resume>, WireError> {
    if !r.bool("resume")? {
        return Ok(None);
    }
    let (gp_get, reference, notify_seq) = (r.u32()?, r.u32()?, r.u32()?);
    let error = if r.bool("error")? {
        Some((error_code(r.u32()?)?, r.u64()?))
    } else {
        None
    };
    Ok(Some(Resume {
        gp_get,
        reference,
        notify_seq,
        error,
    }))
}

/// Decodes a command frame that arrived with `fds` file descriptors: (sequence number,
/// command).
pub fn decode_command(frame: &[u8], fds: u8) -> Result<(u32, Command), WireError> {
    let (h, mut r) = open(frame, fds, command_fds)?;
    let c = match h.kind {
        HELLO => Command::Hello { worker: r.u32()? },
        ADD_GUEST_REGION => {
            let gpa = page_aligned(r.u64()?, "gpa")?;
            let len = length(r.u64()?, "len")?;
            let fd_offset = page_aligned(r.u64()?, "fd_offset")?;
            if gpa.checked_add(len).is_none() || fd_offset.checked_add(len).is_none() {
                return Err(WireError::Field("len"));
            }
            Command::AddGuestRegion {
                gpa,
                len,
                fd_offset,
            }
        }
        CLEAR_GUEST_REGIONS => Command::ClearGuestRegions,
        COPY_BUFFER => Command::CopyBuffer {
            len: length(r.u64()?, "len")?,
        },
        CREATE_CONTEXT => Command::CreateContext { ctx: r.u32()? },
        DESTROY_CONTEXT => Command::DestroyContext { ctx: r.u32()? },
        ALLOC_VRAM => {
            let size = length(r.u64()?, "size")?;
            let align = r.u64()?;
            if !align.is_power_of_two() || !(PAGE_SIZE..=MAX_BYTES).contains(&align) {
                return Err(WireError::Field("align"));
            }
            Command::AllocVram { size, align }
        }
        FREE_VRAM => Command::FreeVram {
            offset: page_aligned(r.u64()?, "offset")?,
        },
        VRAM_FREE => Command::VramFree,
        MAP => {
            let (ctx, va, size) = ctx_range(&mut r)?;
            let target = target(&mut r)?;
            let page = page_size(r.u8()?)?;
            let read_only = r.bool("read_only")?;
            if !va.is_multiple_of(page.bytes()) || !size.is_multiple_of(page.bytes()) {
                return Err(WireError::Field("page"));
            }
            Command::Map {
                ctx,
                va,
                size,
                target,
                page,
                read_only,
            }
        }
        UNMAP => {
            let (ctx, va, size) = ctx_range(&mut r)?;
            Command::Unmap { ctx, va, size }
        }
        REMAP => {
            let (ctx, va, size) = ctx_range(&mut r)?;
            Command::Remap {
                ctx,
                va,
                size,
                target: target(&mut r)?,
            }
        }
        INVALIDATE_TLB => Command::InvalidateTlb { ctx: r.u32()? },
        PAGE_TABLE_BYTES => Command::PageTableBytes { ctx: r.u32()? },
        // Any range: the GPU answers 0 for one it would refuse, as the HAL says.
        MAP_COST => Command::MapCost {
            ctx: r.u32()?,
            va: r.u64()?,
            size: r.u64()?,
            page: page_size(r.u8()?)?,
        },
        SYSRAM_HINT => {
            let ctx = r.u32()?;
            let addr = page_aligned(r.u64()?, "addr")?;
            let len = length(r.u64()?, "len")?;
            if addr.checked_add(len).is_none() {
                return Err(WireError::Field("len"));
            }
            Command::SysramHint {
                ctx,
                addr,
                len,
                prepare: r.bool("prepare")?,
            }
        }
        CREATE_CHANNEL => {
            let (ctx, ch) = (r.u32()?, r.u32()?);
            let gp_ring_va = r.u64()?;
            let gp_entries = r.u32()?;
            gp_ring(gp_ring_va, gp_entries)?;
            Command::CreateChannel {
                ctx,
                ch,
                gp_ring_va,
                gp_entries,
                resume: resume(&mut r)?,
            }
        }
        DESTROY_CHANNEL => Command::DestroyChannel { ch: r.u32()? },
        KILL_CHANNEL => Command::KillChannel {
            ch: r.u32()?,
            code: error_code(r.u32()?)?,
        },
        DOORBELL => Command::Doorbell { ch: r.u32()? },
        HOLD_FETCH => Command::HoldFetch {
            ch: r.u32()?,
            hold: r.bool("hold")?,
        },
        FETCHED_DONE => Command::FetchedDone { ch: r.u32()? },
        COPY => {
            let vram_offset = r.u64()?;
            let buf_offset = r.u64()?;
            let len = r.u64()?;
            if len == 0
                || vram_offset.checked_add(len).is_none_or(|e| e > MAX_BYTES)
                || buf_offset.checked_add(len).is_none_or(|e| e > MAX_BYTES)
            {
                return Err(WireError::Field("len"));
            }
            Command::Copy {
                vram_offset,
                buf_offset,
                len,
                to_vram: r.bool("to_vram")?,
            }
        }
        SHUTDOWN => Command::Shutdown,
        MODULE_LOAD => {
            let (ctx, module) = (r.u32()?, r.u32()?);
            let len = r.u64()?;
            if len == 0 || len > vgpu_protocol::module::MAX_MODULE_BYTES {
                return Err(WireError::Field("len"));
            }
            Command::ModuleLoad { ctx, module, len }
        }
        MODULE_UNLOAD => Command::ModuleUnload {
            ctx: r.u32()?,
            module: r.u32()?,
        },
        FUNCTION_GET => Command::FunctionGet {
            ctx: r.u32()?,
            module: r.u32()?,
            function: r.u32()?,
            name: r.name()?,
        },
        GLOBAL_GET => Command::GlobalGet {
            ctx: r.u32()?,
            module: r.u32()?,
            name: r.name()?,
        },
        VARIABLE_COPY => {
            let (ctx, module) = (r.u32()?, r.u32()?);
            let (offset, len) = (r.u64()?, r.u64()?);
            if offset.checked_add(len).is_none_or(|e| e > MAX_BYTES) {
                return Err(WireError::Field("len"));
            }
            Command::VariableCopy {
                ctx,
                module,
                offset,
                len,
                to_variable: r.bool("to_variable")?,
                name: r.name()?,
            }
        }
        k => return Err(WireError::Kind(k)),
    };
    r.finish()?;
    Ok((h.seq, c))
}

/// The frame of reply `rep` to the command numbered `seq`; a `Hello` reply is sent with
/// the control pages' and the counters page's fds.
pub fn encode_reply(seq: u32, rep: &Reply) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    let kind = match rep.clone() {
        Reply::Ok => REPLY_OK,
        Reply::Hello {
            vram_bytes,
            max_channels,
            max_contexts,
            compute_engines,
            control_pages_len,
            counters_len,
            attributes,
        } => {
            let n = attributes.len().min(MAX_ATTRIBUTES);
            w.u64(vram_bytes)
                .u32(max_channels)
                .u32(max_contexts)
                .u32(compute_engines)
                .u64(control_pages_len)
                .u64(counters_len)
                .u32(n as u32);
            for (attr, value) in &attributes[..n] {
                w.u32(*attr).u32(*value as u32);
            }
            REPLY_HELLO
        }
        Reply::Vram { offset, len } => {
            w.u64(offset).u64(len);
            REPLY_VRAM
        }
        Reply::Bytes { n } => {
            w.u64(n);
            REPLY_BYTES
        }
        Reply::Channel { slot } => {
            w.u32(slot);
            REPLY_CHANNEL
        }
        Reply::Error { code } => {
            w.u32(code as u32);
            REPLY_ERROR
        }
        Reply::Function { params } => {
            match params {
                None => w.u32(vgpu_protocol::module::PARAMS_UNKNOWN),
                Some(p) => {
                    w.u32(p.len() as u32);
                    for q in p {
                        w.u32(q.offset).u32(q.size);
                    }
                    &mut w
                }
            };
            REPLY_FUNCTION
        }
        Reply::Global { addr, size } => {
            w.u64(addr).u64(size);
            REPLY_GLOBAL
        }
    };
    frame(kind, seq, reply_fds(kind), w)
}

/// The most channels or contexts a worker may say it has.
const MAX_SLOTS: u32 = 1 << 16;

/// Decodes a reply frame that arrived with `fds` file descriptors: (sequence number,
/// reply).
pub fn decode_reply(frame: &[u8], fds: u8) -> Result<(u32, Reply), WireError> {
    let (h, mut r) = open(frame, fds, reply_fds)?;
    let rep = match h.kind {
        REPLY_OK => Reply::Ok,
        REPLY_HELLO => {
            let vram_bytes = length(r.u64()?, "vram_bytes")?;
            let slots = |v: u32, name| {
                if v == 0 || v > MAX_SLOTS {
                    Err(WireError::Field(name))
                } else {
                    Ok(v)
                }
            };
            let max_channels = slots(r.u32()?, "max_channels")?;
            let max_contexts = slots(r.u32()?, "max_contexts")?;
            let compute_engines = slots(r.u32()?, "compute_engines")?;
            let control_pages_len = length(r.u64()?, "control_pages_len")?;
            let counters_len = length(r.u64()?, "counters_len")?;
            if control_pages_len != u64::from(max_channels) * PAGE_SIZE
                || counters_len != crate::counters::page_len(max_channels)
            {
                return Err(WireError::Field("pages"));
            }
            let n = r.u32()? as usize;
            if n > MAX_ATTRIBUTES {
                return Err(WireError::Field("attributes"));
            }
            let mut attributes = Vec::with_capacity(n);
            for _ in 0..n {
                attributes.push((r.u32()?, r.u32()? as i32));
            }
            Reply::Hello {
                vram_bytes,
                max_channels,
                max_contexts,
                compute_engines,
                control_pages_len,
                counters_len,
                attributes,
            }
        }
        REPLY_VRAM => {
            let offset = page_aligned(r.u64()?, "offset")?;
            let len = length(r.u64()?, "len")?;
            if offset.checked_add(len).is_none_or(|e| e > MAX_BYTES) {
                return Err(WireError::Field("len"));
            }
            Reply::Vram { offset, len }
        }
        REPLY_BYTES => Reply::Bytes { n: r.u64()? },
        REPLY_CHANNEL => {
            let slot = r.u32()?;
            if slot >= MAX_SLOTS {
                return Err(WireError::Field("slot"));
            }
            Reply::Channel { slot }
        }
        REPLY_ERROR => Reply::Error {
            code: error_code(r.u32()?)?,
        },
        REPLY_FUNCTION => {
            let count = r.u32()?;
            let params = if count == vgpu_protocol::module::PARAMS_UNKNOWN {
                None
            } else {
                if count as usize > vgpu_protocol::module::MAX_FUNCTION_PARAMS {
                    return Err(WireError::Field("param_count"));
                }
                let mut p = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let (offset, size) = (r.u32()?, r.u32()?);
                    if u64::from(offset) + u64::from(size)
                        > u64::from(vgpu_protocol::module::MAX_PARAM_BYTES)
                    {
                        return Err(WireError::Field("param"));
                    }
                    p.push(vgpu_protocol::module::ParamInfo { offset, size });
                }
                Some(p)
            };
            Reply::Function { params }
        }
        REPLY_GLOBAL => Reply::Global {
            addr: r.u64()?,
            size: r.u64()?,
        },
        k => return Err(WireError::Kind(k)),
    };
    r.finish()?;
    Ok((h.seq, rep))
}

/// The frame of event `ev` (its sequence number counts events, for the logs).
pub fn encode_event(seq: u32, ev: &Event) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    let kind = match *ev {
        Event::Notify { ch, token } => {
            w.u32(ch).u32(token);
            EVENT_NOTIFY
        }
        Event::Error { ch, code, info } => {
            w.u32(ch).u32(code as u32).u64(info);
            EVENT_ERROR
        }
        Event::Fence { ch, reference } => {
            w.u32(ch).u32(reference);
            EVENT_FENCE
        }
    };
    frame(kind, seq, 0, w)
}

/// Decodes an event frame that arrived with `fds` file descriptors (events carry none).
pub fn decode_event(frame: &[u8], fds: u8) -> Result<(u32, Event), WireError> {
    let (h, mut r) = open(frame, fds, event_fds)?;
    let ev = match h.kind {
        EVENT_NOTIFY => Event::Notify {
            ch: r.u32()?,
            token: r.u32()?,
        },
        EVENT_FENCE => Event::Fence {
            ch: r.u32()?,
            reference: r.u32()?,
        },
        EVENT_ERROR => {
            let ch = r.u32()?;
            let code = error_code(r.u32()?)?;
            if code == ErrorCode::Ok {
                return Err(WireError::Field("code"));
            }
            Event::Error {
                ch,
                code,
                info: r.u64()?,
            }
        }
        k => return Err(WireError::Kind(k)),
    };
    r.finish()?;
    Ok((h.seq, ev))
}

#[cfg(test)]
mod tests;
