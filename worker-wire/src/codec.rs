//! Frames: encoding, and decoding that checks every field (see the crate's docs).

use vgpu_protocol::channel::valid_gp_entries;
use vgpu_protocol::gp::GPU_VA_LIMIT;
use vgpu_protocol::mem::PageSize;
use vgpu_protocol::{ErrorCode, PAGE_SIZE};

use crate::message::{Command, Reply, Resume, Target};
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
const CONTROL_PAGES: u16 = 2;
const ADD_GUEST_REGION: u16 = 3;
const SWAP_STORE: u16 = 4;
const CREATE_CONTEXT: u16 = 5;
const DESTROY_CONTEXT: u16 = 6;
const ALLOC_VRAM: u16 = 7;
const FREE_VRAM: u16 = 8;
const MAP: u16 = 9;
const UNMAP: u16 = 10;
const REMAP: u16 = 11;
const INVALIDATE_TLB: u16 = 12;
const CREATE_CHANNEL: u16 = 13;
const DESTROY_CHANNEL: u16 = 14;
const KILL_CHANNEL: u16 = 15;
const MOVE_CHUNK: u16 = 16;
const PAUSE: u16 = 17;
const RESUME: u16 = 18;
const SHUTDOWN: u16 = 19;

const REPLY_OK: u16 = 0x100;
const REPLY_HELLO: u16 = 0x101;
const REPLY_VRAM: u16 = 0x102;
const REPLY_ERROR: u16 = 0x103;

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
        CONTROL_PAGES | ADD_GUEST_REGION | SWAP_STORE => 1,
        _ => 0,
    }
}

fn reply_fds(kind: u16) -> u8 {
    u8::from(kind == REPLY_HELLO)
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
    let kind = match *c {
        Command::Hello { worker } => {
            w.u32(worker);
            HELLO
        }
        Command::ControlPages { len } => {
            w.u64(len);
            CONTROL_PAGES
        }
        Command::AddGuestRegion {
            gpa,
            len,
            fd_offset,
        } => {
            w.u64(gpa).u64(len).u64(fd_offset);
            ADD_GUEST_REGION
        }
        Command::SwapStore { len } => {
            w.u64(len);
            SWAP_STORE
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
        Command::CreateChannel {
            ctx,
            ch,
            slot,
            gp_ring_va,
            gp_entries,
            resume,
        } => {
            w.u32(ctx).u32(ch).u32(slot).u64(gp_ring_va).u32(gp_entries);
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
        Command::MoveChunk {
            vram_offset,
            store_offset,
            len,
            to_vram,
        } => {
            w.u64(vram_offset)
                .u64(store_offset)
                .u64(len)
                .u8(u8::from(to_vram));
            MOVE_CHUNK
        }
        Command::Pause => PAUSE,
        Command::Resume => RESUME,
        Command::Shutdown => SHUTDOWN,
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

/// Decodes a command frame that arrived with `fds` file descriptors: (sequence number,
/// command).
pub fn decode_command(frame: &[u8], fds: u8) -> Result<(u32, Command), WireError> {
    let (h, mut r) = open(frame, fds, command_fds)?;
    let c = match h.kind {
        HELLO => Command::Hello { worker: r.u32()? },
        CONTROL_PAGES => Command::ControlPages {
            len: length(r.u64()?, "len")?,
        },
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
        SWAP_STORE => Command::SwapStore {
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
        CREATE_CHANNEL => {
            let (ctx, ch, slot) = (r.u32()?, r.u32()?, r.u32()?);
            let gp_ring_va = r.u64()?;
            let gp_entries = r.u32()?;
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
            let resume = if r.bool("resume")? {
                let (gp_get, reference, notify_seq) = (r.u32()?, r.u32()?, r.u32()?);
                let error = if r.bool("error")? {
                    Some((error_code(r.u32()?)?, r.u64()?))
                } else {
                    None
                };
                Some(Resume {
                    gp_get,
                    reference,
                    notify_seq,
                    error,
                })
            } else {
                None
            };
            Command::CreateChannel {
                ctx,
                ch,
                slot,
                gp_ring_va,
                gp_entries,
                resume,
            }
        }
        DESTROY_CHANNEL => Command::DestroyChannel { ch: r.u32()? },
        KILL_CHANNEL => Command::KillChannel {
            ch: r.u32()?,
            code: error_code(r.u32()?)?,
        },
        MOVE_CHUNK => {
            let vram_offset = page_aligned(r.u64()?, "vram_offset")?;
            let store_offset = page_aligned(r.u64()?, "store_offset")?;
            let len = length(r.u64()?, "len")?;
            if vram_offset.checked_add(len).is_none_or(|e| e > MAX_BYTES)
                || store_offset.checked_add(len).is_none_or(|e| e > MAX_BYTES)
            {
                return Err(WireError::Field("len"));
            }
            Command::MoveChunk {
                vram_offset,
                store_offset,
                len,
                to_vram: r.bool("to_vram")?,
            }
        }
        PAUSE => Command::Pause,
        RESUME => Command::Resume,
        SHUTDOWN => Command::Shutdown,
        k => return Err(WireError::Kind(k)),
    };
    r.finish()?;
    Ok((h.seq, c))
}

/// The frame of reply `rep` to the command numbered `seq`; a `Hello` reply is sent with
/// the aperture's fd.
pub fn encode_reply(seq: u32, rep: &Reply) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    let kind = match *rep {
        Reply::Ok => REPLY_OK,
        Reply::Hello {
            vram_bytes,
            aperture_len,
        } => {
            w.u64(vram_bytes).u64(aperture_len);
            REPLY_HELLO
        }
        Reply::Vram { offset, len } => {
            w.u64(offset).u64(len);
            REPLY_VRAM
        }
        Reply::Error { code } => {
            w.u32(code as u32);
            REPLY_ERROR
        }
    };
    frame(kind, seq, reply_fds(kind), w)
}

/// Decodes a reply frame that arrived with `fds` file descriptors: (sequence number,
/// reply).
pub fn decode_reply(frame: &[u8], fds: u8) -> Result<(u32, Reply), WireError> {
    let (h, mut r) = open(frame, fds, reply_fds)?;
    let rep = match h.kind {
        REPLY_OK => Reply::Ok,
        REPLY_HELLO => Reply::Hello {
            vram_bytes: length(r.u64()?, "vram_bytes")?,
            aperture_len: length(r.u64()?, "aperture_len")?,
        },
        REPLY_VRAM => {
            let offset = page_aligned(r.u64()?, "offset")?;
            let len = length(r.u64()?, "len")?;
            if offset.checked_add(len).is_none_or(|e| e > MAX_BYTES) {
                return Err(WireError::Field("len"));
            }
            Reply::Vram { offset, len }
        }
        REPLY_ERROR => Reply::Error {
            code: error_code(r.u32()?)?,
        },
        k => return Err(WireError::Kind(k)),
    };
    r.finish()?;
    Ok((h.seq, rep))
}

#[cfg(test)]
mod tests;
