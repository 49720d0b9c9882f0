//! A move on a GPU without a CPU view of VRAM (the `cuda` GPU) copies all its chunks in
//! one batched HAL call each way, and the bytes arrive exactly.

use std::sync::Arc;
use std::time::Duration;

use vgpu_host_shim::{CopyDir, Gpu, HostCopy, HostCopyLog, SimConfig, SimGpu};
use vgpu_protocol::request::{Op, ReplyBody, Request};
use vm_memory::GuestAddress;

use crate::guest_mem::GuestMemory;
use crate::shmem::ShmMapper;
use crate::vm::session::{Session, VmLimits};
use crate::vram::backing::Loc;
use crate::vram::handle::Dir;

const MIB: u64 = 1 << 20;

/// Maps nothing (the object has no CPU view to map).
struct NoMaps;

impl ShmMapper for NoMaps {
    fn map(
        &self,
        _: u64,
        _: std::os::fd::RawFd,
        _: u64,
        _: u64,
        _: bool,
    ) -> std::result::Result<(), crate::error::ShmError> {
        panic!("a move without a CPU view mapped one")
    }
    fn unmap(&self, _: u64, _: u64) -> std::result::Result<(), crate::error::ShmError> {
        Ok(())
    }
}

/// The VRAM offsets of object `obj`'s chunks (all resident).
fn vram_chunks(s: &Session, obj: u32) -> Vec<(u64, u64)> {
    s.hal.vram[&obj]
        .chunks
        .iter()
        .map(|c| match c.loc {
            Loc::Vram(o) => (o, c.len),
            Loc::Swap => panic!("chunk at {:#x} is not resident", c.off),
        })
        .collect()
}

#[test]
fn a_move_without_a_cpu_view_copies_every_chunk_in_one_batch_exactly() {
    // The sim without a CPU view of VRAM, recording its host copies.
    let copies = Arc::new(HostCopyLog::default());
    let gpu = SimGpu::new(SimConfig {
        vram_bytes: 32 * MIB,
        hide_vram_view: true,
        host_copy_log: Some(copies.clone()),
        ..SimConfig::default()
    })
    .unwrap();
    let limits = VmLimits {
        swap_bytes: 32 * MIB,
        ..VmLimits::default()
    };
    let mut s = Session::new(gpu.clone(), limits);
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0x10000), 0x10000)]).unwrap();
    let shm = NoMaps;
    let req = |s: &mut Session, ctx: u32, op: Op| {
        s.execute(&Request { pid: 7, ctx, op }, &mem, &shm).unwrap()
    };
    let ReplyBody::Context { ctx, .. } = req(&mut s, 0, Op::CreateContext) else {
        panic!("context");
    };
    // Three chunks, the last one short.
    let ReplyBody::Mem { mem: obj, .. } = req(
        &mut s,
        ctx,
        Op::AllocVram {
            size: 5 * MIB,
            align: 2 * MIB,
        },
    ) else {
        panic!("alloc");
    };
    let pattern = |k: usize, len: u64| -> Vec<u8> {
        (0..len as usize)
            .map(|i| (i.wrapping_mul(31) ^ (k * 0x55)) as u8)
            .collect()
    };
    for (k, (o, len)) in vram_chunks(&s, obj).into_iter().enumerate() {
        gpu.vram_write(o, &pattern(k, len)).unwrap();
    }
    copies.take();
    let t = Duration::from_secs(1);
    let out = s
        .move_chunks(obj, &[0, 1, 2], Dir::Out, &NoMaps, t)
        .unwrap();
    assert_eq!((out.chunks, out.bytes), (3, 5 * MIB));
    let back = s.move_chunks(obj, &[0, 1, 2], Dir::In, &NoMaps, t).unwrap();
    assert_eq!((back.chunks, back.bytes), (3, 5 * MIB));
    let copies = copies.take();
    let batches: Vec<(Dir, usize)> = copies
        .iter()
        .filter_map(|c| match *c {
            HostCopy::Batch(CopyDir::FromVram, n) => Some((Dir::Out, n)),
            HostCopy::Batch(CopyDir::ToVram, n) => Some((Dir::In, n)),
            HostCopy::Single(_) => None,
        })
        .collect();
    assert_eq!(
        batches,
        [(Dir::Out, 3), (Dir::In, 3)],
        "one batched call per move"
    );
    let single = copies
        .iter()
        .filter(|c| matches!(c, HostCopy::Single(_)))
        .count();
    assert_eq!(single, 0);
    // The bytes went out to swap and came back to (new) VRAM unchanged.
    for (k, (o, len)) in vram_chunks(&s, obj).into_iter().enumerate() {
        let mut got = vec![0u8; len as usize];
        gpu.vram_read(o, &mut got).unwrap();
        assert!(
            got == pattern(k, len),
            "chunk {k} differs after a round trip"
        );
    }
}
