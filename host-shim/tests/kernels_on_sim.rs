//! Every builtin kernel, run by the sim through its MMU on system memory and on VRAM,
//! checked against the CPU reference.

mod common;

use common::kernels::*;
use common::*;
use vgpu_host_shim::*;
use vgpu_protocol::KernelArgs;

const VRAM_VA: u64 = 0x30_0000_0000;
const AREA: u64 = 1 << 20;

#[test]
fn every_kernel_on_system_memory() {
    let gpu = gpu();
    let p = Proc::new(&gpu, SYS_BASE);
    let mut ch = p.channel(0);
    run_all(
        &Mem {
            p: &p,
            vram: None,
            va: SYS_VA + DATA_OFF,
        },
        &mut ch,
    );
}

#[test]
fn every_kernel_on_vram() {
    let gpu = gpu();
    let p = Proc::new(&gpu, SYS_BASE);
    let buf2 = gpu.alloc_vram(AREA * 2, 2 << 20).unwrap();
    gpu.map(
        p.ctx,
        VRAM_VA,
        2 << 20,
        MapTarget::Vram {
            offset: buf2.offset,
        },
        PageSize::Huge2M,
        MapFlags::default(),
    )
    .unwrap();
    let mut ch = p.channel(0);
    run_all(
        &Mem {
            p: &p,
            vram: Some(buf2.offset),
            va: VRAM_VA,
        },
        &mut ch,
    );
}

#[test]
fn read_only_pages_fault_kernel_writes() {
    let gpu = gpu();
    let p = Proc::new(&gpu, SYS_BASE);
    let buf = gpu.alloc_vram(1 << 16, 1 << 16).unwrap();
    gpu.map(
        p.ctx,
        VRAM_VA,
        1 << 16,
        MapTarget::Vram { offset: buf.offset },
        PageSize::Big64K,
        MapFlags { read_only: true },
    )
    .unwrap();
    let mut ch = p.channel(0);
    let m = ch.launch(&KernelArgs::Checksum {
        src: VRAM_VA,
        len: 4096,
        dst: SYS_VA + DATA_OFF,
    });
    ch.submit(&[m]);
    ch.wait_idle(T).unwrap();
    let m = ch.launch(&KernelArgs::Memset {
        dst: VRAM_VA + 8,
        len: 8,
        pattern: 1,
    });
    ch.submit(&[m]);
    assert_eq!(ch.wait_idle(T), Err(vgpu_protocol::ErrorCode::MmuFault));
    assert_eq!(
        gpu.channel_error(ch.id).unwrap().map(|e| e.1),
        Some(VRAM_VA + 8)
    );
}
