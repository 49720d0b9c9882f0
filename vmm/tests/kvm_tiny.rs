//! The KVM layer against tiny hand-assembled real-mode guests. Each test skips (with a note)
//! where /dev/kvm is missing or not accessible. Every run loop is bounded by an exit cap and
//! a watchdog that kicks the vCPU out of the guest.

use std::ops::ControlFlow;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vgpu_vmm::guest_memory::{GuestRam, PAGE_SIZE};
use vgpu_vmm::kvm::{IoEventAddress, KvmError, NoDatamatch, Vcpu, VcpuKicker, Vm, VmExit};
use vgpu_vmm::shm_window::ShmWindow;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Guest RAM: 64 KiB at GPA 0; code is loaded at 0x1000 and entered at 0000:1000.
const RAM_LEN: u64 = 0x10000;
const CODE: u64 = 0x1000;
/// Exit cap for every run loop.
const MAX_EXITS: u64 = 10_000;
/// After this, the watchdog kicks the vCPU (the test then fails with `Interrupted`).
const WATCHDOG: Duration = Duration::from_secs(10);

fn vm_or_skip(test: &str) -> Option<Vm> {
    match Vm::new() {
        Ok(vm) => Some(vm),
        Err(KvmError::Open(e)) => {
            eprintln!("note: skipping {test}: /dev/kvm is missing or not accessible ({e})");
            None
        }
        Err(e) => panic!("creating a VM failed: {e}"),
    }
}

fn poke(ram: &GuestRam, gpa: u64, bytes: &[u8]) {
    let p = ram.host_ptr(gpa, bytes.len() as u64).expect("gpa in RAM");
    // SAFETY: `p` points at `bytes.len()` bytes of guest RAM (checked by `host_ptr`); the
    // vCPU is not running.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
}

/// A VM with 64 KiB of RAM holding `code` at 0x1000, and one vCPU about to run it.
fn tiny_vm(test: &str, code: &[u8]) -> Option<(Vm, Arc<GuestRam>, Vcpu)> {
    let vm = vm_or_skip(test)?;
    let ram = Arc::new(GuestRam::new(&[(0, RAM_LEN)]).expect("guest RAM"));
    vm.add_ram(&ram).expect("RAM memslot");
    poke(&ram, CODE, code);
    let vcpu = vm.create_vcpu(0).expect("vCPU");
    vcpu.setup_real_mode(0, CODE as u16).expect("real mode");
    Some((vm, ram, vcpu))
}

/// Kicks the vCPU (repeatedly) if not dropped within `timeout`.
struct Watchdog {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<bool>>,
}

impl Watchdog {
    fn new(kicker: VcpuKicker, timeout: Duration) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            if rx.recv_timeout(timeout) != Err(mpsc::RecvTimeoutError::Timeout) {
                return false;
            }
            eprintln!("watchdog: vCPU still running after {timeout:?}, kicking it");
            while kicker.kick()
                && rx.recv_timeout(Duration::from_millis(10))
                    == Err(mpsc::RecvTimeoutError::Timeout)
            {}
            true
        });
        Watchdog {
            stop: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs to the next exit, which must be an `out` (returned as port and data); fills
/// `MmioRead`s on the way from `mmio_fill` and records their addresses.
fn next_out(vcpu: &mut Vcpu, mmio_fill: u8, mmio_reads: &mut Vec<u64>) -> (u16, Vec<u8>) {
    let mut out = None;
    vcpu.run_bounded(MAX_EXITS, |exit| match exit {
        VmExit::IoOut { port, data } => {
            out = Some((port, data.to_vec()));
            Ok(ControlFlow::Break(()))
        }
        VmExit::MmioRead { addr, data } => {
            mmio_reads.push(addr);
            data.fill(mmio_fill);
            Ok(ControlFlow::Continue(()))
        }
        other => Err(KvmError::UnhandledExit(format!("{other:?}"))),
    })
    .expect("run to the next out");
    out.expect("an out exit")
}

fn memfd_pages(words: &[u32]) -> std::fs::File {
    // SAFETY: a valid NUL-terminated name and valid flags.
    let fd = unsafe { libc::memfd_create(c"kvm-tiny".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is fresh and owned by nobody else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(words.len() as u64 * PAGE_SIZE).unwrap();
    for (i, w) in words.iter().enumerate() {
        f.write_all_at(&w.to_le_bytes(), i as u64 * PAGE_SIZE)
            .unwrap();
    }
    f
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Test 1, memslots: the guest reads guest RAM and a second slot added (and removed) while it
/// runs; outside any slot its reads are MMIO exits.
#[test]
fn memslots_visible_to_guest() {
    #[rustfmt::skip]
    let code = [
        0xA0, 0x00, 0x05,   // 1000: mov al, [0x0500]      ; DS=0: GPA 0x500 (RAM slot)
        0xE6, 0x10,         // 1003: out 0x10, al
        0xB8, 0x00, 0x20,   // 1005: mov ax, 0x2000
        0x8E, 0xD8,         // 1008: mov ds, ax            ; DS base 0x20000
        0xA0, 0x00, 0x00,   // 100a: mov al, [0x0000]      ; GPA 0x20000 (second slot)
        0xE6, 0x11,         // 100d: out 0x11, al
        0xEB, 0xF9,         // 100f: jmp 0x100a            ; -7
    ];
    let Some((vm, ram, mut vcpu)) = tiny_vm("memslots_visible_to_guest", &code) else {
        return;
    };
    let _wd = Watchdog::new(vcpu.kicker(), WATCHDOG);
    poke(&ram, 0x500, &[0x42]);
    let mut mmio = Vec::new();

    assert_eq!(next_out(&mut vcpu, 0xEE, &mut mmio), (0x10, vec![0x42]));

    // No slot at 0x20000 yet: the read is an MMIO exit, answered by the host.
    assert_eq!(next_out(&mut vcpu, 0xEE, &mut mmio), (0x11, vec![0xEE]));
    assert_eq!(mmio, [0x20000]);

    // Add a second slot at GPA 0x20000 while the vCPU is stopped at the `out`.
    let second = Arc::new(GuestRam::new(&[(0x20000, PAGE_SIZE)]).unwrap());
    poke(&second, 0x20000, &[0x77]);
    let slots = vm.add_ram(&second).unwrap();
    assert_eq!(slots.len(), 1);
    assert!(matches!(vm.add_ram(&second), Err(KvmError::Overlap { .. })));
    assert_eq!(next_out(&mut vcpu, 0xEE, &mut mmio), (0x11, vec![0x77]));
    poke(&second, 0x20000, &[0x78]);
    assert_eq!(next_out(&mut vcpu, 0xEE, &mut mmio), (0x11, vec![0x78]));
    assert_eq!(mmio.len(), 1, "reads inside the slot must not exit");

    // Remove it: MMIO again.
    vm.remove_memslot(slots[0]).unwrap();
    assert_eq!(next_out(&mut vcpu, 0xDD, &mut mmio), (0x11, vec![0xDD]));
    assert_eq!(mmio, [0x20000, 0x20000]);
    assert_eq!(vm.memslots().len(), 1);
    // 1 out + (1 mmio + 1 out) + 1 out + 1 out + (1 mmio + 1 out)
    assert_eq!(vcpu.exits(), 7);
}

/// Test 2, the shared-memory window (the device's BAR) under a memslot: a SHMEM_MAP-style remap
/// (`ShmWindow::map`, i.e. mmap MAP_FIXED) is seen by the guest's next read, with the slot
/// untouched.
#[test]
fn shm_window_remap_seen_by_guest() {
    const WIN_GPA: u64 = 0x80000;
    #[rustfmt::skip]
    let code = [
        0xB8, 0x00, 0x80,         // 1000: mov ax, 0x8000
        0x8E, 0xD8,               // 1003: mov ds, ax          ; DS base 0x80000 = window
        0x66, 0xA1, 0x00, 0x00,   // 1005: mov eax, [0x0000]   ; first word of the window
        0x66, 0xE7, 0x10,         // 1009: out 0x10, eax
        0xEB, 0xF7,               // 100c: jmp 0x1005          ; -9
    ];
    let Some((vm, _ram, mut vcpu)) = tiny_vm("shm_window_remap_seen_by_guest", &code) else {
        return;
    };
    let _wd = Watchdog::new(vcpu.kicker(), WATCHDOG);
    const A: u32 = 0xAAAA_0001;
    const B: u32 = 0xBBBB_0002;
    let pages = memfd_pages(&[A, B]);
    let window = Arc::new(ShmWindow::new(0, 4 * PAGE_SIZE).unwrap());
    window
        .map(0, 0, PAGE_SIZE, pages.as_raw_fd(), 0, true)
        .unwrap();
    let slot = vm.add_shm_window(WIN_GPA, &window).unwrap();
    let slots_before = vm.memslots();

    let mut mmio = Vec::new();
    let mut read = |vcpu: &mut Vcpu| {
        let (port, data) = next_out(vcpu, 0, &mut mmio);
        assert_eq!(port, 0x10);
        u32::from_le_bytes(data.try_into().unwrap())
    };
    assert_eq!(read(&mut vcpu), A);
    assert_eq!(read(&mut vcpu), A);

    const ROUNDS: usize = 200;
    let (mut remap, mut visible, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..ROUNDS {
        // Swap the page under the window: B at odd rounds' ends, A at even ones'.
        let (fd_off, want) = if i % 2 == 0 { (PAGE_SIZE, B) } else { (0, A) };
        let t0 = Instant::now();
        window
            .map(0, 0, PAGE_SIZE, pages.as_raw_fd(), fd_off, true)
            .unwrap();
        let t1 = Instant::now();
        assert_eq!(
            read(&mut vcpu),
            want,
            "round {i}: the next read sees the new page"
        );
        let t2 = Instant::now();
        assert_eq!(read(&mut vcpu), want);
        let t3 = Instant::now();
        remap.push(t1 - t0);
        visible.push(t2 - t0);
        plain.push(t3 - t2);
    }
    assert_eq!(vm.memslots(), slots_before, "the memslot was not touched");
    assert_eq!(vm.memslots()[slot as usize].host, window.base() as u64);
    assert!(mmio.is_empty());
    assert_eq!(window.maps(), 1 + ROUNDS as u64);
    eprintln!(
        "shm remap under a memslot ({ROUNDS} rounds, medians): mmap(MAP_FIXED) {:?}; \
         remap -> guest's next read seen by host {:?}; plain read+exit round trip {:?}",
        median(&mut remap),
        median(&mut visible),
        median(&mut plain),
    );
}

/// Test 3, ioeventfd: guest writes to a PIO port and an MMIO address with ioeventfds signal the
/// host's EventFds in the kernel, with no userspace exit.
#[test]
fn ioeventfd_no_exit() {
    const PIO_PORT: u16 = 0x44;
    const MMIO_ADDR: u64 = 0x90000;
    #[rustfmt::skip]
    let code = [
        0xB9, 0x0A, 0x00,   // 1000: mov cx, 10
        0xE6, 0x44,         // 1003: out 0x44, al          ; PIO ioeventfd
        0xE2, 0xFC,         // 1005: loop 0x1003           ; -4
        0xB8, 0x00, 0x90,   // 1007: mov ax, 0x9000
        0x8E, 0xD8,         // 100a: mov ds, ax            ; DS base 0x90000 (no memslot)
        0xB9, 0x05, 0x00,   // 100c: mov cx, 5
        0xA2, 0x00, 0x00,   // 100f: mov [0x0000], al      ; MMIO ioeventfd at 0x90000
        0xE2, 0xFB,         // 1012: loop 0x100f           ; -5
        0xE6, 0x45,         // 1014: out 0x45, al          ; "done" (a real exit)
        0xF4,               // 1016: hlt
    ];
    let Some((vm, _ram, mut vcpu)) = tiny_vm("ioeventfd_no_exit", &code) else {
        return;
    };
    let _wd = Watchdog::new(vcpu.kicker(), WATCHDOG);
    let pio = EventFd::new(EFD_NONBLOCK).unwrap();
    let mmio = EventFd::new(EFD_NONBLOCK).unwrap();
    vm.register_ioevent(&pio, IoEventAddress::Pio(PIO_PORT.into()), NoDatamatch)
        .unwrap();
    vm.register_ioevent(&mmio, IoEventAddress::Mmio(MMIO_ADDR), NoDatamatch)
        .unwrap();
    assert!(pio.read().is_err(), "not readable before the guest runs");

    let mut seen = Vec::new();
    vcpu.run_bounded(MAX_EXITS, |exit| match exit {
        VmExit::IoOut { port, .. } => {
            seen.push(format!("out {port:#x}"));
            Ok(ControlFlow::Continue(()))
        }
        VmExit::MmioWrite { addr, .. } => {
            seen.push(format!("mmio write {addr:#x}"));
            Ok(ControlFlow::Continue(()))
        }
        VmExit::Hlt => {
            seen.push("hlt".into());
            Ok(ControlFlow::Break(()))
        }
        other => Err(KvmError::UnhandledExit(format!("{other:?}"))),
    })
    .unwrap();
    assert_eq!(
        seen,
        ["out 0x45", "hlt"],
        "only the done marker and hlt exit"
    );
    assert_eq!(vcpu.exits(), 2);
    assert_eq!(pio.read().unwrap(), 10, "one signal per PIO write");
    assert_eq!(mmio.read().unwrap(), 5, "one signal per MMIO write");

    // Unregistered, the same writes exit to userspace again.
    vm.unregister_ioevent(&pio, IoEventAddress::Pio(PIO_PORT.into()), NoDatamatch)
        .unwrap();
    vcpu.setup_real_mode(0, CODE as u16).unwrap();
    let mut outs = 0;
    vcpu.run_bounded(MAX_EXITS, |exit| match exit {
        VmExit::IoOut { port: PIO_PORT, .. } => {
            outs += 1;
            Ok(ControlFlow::Continue(()))
        }
        VmExit::IoOut { .. } => Ok(ControlFlow::Continue(())),
        VmExit::Hlt => Ok(ControlFlow::Break(())),
        other => Err(KvmError::UnhandledExit(format!("{other:?}"))),
    })
    .unwrap();
    assert_eq!(outs, 10);
    assert!(pio.read().is_err());
    assert_eq!(mmio.read().unwrap(), 5);
}

/// The kicker (what the watchdog uses) gets a vCPU out of a guest that never exits.
#[test]
fn kick_interrupts_spinning_guest() {
    #[rustfmt::skip]
    let code = [
        0xEB, 0xFE,   // 1000: jmp 0x1000   ; spin forever, no exits
    ];
    let Some((_vm, _ram, mut vcpu)) = tiny_vm("kick_interrupts_spinning_guest", &code) else {
        return;
    };
    let kicker = vcpu.kicker();
    let t0 = Instant::now();
    let k = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        kicker.kick()
    });
    let r = vcpu.run_bounded(MAX_EXITS, |exit| {
        Err(KvmError::UnhandledExit(format!("{exit:?}")))
    });
    assert!(matches!(r, Err(KvmError::Interrupted)), "{r:?}");
    assert!(t0.elapsed() >= Duration::from_millis(50));
    assert!(k.join().unwrap());
    assert_eq!(vcpu.exits(), 0);
    let rip = vcpu.regs().unwrap().rip;
    assert_eq!(rip, CODE, "still at the spin loop");
    // A kick is reported once: the vCPU runs again afterwards (kicked again to stop).
    let kicker = vcpu.kicker();
    {
        let _wd = Watchdog::new(kicker.clone(), Duration::from_millis(50));
        assert!(matches!(vcpu.run(), Ok(VmExit::Interrupted)));
    }
    drop(vcpu);
    assert!(!kicker.kick(), "a kicker outliving its vCPU does nothing");
}

/// irqfd: with the in-kernel irqchip, a host write to an irqfd on GSI 5 interrupts the
/// guest (PIC IRQ5 -> vector 0x25) out of an in-kernel HLT; its handler reports on a port.
#[test]
fn irqfd_interrupts_guest() {
    const GSI: u32 = 5;
    const HANDLER: u16 = 0x1100;
    #[rustfmt::skip]
    let code = [
        0xB0, 0x11,   // 1000: mov al, 0x11
        0xE6, 0x20,   // 1002: out 0x20, al   ; PIC ICW1: edge, cascade, ICW4 follows
        0xB0, 0x20,   // 1004: mov al, 0x20
        0xE6, 0x21,   // 1006: out 0x21, al   ; ICW2: IRQ0-7 -> vectors 0x20-0x27
        0xB0, 0x04,   // 1008: mov al, 0x04
        0xE6, 0x21,   // 100a: out 0x21, al   ; ICW3: slave on IRQ2
        0xB0, 0x01,   // 100c: mov al, 0x01
        0xE6, 0x21,   // 100e: out 0x21, al   ; ICW4: 8086 mode
        0xB0, 0xDF,   // 1010: mov al, 0xdf
        0xE6, 0x21,   // 1012: out 0x21, al   ; OCW1: mask all but IRQ5
        0xE6, 0x10,   // 1014: out 0x10, al   ; "ready" (the PIC ports above do not exit)
        0xFB,         // 1016: sti
        0xF4,         // 1017: hlt            ; in the kernel (irqchip): no exit
        0xEB, 0xFD,   // 1018: jmp 0x1017     ; -3
    ];
    #[rustfmt::skip]
    let handler = [
        0xB0, 0x20,   // 1100: mov al, 0x20
        0xE6, 0x20,   // 1102: out 0x20, al   ; EOI to the PIC
        0xB0, 0x99,   // 1104: mov al, 0x99
        0xE6, 0x11,   // 1106: out 0x11, al   ; report the interrupt
        0xCF,         // 1108: iret
    ];
    let Some(mut vm) = vm_or_skip("irqfd_interrupts_guest") else {
        return;
    };
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    assert!(matches!(
        vm.register_irqfd(&irq, GSI),
        Err(KvmError::NoIrqChip)
    ));
    vm.create_irqchip().unwrap();
    vm.register_irqfd(&irq, GSI).unwrap();
    let ram = Arc::new(GuestRam::new(&[(0, RAM_LEN)]).unwrap());
    vm.add_ram(&ram).unwrap();
    poke(&ram, CODE, &code);
    poke(&ram, HANDLER.into(), &handler);
    // IVT entry 0x25 (at 0x25 * 4): offset, segment.
    let [lo, hi] = HANDLER.to_le_bytes();
    poke(&ram, 0x25 * 4, &[lo, hi, 0, 0]);
    let mut vcpu = vm.create_vcpu(0).unwrap();
    vcpu.setup_real_mode(0, CODE as u16).unwrap();
    let _wd = Watchdog::new(vcpu.kicker(), WATCHDOG);

    let mut mmio = Vec::new();
    assert_eq!(next_out(&mut vcpu, 0, &mut mmio).0, 0x10);
    const IRQS: usize = 3;
    let irq2 = irq.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let mut sent = Vec::new();
        for _ in 0..IRQS {
            // The guest is (most likely) halted in the kernel by now.
            std::thread::sleep(Duration::from_millis(20));
            sent.push(Instant::now());
            irq2.write(1).unwrap();
        }
        sent
    });
    let mut got = Vec::new();
    for _ in 0..IRQS {
        assert_eq!(next_out(&mut vcpu, 0, &mut mmio), (0x11, vec![0x99]));
        got.push(Instant::now());
    }
    let sent = writer.join().unwrap();
    assert!(mmio.is_empty());
    assert_eq!(
        vcpu.exits(),
        1 + IRQS as u64,
        "PIC writes and HLT stay in the kernel"
    );
    let mut lat: Vec<Duration> = got.iter().zip(&sent).map(|(g, s)| *g - *s).collect();
    eprintln!(
        "irqfd write -> guest handler's out seen by host: median {:?}",
        median(&mut lat)
    );
    vm.unregister_irqfd(&irq, GSI).unwrap();
}

/// Test 6, a store into a window page the backend holds read-only while it moves it (the
/// VRAM manager's move of an aperture chunk). Depending on the KVM, either `KVM_RUN` fails
/// with EFAULT (or a memory-fault exit) before the store runs, and re-entering after the new
/// copy is mapped writable runs it into the new copy (Linux KVM); or the store reaches
/// userspace as an MMIO write, which `ShmWindow::complete_store` performs once the new copy
/// is writable (the PVM KVM of the dev machines). Either way nothing is lost and the old
/// copy is untouched.
#[test]
fn store_into_read_only_window_page_waits_for_the_new_copy() {
    const WIN_GPA: u64 = 0x80000;
    const STORE_IP: u64 = 0x1008;
    #[rustfmt::skip]
    let code = [
        0xB8, 0x00, 0x80,   // 1000: mov ax, 0x8000
        0x8E, 0xD8,         // 1003: mov ds, ax          ; DS base 0x80000 = window
        0xB8, 0x01, 0x00,   // 1005: mov ax, 1
        0xA3, 0x00, 0x00,   // 1008: mov [0x0000], ax    ; store into the window
        0xE7, 0x10,         // 100b: out 0x10, ax
        0x40,               // 100d: inc ax
        0xEB, 0xF8,         // 100e: jmp 0x1008          ; -8
    ];
    let test = "store_into_read_only_window_page_waits_for_the_new_copy";
    let Some((vm, _ram, mut vcpu)) = tiny_vm(test, &code) else {
        return;
    };
    let _wd = Watchdog::new(vcpu.kicker(), WATCHDOG);
    let copies = [memfd_pages(&[0]), memfd_pages(&[0])];
    let window = Arc::new(ShmWindow::new(0, 4 * PAGE_SIZE).unwrap());
    window
        .map(0, 0, PAGE_SIZE, copies[0].as_raw_fd(), 0, true)
        .unwrap();
    vm.add_shm_window(WIN_GPA, &window).unwrap();
    let word = |f: &std::fs::File| {
        let mut b = [0u8; 2];
        f.read_exact_at(&mut b, 0).unwrap();
        u16::from_le_bytes(b)
    };
    let mut mmio = Vec::new();
    assert_eq!(next_out(&mut vcpu, 0, &mut mmio), (0x10, vec![1, 0]));
    assert_eq!(word(&copies[0]), 1);
    let (mut faulted, mut emulated) = (0, 0);
    let mut cur = 0;
    for round in 2..=41u16 {
        let next = 1 - cur;
        // The move: write-protect the current copy, copy it, map the new copy writable.
        window
            .map(0, 0, PAGE_SIZE, copies[cur].as_raw_fd(), 0, false)
            .unwrap();
        assert!(window.store_may_wait());
        let copy_and_remap = || {
            let mut page = vec![0u8; PAGE_SIZE as usize];
            copies[cur].read_exact_at(&mut page, 0).unwrap();
            copies[next].write_all_at(&page, 0).unwrap();
            window
                .map(0, 0, PAGE_SIZE, copies[next].as_raw_fd(), 0, true)
                .unwrap();
        };
        let emulated_store = match vcpu.run() {
            Err(KvmError::Run(e)) if e.errno() == libc::EFAULT => None,
            Err(KvmError::MemoryFault { gpa, .. }) => {
                assert_eq!(gpa & !(PAGE_SIZE - 1), WIN_GPA);
                None
            }
            Ok(VmExit::MmioWrite { addr, data }) => {
                assert_eq!(addr, WIN_GPA, "round {round}");
                Some(data.to_vec())
            }
            Ok(other) => panic!("round {round}: a store to a read-only page gave {other:?}"),
            Err(e) => panic!("round {round}: a store to a read-only page gave {e}"),
        };
        match emulated_store {
            None => {
                faulted += 1;
                assert_eq!(vcpu.regs().unwrap().rip, STORE_IP, "the store did not run");
                assert!(
                    matches!(
                        vcpu.run(),
                        Err(KvmError::Run(_) | KvmError::MemoryFault { .. })
                    ),
                    "the store faults again while the page is read-only"
                );
                copy_and_remap();
            }
            Some(data) => {
                emulated += 1;
                std::thread::scope(|s| {
                    let store = s.spawn(|| window.complete_store(0, &data).unwrap());
                    std::thread::sleep(Duration::from_millis(5));
                    assert!(
                        !store.is_finished(),
                        "the store waits while the page is read-only"
                    );
                    copy_and_remap();
                    store.join().unwrap();
                });
            }
        }
        let v = round.to_le_bytes().to_vec();
        assert_eq!(next_out(&mut vcpu, 0, &mut mmio), (0x10, v));
        assert_eq!(
            word(&copies[next]),
            round,
            "the store landed in the new copy"
        );
        assert_eq!(
            word(&copies[cur]),
            round - 1,
            "the old copy was not written"
        );
        cur = next;
    }
    assert!(mmio.is_empty());
    assert_eq!(window.read_only_bytes(), 0);
    eprintln!("read-only window stores: {faulted} faulted (EFAULT), {emulated} emulated (MMIO)");
}
