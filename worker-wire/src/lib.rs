//! The messages between `vgpu-backend` and a GPU worker process (issue 30,
//! `docs/design/gpu-workers.md`): the backend's commands, the worker's replies, and the
//! frame both travel in over the worker's unix socket.
//!
//! A worker may have run a guest's own kernel, so the backend decodes its replies as it
//! decodes guest requests: every length, enum value, alignment and bound is checked, a
//! frame is decoded from one copy, and decoding never panics (property tests; fuzzed).
//! The worker decodes commands the same way, though they come from its parent: a bug on
//! either side shows as an error, not as memory corruption.
//!
//! Events (a channel's NOTIFY or fault) travel the other way on a socket of their own,
//! in the same frames; per-channel counters are in a shared page ([`counters`]).
//!
//! Frame: a 16-byte header (magic, version, kind, sequence number, payload length, count
//! of file descriptors sent with it as `SCM_RIGHTS`), then the payload, little-endian
//! fields in a fixed order per kind. Replies carry the sequence number of their command.

mod codec;
pub mod counters;
mod message;

pub use codec::{
    decode_command, decode_event, decode_reply, encode_command, encode_event, encode_reply, Header,
};
pub use message::{Command, Event, Reply, Resume, Target};

use thiserror::Error;

/// The first word of every frame: "VGWK".
pub const MAGIC: u32 = u32::from_le_bytes(*b"VGWK");
/// The wire version this build speaks; a worker of another version is refused.
pub const VERSION: u16 = 2;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 16;
/// The largest payload of any message (commands and replies are small: bulk data moves
/// through shared memory, never the socket; the largest are a symbol name and a
/// function's parameter layout).
pub const MAX_PAYLOAD: usize = 2048;
/// The most file descriptors one frame may carry.
pub const MAX_FDS: u8 = 4;

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("frame of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("bad magic {0:#010x}")]
    Magic(u32),
    #[error("wire version {0}, this side speaks {VERSION}")]
    Version(u16),
    #[error("unknown message kind {0}")]
    Kind(u16),
    #[error("payload of {got} bytes where the header says {said}")]
    Length { said: u32, got: usize },
    #[error("payload of {0} bytes is over the limit")]
    TooLong(u32),
    #[error("kind {kind} carries {want} file descriptor(s), the frame says {got}")]
    Fds { kind: u16, want: u8, got: u8 },
    #[error("payload of kind {kind} is {got} bytes, not {want}")]
    PayloadSize { kind: u16, want: usize, got: usize },
    #[error("field {0} is out of range")]
    Field(&'static str),
}
