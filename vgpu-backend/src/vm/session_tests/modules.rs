//! Guest modules: the requests, their checks, and their migration.

use super::*;
use vgpu_protocol::request::GlobalCopy;

/// The fake cuda GPU set up as a worker sets it up: guest modules load.
fn module_gpu() -> Arc<vgpu_host_shim::cuda::FakeCudaGpu> {
    use vgpu_host_shim::cuda::{CudaConfig, FakeCudaGpu, FakeDevice};
    FakeCudaGpu::with_device(
        Arc::new(FakeDevice::default()),
        CudaConfig {
            vram_bytes: 64 * MIB,
            guest_modules: true,
            ..CudaConfig::default()
        },
    )
    .unwrap()
}

/// The module requests on a GPU that loads guest modules (the fake cuda GPU as a worker
/// sets it up), one request at a time: the image is read from guest RAM, ids are fresh,
/// ownership and limits are checked, a destroyed context takes its modules, and a live
/// migration carries the modules, their variables and bindings.
#[test]
fn module_requests_check_everything_and_migrate() {
    use vgpu_protocol::migration::VmRecord;
    let mut s = Session::new(module_gpu(), limits());
    let (mem, shm) = (guest_mem(), FakeShm::default());
    let req = |s: &mut Session, pid, ctx, op| {
        let r = Request { pid, ctx, op };
        decode_reply(r.opcode(), &s.handle(&r.encode(), &mem, &shm)).unwrap()
    };
    let ptx = b".version 7.0\n.target sm_50\n.global .u32 g;\n.entry k(\n.param .u64 p,\n.param .u32 n\n)\n{\nret;\n}\n";
    // The image spans two guest RAM regions, in order.
    let (head, tail) = ptx.split_at(40);
    use vm_memory::Bytes;
    mem.write_slice(head, GuestAddress(R0.0 + 0x1000)).unwrap();
    mem.write_slice(tail, GuestAddress(R1.0)).unwrap();
    let ranges = vec![
        range(R0.0 + 0x1000, head.len() as u64),
        range(R1.0, tail.len() as u64),
    ];
    let Ok(ReplyBody::Context { ctx, .. }) = req(&mut s, 7, 0, Op::CreateContext) else {
        panic!("no context");
    };
    // Ownership before anything is read: another process, an unknown context.
    let load = |ranges: &Vec<GuestRange>| Op::ModuleLoad {
        ranges: ranges.clone(),
    };
    assert_eq!(
        req(&mut s, 8, ctx, load(&ranges)),
        Err(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        req(&mut s, 7, ctx + 1, load(&ranges)),
        Err(ErrorCode::NotFound)
    );
    // A range outside guest RAM.
    let outside = vec![range(3 << 30, 4096)];
    assert_eq!(
        req(&mut s, 7, ctx, load(&outside)),
        Err(ErrorCode::InvalidArgument)
    );
    let Ok(ReplyBody::Module { module }) = req(&mut s, 7, ctx, load(&ranges)) else {
        panic!("the module loads");
    };
    assert_ne!(module, 0);
    // What the guest writes there afterwards changes nothing (read once).
    mem.write_slice(&[0xff; 16], GuestAddress(R0.0 + 0x1000))
        .unwrap();
    let get = |module, name: &[u8]| Op::FunctionGet {
        module,
        name: name.to_vec(),
    };
    let Ok(ReplyBody::Function(f)) = req(&mut s, 7, ctx, get(module, b"k")) else {
        panic!("function k");
    };
    let layout: Vec<(u32, u32)> = f
        .params
        .unwrap()
        .iter()
        .map(|p| (p.offset, p.size))
        .collect();
    assert_eq!(layout, [(0, 8), (8, 4)]);
    assert_eq!(
        req(&mut s, 7, ctx, get(module, b"nope")),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        req(&mut s, 7, ctx, get(module + 1, b"k")),
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        req(&mut s, 8, ctx, get(module, b"k")),
        Err(ErrorCode::PermissionDenied)
    );
    let Ok(ReplyBody::Global { size, .. }) = req(
        &mut s,
        7,
        ctx,
        Op::GlobalGet {
            module,
            name: b"g".to_vec(),
        },
    ) else {
        panic!("global g");
    };
    assert_eq!(size, 4);
    // A migration carries the module, its variable's contents and the binding: the
    // destination has them at the same ids.
    let hctx = s.hal.contexts[&ctx].0;
    s.gpu
        .global_write(hctx, module, "g", 0, &0x1234_5678u32.to_le_bytes())
        .unwrap();
    s.hold.paused = true;
    let st = s.save_device_state(VmRecord::default()).unwrap();
    let st = vgpu_protocol::migration::DeviceState::decode(&st.encode()).unwrap();
    assert_eq!(st.modules.modules.len(), 1);
    assert_eq!(
        st.modules.modules[0].variables,
        [("g".to_string(), 0x1234_5678u32.to_le_bytes().to_vec())]
    );
    assert_eq!(st.modules.functions[0].name, "k");
    s.hold.paused = false;
    let mut d = Session::new(module_gpu(), limits());
    d.load_device_state(&st, &mem, &shm).unwrap();
    assert_eq!(
        d.state.modules.keys().copied().collect::<Vec<_>>(),
        [module]
    );
    assert_eq!(
        d.state.modules[&module].image,
        s.state.modules[&module].image
    );
    assert_eq!(d.state.functions, s.state.functions);
    let dctx = d.hal.contexts[&ctx].0;
    let mut got = [0u8; 4];
    d.gpu.global_read(dctx, module, "g", 0, &mut got).unwrap();
    assert_eq!(u32::from_le_bytes(got), 0x1234_5678);
    // Fresh ids on the destination continue after the source's.
    d.hold.paused = false;
    let Ok(ReplyBody::Function(f2)) = req(&mut d, 7, ctx, get(module, b"k")) else {
        panic!("k again on the destination");
    };
    assert!(f2.function > st.modules.functions[0].id);
    // Unload, then again: gone.
    assert_eq!(
        req(&mut s, 7, ctx, Op::ModuleUnload { module }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        req(&mut s, 7, ctx, Op::ModuleUnload { module }),
        Err(ErrorCode::NotFound)
    );
    assert!(s.state.functions.is_empty());
    // The overwritten image no longer loads; restored, it does.
    assert_eq!(
        req(&mut s, 7, ctx, load(&ranges)),
        Err(ErrorCode::BadModule)
    );
    mem.write_slice(head, GuestAddress(R0.0 + 0x1000)).unwrap();
    // A destroyed context takes its modules; ids are not reused.
    let Ok(ReplyBody::Module { module: m2 }) = req(&mut s, 7, ctx, load(&ranges)) else {
        panic!("loads again");
    };
    assert_ne!(m2, module);
    req(&mut s, 7, ctx, Op::DestroyContext).unwrap();
    assert!(s.state.modules.is_empty());
    s.hold.paused = true;
    assert!(s.save_device_state(VmRecord::default()).is_ok());
}

/// A fatbin nvcc packed with LZ4 (`--compress-mode=speed -Xfatbin -compress-all`, as
/// older nvcc did by default) migrates with its variable: the source lists it from the
/// unpacked image, the destination gets its contents.
#[test]
fn an_lz4_packed_fatbins_variable_migrates() {
    use vgpu_protocol::migration::VmRecord;
    use vm_memory::Bytes;
    let image = include_bytes!("../../../../protocol/tests/data/matmul_sm75_lz4.fatbin");
    let mut s = Session::new(module_gpu(), limits());
    let (mem, shm) = (guest_mem(), FakeShm::default());
    let req = |s: &mut Session, ctx, op| {
        let r = Request { pid: 7, ctx, op };
        decode_reply(r.opcode(), &s.handle(&r.encode(), &mem, &shm)).unwrap()
    };
    mem.write_slice(image, GuestAddress(R0.0 + 0x1000)).unwrap();
    let Ok(ReplyBody::Context { ctx, .. }) = req(&mut s, 0, Op::CreateContext) else {
        panic!("no context");
    };
    let load = Op::ModuleLoad {
        ranges: vec![range(R0.0 + 0x1000, image.len() as u64)],
    };
    let Ok(ReplyBody::Module { module }) = req(&mut s, ctx, load) else {
        panic!("the fatbin loads");
    };
    let hctx = s.hal.contexts[&ctx].0;
    s.gpu
        .global_write(hctx, module, "calls", 0, &41u32.to_le_bytes())
        .unwrap();
    s.hold.paused = true;
    let st = s.save_device_state(VmRecord::default()).unwrap();
    assert_eq!(
        st.modules.modules[0].variables,
        [("calls".to_string(), 41u32.to_le_bytes().to_vec())]
    );
    let mut d = Session::new(module_gpu(), limits());
    d.load_device_state(&st, &mem, &shm).unwrap();
    let mut got = [0u8; 4];
    d.gpu
        .global_read(d.hal.contexts[&ctx].0, module, "calls", 0, &mut got)
        .unwrap();
    assert_eq!(u32::from_le_bytes(got), 41);
}

#[test]
fn the_sim_refuses_module_loads_with_its_code() {
    let mut t = T::new();
    let ctx = t.ctx(1);
    let r = t.req(
        1,
        ctx,
        Op::ModuleLoad {
            ranges: vec![range(R0.0, 64)],
        },
    );
    assert_eq!(r, Err(ErrorCode::ModulesNeedCudaGpu));
    assert!(t.s.state.modules.is_empty());
}

/// GLOBAL_WRITE and GLOBAL_READ (`cuMemcpyHtoD`/`DtoH` at a global's address): guest RAM
/// to the variable and back, split over ranges; arguments, then ownership, then the
/// variable's bounds are checked before anything moves, and a refused copy changes
/// nothing.
#[test]
fn global_copies_move_guest_ram_to_a_variable_and_back() {
    use vm_memory::Bytes;
    let mut s = Session::new(module_gpu(), limits());
    let (mem, shm) = (guest_mem(), FakeShm::default());
    let req = |s: &mut Session, pid, ctx, op| {
        let r = Request { pid, ctx, op };
        decode_reply(r.opcode(), &s.handle(&r.encode(), &mem, &shm)).unwrap()
    };
    let ptx = b".version 7.0\n.target sm_50\n.global .align 4 .b8 table[16];\n";
    mem.write_slice(ptx, GuestAddress(R0.0 + 0x1000)).unwrap();
    let Ok(ReplyBody::Context { ctx, .. }) = req(&mut s, 7, 0, Op::CreateContext) else {
        panic!("no context");
    };
    let load = Op::ModuleLoad {
        ranges: vec![range(R0.0 + 0x1000, ptx.len() as u64)],
    };
    let Ok(ReplyBody::Module { module }) = req(&mut s, 7, ctx, load) else {
        panic!("the module loads");
    };
    let copy = |name: &[u8], offset, ranges: Vec<GuestRange>| GlobalCopy {
        module,
        name: name.to_vec(),
        offset,
        ranges,
    };
    // 12 bytes from two guest RAM regions to bytes 4..16 of the table.
    let src: Vec<u8> = (1..=12).collect();
    mem.write_slice(&src[..5], GuestAddress(R0.0 + 0x3000))
        .unwrap();
    mem.write_slice(&src[5..], GuestAddress(R1.0 + 0x100))
        .unwrap();
    let two = vec![range(R0.0 + 0x3000, 5), range(R1.0 + 0x100, 7)];
    assert_eq!(
        req(
            &mut s,
            7,
            ctx,
            Op::GlobalWrite(copy(b"table", 4, two.clone()))
        ),
        Ok(ReplyBody::Empty)
    );
    let hctx = s.hal.contexts[&ctx].0;
    let mut whole = [0u8; 16];
    s.gpu
        .global_read(hctx, module, "table", 0, &mut whole)
        .unwrap();
    assert_eq!(whole[..4], [0; 4]);
    assert_eq!(whole[4..], src[..]);
    // And back, into other guest RAM.
    let dst = vec![range(R0.0 + 0x5000, 16)];
    assert_eq!(
        req(&mut s, 7, ctx, Op::GlobalRead(copy(b"table", 0, dst))),
        Ok(ReplyBody::Empty)
    );
    let mut back = [0u8; 16];
    mem.read_slice(&mut back, GuestAddress(R0.0 + 0x5000))
        .unwrap();
    assert_eq!(back, whole);
    // Refused, each with its code, the variable unchanged: past its end, outside guest
    // RAM, another process, another context, an unknown module or variable, a bad name.
    let refused = [
        (
            7,
            ctx,
            copy(b"table", 5, two.clone()),
            ErrorCode::InvalidArgument,
        ),
        (
            7,
            ctx,
            copy(b"table", u64::MAX - 4, two.clone()),
            ErrorCode::InvalidArgument,
        ),
        (
            7,
            ctx,
            copy(b"table", 0, vec![range(3 << 30, 4)]),
            ErrorCode::InvalidArgument,
        ),
        (
            8,
            ctx,
            copy(b"table", 4, two.clone()),
            ErrorCode::PermissionDenied,
        ),
        (
            7,
            ctx + 1,
            copy(b"table", 4, two.clone()),
            ErrorCode::NotFound,
        ),
        (7, ctx, copy(b"nope", 0, two.clone()), ErrorCode::NotFound),
        (
            7,
            ctx,
            copy(b"a b", 0, two.clone()),
            ErrorCode::InvalidArgument,
        ),
    ];
    mem.write_slice(&[0xee; 12], GuestAddress(R1.0 + 0x100))
        .unwrap();
    for (pid, c, bad, code) in refused {
        // Built in process, past the decoder (a name with a space would not decode).
        let write = Request {
            pid,
            ctx: c,
            op: Op::GlobalWrite(bad.clone()),
        };
        assert_eq!(
            s.execute(&write, &mem, &shm),
            Err(code),
            "{bad:?} by {pid} in {c}"
        );
        let read = Request {
            pid,
            ctx: c,
            op: Op::GlobalRead(bad),
        };
        assert_eq!(s.execute(&read, &mem, &shm), Err(code));
    }
    let mut after = [0u8; 16];
    s.gpu
        .global_read(hctx, module, "table", 0, &mut after)
        .unwrap();
    assert_eq!(after, whole, "refused copies changed nothing");
    // The module gone, its variables go with it.
    assert_eq!(
        req(&mut s, 7, ctx, Op::ModuleUnload { module }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(
        req(&mut s, 7, ctx, Op::GlobalWrite(copy(b"table", 4, two))),
        Err(ErrorCode::NotFound)
    );
}
