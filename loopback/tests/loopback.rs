//! The loopback frontend against a minimal in-test vhost-user backend (vhost-user-backend
//! 0.24): echoes control requests, offers the shm config, and on command sends
//! SHMEM_MAP / SHMEM_UNMAP requests and events.

use std::fs::File;
use std::io::Result as IoResult;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vgpu_loopback::{LoopbackConfig, LoopbackError, LoopbackVm};
use vgpu_protocol::device::{DeviceConfig, QUEUE_SIZE, SHM_REGION_ID, SHM_SIZE};
use vgpu_protocol::request::{
    event, op, Event, GuestRange, Op, Request, MAX_REPLY_SIZE, MAX_SG_ENTRIES,
};
use vhost::vhost_user::message::{
    VhostUserMMap, VhostUserMMapFlags, VhostUserProtocolFeatures, VhostUserShMemConfig,
    VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Backend, Listener, VhostUserFrontendReqHandler};
use vhost_user_backend::{VhostUserBackendMut, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_config::{VIRTIO_F_NOTIFY_ON_EMPTY, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

const PAGE: u64 = 4096;
const CMD_MAP: u32 = 0xffff_0001; // AllocVram { size: shm_offset, align: fill byte }
const CMD_MAP_RANGE: u32 = 0xffff_0002; // AllocVram { size: shm_offset, align: len }
const CMD_UNMAP: u32 = 0xffff_0003; // AllocVram { size: shm_offset, align: len }
const CMD_EVENT: u32 = 0xffff_0004; // AllocVram { size: info, align: value }

fn test_config() -> DeviceConfig {
    DeviceConfig {
        version: vgpu_protocol::PROTOCOL_VERSION,
        channel_slots: 1024,
        aperture_offset: vgpu_protocol::device::APERTURE_OFFSET,
        aperture_size: vgpu_protocol::device::APERTURE_SIZE,
        vram_bytes: 1 << 30,
    }
}

struct EchoBackend {
    backend: Option<Backend>,
    mem: Option<GuestMemoryAtomic<GuestMemoryMmap>>,
    /// Memfds handed out with SHMEM_MAP, by shm offset.
    pages: Vec<(u64, File)>,
    acked: u64,
}

fn memfd_page(fill: u8) -> File {
    // SAFETY: valid NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"test-page".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh fd owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.write_all_at(&[fill; PAGE as usize], 0).unwrap();
    f
}

impl EchoBackend {
    fn status(ok: bool) -> Vec<u8> {
        (if ok { 0u64 } else { 1u64 }).to_le_bytes().to_vec()
    }

    fn shm_req(shm_offset: u64, len: u64) -> VhostUserMMap {
        VhostUserMMap {
            shmid: SHM_REGION_ID,
            fd_offset: 0,
            shm_offset,
            len,
            flags: VhostUserMMapFlags::WRITABLE.bits(),
            ..Default::default()
        }
    }

    fn command(&mut self, req: &[u8], vrings: &[VringRwLock]) -> Vec<u8> {
        let Ok(r) = Request::decode(req) else {
            return req[..req.len().min(MAX_REPLY_SIZE)].to_vec();
        };
        let (a, b) = match r.op {
            Op::AllocVram { size, align } => (size, align),
            _ => return req[..req.len().min(MAX_REPLY_SIZE)].to_vec(),
        };
        let Some(be) = self.backend.as_ref() else {
            return Self::status(false);
        };
        match r.pid {
            CMD_MAP => {
                let f = memfd_page(b as u8);
                let ok = be.shmem_map(&Self::shm_req(a, PAGE), &f).is_ok();
                self.pages.push((a, f));
                Self::status(ok)
            }
            CMD_MAP_RANGE => {
                let f = memfd_page(0x77);
                Self::status(be.shmem_map(&Self::shm_req(a, b), &f).is_ok())
            }
            CMD_UNMAP => Self::status(be.shmem_unmap(&Self::shm_req(a, b)).is_ok()),
            CMD_EVENT => {
                let ev = Event {
                    kind: event::NOTIFY,
                    channel: 7,
                    value: b as u32,
                    info: a,
                };
                Self::status(self.push_event(&vrings[1], ev))
            }
            _ => req[..req.len().min(MAX_REPLY_SIZE)].to_vec(),
        }
    }

    fn push_event(&self, vring: &VringRwLock, ev: Event) -> bool {
        let Some(atomic) = self.mem.as_ref() else {
            return false;
        };
        let mem = atomic.memory();
        let chain = vring
            .get_mut()
            .get_queue_mut()
            .pop_descriptor_chain(mem.clone());
        let Some(chain) = chain else { return false };
        let head = chain.head_index();
        let mut n = 0;
        for d in chain {
            if d.is_write_only() && d.len() as usize >= vgpu_protocol::request::EVENT_SIZE {
                mem.write_slice(&ev.encode(), d.addr()).unwrap();
                n = vgpu_protocol::request::EVENT_SIZE as u32;
                break;
            }
        }
        vring.add_used(head, n).unwrap();
        vring.signal_used_queue().unwrap();
        n > 0
    }

    fn process_control(&mut self, vrings: &[VringRwLock]) {
        let atomic = self.mem.clone().unwrap();
        let mem = atomic.memory();
        loop {
            let chain = vrings[0]
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let mut req = Vec::new();
            let mut out = Vec::new();
            for d in chain {
                if d.is_write_only() {
                    out.push((d.addr(), d.len() as usize));
                } else {
                    let mut b = vec![0u8; d.len() as usize];
                    mem.read_slice(&mut b, d.addr()).unwrap();
                    req.extend_from_slice(&b);
                }
            }
            let reply = self.command(&req, vrings);
            assert_eq!(out.len(), 1);
            assert!(out[0].1 >= reply.len());
            mem.write_slice(&reply, out[0].0).unwrap();
            vrings[0].add_used(head, reply.len() as u32).unwrap();
        }
        vrings[0].signal_used_queue().unwrap();
    }
}

impl VhostUserBackendMut for EchoBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        2
    }
    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE as usize
    }
    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_F_NOTIFY_ON_EMPTY
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }
    fn acked_features(&mut self, features: u64) {
        self.acked = features;
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::BACKEND_REQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::SHMEM
    }
    fn set_event_idx(&mut self, enabled: bool) {
        assert!(!enabled, "the loopback driver must not negotiate EVENT_IDX");
    }
    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = test_config().encode();
        c.get(offset as usize..(offset + size) as usize)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }
    fn update_memory(&mut self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> IoResult<()> {
        self.mem = Some(mem);
        Ok(())
    }
    fn set_backend_req_fd(&mut self, backend: Backend) {
        self.backend = Some(backend);
    }
    fn get_shmem_config(&self) -> IoResult<VhostUserShMemConfig> {
        Ok(VhostUserShMemConfig::new(1, &[SHM_SIZE]))
    }
    fn handle_event(
        &mut self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> IoResult<()> {
        if device_event == 0 {
            self.process_control(vrings);
        }
        Ok(())
    }
}

struct Server {
    path: PathBuf,
    backend: Arc<Mutex<EchoBackend>>,
    done: mpsc::Receiver<()>,
    shutdown: ShutdownHandle,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn start_server() -> Server {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "vgpu-vmm-test-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let backend = Arc::new(Mutex::new(EchoBackend {
        backend: None,
        mem: None,
        pages: Vec::new(),
        acked: 0,
    }));
    let mut listener = Listener::new(&path, true).unwrap();
    let mut daemon = VhostUserDaemon::new(
        "echo".into(),
        backend.clone(),
        GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new()),
    )
    .unwrap();
    let (tx, done) = mpsc::channel();
    let (htx, hrx) = mpsc::channel();
    std::thread::spawn(move || {
        daemon.start(&mut listener).unwrap();
        htx.send(daemon.shutdown_handle().unwrap()).unwrap();
        let _ = daemon.wait();
        let _ = tx.send(());
    });
    // `start` returns once a frontend has connected: hand out a lazy handle.
    Server {
        path,
        backend,
        done,
        shutdown: ShutdownHandle(Mutex::new(None), Mutex::new(Some(hrx))),
    }
}

/// The daemon's shutdown handle, available once a frontend has connected.
struct ShutdownHandle(
    Mutex<Option<vhost_user_backend::ShutdownHandle>>,
    Mutex<Option<mpsc::Receiver<vhost_user_backend::ShutdownHandle>>>,
);

impl ShutdownHandle {
    fn shutdown(&self) {
        let mut h = self.0.lock().unwrap();
        if h.is_none() {
            let rx = self.1.lock().unwrap().take().unwrap();
            *h = Some(rx.recv_timeout(Duration::from_secs(5)).unwrap());
        }
        h.as_ref().unwrap().shutdown();
    }
}

fn connect(server: &Server) -> Arc<LoopbackVm> {
    let _ = env_logger::builder().is_test(true).try_init();
    LoopbackVm::connect(&server.path, LoopbackConfig::with_mem(64 << 20)).unwrap()
}

fn cmd(vm: &LoopbackVm, pid: u32, size: u64, align: u64) -> bool {
    let req = Request {
        pid,
        ctx: 0,
        op: Op::AllocVram { size, align },
    };
    let r = vm.request(&req.encode()).unwrap();
    assert_eq!(r.len(), 8);
    r == 0u64.to_le_bytes()
}

/// Permissions of the mapping containing `addr` in /proc/self/maps.
fn perms_at(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let mut it = line.split_whitespace();
        let range = it.next().unwrap();
        let perms = it.next().unwrap();
        let (s, e) = range.split_once('-').unwrap();
        let (s, e) = (
            usize::from_str_radix(s, 16).unwrap(),
            usize::from_str_radix(e, 16).unwrap(),
        );
        if (s..e).contains(&addr) {
            return perms.to_string();
        }
    }
    panic!("address {addr:#x} not mapped");
}

#[test]
fn handshake_and_config() {
    let server = start_server();
    let vm = connect(&server);
    assert_eq!(vm.config().unwrap(), test_config());
    assert_eq!(vm.shm_len(), SHM_SIZE);
    let acked = server.backend.lock().unwrap().acked;
    assert_eq!(
        acked,
        1 << VIRTIO_F_VERSION_1 | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    );
    // The window starts out inaccessible.
    assert_eq!(perms_at(vm.shm_base() as usize), "---p");
    assert_eq!(
        perms_at(vm.shm_base() as usize + SHM_SIZE as usize - 1),
        "---p"
    );
}

#[test]
fn concurrent_round_trips() {
    let server = start_server();
    let vm = connect(&server);
    let threads: Vec<_> = (0..4u32)
        .map(|t| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                for i in 0..2000u32 {
                    let req = Request {
                        pid: t,
                        ctx: i,
                        op: if i % 2 == 0 {
                            Op::GetInfo
                        } else {
                            Op::MapVram {
                                mem: i,
                                flags: 0,
                                va: (t as u64) << 32 | i as u64,
                                page: 0,
                            }
                        },
                    }
                    .encode();
                    assert_eq!(vm.request(&req).unwrap(), req);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // More threads than request slots (QUEUE_SIZE / 2): callers wait for a free slot.
    let threads: Vec<_> = (0..200u32)
        .map(|t| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                for i in 0..20u32 {
                    let req = Request {
                        pid: t,
                        ctx: i,
                        op: Op::GetStats,
                    }
                    .encode();
                    assert_eq!(vm.request(&req).unwrap(), req);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // The largest request goes through too (echo returns its first MAX_REPLY_SIZE bytes).
    let big = Request {
        pid: 1,
        ctx: 2,
        op: Op::MapGuest {
            va: 0,
            page: 0,
            flags: 0,
            ranges: vec![GuestRange { gpa: 0, len: 0 }; MAX_SG_ENTRIES],
        },
    }
    .encode();
    assert_eq!(big.len(), vgpu_protocol::request::MAX_REQUEST_SIZE);
    assert_eq!(vm.request(&big).unwrap(), big[..MAX_REPLY_SIZE]);
    assert!(matches!(
        vm.request(&[0; vgpu_protocol::request::MAX_REQUEST_SIZE + 1]),
        Err(LoopbackError::RequestSize(_))
    ));
    assert!(matches!(
        vm.request(&[]),
        Err(LoopbackError::RequestSize(0))
    ));
}

#[test]
fn shmem_map_remap_unmap() {
    let server = start_server();
    let vm = connect(&server);
    let base = vm.shm_base();
    let off = 5 * PAGE;
    let read = |o: u64| {
        // SAFETY: every read below is of a page at `off` that is mapped readable at
        // that point (the window itself stays reserved for the VM's lifetime).
        unsafe { base.add(o as usize).read_volatile() }
    };

    assert!(cmd(&vm, CMD_MAP, off, 0x11));
    assert_eq!(vm.shmem_maps(), 1);
    assert_eq!(read(off), 0x11);
    assert_eq!(read(off + PAGE - 1), 0x11);
    assert_eq!(perms_at(base as usize + off as usize), "rw-s");
    assert_eq!(perms_at(base as usize + off as usize - 1), "---p");

    // Writes through the window land in the backend's page.
    // SAFETY: the page is mapped writable.
    unsafe { base.add(off as usize + 3).write_volatile(0xee) };
    {
        let be = server.backend.lock().unwrap();
        let mut b = [0u8; 4];
        be.pages[0].1.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(b, [0x11, 0x11, 0x11, 0xee]);
    }

    // Remap: a new page appears at the same place.
    assert!(cmd(&vm, CMD_MAP, off, 0x22));
    assert_eq!(vm.shmem_maps(), 2);
    assert_eq!(read(off), 0x22);
    assert_eq!(read(off + 3), 0x22);

    // A page in the aperture part, far in.
    let far = SHM_SIZE - PAGE;
    assert!(cmd(&vm, CMD_MAP, far, 0x33));
    assert_eq!(read(far + 100), 0x33);

    // Unmap: back to PROT_NONE.
    assert!(cmd(&vm, CMD_UNMAP, off, PAGE));
    assert_eq!(perms_at(base as usize + off as usize), "---p");
    assert_eq!(vm.shmem_unmaps(), 1);
    assert_eq!(read(far), 0x33);
}

#[test]
fn shmem_map_out_of_bounds_refused() {
    let server = start_server();
    let vm = connect(&server);
    let refused = [
        (SHM_SIZE, PAGE),            // starts at the end
        (SHM_SIZE - PAGE, 2 * PAGE), // runs past the end
        (100, PAGE),                 // unaligned offset
        (0, 100),                    // unaligned length
    ];
    for (o, l) in refused {
        assert!(!cmd(&vm, CMD_MAP_RANGE, o, l), "map {o:#x}+{l:#x} accepted");
    }
    assert!(!cmd(&vm, CMD_UNMAP, SHM_SIZE - PAGE, 2 * PAGE));
    assert_eq!(vm.shmem_maps(), 0);
    // The channel still works afterwards.
    assert!(cmd(&vm, CMD_MAP_RANGE, 0, PAGE));
    assert_eq!(vm.shmem_maps(), 1);
    assert_eq!(
        perms_at(vm.shm_base() as usize + SHM_SIZE as usize - 1),
        "---p"
    );
}

/// A SHMEM_MAP that is malformed at the vhost-user level (offset + len wraps) is
/// rejected by vhost's message validator before our handler runs, without a reply; the
/// frontend then closes the backend-request channel rather than leave the backend
/// waiting for an ack forever. The control queue keeps working.
#[test]
fn malformed_shmem_message_closes_channel() {
    let server = start_server();
    let vm = connect(&server);
    assert!(!cmd(&vm, CMD_MAP_RANGE, u64::MAX - PAGE + 1, PAGE));
    assert!(!cmd(&vm, CMD_MAP_RANGE, 0, PAGE));
    assert_eq!(vm.shmem_maps(), 0);
    let req = Request {
        pid: 1,
        ctx: 0,
        op: Op::GetInfo,
    }
    .encode();
    assert_eq!(vm.request(&req).unwrap(), req);
}

#[test]
fn guest_allocations() {
    let server = start_server();
    let vm = connect(&server);
    let a = vm.alloc_guest(10_000, 0).unwrap();
    assert_eq!(a.gpa % PAGE, 0);
    assert_eq!(a.len, 3 * PAGE);
    let b = vm.alloc_guest(PAGE, 2 << 20).unwrap();
    assert_eq!(b.gpa % (2 << 20), 0);
    assert!(b.gpa >= a.gpa + a.len || b.gpa + b.len <= a.gpa);
    // SAFETY: `a` is ours and `a.len` bytes long.
    unsafe {
        assert_eq!(a.ptr.read(), 0);
        a.ptr.add(a.len as usize - 1).write(9);
    }
    assert_eq!(vm.guest_ptr(a.gpa, a.len), Some(a.ptr));
    assert!(vm.alloc_guest(1 << 40, 0).is_err());
    vm.free_guest(a.gpa).unwrap();
    assert!(vm.free_guest(a.gpa).is_err());
    vm.free_guest(b.gpa).unwrap();
    // Most of the 64 MiB is available to guest processes.
    let big = vm.alloc_guest(48 << 20, 0).unwrap();
    vm.free_guest(big.gpa).unwrap();
}

#[test]
fn events_are_delivered_and_refilled() {
    let server = start_server();
    let vm = connect(&server);
    assert_eq!(vm.next_event(Duration::from_millis(10)), None);
    // More events than the queue has buffers: only works if buffers are reposted.
    for i in 0..(QUEUE_SIZE as u64 + 50) {
        assert!(cmd(&vm, CMD_EVENT, 1000 + i, i));
        let ev = vm.next_event(Duration::from_secs(5)).unwrap();
        assert_eq!(
            ev,
            Event {
                kind: event::NOTIFY,
                channel: 7,
                value: i as u32,
                info: 1000 + i,
            }
        );
    }
    // A burst: queued events wait for the consumer.
    for i in 0..10 {
        assert!(cmd(&vm, CMD_EVENT, i, i));
    }
    for i in 0..10 {
        assert_eq!(vm.next_event(Duration::from_secs(5)).unwrap().info, i);
    }
}

#[test]
fn disconnect_is_observed() {
    let server = start_server();
    let vm = connect(&server);
    let req = Request {
        pid: 1,
        ctx: 0,
        op: Op::GetInfo,
    }
    .encode();
    assert_eq!(vm.request(&req).unwrap(), req);
    assert!(server.done.try_recv().is_err());
    assert!(cmd(&vm, CMD_MAP, 0, 0x44));
    assert_eq!(perms_at(vm.shm_base() as usize), "rw-s");
    vm.disconnect();
    // Mappings of the backend's objects go away with the connection: the window reads
    // scratch zeros (a guest thread of the old connection may still read it once).
    assert_eq!(perms_at(vm.shm_base() as usize), "rw-p");
    // SAFETY: the window stays reserved while `vm` lives, and is readable scratch now.
    assert_eq!(unsafe { vm.shm_base().read_volatile() }, 0);
    server
        .done
        .recv_timeout(Duration::from_secs(5))
        .expect("backend did not see the disconnect");
    assert!(matches!(vm.request(&req), Err(LoopbackError::Disconnected)));
    assert!(!vm.is_connected());
    vm.disconnect(); // idempotent
    drop(vm);
}

#[test]
fn backend_hangup_fails_requests() {
    let server = start_server();
    let vm = connect(&server);
    let req = Request {
        pid: 1,
        ctx: 0,
        op: Op::GetInfo,
    }
    .encode();
    assert_eq!(vm.request(&req).unwrap(), req);
    assert!(cmd(&vm, CMD_MAP, PAGE, 0x55));
    server.shutdown.shutdown();
    server.done.recv_timeout(Duration::from_secs(5)).unwrap();
    // The hang-up is noticed (by the interrupt thread) without any request in flight.
    let t0 = std::time::Instant::now();
    while vm.is_connected() {
        assert!(t0.elapsed() < Duration::from_secs(5), "hang-up not noticed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (tx, rx) = mpsc::channel();
    let vm2 = vm.clone();
    std::thread::spawn(move || tx.send(vm2.request(&req).map(|_| ())).unwrap());
    let r = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("request hangs after the backend hung up");
    // The backend's page left the window: scratch zeros in its place.
    assert_eq!(perms_at(vm.shm_base() as usize + PAGE as usize), "rw-p");
    assert!(matches!(r, Err(LoopbackError::Disconnected)), "{r:?}");
    assert!(!vm.is_connected());
    assert_eq!(vm.next_event(Duration::from_millis(1)), None);
}

#[test]
fn drop_disconnects() {
    let server = start_server();
    let vm = connect(&server);
    drop(vm);
    server
        .done
        .recv_timeout(Duration::from_secs(5))
        .expect("backend did not see the disconnect");
}

#[test]
fn connect_to_missing_socket_fails() {
    let r = LoopbackVm::connect(
        std::path::Path::new("/nonexistent/vgpu.sock"),
        LoopbackConfig::default(),
    );
    assert!(r.is_err());
    let _ = op::GET_INFO;
}
