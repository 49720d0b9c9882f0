//! Guest modules through the runtime's API on the native transport: the fake `cuda` GPU
//! as a GPU worker sets it up (it loads guest modules), the test PTX of
//! `host-shim/tests/data/test_module.ptx`, buffers of both kinds as relocated arguments.

use std::sync::Arc;

use vgpu_guest::{Arg, Device, Error, ErrorCode};
use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice};
use vgpu_host_shim::hal::Gpu;

const PTX: &str = include_str!("../../../host-shim/tests/data/test_module.ptx");

fn device(guest_modules: bool) -> Device {
    let gpu: Arc<dyn Gpu> = FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 << 20,
            guest_modules,
            ..CudaConfig::default()
        },
    )
    .expect("fake cuda GPU");
    Device::native(gpu).expect("native device")
}

#[test]
fn a_vector_add_and_a_global_through_the_runtime() {
    let dev = device(true);
    let ctx = dev.create_context().unwrap();
    let m = ctx.load_module(PTX.as_bytes()).unwrap();
    let vadd = m.function("vgpu_test_vadd_u32").unwrap();
    const N: u32 = 3000;
    let bytes = u64::from(N) * 4;
    // One operand in VRAM (staged: the CPU cannot map it), two in host memory.
    let (a, b, c) = (
        ctx.alloc_vram(bytes).unwrap(),
        ctx.alloc_host(bytes).unwrap(),
        ctx.alloc_host(bytes).unwrap(),
    );
    let va: Vec<u32> = (0..N).map(|i| i * 5).collect();
    let vb: Vec<u32> = (0..N).map(|i| u32::MAX - i).collect();
    a.write_u32(0, &va).unwrap();
    b.write_u32(0, &vb).unwrap();
    let mut ch = ctx.create_channel().unwrap();
    let args = [
        Arg::Buffer(&a, false),
        Arg::Buffer(&b, false),
        Arg::Buffer(&c, true),
        Arg::U32(N),
    ];
    ch.launch_function(&vadd, [N.div_ceil(128), 1, 1], [128, 1, 1], &args)
        .unwrap();
    let f = ch.submit().unwrap();
    ch.wait(f).unwrap();
    let want: Vec<u32> = va
        .iter()
        .zip(&vb)
        .map(|(x, y)| x.wrapping_add(*y))
        .collect();
    assert_eq!(c.read_u32_vec(0, N as usize).unwrap(), want);

    let g = m.global("vgpu_test_counter").unwrap();
    let (set, copy) = (
        m.function("vgpu_test_set_global").unwrap(),
        m.function("vgpu_test_copy_u32").unwrap(),
    );
    ch.launch_function(&set, [1, 1, 1], [1, 1, 1], &[Arg::U32(41)])
        .unwrap();
    ch.launch_function(
        &copy,
        [1, 1, 1],
        [1, 1, 1],
        &[Arg::Buffer(&c, true), Arg::U64(g.addr), Arg::U32(1)],
    )
    .unwrap();
    let f = ch.submit().unwrap();
    ch.wait(f).unwrap();
    assert_eq!(c.read_u32_vec(0, 1).unwrap(), [41]);
    // Arguments that do not fit the layout never reach the GPU.
    assert!(matches!(
        ch.launch_function(&vadd, [1, 1, 1], [1, 1, 1], &[Arg::U32(1)]),
        Err(Error::InvalidArgument(_))
    ));
    m.unload().unwrap();
}

#[test]
fn a_gpu_shared_by_every_vm_refuses_modules() {
    let dev = device(false);
    let ctx = dev.create_context().unwrap();
    match ctx.load_module(PTX.as_bytes()) {
        Err(Error::Hal(e)) => assert_eq!(e.code(), ErrorCode::ModulesNeedWorker),
        other => panic!("{other:?}"),
    }
}
