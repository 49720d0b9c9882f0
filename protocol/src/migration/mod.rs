//! The device-state format of live migration: everything a VM has on the GPU, as the
//! source backend writes it into the vhost-user device-state fd
//! (`VHOST_USER_SET_DEVICE_STATE_FD`) and the destination backend reads it back.
//!
//! A stream is a 32-byte header followed by a body (all integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `b"VGPUSTAT"` |
//! | 8 | 4 | format version ([`STATE_VERSION`]) |
//! | 12 | 4 | kind: 1 = full state ([`DeviceState`]), 2 = tail ([`TailState`]) |
//! | 16 | 8 | body length in bytes |
//! | 24 | 4 | CRC-32 (IEEE) of the body |
//! | 28 | 4 | reserved, 0 |
//!
//! The body is a sequence of sections, each `tag: u32, len: u64, payload`, in tag order;
//! the sections of each kind are listed at [`Section`]. A reader accepts a version it
//! knows (today: only 1); a newer writer bumps the version when it changes a section's
//! layout and keeps writing the older version for older readers where it can.
//!
//! Decoding is meant for hostile input: a truncated, oversized or corrupt stream gives a
//! [`StateError`], never a panic or an allocation larger than the input.

use thiserror::Error;

use crate::request::{Event, EVENT_SIZE};

/// Magic at the start of every device-state stream.
pub const STATE_MAGIC: [u8; 8] = *b"VGPUSTAT";
/// The format version this crate writes: 2 added pre-copy ([`precopy`]: kinds 3 to 5,
/// VRAM contents delivered in chunk frames before the full state); 3 added guests'
/// modules to the full state ([`Section::Modules`]).
pub const STATE_VERSION: u32 = 3;
/// The oldest version this crate reads (1: a single full state with inline contents).
pub const STATE_VERSION_MIN: u32 = 1;
/// Header size in bytes.
pub const HEADER_SIZE: usize = 32;
/// The largest body a reader accepts (64 GiB): a bound on what a corrupt length can ask
/// a reader to wait for.
pub const MAX_BODY: u64 = 64 << 30;

/// Kinds of stream.
pub const KIND_FULL: u32 = 1;
pub const KIND_TAIL: u32 = 2;
/// Version 2, pre-copy ([`precopy`]): the VM's contexts and VRAM objects, first.
pub const KIND_OBJECTS: u32 = 3;
/// Version 2, pre-copy: a piece of one round of VRAM chunks.
pub const KIND_CHUNKS: u32 = 4;
/// Version 2, pre-copy: the source paused the VM's channels (a marker).
pub const KIND_PAUSED: u32 = 5;

pub mod precopy;

/// Section tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Section {
    /// Full: the VM's scheduling weight, VRAM quota, last handed-out ids.
    Vm = 1,
    /// Full: contexts (id, guest PID).
    Contexts = 2,
    /// Full: VRAM objects with their contents and residency.
    Mems = 3,
    /// Full: GPU mappings.
    Mappings = 4,
    /// Full: channels with their ring position, reference counter and error.
    Channels = 5,
    /// Full: events the GPU raised that the guest has not received yet.
    Events = 6,
    /// Full (v3): guests' modules (images and variables) and their function bindings.
    Modules = 7,
    /// Tail: the final guest GP_PUT of each channel.
    Puts = 16,
    /// Chunks (v2): the round this piece belongs to.
    Round = 17,
    /// Chunks (v2): VRAM chunks of objects.
    Chunks = 18,
    /// Paused (v2): when the source paused the channels.
    Pause = 19,
}

/// Errors of decoding a device-state stream.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StateError {
    #[error("stream truncated: needed {needed} more bytes at offset {at}")]
    Truncated { at: usize, needed: u64 },
    #[error("not a vgpu device-state stream (bad magic)")]
    BadMagic,
    #[error("unsupported device-state version {0} (this backend reads {STATE_VERSION_MIN} to {STATE_VERSION})")]
    Version(u32),
    #[error("unknown stream kind {0}")]
    Kind(u32),
    #[error("expected a stream of kind {expected}, got {got}")]
    WrongKind { expected: u32, got: u32 },
    #[error("body of {0} bytes exceeds the limit")]
    TooLarge(u64),
    #[error("checksum mismatch: header says {expected:#010x}, body has {actual:#010x}")]
    Checksum { expected: u32, actual: u32 },
    #[error("{0} trailing bytes after the body")]
    Trailing(usize),
    #[error("section {got} where section {expected} was expected")]
    UnexpectedSection { expected: u32, got: u32 },
    #[error("section {section}: {what}")]
    Invalid { section: u32, what: &'static str },
    #[error("pre-copy: {0}")]
    Precopy(&'static str),
}

/// The VM section.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmRecord {
    pub weight: u32,
    pub vram_quota: u64,
    pub last_context: u32,
    pub last_mem: u32,
    pub last_channel: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextRecord {
    pub id: u32,
    pub pid: u32,
}

/// A VRAM object: its size, owner, aperture window and contents; `resident` says per
/// 2 MiB chunk whether it was in VRAM on the source (advisory: the destination places
/// chunks by its own free VRAM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemRecord {
    pub id: u32,
    pub pid: u32,
    pub ctx: u32,
    pub size: u64,
    pub align: u64,
    pub aperture: Option<u64>,
    pub resident: Vec<bool>,
    /// Exactly `size` bytes, or (version 2) empty: the contents travel in chunk frames
    /// ([`precopy`]).
    pub data: Vec<u8>,
}

/// What a mapping points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MappingTargetRecord {
    Vram {
        mem: u32,
    },
    /// Guest-physical ranges (gpa, len), mapped back to back.
    Guest {
        ranges: Vec<(u64, u64)>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappingRecord {
    pub ctx: u32,
    pub va: u64,
    pub pid: u32,
    pub size: u64,
    /// Page-size code (`request::PAGE_*`).
    pub page: u32,
    /// Mapping flags (`request::MAP_*`).
    pub flags: u32,
    pub target: MappingTargetRecord,
}

/// A channel: where it is, and how far it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelRecord {
    pub id: u32,
    pub pid: u32,
    pub ctx: u32,
    /// Control-page slot in the BAR.
    pub slot: u32,
    pub gp_ring_va: u64,
    pub gp_entries: u32,
    /// Entries the GPU completed.
    pub gp_get: u32,
    /// Entries the guest submitted (its shadow GP_PUT while paused).
    pub gp_put: u32,
    pub reference: u32,
    pub notify_seq: u32,
    /// The error the channel stopped on: (error code, info).
    pub error: Option<(u32, u64)>,
}

/// A guest's module: its image as loaded, and its variables' contents by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModuleRecord {
    pub id: u32,
    pub pid: u32,
    pub ctx: u32,
    /// At most `module::MAX_MODULE_BYTES`.
    pub image: Vec<u8>,
    pub variables: Vec<(String, Vec<u8>)>,
}

/// A function binding (LAUNCH_FUNCTION's id) by its module and name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FunctionRecord {
    pub id: u32,
    pub pid: u32,
    pub ctx: u32,
    pub module: u32,
    pub name: String,
}

/// The modules section: the last ids handed out, the modules, the bindings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModulesRecord {
    pub last_module: u32,
    pub last_function: u32,
    pub modules: Vec<ModuleRecord>,
    pub functions: Vec<FunctionRecord>,
}

/// A full device state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceState {
    pub vm: VmRecord,
    pub contexts: Vec<ContextRecord>,
    pub mems: Vec<MemRecord>,
    pub mappings: Vec<MappingRecord>,
    pub channels: Vec<ChannelRecord>,
    pub events: Vec<Event>,
    /// Empty in streams before version 3.
    pub modules: ModulesRecord,
}

/// A tail: the guest's final GP_PUT per channel, read by the source after the destination
/// took over the BAR (for frontends whose guest kept running during the transfer).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TailState {
    /// (channel id, GP_PUT).
    pub puts: Vec<(u32, u32)>,
}

// ---- CRC-32 (IEEE 802.3, reflected, as zlib) -------------------------------------------

/// Slicing-by-8 tables: `T[0]` is the classic byte table, `T[k][b]` the CRC of byte `b`
/// followed by `k` zero bytes (eight bytes per step instead of one: the streams carry
/// gigabytes of VRAM).
const fn crc_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut k = 1;
        while k < 8 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            k += 1;
        }
        i += 1;
    }
    t
}

static CRC_TABLES: [[u32; 256]; 8] = crc_tables();

/// CRC-32 of `data` (the checksum of zlib and Ethernet).
pub fn crc32(data: &[u8]) -> u32 {
    let t = &CRC_TABLES;
    let mut c = !0u32;
    let mut blocks = data.chunks_exact(8);
    for b in &mut blocks {
        let lo = c ^ u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        c = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][b[4] as usize]
            ^ t[2][b[5] as usize]
            ^ t[1][b[6] as usize]
            ^ t[0][b[7] as usize];
    }
    for &b in blocks.remainder() {
        c = t[0][((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

// ---- writing ----------------------------------------------------------------------------

struct Writer {
    buf: Vec<u8>,
    section_at: usize,
}

impl Writer {
    fn new() -> Self {
        Writer {
            buf: vec![0; HEADER_SIZE],
            section_at: 0,
        }
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn begin(&mut self, s: Section) {
        self.u32(s as u32);
        self.section_at = self.buf.len();
        self.u64(0);
    }
    fn end(&mut self) {
        let len = (self.buf.len() - self.section_at - 8) as u64;
        self.buf[self.section_at..self.section_at + 8].copy_from_slice(&len.to_le_bytes());
    }
    fn finish(mut self, kind: u32) -> Vec<u8> {
        let body_len = (self.buf.len() - HEADER_SIZE) as u64;
        let crc = crc32(&self.buf[HEADER_SIZE..]);
        let h = &mut self.buf[..HEADER_SIZE];
        h[0..8].copy_from_slice(&STATE_MAGIC);
        h[8..12].copy_from_slice(&STATE_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&kind.to_le_bytes());
        h[16..24].copy_from_slice(&body_len.to_le_bytes());
        h[24..28].copy_from_slice(&crc.to_le_bytes());
        self.buf
    }
}

impl DeviceState {
    /// The stream of this state (header included).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.begin(Section::Vm);
        w.u32(self.vm.weight);
        w.u64(self.vm.vram_quota);
        w.u32(self.vm.last_context);
        w.u32(self.vm.last_mem);
        w.u32(self.vm.last_channel);
        w.end();

        encode_contexts(&mut w, &self.contexts);
        encode_mems(&mut w, &self.mems);

        w.begin(Section::Mappings);
        w.u32(self.mappings.len() as u32);
        for m in &self.mappings {
            w.u32(m.ctx);
            w.u64(m.va);
            w.u32(m.pid);
            w.u64(m.size);
            w.u32(m.page);
            w.u32(m.flags);
            match &m.target {
                MappingTargetRecord::Vram { mem } => {
                    w.u32(0);
                    w.u32(*mem);
                }
                MappingTargetRecord::Guest { ranges } => {
                    w.u32(1);
                    w.u32(ranges.len() as u32);
                    for (gpa, len) in ranges {
                        w.u64(*gpa);
                        w.u64(*len);
                    }
                }
            }
        }
        w.end();

        w.begin(Section::Channels);
        w.u32(self.channels.len() as u32);
        for c in &self.channels {
            w.u32(c.id);
            w.u32(c.pid);
            w.u32(c.ctx);
            w.u32(c.slot);
            w.u64(c.gp_ring_va);
            w.u32(c.gp_entries);
            w.u32(c.gp_get);
            w.u32(c.gp_put);
            w.u32(c.reference);
            w.u32(c.notify_seq);
            let (code, info) = c.error.unwrap_or((0, 0));
            w.u32(code);
            w.u64(info);
        }
        w.end();

        w.begin(Section::Events);
        w.u32(self.events.len() as u32);
        for e in &self.events {
            w.buf.extend_from_slice(&e.encode());
        }
        w.end();
        encode_modules(&mut w, &self.modules);
        w.finish(KIND_FULL)
    }

    /// Decodes a full-state stream (header included, nothing after the body).
    pub fn decode(stream: &[u8]) -> Result<Self, StateError> {
        let (version, body) = check_header(stream, KIND_FULL)?;
        let mut r = Reader { buf: body, pos: 0 };

        let mut s = r.section(Section::Vm)?;
        let vm = VmRecord {
            weight: s.u32()?,
            vram_quota: s.u64()?,
            last_context: s.u32()?,
            last_mem: s.u32()?,
            last_channel: s.u32()?,
        };
        s.done(Section::Vm)?;

        let contexts = decode_contexts(&mut r)?;
        let mems = decode_mems(&mut r, version)?;

        let mut s = r.section(Section::Mappings)?;
        let n = s.count(40)?;
        let mut mappings = Vec::with_capacity(n);
        for _ in 0..n {
            let ctx = s.u32()?;
            let va = s.u64()?;
            let pid = s.u32()?;
            let size = s.u64()?;
            let page = s.u32()?;
            let flags = s.u32()?;
            let target = match s.u32()? {
                0 => MappingTargetRecord::Vram { mem: s.u32()? },
                1 => {
                    let k = s.count(16)?;
                    let mut ranges = Vec::with_capacity(k);
                    for _ in 0..k {
                        ranges.push((s.u64()?, s.u64()?));
                    }
                    MappingTargetRecord::Guest { ranges }
                }
                _ => return Err(invalid(Section::Mappings, "unknown target kind")),
            };
            mappings.push(MappingRecord {
                ctx,
                va,
                pid,
                size,
                page,
                flags,
                target,
            });
        }
        s.done(Section::Mappings)?;

        let mut s = r.section(Section::Channels)?;
        let n = s.count(52)?;
        let mut channels = Vec::with_capacity(n);
        for _ in 0..n {
            let id = s.u32()?;
            let pid = s.u32()?;
            let ctx = s.u32()?;
            let slot = s.u32()?;
            let gp_ring_va = s.u64()?;
            let gp_entries = s.u32()?;
            let gp_get = s.u32()?;
            let gp_put = s.u32()?;
            let reference = s.u32()?;
            let notify_seq = s.u32()?;
            let code = s.u32()?;
            let info = s.u64()?;
            channels.push(ChannelRecord {
                id,
                pid,
                ctx,
                slot,
                gp_ring_va,
                gp_entries,
                gp_get,
                gp_put,
                reference,
                notify_seq,
                error: (code != 0).then_some((code, info)),
            });
        }
        s.done(Section::Channels)?;

        let mut s = r.section(Section::Events)?;
        let n = s.count(EVENT_SIZE)?;
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            let b = s.bytes(EVENT_SIZE as u64)?;
            events.push(Event::decode(b).ok_or(invalid(Section::Events, "bad event"))?);
        }
        s.done(Section::Events)?;
        let modules = if version >= 3 {
            decode_modules(&mut r)?
        } else {
            ModulesRecord::default()
        };
        r.end()?;
        Ok(DeviceState {
            vm,
            contexts,
            mems,
            mappings,
            channels,
            events,
            modules,
        })
    }
}

/// The contexts section.
fn decode_contexts(r: &mut Reader<'_>) -> Result<Vec<ContextRecord>, StateError> {
    let mut s = r.section(Section::Contexts)?;
    let n = s.count(8)?;
    let mut contexts = Vec::with_capacity(n);
    for _ in 0..n {
        contexts.push(ContextRecord {
            id: s.u32()?,
            pid: s.u32()?,
        });
    }
    s.done(Section::Contexts)?;
    Ok(contexts)
}

/// The VRAM objects section; from version 2 an object's contents may be left out
/// (length 0: they travel in chunk frames).
fn decode_mems(r: &mut Reader<'_>, version: u32) -> Result<Vec<MemRecord>, StateError> {
    let mut s = r.section(Section::Mems)?;
    let n = s.count(48)?;
    let mut mems = Vec::with_capacity(n);
    for _ in 0..n {
        let id = s.u32()?;
        let pid = s.u32()?;
        let ctx = s.u32()?;
        let size = s.u64()?;
        let align = s.u64()?;
        let aperture = Some(s.u64()?).filter(|&a| a != u64::MAX);
        let nres = s.count(1)?;
        let resident = s.bytes(nres as u64)?.iter().map(|&b| b != 0).collect();
        let len = s.u64()?;
        let inline_ok = len == size || (version >= 2 && len == 0);
        if !inline_ok {
            return Err(invalid(
                Section::Mems,
                "contents differ from the object size",
            ));
        }
        let data = s.bytes(len)?.to_vec();
        mems.push(MemRecord {
            id,
            pid,
            ctx,
            size,
            align,
            aperture,
            resident,
            data,
        });
    }
    s.done(Section::Mems)?;
    Ok(mems)
}

/// A name as `len: u32` and its bytes.
fn put_name(w: &mut Writer, name: &str) {
    w.u32(name.len() as u32);
    w.buf.extend_from_slice(name.as_bytes());
}

fn encode_modules(w: &mut Writer, m: &ModulesRecord) {
    w.begin(Section::Modules);
    w.u32(m.last_module);
    w.u32(m.last_function);
    w.u32(m.modules.len() as u32);
    for r in &m.modules {
        w.u32(r.id);
        w.u32(r.pid);
        w.u32(r.ctx);
        w.u64(r.image.len() as u64);
        w.buf.extend_from_slice(&r.image);
        w.u32(r.variables.len() as u32);
        for (name, data) in &r.variables {
            put_name(w, name);
            w.u64(data.len() as u64);
            w.buf.extend_from_slice(data);
        }
    }
    w.u32(m.functions.len() as u32);
    for f in &m.functions {
        w.u32(f.id);
        w.u32(f.pid);
        w.u32(f.ctx);
        w.u32(f.module);
        put_name(w, &f.name);
    }
    w.end();
}

/// A name written by [`put_name`]: a valid symbol.
fn name(s: &mut Reader<'_>) -> Result<String, StateError> {
    let len = s.u32()?;
    let b = s.bytes(u64::from(len))?;
    if !crate::module::valid_symbol(b) {
        return Err(invalid(Section::Modules, "bad symbol name"));
    }
    // valid_symbol admits printable ASCII only.
    Ok(b.iter().map(|&c| char::from(c)).collect())
}

fn decode_modules(r: &mut Reader<'_>) -> Result<ModulesRecord, StateError> {
    let mut s = r.section(Section::Modules)?;
    let (last_module, last_function) = (s.u32()?, s.u32()?);
    let n = s.count(24)?;
    let mut modules = Vec::with_capacity(n);
    for _ in 0..n {
        let (id, pid, ctx) = (s.u32()?, s.u32()?, s.u32()?);
        let len = s.u64()?;
        if len == 0 || len > crate::module::MAX_MODULE_BYTES {
            return Err(invalid(Section::Modules, "module image size"));
        }
        let image = s.bytes(len)?.to_vec();
        let k = s.count(12)?;
        let mut variables = Vec::with_capacity(k);
        for _ in 0..k {
            let name = name(&mut s)?;
            let len = s.u64()?;
            variables.push((name, s.bytes(len)?.to_vec()));
        }
        modules.push(ModuleRecord {
            id,
            pid,
            ctx,
            image,
            variables,
        });
    }
    let n = s.count(20)?;
    let mut functions = Vec::with_capacity(n);
    for _ in 0..n {
        let (id, pid, ctx, module) = (s.u32()?, s.u32()?, s.u32()?, s.u32()?);
        functions.push(FunctionRecord {
            id,
            pid,
            ctx,
            module,
            name: name(&mut s)?,
        });
    }
    s.done(Section::Modules)?;
    Ok(ModulesRecord {
        last_module,
        last_function,
        modules,
        functions,
    })
}

fn encode_contexts(w: &mut Writer, contexts: &[ContextRecord]) {
    w.begin(Section::Contexts);
    w.u32(contexts.len() as u32);
    for c in contexts {
        w.u32(c.id);
        w.u32(c.pid);
    }
    w.end();
}

fn encode_mems(w: &mut Writer, mems: &[MemRecord]) {
    w.begin(Section::Mems);
    w.u32(mems.len() as u32);
    for m in mems {
        w.u32(m.id);
        w.u32(m.pid);
        w.u32(m.ctx);
        w.u64(m.size);
        w.u64(m.align);
        w.u64(m.aperture.unwrap_or(u64::MAX));
        w.u32(m.resident.len() as u32);
        w.buf.extend(m.resident.iter().map(|&r| u8::from(r)));
        w.u64(m.data.len() as u64);
        w.buf.extend_from_slice(&m.data);
    }
    w.end();
}

impl TailState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.begin(Section::Puts);
        w.u32(self.puts.len() as u32);
        for (ch, put) in &self.puts {
            w.u32(*ch);
            w.u32(*put);
        }
        w.end();
        w.finish(KIND_TAIL)
    }

    pub fn decode(stream: &[u8]) -> Result<Self, StateError> {
        let (_, body) = check_header(stream, KIND_TAIL)?;
        let mut r = Reader { buf: body, pos: 0 };
        let mut s = r.section(Section::Puts)?;
        let n = s.count(8)?;
        let mut puts = Vec::with_capacity(n);
        for _ in 0..n {
            puts.push((s.u32()?, s.u32()?));
        }
        s.done(Section::Puts)?;
        r.end()?;
        Ok(TailState { puts })
    }
}

/// Any kind of stream (one frame of a pre-copy stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stream {
    Full(DeviceState),
    Tail(TailState),
    Objects(precopy::ObjectsState),
    Chunks(precopy::ChunkFrame),
    Paused(precopy::PauseRecord),
}

impl Stream {
    pub fn decode(stream: &[u8]) -> Result<Self, StateError> {
        match peek_kind(stream)? {
            KIND_FULL => DeviceState::decode(stream).map(Stream::Full),
            KIND_TAIL => TailState::decode(stream).map(Stream::Tail),
            KIND_OBJECTS => precopy::ObjectsState::decode(stream).map(Stream::Objects),
            KIND_CHUNKS => precopy::ChunkFrame::decode(stream).map(Stream::Chunks),
            KIND_PAUSED => precopy::PauseRecord::decode(stream).map(Stream::Paused),
            k => Err(StateError::Kind(k)),
        }
    }

    /// The stream's bytes (header included).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Stream::Full(s) => s.encode(),
            Stream::Tail(s) => s.encode(),
            Stream::Objects(s) => s.encode(),
            Stream::Chunks(s) => s.encode(),
            Stream::Paused(s) => s.encode(),
        }
    }
}

/// The kind of a stream whose header is valid (without checking the body).
pub fn stream_kind(header: &[u8]) -> Result<u32, StateError> {
    peek_kind(header)
}

// ---- reading ----------------------------------------------------------------------------

fn invalid(s: Section, what: &'static str) -> StateError {
    StateError::Invalid {
        section: s as u32,
        what,
    }
}

fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// The header's declared total stream length (header + body), once `HEADER_SIZE` bytes
/// are there: lets a reader stop reading at the end of the stream, and refuse an absurd
/// length before reading it.
pub fn stream_len(header: &[u8]) -> Result<u64, StateError> {
    let h = header_fields(header)?;
    Ok(HEADER_SIZE as u64 + h.2)
}

fn header_fields(stream: &[u8]) -> Result<(u32, u32, u64, u32), StateError> {
    if stream.len() < HEADER_SIZE {
        return Err(StateError::Truncated {
            at: stream.len(),
            needed: (HEADER_SIZE - stream.len()) as u64,
        });
    }
    if stream[0..8] != STATE_MAGIC {
        return Err(StateError::BadMagic);
    }
    let version = le32(&stream[8..]);
    if !(STATE_VERSION_MIN..=STATE_VERSION).contains(&version) {
        return Err(StateError::Version(version));
    }
    let kind = le32(&stream[12..]);
    let known = match version {
        1 => kind == KIND_FULL || kind == KIND_TAIL,
        _ => (KIND_FULL..=KIND_PAUSED).contains(&kind),
    };
    if !known {
        return Err(StateError::Kind(kind));
    }
    let body_len = le64(&stream[16..]);
    if body_len > MAX_BODY {
        return Err(StateError::TooLarge(body_len));
    }
    if le32(&stream[28..]) != 0 {
        return Err(StateError::Invalid {
            section: 0,
            what: "reserved header field is not zero",
        });
    }
    Ok((version, kind, body_len, le32(&stream[24..])))
}

fn peek_kind(stream: &[u8]) -> Result<u32, StateError> {
    header_fields(stream).map(|h| h.1)
}

/// The version and the checked body of a stream of kind `want`.
fn check_header(stream: &[u8], want: u32) -> Result<(u32, &[u8]), StateError> {
    let (version, kind, body_len, crc) = header_fields(stream)?;
    if kind != want {
        return Err(StateError::WrongKind {
            expected: want,
            got: kind,
        });
    }
    let rest = &stream[HEADER_SIZE..];
    if (rest.len() as u64) < body_len {
        return Err(StateError::Truncated {
            at: stream.len(),
            needed: body_len - rest.len() as u64,
        });
    }
    let body_len = body_len as usize;
    if rest.len() > body_len {
        return Err(StateError::Trailing(rest.len() - body_len));
    }
    let actual = crc32(rest);
    if actual != crc {
        return Err(StateError::Checksum {
            expected: crc,
            actual,
        });
    }
    Ok((version, rest))
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: u64) -> Result<&'a [u8], StateError> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(StateError::Truncated {
                at: HEADER_SIZE + self.pos,
                needed: n - left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, StateError> {
        self.bytes(4).map(le32)
    }
    fn u64(&mut self) -> Result<u64, StateError> {
        self.bytes(8).map(le64)
    }
    /// A record count, checked against the bytes left (each record at least `min` bytes),
    /// so that a corrupt count cannot ask for a huge allocation.
    fn count(&mut self, min: usize) -> Result<usize, StateError> {
        let n = self.u32()? as usize;
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(min.max(1)) > left {
            return Err(StateError::Truncated {
                at: HEADER_SIZE + self.pos,
                needed: (n.saturating_mul(min.max(1)) - left) as u64,
            });
        }
        Ok(n)
    }
    /// The next section, which must be `want`.
    fn section(&mut self, want: Section) -> Result<Reader<'a>, StateError> {
        let tag = self.u32()?;
        if tag != want as u32 {
            return Err(StateError::UnexpectedSection {
                expected: want as u32,
                got: tag,
            });
        }
        let len = self.u64()?;
        let body = self.bytes(len)?;
        Ok(Reader { buf: body, pos: 0 })
    }
    fn done(&self, s: Section) -> Result<(), StateError> {
        if self.pos != self.buf.len() {
            return Err(invalid(s, "section longer than its records"));
        }
        Ok(())
    }
    fn end(&self) -> Result<(), StateError> {
        if self.pos != self.buf.len() {
            return Err(StateError::Trailing(self.buf.len() - self.pos));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DeviceState {
        DeviceState {
            vm: VmRecord {
                weight: 300,
                vram_quota: 64 << 20,
                last_context: 3,
                last_mem: 9,
                last_channel: 4,
            },
            contexts: vec![
                ContextRecord { id: 1, pid: 77 },
                ContextRecord { id: 3, pid: 78 },
            ],
            mems: vec![MemRecord {
                id: 9,
                pid: 77,
                ctx: 1,
                size: 8192,
                align: 4096,
                aperture: Some(0x10_0000),
                resident: vec![true],
                data: (0..8192u32).map(|i| (i * 7) as u8).collect(),
            }],
            mappings: vec![
                MappingRecord {
                    ctx: 1,
                    va: 0x1_0000_0000,
                    pid: 77,
                    size: 8192,
                    page: 0,
                    flags: 0,
                    target: MappingTargetRecord::Vram { mem: 9 },
                },
                MappingRecord {
                    ctx: 3,
                    va: 0x2_0000_0000,
                    pid: 78,
                    size: 0x3000,
                    page: 0,
                    flags: 1,
                    target: MappingTargetRecord::Guest {
                        ranges: vec![(0x10000, 0x1000), (0x40000, 0x2000)],
                    },
                },
            ],
            channels: vec![ChannelRecord {
                id: 4,
                pid: 77,
                ctx: 1,
                slot: 2,
                gp_ring_va: 0x2_0000_0000,
                gp_entries: 64,
                gp_get: 0xffff_fff0,
                gp_put: 5,
                reference: 12,
                notify_seq: 3,
                error: Some((7, 0xdead)),
            }],
            events: vec![Event {
                kind: 1,
                channel: 4,
                value: 9,
                info: 0,
            }],
            modules: ModulesRecord {
                last_module: 2,
                last_function: 5,
                modules: vec![ModuleRecord {
                    id: 2,
                    pid: 77,
                    ctx: 1,
                    image: b".version 8.0\n.target sm_90\n".to_vec(),
                    variables: vec![("calls".into(), vec![1, 0, 0, 0]), ("t".into(), vec![])],
                }],
                functions: vec![FunctionRecord {
                    id: 5,
                    pid: 77,
                    ctx: 1,
                    module: 2,
                    name: "_Z4vaddPjS_S_j".into(),
                }],
            },
        }
    }

    /// A version 2 stream (no modules section) decodes with no modules.
    #[test]
    fn a_version_2_stream_has_no_modules() {
        let st = DeviceState {
            modules: ModulesRecord::default(),
            ..sample()
        };
        let mut b = st.encode();
        // The empty modules section is the body's last 28 bytes: tag, length, 16 bytes.
        b.truncate(b.len() - 28);
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        let body_len = (b.len() - HEADER_SIZE) as u64;
        b[16..24].copy_from_slice(&body_len.to_le_bytes());
        let crc = crc32(&b[HEADER_SIZE..]);
        b[24..28].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(DeviceState::decode(&b), Ok(st));
    }

    #[test]
    fn crc_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b""), 0);
        // Every length around the 8-byte steps agrees with the bytewise definition.
        let data: Vec<u8> = (0..100u32).map(|i| (i * 37 + 11) as u8).collect();
        for n in 0..data.len() {
            let mut c = !0u32;
            for &b in &data[..n] {
                c ^= u32::from(b);
                for _ in 0..8 {
                    c = if c & 1 != 0 {
                        0xedb8_8320 ^ (c >> 1)
                    } else {
                        c >> 1
                    };
                }
            }
            assert_eq!(crc32(&data[..n]), !c, "length {n}");
        }
    }

    #[test]
    fn full_and_tail_round_trip() {
        let s = sample();
        let bytes = s.encode();
        assert_eq!(DeviceState::decode(&bytes), Ok(s.clone()));
        assert_eq!(Stream::decode(&bytes), Ok(Stream::Full(s)));
        let empty = DeviceState::default();
        assert_eq!(DeviceState::decode(&empty.encode()), Ok(empty));
        let t = TailState {
            puts: vec![(4, 17), (5, u32::MAX)],
        };
        let tb = t.encode();
        assert_eq!(Stream::decode(&tb), Ok(Stream::Tail(t.clone())));
        assert_eq!(
            DeviceState::decode(&tb),
            Err(StateError::WrongKind {
                expected: KIND_FULL,
                got: KIND_TAIL
            })
        );
        assert_eq!(stream_len(&tb), Ok(tb.len() as u64));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            let e = DeviceState::decode(&bytes[..n]).expect_err("truncated");
            assert!(matches!(e, StateError::Truncated { .. }), "{n}: {e:?}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(DeviceState::decode(&long), Err(StateError::Trailing(1)));
    }

    #[test]
    fn every_flipped_body_bit_fails_the_checksum() {
        let bytes = sample().encode();
        for i in (HEADER_SIZE..bytes.len()).step_by(97) {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(DeviceState::decode(&b), Err(StateError::Checksum { .. })),
                "byte {i}"
            );
        }
    }

    #[test]
    fn header_fields_are_checked() {
        let bytes = sample().encode();
        let mut b = bytes.clone();
        b[0] = b'X';
        assert_eq!(DeviceState::decode(&b), Err(StateError::BadMagic));
        let mut b = bytes.clone();
        b[8] = 4;
        assert_eq!(DeviceState::decode(&b), Err(StateError::Version(4)));
        let mut b = bytes.clone();
        b[12] = 9;
        assert_eq!(Stream::decode(&b), Err(StateError::Kind(9)));
        let mut b = bytes.clone();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(DeviceState::decode(&b), Err(StateError::TooLarge(u64::MAX)));
    }

    /// A body that passes the checksum but lies about its counts is refused without
    /// allocating what it claims.
    #[test]
    fn lying_counts_with_a_valid_checksum_are_refused() {
        let mut w = Writer::new();
        w.begin(Section::Vm);
        for _ in 0..5 {
            w.u32(0);
        }
        w.u32(0); // half of vram_quota: the section is one u32 short
        w.end();
        let b = w.finish(KIND_FULL);
        assert!(DeviceState::decode(&b).is_err());

        let mut w = Writer::new();
        w.begin(Section::Vm);
        w.u32(1);
        w.u64(0);
        w.u32(0);
        w.u32(0);
        w.u32(0);
        w.end();
        w.begin(Section::Contexts);
        w.u32(u32::MAX);
        w.end();
        let b = w.finish(KIND_FULL);
        assert!(matches!(
            DeviceState::decode(&b),
            Err(StateError::Truncated { .. })
        ));
    }
}
