//! Version 2 of the device-state stream: VRAM pre-copy. One `SAVE` transfer is a
//! sequence of frames, each a complete stream (header, CRC, sections):
//!
//! 1. [`ObjectsState`] (kind 3): the VM's contexts and VRAM objects without contents,
//!    written while its channels still run (the rings are stopped, so no object is
//!    created or freed meanwhile);
//! 2. [`ChunkFrame`]s (kind 4) of round 1, 2, …: VRAM chunks (2 MiB, the last of an
//!    object shorter) — round 1 all of them, later rounds those written since;
//! 3. [`PauseRecord`] (kind 5): the source paused and drained the channels;
//! 4. the last round's [`ChunkFrame`]s (`last` set): what changed since;
//! 5. the [`DeviceState`](super::DeviceState) (kind 1) with every object's contents left
//!    out (they arrived in the chunk frames).
//!
//! A reader applies frames in order; a frame out of this order is refused by the
//! backend that reads it.

use super::{
    check_header, decode_contexts, decode_mems, encode_contexts, encode_mems, invalid,
    ContextRecord, MemRecord, Reader, Section, StateError, Writer, KIND_CHUNKS, KIND_OBJECTS,
    KIND_PAUSED,
};

/// Size of a VRAM chunk in a chunk frame (the last chunk of an object may be shorter).
pub const STATE_CHUNK: u64 = 2 << 20;

/// Kind 3: what exists, before any contents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectsState {
    pub contexts: Vec<ContextRecord>,
    /// Objects with empty `data`.
    pub mems: Vec<MemRecord>,
}

/// One chunk's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRecord {
    pub mem: u32,
    /// Chunk index in the object (offset / [`STATE_CHUNK`]).
    pub index: u32,
    /// The chunk's bytes: [`STATE_CHUNK`], or less for an object's last chunk.
    pub data: Vec<u8>,
}

/// Kind 4: a piece of one round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChunkFrame {
    /// 1 for the first round (every chunk), counting up.
    pub round: u32,
    /// Whether this is the round after the pause (the VM is paused; nothing changes).
    pub last: bool,
    pub chunks: Vec<ChunkRecord>,
}

/// Kind 5: the source paused the VM's channels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PauseRecord {
    /// When the pause began (CLOCK_REALTIME, ns since the Unix epoch): lets a frontend
    /// on the same host measure the guest-visible pause up to the destination's resume.
    pub paused_unix_ns: u64,
    /// How long the drain took.
    pub drain_ns: u64,
}

impl ObjectsState {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        encode_contexts(&mut w, &self.contexts);
        encode_mems(&mut w, &self.mems);
        w.finish(KIND_OBJECTS)
    }

    pub fn decode(stream: &[u8]) -> Result<Self, StateError> {
        let (version, body) = check_header(stream, KIND_OBJECTS)?;
        let mut r = Reader { buf: body, pos: 0 };
        let contexts = decode_contexts(&mut r)?;
        let mems = decode_mems(&mut r, version)?;
        r.end()?;
        if mems.iter().any(|m| !m.data.is_empty()) {
            return Err(invalid(Section::Mems, "contents in an objects frame"));
        }
        Ok(ObjectsState { contexts, mems })
    }
}

impl ChunkFrame {
    /// Bytes of chunk contents in this frame.
    pub fn data_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.data.len() as u64).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.begin(Section::Round);
        w.u32(self.round);
        w.u32(u32::from(self.last));
        w.end();
        w.begin(Section::Chunks);
        w.u32(self.chunks.len() as u32);
        for c in &self.chunks {
            w.u32(c.mem);
            w.u32(c.index);
            w.u64(c.data.len() as u64);
            w.buf.extend_from_slice(&c.data);
        }
        w.end();
        w.finish(KIND_CHUNKS)
    }

    pub fn decode(stream: &[u8]) -> Result<Self, StateError> {
        let (_, body) = check_header(stream, KIND_CHUNKS)?;
        let mut r = Reader { buf: body, pos: 0 };
        let mut s = r.section(Section::Round)?;
        let round = s.u32()?;
        let last = match s.u32()? {
            0 => false,
            1 => true,
            _ => return Err(invalid(Section::Round, "last is neither 0 nor 1")),
        };
        s.done(Section::Round)?;
        if round == 0 {
            return Err(invalid(Section::Round, "round 0"));
        }
        let mut s = r.section(Section::Chunks)?;
        let n = s.count(17)?;
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            let mem = s.u32()?;
            let index = s.u32()?;
            let len = s.u64()?;
            if len == 0 || len > STATE_CHUNK {
                return Err(invalid(Section::Chunks, "chunk length out of range"));
            }
            let data = s.bytes(len)?.to_vec();
            chunks.push(ChunkRecord { mem, index, data });
        }
        s.done(Section::Chunks)?;
        r.end()?;
        Ok(ChunkFrame {
            round,
            last,
            chunks,
        })
    }

    /// The round, `last` flag and chunk bytes of a chunk frame, read from its first bytes
    /// without checking the body (a frontend's progress figures; the destination checks).
    pub fn peek(stream: &[u8]) -> Option<(u32, bool)> {
        let body = stream.get(super::HEADER_SIZE..)?;
        let tag = u32::from_le_bytes(body.get(0..4)?.try_into().ok()?);
        if tag != Section::Round as u32 {
            return None;
        }
        let round = u32::from_le_bytes(body.get(12..16)?.try_into().ok()?);
        let last = u32::from_le_bytes(body.get(16..20)?.try_into().ok()?) == 1;
        Some((round, last))
    }
}

impl PauseRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.begin(Section::Pause);
        w.u64(self.paused_unix_ns);
        w.u64(self.drain_ns);
        w.end();
        w.finish(KIND_PAUSED)
    }

    pub fn decode(stream: &[u8]) -> Result<Self, StateError> {
        let (_, body) = check_header(stream, KIND_PAUSED)?;
        let mut r = Reader { buf: body, pos: 0 };
        let mut s = r.section(Section::Pause)?;
        let rec = PauseRecord {
            paused_unix_ns: s.u64()?,
            drain_ns: s.u64()?,
        };
        s.done(Section::Pause)?;
        r.end()?;
        Ok(rec)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{stream_len, Stream, HEADER_SIZE};
    use super::*;

    fn objects() -> ObjectsState {
        ObjectsState {
            contexts: vec![ContextRecord { id: 1, pid: 7 }],
            mems: vec![MemRecord {
                id: 2,
                pid: 7,
                ctx: 1,
                size: 3 << 20,
                align: 4096,
                aperture: None,
                resident: vec![true, false],
                data: Vec::new(),
            }],
        }
    }

    fn chunks() -> ChunkFrame {
        ChunkFrame {
            round: 2,
            last: true,
            chunks: vec![
                ChunkRecord {
                    mem: 2,
                    index: 1,
                    data: (0..(1u32 << 20)).map(|i| (i * 3) as u8).collect(),
                },
                ChunkRecord {
                    mem: 2,
                    index: 0,
                    data: vec![9; 4096],
                },
            ],
        }
    }

    #[test]
    fn precopy_frames_round_trip() {
        let frames = [
            Stream::Objects(objects()),
            Stream::Chunks(chunks()),
            Stream::Paused(PauseRecord {
                paused_unix_ns: 1_700_000_000_000_000_000,
                drain_ns: 12_345,
            }),
        ];
        for f in frames {
            let b = f.encode();
            assert_eq!(stream_len(&b), Ok(b.len() as u64));
            assert_eq!(Stream::decode(&b), Ok(f));
        }
        assert_eq!(ChunkFrame::peek(&chunks().encode()), Some((2, true)));
    }

    #[test]
    fn every_truncation_of_a_chunk_frame_is_an_error() {
        let mut f = chunks();
        f.chunks[0].data.truncate(300);
        let b = f.encode();
        for n in 0..b.len() {
            assert!(Stream::decode(&b[..n]).is_err(), "{n}");
        }
    }

    #[test]
    fn bad_chunk_records_are_refused() {
        let mut w = Writer::new();
        w.begin(Section::Round);
        w.u32(1);
        w.u32(0);
        w.end();
        w.begin(Section::Chunks);
        w.u32(1);
        w.u32(2);
        w.u32(0);
        w.u64(STATE_CHUNK + 1);
        w.buf.extend_from_slice(&[0; 64]);
        w.end();
        let b = w.finish(KIND_CHUNKS);
        assert_eq!(
            ChunkFrame::decode(&b),
            Err(invalid(Section::Chunks, "chunk length out of range"))
        );
        let mut w = Writer::new();
        w.begin(Section::Round);
        w.u32(0);
        w.u32(0);
        w.end();
        w.begin(Section::Chunks);
        w.u32(0);
        w.end();
        let b = w.finish(KIND_CHUNKS);
        assert_eq!(
            ChunkFrame::decode(&b),
            Err(invalid(Section::Round, "round 0"))
        );
        let mut o = objects();
        o.mems[0].data = vec![0; 3 << 20];
        assert!(ObjectsState::decode(&o.encode()).is_err());
    }

    #[test]
    fn version_1_streams_have_no_precopy_kinds() {
        let mut b = chunks().encode();
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(Stream::decode(&b), Err(StateError::Kind(KIND_CHUNKS)));
        assert!(b.len() > HEADER_SIZE);
    }
}
