//! End to end over a real vhost-user socket: a minimal frontend (the vhost crate's
//! `Frontend` plus hand-made split virtqueues) drives the backend through feature
//! negotiation, the config space, the control and event queues, SHMEM_MAP into a fake
//! BAR, disconnect teardown and reconnect.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vgpu_backend::VmLimits;
use vgpu_host_shim::{Gpu, SimConfig, SimGpu};
use vgpu_protocol::device::{
    slot_offset, DeviceConfig, CHANNEL_SLOTS, CONTROL_QUEUE, EVENT_QUEUE, NUM_QUEUES, SHM_SIZE,
};
use vgpu_protocol::request::{decode_reply, event, Event, Op, ReplyBody, Request, EVENT_SIZE};
use vgpu_protocol::{ControlPage, ErrorCode, PROTOCOL_VERSION};
use vgpu_test_support::Host;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserMMap, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{
    Frontend, FrontendReqHandler, HandlerResult, VhostUserFrontend, VhostUserFrontendReqHandler,
};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const QSIZE: u16 = 16;
const MEM_SIZE: usize = 1 << 20;
const VIRTQ_DESC_F_NEXT: u16 = 1;
const VIRTQ_DESC_F_WRITE: u16 = 2;

/// The fake BAR: a reserved address range where SHMEM_MAP places file pages.
struct Bar {
    base: usize,
    maps: AtomicU64,
    unmaps: AtomicU64,
    log: Mutex<Vec<(u64, u64)>>,
}

impl Bar {
    fn new() -> Arc<Self> {
        // SAFETY: a fresh anonymous PROT_NONE reservation; nothing else uses that range.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SHM_SIZE as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Arc::new(Bar {
            base: p as usize,
            maps: AtomicU64::new(0),
            unmaps: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
        })
    }

    fn read_u32(&self, off: u64) -> u32 {
        assert!(off + 4 <= SHM_SIZE);
        // SAFETY: inside the reservation, at a page the backend mapped (tests only read
        // offsets they were told are mapped); volatile since the GPU writes it.
        unsafe { std::ptr::read_volatile((self.base + off as usize) as *const u32) }
    }
}

impl VhostUserFrontendReqHandler for Bar {
    fn shmem_map(&self, req: &VhostUserMMap, fd: &dyn AsRawFd) -> HandlerResult<u64> {
        let (off, len, fd_off, flags) = (req.shm_offset, req.len, req.fd_offset, req.flags);
        if off.checked_add(len).is_none_or(|e| e > SHM_SIZE) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        let prot = if flags & 1 != 0 {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: MAP_FIXED inside our own reservation (checked above) of a file the
        // backend handed us.
        let p = unsafe {
            libc::mmap(
                (self.base + off as usize) as *mut libc::c_void,
                len as usize,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                fd_off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        self.maps.fetch_add(1, Ordering::SeqCst);
        self.log.lock().unwrap().push((off, len));
        Ok(0)
    }

    fn shmem_unmap(&self, req: &VhostUserMMap) -> HandlerResult<u64> {
        let (off, len) = (req.shm_offset, req.len);
        if off.checked_add(len).is_none_or(|e| e > SHM_SIZE) {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: replaces part of our own reservation with inaccessible memory.
        let p = unsafe {
            libc::mmap(
                (self.base + off as usize) as *mut libc::c_void,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        self.unmaps.fetch_add(1, Ordering::SeqCst);
        Ok(0)
    }
}

/// Driver-side view of one split virtqueue in guest memory.
struct Vq {
    desc: u64,
    avail: u64,
    used: u64,
    next_avail: u16,
    last_used: u16,
    next_desc: u16,
    kick: EventFd,
    call: EventFd,
}

impl Vq {
    fn new(base: u64) -> Self {
        Vq {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            next_avail: 0,
            last_used: 0,
            next_desc: 0,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }

    /// Posts a chain of (addr, len, writable) buffers.
    fn post(&mut self, mem: &GuestMemoryMmap, bufs: &[(u64, u32, bool)]) {
        let head = self.next_desc;
        for (i, &(addr, len, w)) in bufs.iter().enumerate() {
            let idx = (self.next_desc + i as u16) % QSIZE;
            let mut flags = if w { VIRTQ_DESC_F_WRITE } else { 0 };
            let next = (idx + 1) % QSIZE;
            if i + 1 < bufs.len() {
                flags |= VIRTQ_DESC_F_NEXT;
            }
            let d = self.desc + 16 * idx as u64;
            mem.write_obj(addr, GuestAddress(d)).unwrap();
            mem.write_obj(len, GuestAddress(d + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
            mem.write_obj(next, GuestAddress(d + 14)).unwrap();
        }
        self.next_desc = (self.next_desc + bufs.len() as u16) % QSIZE;
        let slot = self.next_avail % QSIZE;
        mem.write_obj(head, GuestAddress(self.avail + 4 + 2 * slot as u64))
            .unwrap();
        self.next_avail = self.next_avail.wrapping_add(1);
        std::sync::atomic::fence(Ordering::SeqCst);
        mem.write_obj(self.next_avail, GuestAddress(self.avail + 2))
            .unwrap();
        self.kick.write(1).unwrap();
    }

    /// Waits for the next used element: (id, len).
    fn wait_used(&mut self, mem: &GuestMemoryMmap) -> (u32, u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
            if idx != self.last_used {
                let e = self.used + 4 + 8 * (self.last_used % QSIZE) as u64;
                let id: u32 = mem.read_obj(GuestAddress(e)).unwrap();
                let len: u32 = mem.read_obj(GuestAddress(e + 4)).unwrap();
                self.last_used = self.last_used.wrapping_add(1);
                return (id, len);
            }
            assert!(Instant::now() < deadline, "no used buffer");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct Vm {
    fe: Frontend,
    mem: GuestMemoryMmap,
    ctrl: Vq,
    evq: Vq,
    bar: Arc<Bar>,
    _req_thread: std::thread::JoinHandle<()>,
}

const REQ_BUF: u64 = 0x10000;
const REPLY_BUF: u64 = 0x20000;
const EVENT_BUFS: u64 = 0x30000;

impl Vm {
    fn connect(sock: &std::path::Path, event_idx: bool) -> Vm {
        let path = std::env::temp_dir().join(format!(
            "vgpu-backend-test-mem-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(MEM_SIZE as u64).unwrap();
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            MEM_SIZE,
            Some(FileOffset::new(file, 0)),
        )])
        .unwrap();
        let region = mem.iter().next().unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
        let host = region.as_ptr() as u64;

        let mut fe = Frontend::connect(sock, NUM_QUEUES as u64).unwrap();
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        let mut want = (1u64 << 32) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if event_idx {
            want |= 1 << 29;
        }
        for bit in [32u32, 28, 29, 24] {
            assert_ne!(features & (1 << bit), 0, "virtio feature bit {bit} offered");
        }
        fe.set_features(want).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        let needed = VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::BACKEND_SEND_FD
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::SHMEM
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::MQ;
        assert!(pf.contains(needed), "{pf:?}");
        fe.set_protocol_features(needed).unwrap();
        assert_eq!(fe.get_queue_num().unwrap(), NUM_QUEUES as u64);
        let shm = fe.get_shmem_config().unwrap();
        assert_eq!({ shm.nregions }, 1);
        assert_eq!({ shm.memory_sizes }[0], SHM_SIZE);
        let (_, cfg) = fe
            .get_config(
                0,
                DeviceConfig::SIZE as u32,
                VhostUserConfigFlags::empty(),
                &[0u8; DeviceConfig::SIZE],
            )
            .unwrap();
        let cfg = DeviceConfig::decode(&cfg).unwrap();
        assert_eq!(cfg.version, PROTOCOL_VERSION);
        assert_eq!(cfg.channel_slots, CHANNEL_SLOTS);

        let bar = Bar::new();
        let mut handler = FrontendReqHandler::new(bar.clone()).unwrap();
        handler.set_reply_ack_flag(true);
        fe.set_backend_request_fd(&handler.get_tx_raw_fd()).unwrap();
        let req_thread = std::thread::spawn(move || while handler.handle_request().is_ok() {});

        fe.set_mem_table(&[info]).unwrap();
        let ctrl = Vq::new(0x1000);
        let evq = Vq::new(0x4000);
        for (i, q) in [(CONTROL_QUEUE, &ctrl), (EVENT_QUEUE, &evq)] {
            let i = i as usize;
            fe.set_vring_num(i, QSIZE).unwrap();
            fe.set_vring_addr(
                i,
                &VringConfigData {
                    queue_max_size: QSIZE,
                    queue_size: QSIZE,
                    flags: 0,
                    desc_table_addr: host + q.desc,
                    used_ring_addr: host + q.used,
                    avail_ring_addr: host + q.avail,
                    log_addr: None,
                },
            )
            .unwrap();
            fe.set_vring_base(i, 0).unwrap();
            fe.set_vring_call(i, &q.call).unwrap();
            fe.set_vring_kick(i, &q.kick).unwrap();
            fe.set_vring_enable(i, true).unwrap();
        }
        Vm {
            fe,
            mem,
            ctrl,
            evq,
            bar,
            _req_thread: req_thread,
        }
    }

    fn request(&mut self, pid: u32, ctx: u32, op: Op) -> Result<ReplyBody, ErrorCode> {
        let r = Request { pid, ctx, op };
        let bytes = r.encode();
        self.mem.write_slice(&bytes, GuestAddress(REQ_BUF)).unwrap();
        // Split the request over two descriptors when it is long enough.
        let split = (bytes.len() / 2) as u32;
        let mut bufs = vec![];
        if split > 0 {
            bufs.push((REQ_BUF, split, false));
        }
        bufs.push((REQ_BUF + split as u64, bytes.len() as u32 - split, false));
        bufs.push((REPLY_BUF, 256, true));
        self.ctrl.post(&self.mem, &bufs);
        let (_, len) = self.ctrl.wait_used(&self.mem);
        let mut reply = vec![0u8; len as usize];
        self.mem
            .read_slice(&mut reply, GuestAddress(REPLY_BUF))
            .unwrap();
        decode_reply(r.opcode(), &reply).unwrap()
    }
}

fn rand_suffix() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn end_to_end_over_vhost_user() {
    let _ = env_logger::builder().is_test(true).try_init();
    let sim = SimGpu::new(SimConfig {
        vram_bytes: 64 << 20,
        ..SimConfig::default()
    })
    .unwrap();
    let baseline = sim.stats();
    let host = Host::with_gpu("vhost-user-e2e", sim, VmLimits::default(), &[]);
    let (sim, backend) = (&host.gpu, &host.backend);
    let sock = host.socket("vm0");
    backend.serve_vm("vm0", &sock).unwrap();
    assert_eq!(backend.vm_names(), vec!["vm0".to_string()]);
    assert!(!backend.vm_stats("vm0").unwrap().connected);

    let mut vm = Vm::connect(&sock, false);
    wait_until("connected", || backend.vm_stats("vm0").unwrap().connected);
    match vm.request(7, 0, Op::GetInfo).unwrap() {
        ReplyBody::Info(i) => assert_eq!(i.version, PROTOCOL_VERSION),
        other => panic!("{other:?}"),
    }
    let ctx = match vm.request(7, 0, Op::CreateContext).unwrap() {
        ReplyBody::Context { ctx, .. } => ctx,
        other => panic!("{other:?}"),
    };
    // A malformed request gets an error reply, the connection stays.
    assert_eq!(
        vm.request(
            7,
            ctx,
            Op::AllocVram {
                size: 0,
                align: 4096
            }
        ),
        Err(ErrorCode::InvalidArgument)
    );
    let (channel, slot) = match vm
        .request(
            7,
            ctx,
            Op::CreateChannel {
                gp_ring_va: 0x10000,
                gp_entries: 16,
            },
        )
        .unwrap()
    {
        ReplyBody::Channel { channel, slot } => (channel, slot),
        other => panic!("{other:?}"),
    };
    // The channel's real control page is in the BAR at its slot.
    let page = slot_offset(slot).unwrap();
    assert_eq!(vm.bar.maps.load(Ordering::SeqCst), 1);
    assert_eq!(
        vm.bar.read_u32(page + ControlPage::VERSION as u64),
        PROTOCOL_VERSION
    );
    assert_eq!(vm.bar.read_u32(page + ControlPage::GP_ENTRIES as u64), 16);
    // VRAM through the aperture.
    let mem = match vm
        .request(
            7,
            ctx,
            Op::AllocVram {
                size: 8192,
                align: 4096,
            },
        )
        .unwrap()
    {
        ReplyBody::Mem { mem, .. } => mem,
        other => panic!("{other:?}"),
    };
    let offset = match vm.request(7, ctx, Op::MapAperture { mem }).unwrap() {
        ReplyBody::Aperture { offset } => offset,
        other => panic!("{other:?}"),
    };
    assert_eq!(vm.bar.log.lock().unwrap().last(), Some(&(offset, 8192)));

    // Events: post buffers, make the GPU report an error on the channel.
    for i in 0..2 {
        let evq_buf = EVENT_BUFS + i * 64;
        vm.evq.post(&vm.mem, &[(evq_buf, 64, true)]);
    }
    let chans = sim.channels();
    assert_eq!(chans.len(), 1);
    sim.kill_channel(chans[0].0, ErrorCode::WatchdogKilled)
        .unwrap();
    let (id, len) = vm.evq.wait_used(&vm.mem);
    assert_eq!(len as usize, EVENT_SIZE);
    assert_eq!(id, 0);
    let mut b = [0u8; EVENT_SIZE];
    vm.mem.read_slice(&mut b, GuestAddress(EVENT_BUFS)).unwrap();
    let ev = Event::decode(&b).unwrap();
    assert_eq!(ev.kind, event::CHANNEL_ERROR);
    assert_eq!(ev.channel, channel);
    assert_eq!(ev.value, ErrorCode::WatchdogKilled.as_u32());

    let s = backend.vm_stats("vm0").unwrap();
    assert_eq!((s.contexts, s.channels, s.aperture_bytes), (1, 1, 8192));
    assert_eq!(s.errors, 1);
    assert_eq!(s.events_delivered, 1);
    assert_eq!(backend.process_busy_ns("vm0").len(), 1);

    // Destroying the channel takes the page out of the BAR first.
    assert_eq!(
        vm.request(7, ctx, Op::DestroyChannel { channel }),
        Ok(ReplyBody::Empty)
    );
    assert_eq!(vm.bar.unmaps.load(Ordering::SeqCst), 1);
    vm.request(
        7,
        ctx,
        Op::CreateChannel {
            gp_ring_va: 0x10000,
            gp_entries: 16,
        },
    )
    .unwrap();

    // Disconnect: everything of the VM is freed, the socket listens again.
    drop(vm);
    wait_until("teardown", || {
        let s = backend.vm_stats("vm0").unwrap();
        !s.connected && s.disconnects == 1 && s.contexts == 0
    });
    wait_until("HAL back to baseline", || sim.stats() == baseline);
    // Reconnect, this time with EVENT_IDX.
    let mut vm = Vm::connect(&sock, true);
    for _ in 0..20 {
        assert!(matches!(
            vm.request(1, 0, Op::GetStats),
            Ok(ReplyBody::Stats(_))
        ));
    }
    let ctx = match vm.request(1, 0, Op::CreateContext) {
        Ok(ReplyBody::Context { ctx, .. }) => ctx,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        vm.request(7, ctx, Op::DestroyContext),
        Err(ErrorCode::PermissionDenied),
        "the new session's context 1 belongs to pid 1"
    );
    // RESET_DEVICE frees the guest's objects, with SHMEM_UNMAP of their BAR views.
    let ctx = match vm.request(2, 0, Op::CreateContext).unwrap() {
        ReplyBody::Context { ctx, .. } => ctx,
        other => panic!("{other:?}"),
    };
    vm.request(
        2,
        ctx,
        Op::CreateChannel {
            gp_ring_va: 0x10000,
            gp_entries: 16,
        },
    )
    .unwrap();
    assert_eq!(backend.vm_stats("vm0").unwrap().contexts, 2);
    let unmaps = vm.bar.unmaps.load(Ordering::SeqCst);
    vm.fe.reset_device().unwrap();
    // (The vhost frontend does not wait for an ack of RESET_DEVICE.)
    wait_until("reset", || backend.vm_stats("vm0").unwrap().contexts == 0);
    wait_until("slot unmapped", || {
        vm.bar.unmaps.load(Ordering::SeqCst) == unmaps + 1
    });
    wait_until("HAL back to baseline after reset", || {
        sim.stats() == baseline
    });
    drop(vm);
    backend.shutdown();
    wait_until("HAL back to baseline after shutdown", || {
        sim.stats() == baseline
    });
    assert!(!sock.exists());
}

/// Issue 19, fault 1: with EVENT_IDX negotiated, an avail index moved more than the queue
/// size ahead made the vring worker spin (the notification loop saw work that popping
/// never returned) and the VM's slot died: its session was never torn down and the socket
/// never listened again. Now the backend ends the connection, frees the VM's objects and
/// serves the socket again — for either queue.
#[test]
fn a_broken_avail_index_ends_the_connection_and_the_socket_serves_again() {
    let _ = env_logger::builder().is_test(true).try_init();
    let sim = SimGpu::new(SimConfig {
        vram_bytes: 64 << 20,
        ..SimConfig::default()
    })
    .unwrap();
    let baseline = sim.stats();
    let host = Host::with_gpu("vhost-user-broken-ring", sim, VmLimits::default(), &[]);
    let (sim, backend) = (&host.gpu, &host.backend);
    let sock = host.socket("vmb");
    backend.serve_vm("vmb", &sock).unwrap();
    for (round, queue) in [CONTROL_QUEUE, EVENT_QUEUE].into_iter().enumerate() {
        let mut vm = Vm::connect(&sock, true);
        let ctx = match vm.request(3, 0, Op::CreateContext).unwrap() {
            ReplyBody::Context { ctx, .. } => ctx,
            other => panic!("{other:?}"),
        };
        vm.request(
            3,
            ctx,
            Op::AllocVram {
                size: 1 << 20,
                align: 4096,
            },
        )
        .unwrap();
        assert_eq!(backend.vm_stats("vmb").unwrap().contexts, 1);
        let q = if queue == CONTROL_QUEUE {
            &mut vm.ctrl
        } else {
            // The event queue is only read when there is an event: make one.
            let chans = sim.channels();
            assert!(chans.is_empty());
            &mut vm.evq
        };
        let bad = q.next_avail.wrapping_add(3 * QSIZE);
        vm.mem.write_obj(bad, GuestAddress(q.avail + 2)).unwrap();
        q.kick.write(1).unwrap();
        if queue == EVENT_QUEUE {
            // A channel error queues an event, which makes the worker read the ring.
            vm.request(
                3,
                ctx,
                Op::CreateChannel {
                    gp_ring_va: 0x10000,
                    gp_entries: 16,
                },
            )
            .unwrap();
            let chans = sim.channels();
            sim.kill_channel(chans[0].0, ErrorCode::WatchdogKilled)
                .unwrap();
        }
        let n = round as u64 + 1;
        wait_until("the backend ends the connection and frees the VM", || {
            let s = backend.vm_stats("vmb").unwrap();
            !s.connected && s.disconnects == n && s.contexts == 0 && s.vram_bytes == 0
        });
        assert_eq!(backend.vm_stats("vmb").unwrap().ring_errors, n);
        wait_until("HAL back to baseline", || sim.stats() == baseline);
        drop(vm);
    }
    // The socket serves a well-behaved frontend again.
    let mut vm = Vm::connect(&sock, true);
    for _ in 0..5 {
        assert!(matches!(
            vm.request(1, 0, Op::GetStats),
            Ok(ReplyBody::Stats(_))
        ));
    }
    drop(vm);
    backend.shutdown();
}

/// `GET_VRING_BASE` stops a ring only once every request the backend took off it is
/// answered: right after the stop, the used index equals the base it returned. A
/// frontend migrating the VM relies on it; before the backend waited (`stop_vring`), a
/// stop falling between the worker's pop and its reply returned a base past a request
/// whose reply and effect came later.
#[test]
fn stopping_the_control_ring_waits_for_the_requests_already_taken() {
    let _ = env_logger::builder().is_test(true).try_init();
    let sim = SimGpu::new(SimConfig {
        vram_bytes: 64 << 20,
        ..SimConfig::default()
    })
    .unwrap();
    let host = Host::with_gpu("vhost-user-stop-waits", sim, VmLimits::default(), &[]);
    let backend = &host.backend;
    let sock = host.socket("vms");
    backend.serve_vm("vms", &sock).unwrap();
    let mut vm = Vm::connect(&sock, false);
    let ctx = match vm.request(3, 0, Op::CreateContext).unwrap() {
        ReplyBody::Context { ctx, .. } => ctx,
        other => panic!("{other:?}"),
    };
    let q = CONTROL_QUEUE as usize;
    let (mut answered_at_stop, mut early) = (0u32, 0u32);
    for round in 0..3000u32 {
        // Taking a request and answering it overlaps the stop that follows the kick.
        let op = if round % 2 == 0 {
            Op::GetInfo
        } else {
            Op::GetStats
        };
        let bytes = Request { pid: 3, ctx, op }.encode();
        vm.mem.write_slice(&bytes, GuestAddress(REQ_BUF)).unwrap();
        vm.ctrl.post(
            &vm.mem,
            &[(REQ_BUF, bytes.len() as u32, false), (REPLY_BUF, 256, true)],
        );
        let base = vm.fe.get_vring_base(q).unwrap() as u16;
        let used: u16 = vm.mem.read_obj(GuestAddress(vm.ctrl.used + 2)).unwrap();
        assert_eq!(
            used, base,
            "round {round}: the stop returned base {base} with used index {used}: a taken request was not answered yet"
        );
        if base == vm.ctrl.next_avail {
            answered_at_stop += 1;
        } else {
            early += 1;
        }
        // Start the ring again where it stopped; the request not taken yet is served now.
        vm.fe.set_vring_base(q, base).unwrap();
        vm.fe.set_vring_call(q, &vm.ctrl.call).unwrap();
        vm.fe.set_vring_kick(q, &vm.ctrl.kick).unwrap();
        vm.fe.set_vring_enable(q, true).unwrap();
        vm.ctrl.kick.write(1).unwrap();
        let (_, len) = vm.ctrl.wait_used(&vm.mem);
        assert!(len > 0, "round {round}: an empty reply");
    }
    eprintln!("stops after the request was taken: {answered_at_stop}, before: {early}");
    drop(vm);
    backend.shutdown();
}
