//! The shared-memory window (the device's BAR): a reserved range of this process's address
//! space into which the backend maps pages with SHMEM_MAP and out of which it takes them
//! with SHMEM_UNMAP. In the KVM VMM the window is registered as a memslot, so a remap here
//! is seen by the guest at once.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use log::{debug, error, warn};
use thiserror::Error;
use vhost::vhost_user::message::{VhostUserMMap, VhostUserMMapFlags};
use vhost::vhost_user::{
    Error as VuError, FrontendReqHandler, HandlerResult, VhostUserFrontendReqHandler,
};
use vmm_sys_util::eventfd::EventFd;

use crate::guest_memory::PAGE_SIZE;
use crate::write_protect::Registration;

#[derive(Debug, Error)]
pub enum ShmWindowError {
    #[error("window size {0:#x} is not a non-zero multiple of the page size")]
    BadSize(u64),
    #[error("reserving the shared-memory window failed: {0}")]
    Reserve(io::Error),
    #[error("creating the backend request handler failed: {0}")]
    Handler(VuError),
    #[error("creating an eventfd failed: {0}")]
    EventFd(io::Error),
    #[error("spawning the backend request thread failed: {0}")]
    Spawn(io::Error),
}

/// What fills the parts of a window where the backend mapped nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HoleFill {
    /// Inaccessible (PROT_NONE): a stray access faults. For the loopback VM, where every
    /// access is ours and a fault points at a bug.
    #[default]
    NoAccess,
    /// Private zero-filled scratch memory: a guest that touches an unmapped slot reads
    /// zeros and writes into memory nobody else sees, instead of making KVM_RUN fail with
    /// EFAULT and ending its own VM. Bounded by the window's size.
    Scratch,
}

/// A reserved window of `len` bytes; holes (where nothing is mapped) as [`HoleFill`] says.
#[derive(Debug)]
pub struct ShmWindow {
    shmid: u8,
    fill: HoleFill,
    base: *mut u8,
    len: u64,
    maps: AtomicU64,
    unmaps: AtomicU64,
    /// Guest stores that waited for read-only pages (faults retried, stores completed).
    store_waits: AtomicU64,
    /// The ranges `(offset, len)` the backend mapped read-only. The mutex also serializes
    /// remaps of overlapping ranges against each other (cheap: one backend thread sends
    /// them anyway).
    lock: Mutex<Vec<(u64, u64)>>,
    /// Where stores that hit read-only ranges learn to wait (see [`crate::write_protect`]).
    wp: Registration,
}

// SAFETY: the window is an mmap reservation owned by this struct; its address is only
// used in mmap/munmap calls made under `lock`, and by users who dereference it at their
// own risk (like guest memory).
unsafe impl Send for ShmWindow {}
// SAFETY: see `Send`; all mutation goes through `lock` or atomics.
unsafe impl Sync for ShmWindow {}

impl ShmWindow {
    /// Reserves `len` bytes of address space for shared-memory region `shmid`, holes
    /// inaccessible.
    pub fn new(shmid: u8, len: u64) -> Result<Self, ShmWindowError> {
        Self::with_fill(shmid, len, HoleFill::NoAccess)
    }

    /// As [`ShmWindow::new`], with holes filled as `fill` says.
    pub fn with_fill(shmid: u8, len: u64, fill: HoleFill) -> Result<Self, ShmWindowError> {
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) || usize::try_from(len).is_err() {
            return Err(ShmWindowError::BadSize(len));
        }
        // SAFETY: a fresh anonymous reservation at an address of the kernel's choosing; it
        // touches no existing mapping.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                Self::hole_prot(fill),
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(ShmWindowError::Reserve(io::Error::last_os_error()));
        }
        Ok(ShmWindow {
            shmid,
            fill,
            base: base.cast(),
            len,
            maps: AtomicU64::new(0),
            unmaps: AtomicU64::new(0),
            store_waits: AtomicU64::new(0),
            lock: Mutex::new(Vec::new()),
            wp: Registration::new(base as usize, len as usize),
        })
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn shmid(&self) -> u8 {
        self.shmid
    }
    pub fn hole_fill(&self) -> HoleFill {
        self.fill
    }

    fn hole_prot(fill: HoleFill) -> libc::c_int {
        match fill {
            HoleFill::NoAccess => libc::PROT_NONE,
            HoleFill::Scratch => libc::PROT_READ | libc::PROT_WRITE,
        }
    }
    /// SHMEM_MAP requests served successfully.
    pub fn maps(&self) -> u64 {
        self.maps.load(Ordering::Relaxed)
    }
    /// SHMEM_UNMAP requests served successfully.
    pub fn unmaps(&self) -> u64 {
        self.unmaps.load(Ordering::Relaxed)
    }
    /// Bytes of the window the backend currently maps read-only.
    pub fn read_only_bytes(&self) -> u64 {
        self.lock
            .lock()
            .map(|ro| ro.iter().map(|r| r.1).sum())
            .unwrap_or(0)
    }
    /// Whether a guest store that just faulted on this window (KVM_RUN's EFAULT) should
    /// wait and be retried: part of the window is read-only while the backend moves it, or
    /// was until a moment ago.
    pub fn store_may_wait(&self) -> bool {
        self.wp.store_may_wait()
    }

    /// After a guest store faulted on this window: waits while part of it is read-only
    /// (until its protection changes, at most 1 ms) and says whether to retry the store.
    pub fn wait_after_fault(&self) -> bool {
        self.wp.wait_after_fault()
    }

    /// The window's protection generation, bumped on every change of its read-only
    /// ranges.
    pub fn protection_generation(&self) -> u32 {
        self.wp.generation()
    }

    /// Performs a guest store at `off` that KVM handed to userspace as an MMIO write
    /// because the page is read-only (some KVMs emulate such stores instead of failing
    /// with EFAULT). Like the store itself, it waits while the page is read-only: the
    /// write below faults into [`crate::write_protect`]'s handler, which retries it once
    /// the backend maps the page's new copy writable.
    pub fn complete_store(&self, off: u64, data: &[u8]) -> io::Result<()> {
        let len = data.len() as u64;
        if self.wp.store_may_wait() {
            self.note_store_wait();
        }
        if len == 0 || off.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `[off, off+len)` lies inside the window (checked above); every page of
        // the window is mapped (hole fill or backend pages), and read-only pages make the
        // stores below wait in the fault handler rather than fail.
        unsafe {
            let at = self.base.add(off as usize);
            // One store of the guest's width where it can be, so it stays atomic.
            match data.len() {
                8 if at.align_offset(8) == 0 => at
                    .cast::<u64>()
                    .write_volatile(u64::from_le_bytes(data.try_into().unwrap_or([0; 8]))),
                4 if at.align_offset(4) == 0 => at
                    .cast::<u32>()
                    .write_volatile(u32::from_le_bytes(data.try_into().unwrap_or([0; 4]))),
                2 if at.align_offset(2) == 0 => at
                    .cast::<u16>()
                    .write_volatile(u16::from_le_bytes(data.try_into().unwrap_or([0; 2]))),
                _ => {
                    for (i, b) in data.iter().enumerate() {
                        at.add(i).write_volatile(*b);
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts a guest store that waited for a read-only page (a vCPU re-entering after
    /// EFAULT).
    pub fn note_store_wait(&self) {
        self.store_waits.fetch_add(1, Ordering::Relaxed);
    }

    /// Guest stores that waited for read-only pages of this window.
    pub fn stores_waited(&self) -> u64 {
        self.store_waits.load(Ordering::Relaxed)
    }

    /// Records `[off, off+len)` as read-only (or not) and publishes the total.
    fn set_read_only(&self, ro: &mut Vec<(u64, u64)>, off: u64, len: u64, read_only: bool) {
        subtract_range(ro, off, len);
        if read_only {
            ro.push((off, len));
        }
        self.wp.set_read_only_bytes(ro.iter().map(|r| r.1).sum());
    }

    fn check(&self, shmid: u8, shm_offset: u64, len: u64) -> io::Result<()> {
        let inval = || io::Error::from_raw_os_error(libc::EINVAL);
        if shmid != self.shmid {
            return Err(inval());
        }
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) || !shm_offset.is_multiple_of(PAGE_SIZE) {
            return Err(inval());
        }
        let end = shm_offset.checked_add(len).ok_or_else(inval)?;
        if end > self.len {
            return Err(inval());
        }
        Ok(())
    }

    /// Maps `len` bytes of `fd` at `fd_offset` at `shm_offset` in the window.
    pub fn map(
        &self,
        shmid: u8,
        shm_offset: u64,
        len: u64,
        fd: RawFd,
        fd_offset: u64,
        writable: bool,
    ) -> io::Result<()> {
        self.check(shmid, shm_offset, len)?;
        if !fd_offset.is_multiple_of(PAGE_SIZE) || i64::try_from(fd_offset).is_err() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        let mut ro = self.lock.lock().map_err(|_| io::Error::other("poisoned"))?;
        if !writable {
            // Published before the pages turn read-only, so a store faulting on them
            // already finds them marked and waits.
            self.set_read_only(&mut ro, shm_offset, len, true);
        }
        // SAFETY: `check` proved `[shm_offset, shm_offset+len)` lies inside the window.
        let at = unsafe { self.base.add(shm_offset as usize) };
        // SAFETY: MAP_FIXED replaces only pages inside our own reservation (bounds checked
        // above); the fd is valid for the duration of the call (it is owned by the caller).
        let p = unsafe {
            libc::mmap(
                at.cast(),
                len as usize,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                fd_offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // A failed MAP_FIXED may have removed the old mapping: put the hole back.
            self.fill_hole(at, len);
            self.set_read_only(&mut ro, shm_offset, len, false);
            return Err(e);
        }
        if writable {
            // Published after the pages turned writable: stores that faulted meanwhile
            // see the change and retry.
            self.set_read_only(&mut ro, shm_offset, len, false);
        }
        self.maps.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Puts a hole (see [`HoleFill`]) back over `[shm_offset, shm_offset+len)`.
    pub fn unmap(&self, shmid: u8, shm_offset: u64, len: u64) -> io::Result<()> {
        self.check(shmid, shm_offset, len)?;
        let mut ro = self.lock.lock().map_err(|_| io::Error::other("poisoned"))?;
        // SAFETY: bounds checked above.
        let at = unsafe { self.base.add(shm_offset as usize) };
        if !self.fill_hole(at, len) {
            return Err(io::Error::last_os_error());
        }
        self.set_read_only(&mut ro, shm_offset, len, false);
        self.unmaps.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Drops every mapping in the window (all holes again). Done when the connection
    /// ends: the backend frees the VM's objects and may hand the pages to another VM.
    pub fn clear(&self) {
        self.clear_to(self.fill);
    }

    /// [`ShmWindow::clear`], filling the window with `fill` rather than the window's own:
    /// a loopback VM whose connection ended clears to scratch, since a guest thread of
    /// the old connection may read its channel page between its last look at the device
    /// and the read, and a fault there would end the whole process.
    pub fn clear_to(&self, fill: HoleFill) {
        let mut ro = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.fill_hole_with(self.base, self.len, fill);
        self.set_read_only(&mut ro, 0, self.len, false);
    }

    fn fill_hole(&self, at: *mut u8, len: u64) -> bool {
        self.fill_hole_with(at, len, self.fill)
    }

    fn fill_hole_with(&self, at: *mut u8, len: u64, fill: HoleFill) -> bool {
        // SAFETY: callers pass a range inside the window; replacing it with a fresh
        // anonymous mapping affects nothing outside the reservation.
        let p = unsafe {
            libc::mmap(
                at.cast(),
                len as usize,
                Self::hole_prot(fill),
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            error!(
                "cannot restore a hole over shm window range: {}",
                io::Error::last_os_error()
            );
            return false;
        }
        true
    }
}

impl Drop for ShmWindow {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are the reservation made in `new` (sub-ranges may have been
        // replaced by MAP_FIXED mappings, which munmap of the whole range removes too).
        unsafe {
            libc::munmap(self.base.cast(), self.len as usize);
        }
    }
}

/// Removes `[off, off+len)` from a set of disjoint `(offset, len)` ranges.
fn subtract_range(ranges: &mut Vec<(u64, u64)>, off: u64, len: u64) {
    let end = off.saturating_add(len);
    let mut out = Vec::with_capacity(ranges.len() + 1);
    for &(o, l) in ranges.iter() {
        let e = o.saturating_add(l);
        if e <= off || o >= end {
            out.push((o, l));
            continue;
        }
        if o < off {
            out.push((o, off - o));
        }
        if e > end {
            out.push((end, e - end));
        }
    }
    *ranges = out;
}

/// Serves backend requests on the window(s): SHMEM_MAP / SHMEM_UNMAP.
#[derive(Debug)]
pub struct ShmHandler {
    windows: Vec<Arc<ShmWindow>>,
    /// Fault injection: answer every SHMEM_MAP with an error (a VMM that cannot map).
    refuse_maps: AtomicBool,
}

impl ShmHandler {
    pub fn new(windows: Vec<Arc<ShmWindow>>) -> Self {
        ShmHandler {
            windows,
            refuse_maps: AtomicBool::new(false),
        }
    }

    /// While `on`, every SHMEM_MAP is refused (`ENOMEM`, nothing mapped); UNMAPs are
    /// still served. For fault tests of the backend's handling of a refused map.
    pub fn set_refuse_maps(&self, on: bool) {
        self.refuse_maps.store(on, Ordering::Release);
    }

    fn window(&self, shmid: u8) -> io::Result<&ShmWindow> {
        self.windows
            .iter()
            .find(|w| w.shmid == shmid)
            .map(|w| &**w)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
    }
}

impl VhostUserFrontendReqHandler for ShmHandler {
    fn shmem_map(&self, req: &VhostUserMMap, fd: &dyn AsRawFd) -> HandlerResult<u64> {
        let (shmid, shm_offset, len, fd_offset, flags) =
            (req.shmid, req.shm_offset, req.len, req.fd_offset, req.flags);
        let writable =
            VhostUserMMapFlags::from_bits_truncate(flags).contains(VhostUserMMapFlags::WRITABLE);
        if self.refuse_maps.load(Ordering::Acquire) {
            warn!("refusing SHMEM_MAP shm {shmid} [{shm_offset:#x}+{len:#x}] (fault injection)");
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        let r = self
            .window(shmid)
            .and_then(|w| w.map(shmid, shm_offset, len, fd.as_raw_fd(), fd_offset, writable));
        match &r {
            Ok(()) => debug!("SHMEM_MAP shm {shmid} [{shm_offset:#x}+{len:#x}] <- fd@{fd_offset:#x} w={writable}"),
            Err(e) => warn!("refused SHMEM_MAP shm {shmid} [{shm_offset:#x}+{len:#x}] fd@{fd_offset:#x}: {e}"),
        }
        r.map(|()| 0)
    }

    fn shmem_unmap(&self, req: &VhostUserMMap) -> HandlerResult<u64> {
        let (shmid, shm_offset, len) = (req.shmid, req.shm_offset, req.len);
        let r = self
            .window(shmid)
            .and_then(|w| w.unmap(shmid, shm_offset, len));
        match &r {
            Ok(()) => debug!("SHMEM_UNMAP shm {shmid} [{shm_offset:#x}+{len:#x}]"),
            Err(e) => warn!("refused SHMEM_UNMAP shm {shmid} [{shm_offset:#x}+{len:#x}]: {e}"),
        }
        r.map(|()| 0)
    }
}

/// A thread running the backend-request loop of a [`FrontendReqHandler`].
pub struct BackendReqThread {
    exit: EventFd,
    stopped: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl BackendReqThread {
    /// Starts serving `handler`. `reply_ack` must say whether REPLY_ACK was negotiated.
    /// Returns the thread and the fd to send with SET_BACKEND_REQ_FD (it stays valid while
    /// the thread lives; the backend gets its own copy with the message).
    pub fn start<S>(handler: Arc<S>, reply_ack: bool) -> Result<(Self, RawFd), ShmWindowError>
    where
        S: VhostUserFrontendReqHandler + Send + Sync + 'static,
    {
        let mut server = FrontendReqHandler::new(handler).map_err(ShmWindowError::Handler)?;
        server.set_reply_ack_flag(reply_ack);
        let tx_fd = server.get_tx_raw_fd();
        let exit = EventFd::new(libc::EFD_CLOEXEC).map_err(ShmWindowError::EventFd)?;
        let exit_fd = exit.as_raw_fd();
        let stopped = Arc::new(AtomicBool::new(false));
        let stopped2 = stopped.clone();
        let thread = std::thread::Builder::new()
            .name("vu-backend-req".into())
            .spawn(move || {
                vgpu_sandbox::enter(vgpu_sandbox::Role::VmmBackendReq);
                serve(&mut server, exit_fd);
                stopped2.store(true, Ordering::Release);
                // `server` (both socket ends) is dropped here: the backend sees the channel close.
            })
            .map_err(ShmWindowError::Spawn)?;
        Ok((
            BackendReqThread {
                exit,
                stopped,
                thread: Some(thread),
            },
            tx_fd,
        ))
    }

    /// Whether the loop has ended (channel closed or broken).
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Stops the loop and joins the thread.
    pub fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            if let Err(e) = self.exit.write(1) {
                error!("cannot signal backend request thread: {e}");
            }
            if t.join().is_err() {
                error!("backend request thread panicked");
            }
        }
    }
}

impl Drop for BackendReqThread {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve<S: VhostUserFrontendReqHandler>(server: &mut FrontendReqHandler<S>, exit_fd: RawFd) {
    let sock = server.as_raw_fd();
    loop {
        let mut fds = [
            libc::pollfd {
                fd: sock,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: exit_fd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            error!("poll on backend request channel failed: {e}");
            return;
        }
        if fds[1].revents != 0 {
            debug!("backend request thread: exit requested");
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        match server.handle_request() {
            Ok(_) => {}
            // The handler refused the request; the error reply has been sent.
            Err(VuError::ReqHandlerError(e)) => debug!("backend request refused: {e}"),
            Err(VuError::Disconnected) | Err(VuError::PartialMessage) => {
                debug!("backend request channel closed");
                return;
            }
            // Anything else leaves the channel in an unknown state (possibly with the
            // backend waiting for a reply that will never come): close it.
            Err(e) => {
                warn!("backend request channel broken, closing it: {e}");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn memfd_page(fill: u8) -> std::fs::File {
        // SAFETY: valid NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh fd.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[fill; 4096], 0).unwrap();
        f
    }

    #[test]
    fn map_unmap_bounds() {
        let w = ShmWindow::new(0, 16 * PAGE_SIZE).unwrap();
        let f = memfd_page(0x5a);
        w.map(0, PAGE_SIZE, PAGE_SIZE, f.as_raw_fd(), 0, true)
            .unwrap();
        // SAFETY: test; the page was just mapped readable.
        let byte = unsafe { w.base().add(PAGE_SIZE as usize + 7).read_volatile() };
        assert_eq!(byte, 0x5a);
        assert!(w
            .map(0, 16 * PAGE_SIZE, PAGE_SIZE, f.as_raw_fd(), 0, true)
            .is_err());
        assert!(w
            .map(0, 15 * PAGE_SIZE, 2 * PAGE_SIZE, f.as_raw_fd(), 0, true)
            .is_err());
        assert!(w.map(0, !0xfff, PAGE_SIZE, f.as_raw_fd(), 0, true).is_err());
        assert!(w.map(0, 100, PAGE_SIZE, f.as_raw_fd(), 0, true).is_err());
        assert!(w.map(1, 0, PAGE_SIZE, f.as_raw_fd(), 0, true).is_err());
        assert!(w.map(0, 0, PAGE_SIZE, f.as_raw_fd(), 1, true).is_err());
        w.unmap(0, PAGE_SIZE, PAGE_SIZE).unwrap();
        assert!(w.unmap(0, 0, 17 * PAGE_SIZE).is_err());
        assert_eq!((w.maps(), w.unmaps()), (1, 1));
    }

    #[test]
    fn read_only_ranges_are_tracked() {
        let w = ShmWindow::new(0, 16 * PAGE_SIZE).unwrap();
        let f = memfd_page(1);
        f.set_len(4 * PAGE_SIZE).unwrap();
        w.map(0, 0, 4 * PAGE_SIZE, f.as_raw_fd(), 0, false).unwrap();
        assert_eq!(w.read_only_bytes(), 4 * PAGE_SIZE);
        assert!(w.store_may_wait());
        w.map(0, PAGE_SIZE, PAGE_SIZE, f.as_raw_fd(), 0, true)
            .unwrap();
        assert_eq!(w.read_only_bytes(), 3 * PAGE_SIZE);
        w.unmap(0, 2 * PAGE_SIZE, PAGE_SIZE).unwrap();
        assert_eq!(w.read_only_bytes(), 2 * PAGE_SIZE);
        w.clear();
        assert_eq!(w.read_only_bytes(), 0);
        let mut r = vec![(0, 10), (20, 10)];
        subtract_range(&mut r, 5, 20);
        assert_eq!(r, [(0, 5), (25, 5)]);
    }

    /// A thread storing into the window while its pages are moved the way the VRAM manager
    /// moves a chunk (read-only map of the old copy, copy, writable map of the new copy)
    /// loses no store: stores that hit the read-only pages wait (SIGSEGV handler) and land
    /// in the new copy. The writer checks every pass through the window (which always
    /// shows the current copy) and goes on until some of its stores did wait, so the test
    /// cannot pass without exercising the wait.
    #[test]
    fn stores_during_moves_wait_and_land_in_the_new_copy() {
        use std::os::unix::fs::FileExt;
        use std::time::{Duration, Instant};
        const PAGES: u64 = 4;
        const WORDS: usize = (PAGES * PAGE_SIZE) as usize / 8;
        let w = Arc::new(ShmWindow::new(0, 8 * PAGE_SIZE).unwrap());
        let copies = [memfd_page(0), memfd_page(0)];
        for c in &copies {
            c.set_len(PAGES * PAGE_SIZE).unwrap();
        }
        w.map(0, 0, PAGES * PAGE_SIZE, copies[0].as_raw_fd(), 0, true)
            .unwrap();
        let waited0 = crate::write_protect::stores_waited();
        let done = Arc::new(AtomicBool::new(false));
        let base = w.base() as usize;
        let writer = {
            let done = done.clone();
            std::thread::spawn(move || -> Result<u64, String> {
                let p = base as *mut u64;
                let t0 = Instant::now();
                let mut pass = 0u64;
                let result = loop {
                    pass += 1;
                    let word = |i: usize| (pass << 32) | (i as u64 + 1);
                    for i in 0..WORDS {
                        // SAFETY: word `i` lies in the window's first PAGES pages, mapped
                        // for the whole test (read-only at times: then the store waits).
                        unsafe { p.add(i).write_volatile(word(i)) };
                        let t = Instant::now();
                        while t.elapsed() < Duration::from_micros(2) {
                            std::hint::spin_loop();
                        }
                    }
                    // SAFETY: as above; reads never wait.
                    let lost = (0..WORDS).find(|&i| unsafe { p.add(i).read_volatile() } != word(i));
                    if let Some(i) = lost {
                        break Err(format!("pass {pass}: word {i}: a store was lost"));
                    }
                    let waited = crate::write_protect::stores_waited() > waited0;
                    if (waited && pass >= 2) || t0.elapsed() > Duration::from_secs(20) {
                        break Ok(pass);
                    }
                };
                done.store(true, Ordering::Release);
                result
            })
        };
        let mut moves = 0usize;
        let mut cur = 0;
        let mut page = vec![0u8; (PAGES * PAGE_SIZE) as usize];
        while !done.load(Ordering::Acquire) {
            let next = 1 - cur;
            w.map(0, 0, PAGES * PAGE_SIZE, copies[cur].as_raw_fd(), 0, false)
                .unwrap();
            copies[cur].read_exact_at(&mut page, 0).unwrap();
            copies[next].write_all_at(&page, 0).unwrap();
            w.map(0, 0, PAGES * PAGE_SIZE, copies[next].as_raw_fd(), 0, true)
                .unwrap();
            cur = next;
            moves += 1;
        }
        let passes = writer.join().unwrap().unwrap();
        let waited = crate::write_protect::stores_waited() - waited0;
        assert!(
            waited > 0,
            "no store hit a read-only page in {passes} passes and {moves} moves: nothing tested"
        );
        assert_eq!(w.read_only_bytes(), 0);
        eprintln!("{passes} passes of {WORDS} stores over {moves} moves; {waited} stores waited");
    }
}
