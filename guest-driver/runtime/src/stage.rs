//! CPU access to VRAM the CPU cannot map: copy-engine DMA through a buffer in guest RAM.
//!
//! Each context makes one `Stager` when a buffer first needs it: a channel of its own
//! and a staging buffer of two halves, so the CPU fills (or drains) one half while the
//! copy engine moves the other. The copies are ordinary GPU work on an ordinary channel:
//! the scheduler accounts and throttles them like any other.

use std::sync::Arc;

use vgpu_protocol::mem::PageSize;

use crate::buffer::Buffer;
use crate::channel::{Channel, ChannelOptions, Fence};
use crate::context::{CtxInner, CtxLink};
use crate::error::Result;
use crate::transport::MemKind;

/// Bytes moved per copy (one half of the staging buffer).
pub(crate) const PIECE: usize = 8 << 20;

pub(crate) struct Stager {
    ch: Channel,
    buf: Buffer,
}

impl Stager {
    pub(crate) fn new(ctx: &Arc<CtxInner>) -> Result<Self> {
        let link = CtxLink::owned_by(ctx);
        let buf = Buffer::new(
            ctx,
            link.clone(),
            MemKind::Host,
            2 * PIECE as u64,
            PageSize::Huge2M,
        )?;
        let ch = Channel::with_link(ctx, link, ChannelOptions::default())?;
        Ok(Stager { ch, buf })
    }

    fn half(&self, i: usize) -> (u64, u64) {
        let off = (i % 2 * PIECE) as u64;
        (off, self.buf.gpu_va() + off)
    }

    /// Copies `data` to GPU address `dst`; the bytes are there when this returns.
    pub(crate) fn write(&mut self, dst: u64, data: &[u8]) -> Result<()> {
        let mut fences: [Option<Fence>; 2] = [None, None];
        for (i, piece) in data.chunks(PIECE).enumerate() {
            if let Some(f) = fences[i % 2].take() {
                self.ch.wait(f)?;
            }
            let (off, va) = self.half(i);
            self.buf.write(off, piece)?;
            self.ch
                .copy(dst + (i * PIECE) as u64, va, piece.len() as u64)?;
            fences[i % 2] = Some(self.ch.submit()?);
        }
        for f in fences.into_iter().flatten() {
            self.ch.wait(f)?;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes from GPU address `src` into `out`.
    pub(crate) fn read(&mut self, src: u64, out: &mut [u8]) -> Result<()> {
        let total = out.len();
        let pieces = total.div_ceil(PIECE);
        let span = |i: usize| (i * PIECE, PIECE.min(total - i * PIECE));
        // One piece in flight ahead of the one being drained.
        let mut next = None;
        for i in 0..pieces {
            if i == 0 {
                next = Some(self.issue_read(src, span(0), 0)?);
            }
            let fence = next.take();
            if i + 1 < pieces {
                next = Some(self.issue_read(src, span(i + 1), i + 1)?);
            }
            if let Some(f) = fence {
                self.ch.wait(f)?;
            }
            let (at, n) = span(i);
            self.buf.read(self.half(i).0, &mut out[at..at + n])?;
        }
        Ok(())
    }

    /// Submits the copy of piece `(at, n)` of a read from `src` into half `i % 2`.
    fn issue_read(&mut self, src: u64, (at, n): (usize, usize), i: usize) -> Result<Fence> {
        let va = self.half(i).1;
        self.ch.copy(va, src + at as u64, n as u64)?;
        self.ch.submit()
    }
}
