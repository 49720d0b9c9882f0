//! The KVM VMM's vgpu device — the virtio-pci transport over a vhost-user connection to
//! the real `vgpu-backend` — driven the way Linux's `virtio_pci` driver drives it: status
//! handshake and feature negotiation through the common configuration, rings in guest RAM,
//! doorbells in BAR0, completions on the call eventfds. Only KVM is left out (the guest's
//! accesses are made here as `bar_read`/`bar_write`), so this runs on any host; the nested
//! rig runs the same device under a real Linux guest (`ci/rig/l2-vgpu.sh`).

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vgpu_backend::{VgpuBackend, VmLimits};
use vgpu_host_shim::{SimConfig, SimGpu};
use vgpu_protocol::device::{DeviceConfig, NUM_QUEUES, SHM_REGION_ID, SHM_SIZE};
use vgpu_protocol::request::{
    decode_reply, Op, ReplyBody, Request, EVENT_SIZE, MAX_REPLY_SIZE, MAX_REQUEST_SIZE,
};
use vgpu_protocol::ControlPage;
use vgpu_protocol::{PAGE_SIZE, PROTOCOL_VERSION};
use vgpu_vmm::boot::intx::IntxForwarder;
use vgpu_vmm::guest_memory::{GuestRam, PageAllocator};
use vgpu_vmm::pci::PciBus;
use vgpu_vmm::reconnect::{FaultPolicy, ReconnectPolicy};
use vgpu_vmm::shm_window::{HoleFill, ShmWindow};
use vgpu_vmm::vgpu_device::VhostUserVgpu;
use vgpu_vmm::virtio_pci::{
    BarPlacement, VirtioPciDevice, DEVICE_CFG_OFFSET, ISR_OFFSET, NOTIFY_OFFSET,
    STATUS_ACKNOWLEDGE, STATUS_DEVICE_NEEDS_RESET, STATUS_DRIVER, STATUS_DRIVER_OK,
    STATUS_FEATURES_OK,
};
use vgpu_vmm::virtq::{Buffer, SplitQueue};
use vmm_sys_util::eventfd::EventFd;

type Dev = VirtioPciDevice<VhostUserVgpu>;

// Common configuration offsets (virtio 1.x §4.1.4.3).
const DEVICE_FEATURE_SELECT: u64 = 0x00;
const DEVICE_FEATURE: u64 = 0x04;
const DRIVER_FEATURE_SELECT: u64 = 0x08;
const DRIVER_FEATURE: u64 = 0x0c;
const DEVICE_STATUS: u64 = 0x14;
const QUEUE_SELECT: u64 = 0x16;
const QUEUE_SIZE: u64 = 0x18;
const QUEUE_ENABLE: u64 = 0x1c;
const QUEUE_DESC: u64 = 0x20;
const QUEUE_DRIVER: u64 = 0x28;
const QUEUE_DEVICE: u64 = 0x30;

const PID: u32 = 4242;

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vgpu-vmm-vu-{}-{name}.sock", std::process::id()))
}

use vgpu_vmm::pci::PciDevice;

fn w8(d: &mut Dev, off: u64, v: u8) {
    d.bar_write(0, off, &[v]);
}
fn w16(d: &mut Dev, off: u64, v: u16) {
    d.bar_write(0, off, &v.to_le_bytes());
}
fn w32(d: &mut Dev, off: u64, v: u32) {
    d.bar_write(0, off, &v.to_le_bytes());
}
fn w64(d: &mut Dev, off: u64, v: u64) {
    // As Linux does it: two 32-bit halves.
    w32(d, off, v as u32);
    w32(d, off + 4, (v >> 32) as u32);
}
fn r8(d: &mut Dev, off: u64) -> u8 {
    let mut b = [0u8; 1];
    d.bar_read(0, off, &mut b);
    b[0]
}
fn r16(d: &mut Dev, off: u64) -> u16 {
    let mut b = [0u8; 2];
    d.bar_read(0, off, &mut b);
    u16::from_le_bytes(b)
}
fn r32(d: &mut Dev, off: u64) -> u32 {
    let mut b = [0u8; 4];
    d.bar_read(0, off, &mut b);
    u32::from_le_bytes(b)
}

/// The guest side: RAM, rings and request buffers.
struct Guest {
    ram: GuestRam,
    alloc: PageAllocator,
    ctrl: SplitQueue,
    events: SplitQueue,
    req_gpa: u64,
    reply_gpa: u64,
}

impl Guest {
    fn new() -> Guest {
        let ram = GuestRam::new(&[(0, 32 << 20)]).unwrap();
        let mut alloc = PageAllocator::new(PAGE_SIZE, (32 << 20) - PAGE_SIZE);
        let ctrl = SplitQueue::new(64, &ram, &mut alloc).unwrap();
        let events = SplitQueue::new(64, &ram, &mut alloc).unwrap();
        let (req_gpa, _) = alloc.alloc(MAX_REQUEST_SIZE as u64, PAGE_SIZE).unwrap();
        let (reply_gpa, _) = alloc.alloc(MAX_REPLY_SIZE as u64, PAGE_SIZE).unwrap();
        Guest {
            ram,
            alloc,
            ctrl,
            events,
            req_gpa,
            reply_gpa,
        }
    }
}

/// Connects a device to a fresh backend VM `name`.
fn device(name: &str) -> (Arc<VgpuBackend>, Guest, Dev, Arc<ShmWindow>) {
    let _ = env_logger::builder().is_test(true).try_init();
    let gpu = SimGpu::new(SimConfig::default()).unwrap();
    let backend = VgpuBackend::new(gpu, VmLimits::default());
    let path = socket(name);
    backend.serve_vm(name, &path).unwrap();
    let guest = Guest::new();
    let window =
        Arc::new(ShmWindow::with_fill(SHM_REGION_ID, SHM_SIZE, HoleFill::Scratch).unwrap());
    let vu =
        VhostUserVgpu::connect(&path, &guest.ram, window.clone(), FaultPolicy::default()).unwrap();
    let dev = VirtioPciDevice::new(vu, BarPlacement::default()).unwrap();
    (backend, guest, dev, window)
}

/// What Linux's virtio_pci_modern + virtio core do up to DRIVER_OK. Returns the status.
fn bring_up(dev: &mut Dev, g: &Guest, queue_ok: bool) -> u8 {
    w8(dev, DEVICE_STATUS, 0);
    w8(dev, DEVICE_STATUS, STATUS_ACKNOWLEDGE);
    w8(dev, DEVICE_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    w32(dev, DEVICE_FEATURE_SELECT, 1);
    let hi = r32(dev, DEVICE_FEATURE);
    assert_ne!(hi & 1, 0, "VERSION_1 offered");
    w32(dev, DRIVER_FEATURE_SELECT, 0);
    w32(dev, DRIVER_FEATURE, 0);
    w32(dev, DRIVER_FEATURE_SELECT, 1);
    w32(dev, DRIVER_FEATURE, 1);
    let s = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
    w8(dev, DEVICE_STATUS, s);
    assert_eq!(r8(dev, DEVICE_STATUS), s, "FEATURES_OK accepted");
    for (i, q) in [&g.ctrl, &g.events].into_iter().enumerate() {
        w16(dev, QUEUE_SELECT, i as u16);
        assert!(r16(dev, QUEUE_SIZE) >= q.size());
        w16(dev, QUEUE_SIZE, q.size());
        let desc = if queue_ok {
            q.desc_gpa()
        } else {
            0xdead_0000_0000
        };
        w64(dev, QUEUE_DESC, desc);
        w64(dev, QUEUE_DRIVER, q.avail_gpa());
        w64(dev, QUEUE_DEVICE, q.used_gpa());
        w16(dev, QUEUE_ENABLE, 1);
    }
    w8(dev, DEVICE_STATUS, s | STATUS_DRIVER_OK);
    r8(dev, DEVICE_STATUS)
}

fn wait_call(dev: &Dev, q: usize) {
    let fd = dev.backend().calls()[q].as_raw_fd();
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one valid fd for up to 10 s.
    let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(n, 1, "no interrupt from the backend on queue {q}");
    let _ = dev.backend().calls()[q].read();
}

/// One request over the control queue: write, doorbell, wait for the call, read the reply.
fn request(dev: &mut Dev, g: &mut Guest, op: Op) -> Result<ReplyBody, vgpu_protocol::ErrorCode> {
    let req = Request {
        pid: PID,
        ctx: 0,
        op,
    };
    request_raw(dev, g, &req)
}

fn request_raw(
    dev: &mut Dev,
    g: &mut Guest,
    req: &Request,
) -> Result<ReplyBody, vgpu_protocol::ErrorCode> {
    let bytes = req.encode();
    let p = g.ram.host_ptr(g.req_gpa, bytes.len() as u64).unwrap();
    // SAFETY: `p` is inside guest RAM, which this test owns.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    g.ctrl
        .add(&[
            Buffer {
                gpa: g.req_gpa,
                len: bytes.len() as u64,
                write: false,
            },
            Buffer {
                gpa: g.reply_gpa,
                len: MAX_REPLY_SIZE as u64,
                write: true,
            },
        ])
        .unwrap();
    w16(dev, NOTIFY_OFFSET, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let used = loop {
        if let Some(u) = g.ctrl.pop_used().unwrap() {
            break u;
        }
        assert!(Instant::now() < deadline, "no reply");
        wait_call(dev, 0);
        // The ISR's queue bit is the forwarder's business in the VMM; here nothing sets it.
        let _ = r8(dev, ISR_OFFSET);
    };
    let rp = g.ram.host_ptr(g.reply_gpa, u64::from(used.len)).unwrap();
    // SAFETY: the device wrote `used.len` bytes of reply there.
    let reply = unsafe { std::slice::from_raw_parts(rp, used.len as usize) }.to_vec();
    decode_reply(req.opcode(), &reply).unwrap()
}

#[test]
fn linux_style_bring_up_requests_shmem_map_and_reset() {
    let (backend, mut g, mut dev, window) = device("vm0");

    // Config space is the backend's, read through BAR0.
    let mut cfg = [0u8; DeviceConfig::SIZE];
    dev.bar_read(0, DEVICE_CFG_OFFSET, &mut cfg);
    let cfg = DeviceConfig::decode(&cfg).unwrap();
    assert_eq!(cfg.version, PROTOCOL_VERSION);

    let status = bring_up(&mut dev, &g, true);
    assert_eq!(status & STATUS_DEVICE_NEEDS_RESET, 0);
    assert!(dev.is_active());
    assert_eq!(dev.backend().activations(), 1);
    assert_ne!(dev.backend().acked_features() & (1 << 32), 0);
    assert_eq!(dev.backend().calls().len(), NUM_QUEUES);

    // Event buffers posted (the driver does this at probe).
    let (ev_gpa, _) = g.alloc.alloc(PAGE_SIZE, PAGE_SIZE).unwrap();
    g.events
        .add(&[Buffer {
            gpa: ev_gpa,
            len: EVENT_SIZE as u64,
            write: true,
        }])
        .unwrap();
    w16(&mut dev, NOTIFY_OFFSET + 4, 1);

    let Ok(ReplyBody::Info(info)) = request(&mut dev, &mut g, Op::GetInfo) else {
        panic!("GET_INFO failed");
    };
    assert_eq!(info.version, PROTOCOL_VERSION);

    let Ok(ReplyBody::Context { ctx, .. }) = request(&mut dev, &mut g, Op::CreateContext) else {
        panic!("CREATE_CONTEXT failed");
    };
    let req = Request {
        pid: PID,
        ctx,
        op: Op::CreateChannel {
            gp_ring_va: 0x10000,
            gp_entries: 16,
        },
    };
    let Ok(ReplyBody::Channel { slot, .. }) = request_raw(&mut dev, &mut g, &req) else {
        panic!("CREATE_CHANNEL failed");
    };
    // The backend SHMEM_MAPped the channel's real control page at its slot in the window:
    // what the guest would read through the shared-memory BAR.
    assert!(window.maps() >= 1);
    let page = window
        .base()
        .wrapping_add((u64::from(slot) * PAGE_SIZE) as usize);
    // SAFETY: the slot is mapped (the reply came after the frontend acked the map) and
    // the window lives as long as `dev`.
    let (version, entries) = unsafe {
        (
            page.add(ControlPage::VERSION).cast::<u32>().read_volatile(),
            page.add(ControlPage::GP_ENTRIES)
                .cast::<u32>()
                .read_volatile(),
        )
    };
    assert_eq!(version, PROTOCOL_VERSION);
    assert_eq!(entries, 16);
    assert_eq!(backend.vm_stats("vm0").unwrap().contexts, 1);

    // Driver reset (rmmod, reboot): the backend frees everything, the slot becomes a hole
    // (scratch: reads zero, never faults the VMM).
    w8(&mut dev, DEVICE_STATUS, 0);
    assert!(!dev.is_active());
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.vm_stats("vm0").unwrap().contexts != 0 {
        assert!(Instant::now() < deadline, "reset did not free the context");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: as above; the slot is now scratch memory.
    let version = unsafe { page.add(ControlPage::VERSION).cast::<u32>().read_volatile() };
    assert_eq!(version, 0);

    // And the driver can start over on the same connection, with fresh rings.
    g.ctrl = SplitQueue::new(64, &g.ram, &mut g.alloc).unwrap();
    g.events = SplitQueue::new(64, &g.ram, &mut g.alloc).unwrap();
    let status = bring_up(&mut dev, &g, true);
    assert_eq!(status & STATUS_DEVICE_NEEDS_RESET, 0);
    assert_eq!(dev.backend().activations(), 2);
    let Ok(ReplyBody::Info(_)) = request(&mut dev, &mut g, Op::GetInfo) else {
        panic!("GET_INFO after reset failed");
    };
}

#[test]
fn rings_outside_guest_ram_are_refused() {
    let (_backend, g, mut dev, _window) = device("vm1");
    let status = bring_up(&mut dev, &g, false);
    assert_ne!(status & STATUS_DEVICE_NEEDS_RESET, 0, "status {status:#x}");
    assert!(!dev.is_active());
}

#[test]
fn refused_socket_is_a_clear_error() {
    let g = Guest::new();
    let window =
        Arc::new(ShmWindow::with_fill(SHM_REGION_ID, SHM_SIZE, HoleFill::Scratch).unwrap());
    let err = VhostUserVgpu::connect(
        &socket("nobody-listens"),
        &g.ram,
        window,
        FaultPolicy::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("nobody-listens"), "{msg}");
}

/// Finds capability `id` in the function's configuration space.
fn find_cap(dev: &mut Dev, id: u8) -> Option<usize> {
    let mut off = (dev.config_read(0x34 / 4) & 0xff) as usize;
    while off != 0 {
        let dw = dev.config_read(off / 4);
        if dw & 0xff == u32::from(id) {
            return Some(off);
        }
        off = ((dw >> 8) & 0xff) as usize;
    }
    None
}

#[test]
fn msix_table_vectors_and_updates() {
    use vgpu_vmm::virtio_pci::msix::{MSIX_ENABLE, MSIX_FUNCTION_MASK, MSIX_TABLE_OFFSET};
    use vgpu_vmm::virtio_pci::VIRTIO_MSI_NO_VECTOR;
    const MSIX_CONFIG: u64 = 0x10;
    const QUEUE_MSIX_VECTOR: u64 = 0x1a;

    let (_backend, _g, mut dev, _window) = device("vm2");
    let cap = find_cap(&mut dev, 0x11).expect("MSI-X capability");
    let ctl = (dev.config_read(cap / 4) >> 16) as u16;
    assert_eq!(
        ctl & 0x7ff,
        NUM_QUEUES as u16,
        "table size = queues + config - 1"
    );
    assert_eq!(dev.config_read(cap / 4 + 1), MSIX_TABLE_OFFSET as u32);

    // Vectors: valid ones stick, out-of-range ones read back as NO_VECTOR.
    w16(&mut dev, MSIX_CONFIG, 0);
    assert_eq!(r16(&mut dev, MSIX_CONFIG), 0);
    w16(&mut dev, QUEUE_SELECT, 0);
    w16(&mut dev, QUEUE_MSIX_VECTOR, 1);
    w16(&mut dev, QUEUE_SELECT, 1);
    w16(&mut dev, QUEUE_MSIX_VECTOR, 99);
    assert_eq!(r16(&mut dev, QUEUE_MSIX_VECTOR), VIRTIO_MSI_NO_VECTOR);
    w16(&mut dev, QUEUE_MSIX_VECTOR, 2);

    // Program the table: address, data, unmask; read back.
    for v in 0..3u64 {
        let e = MSIX_TABLE_OFFSET + v * 16;
        w32(&mut dev, e, 0xfee0_0000);
        w32(&mut dev, e + 4, 0);
        w32(&mut dev, e + 8, 0x40 + v as u32);
        w32(&mut dev, e + 12, 0);
        assert_eq!(r32(&mut dev, e + 8), 0x40 + v as u32);
    }
    // Enabled but function-masked: not deliverable yet.
    let ctl_bytes = (MSIX_ENABLE | MSIX_FUNCTION_MASK).to_le_bytes();
    dev.config_write(cap / 4, 2, &ctl_bytes);
    let st = dev.take_msix_update().expect("an update");
    assert!(!st.enabled);
    dev.config_write(cap / 4, 2, &MSIX_ENABLE.to_le_bytes());
    let st = dev.take_msix_update().expect("an update");
    assert!(st.enabled);
    assert_eq!(
        st.deliverable(Some(0)).map(|(v, e)| (v, e.data)),
        Some((1, 0x41))
    );
    assert_eq!(st.deliverable(Some(1)).map(|(v, _)| v), Some(2));
    assert_eq!(st.deliverable(None).map(|(v, _)| v), Some(0));
    assert!(dev.take_msix_update().is_none(), "nothing changed since");
    // Masking vector 2 takes queue 1 off MSI.
    w32(&mut dev, MSIX_TABLE_OFFSET + 2 * 16 + 12, 1);
    let st = dev.take_msix_update().expect("an update");
    assert_eq!(st.deliverable(Some(1)), None);
    // A device reset clears the virtio vector registers.
    w8(&mut dev, DEVICE_STATUS, 0);
    let st = dev.take_msix_update().expect("an update");
    assert_eq!(st.queue_vectors, vec![VIRTIO_MSI_NO_VECTOR; NUM_QUEUES]);
}

/// Runs `f` on the vgpu function in `slot` of `bus`.
fn with_dev<R>(bus: &Mutex<PciBus>, slot: u8, f: impl FnOnce(&mut Dev) -> R) -> R {
    let mut bus = bus.lock().unwrap();
    f(bus
        .device_mut(slot)
        .unwrap()
        .as_any_mut()
        .downcast_mut::<Dev>()
        .unwrap())
}

/// Waits (up to 10 s) for a configuration interrupt.
fn wait_config_irq(fd: &EventFd) {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one valid fd for up to 10 s.
    let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(n, 1, "no configuration interrupt");
    let _ = fd.read();
}

#[test]
fn a_restarted_backend_is_reconnected_and_the_driver_starts_over() {
    let _ = env_logger::builder().is_test(true).try_init();
    let name = "vm-reconnect";
    let path = socket(name);
    let first = VgpuBackend::new(
        SimGpu::new(SimConfig::default()).unwrap(),
        VmLimits::default(),
    );
    first.serve_vm(name, &path).unwrap();
    let mut g = Guest::new();
    let window =
        Arc::new(ShmWindow::with_fill(SHM_REGION_ID, SHM_SIZE, HoleFill::Scratch).unwrap());
    let faults = FaultPolicy {
        reconnect: Some(ReconnectPolicy {
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(200),
            max_attempts: None,
        }),
        request_timeout: Some(Duration::from_secs(10)),
    };
    let vu = VhostUserVgpu::connect(&path, &g.ram, window.clone(), faults).unwrap();
    let mut bus = PciBus::new();
    let slot = bus
        .add_device(Box::new(
            VirtioPciDevice::new(vu, BarPlacement::default()).unwrap(),
        ))
        .unwrap();
    let bus = Arc::new(Mutex::new(bus));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let config_irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    // The watcher thread of the VMM; the queues' calls stay with this test.
    let fwd = IntxForwarder::start(bus.clone(), slot, irq, config_irq.clone()).unwrap();
    for q in 0..NUM_QUEUES {
        fwd.forward_queue(q, false).unwrap();
    }

    let slot_page = with_dev(&bus, slot, |dev| {
        assert_eq!(bring_up(dev, &g, true) & STATUS_DEVICE_NEEDS_RESET, 0);
        let Ok(ReplyBody::Context { ctx, .. }) = request(dev, &mut g, Op::CreateContext) else {
            panic!("CREATE_CONTEXT failed");
        };
        let req = Request {
            pid: PID,
            ctx,
            op: Op::CreateChannel {
                gp_ring_va: 0x10000,
                gp_entries: 16,
            },
        };
        let Ok(ReplyBody::Channel { slot, .. }) = request_raw(dev, &mut g, &req) else {
            panic!("CREATE_CHANNEL failed");
        };
        window
            .base()
            .wrapping_add((u64::from(slot) * PAGE_SIZE) as usize)
    });
    // SAFETY: the slot is mapped (the reply came after the map was acked); the window
    // lives as long as this test.
    let version = || unsafe {
        slot_page
            .add(ControlPage::VERSION)
            .cast::<u32>()
            .read_volatile()
    };
    assert_eq!(version(), PROTOCOL_VERSION);

    // The backend goes away: the device asks for a reset and the old page is gone.
    first.shutdown();
    wait_config_irq(&config_irq);
    let status = with_dev(&bus, slot, |dev| dev.status());
    assert_ne!(status & STATUS_DEVICE_NEEDS_RESET, 0, "status {status:#x}");
    assert_eq!(version(), 0, "a stale control page stayed in the BAR");

    // A new backend on the same socket: the VMM reconnects and asks for a reset again.
    let second = VgpuBackend::new(
        SimGpu::new(SimConfig::default()).unwrap(),
        VmLimits::default(),
    );
    second.serve_vm(name, &path).unwrap();
    wait_config_irq(&config_irq);
    assert!(with_dev(&bus, slot, |dev| dev.backend().is_connected()));
    // The driver resets and starts over on fresh rings, against the new backend.
    g.ctrl = SplitQueue::new(64, &g.ram, &mut g.alloc).unwrap();
    g.events = SplitQueue::new(64, &g.ram, &mut g.alloc).unwrap();
    with_dev(&bus, slot, |dev| {
        assert_eq!(bring_up(dev, &g, true) & STATUS_DEVICE_NEEDS_RESET, 0);
        let Ok(ReplyBody::Context { .. }) = request(dev, &mut g, Op::CreateContext) else {
            panic!("CREATE_CONTEXT on the new backend failed");
        };
    });
    assert_eq!(second.vm_stats(name).unwrap().contexts, 1);
    drop(fwd);
    second.shutdown();
}

#[test]
fn a_backend_that_never_answers_times_out() {
    use std::io::Read;
    use vgpu_vmm::frontend::FrontendError;
    use vgpu_vmm::vgpu_device::VgpuDeviceError;

    let path = socket("silent");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    // Accepts and reads, never answers (a stopped backend's socket answers no better);
    // ends when the frontend shuts the connection down.
    let silent = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let g = Guest::new();
    let window =
        Arc::new(ShmWindow::with_fill(SHM_REGION_ID, SHM_SIZE, HoleFill::Scratch).unwrap());
    let faults = FaultPolicy {
        reconnect: None,
        request_timeout: Some(Duration::from_millis(300)),
    };
    let err = VhostUserVgpu::connect(&path, &g.ram, window, faults).unwrap_err();
    assert!(
        matches!(
            err,
            VgpuDeviceError::Frontend {
                source: FrontendError::Timeout {
                    step: "GET_FEATURES",
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
    silent.join().unwrap();
    let _ = std::fs::remove_file(&path);
}
