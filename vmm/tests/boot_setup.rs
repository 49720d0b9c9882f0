//! Boot setup of `vgpu-vmm`: what lands where in guest memory, the initial vCPU state, a
//! tiny 64-bit "kernel" that talks to the serial port and resets through the i8042 (runs
//! where `/dev/kvm` works, even the software PVM KVM of the dev machines), and the
//! binary's error on a missing kernel.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use linux_loader::loader::bootparam::boot_params;
use vgpu_vmm::boot::serial::SerialOut;
use vgpu_vmm::boot::x86_64::{self as arch, BOOT_GDT, E820_RAM};
use vgpu_vmm::boot::{guest_memory_of, GuestExit, LinuxVm, VmConfig};
use vgpu_vmm::guest_memory::GuestRam;
use vm_memory::{Bytes, GuestAddress};

/// 64-bit code at the entry point: print "OK\n" on COM1, then reset via the i8042.
const GUEST_CODE: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
    0xb0, b'O', 0xee, // mov al, 'O'; out dx, al
    0xb0, b'K', 0xee, // mov al, 'K'; out dx, al
    0xb0, b'\n', 0xee, // mov al, '\n'; out dx, al
    0xb0, 0xfe, 0xe6, 0x64, // mov al, 0xfe; out 0x64, al
    0xf4, // hlt
];

/// A minimal bzImage: one setup sector after the boot sector, a protected-mode part with
/// `GUEST_CODE` at its 64-bit entry (offset 0x200).
fn fake_bzimage() -> Vec<u8> {
    let mut img = vec![0u8; 2 * 512];
    img[0x1f1] = 1; // setup_sects
    img[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    img[0x202..0x206].copy_from_slice(b"HdrS");
    img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes()); // protocol 2.15
    img[0x211] = 0x01; // loadflags: LOADED_HIGH
    img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
    img[0x22c..0x230].copy_from_slice(&0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    img[0x230..0x234].copy_from_slice(&0x20_0000u32.to_le_bytes()); // kernel_alignment
    img[0x238..0x23c].copy_from_slice(&2047u32.to_le_bytes()); // cmdline_size
    let mut pm = vec![0x90u8; 0x1000];
    pm[0x200..0x200 + GUEST_CODE.len()].copy_from_slice(GUEST_CODE);
    img.extend_from_slice(&pm);
    img
}

fn temp_file(name: &str, data: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("vgpu-boot-test-{}-{name}", std::process::id()));
    let mut f = std::fs::File::create(&p).unwrap();
    f.write_all(data).unwrap();
    p
}

#[test]
fn guest_memory_layout() {
    const MEM: u64 = 64 << 20;
    let kernel = temp_file("layout-kernel", &fake_bzimage());
    let initrd_data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
    let initrd = temp_file("layout-initrd", &initrd_data);
    let ram = GuestRam::new(&arch::ram_layout(MEM)).unwrap();
    let mem = guest_memory_of(&ram).unwrap();
    let cmdline = "console=ttyS0 foo=bar";
    let l = arch::load_all(&mem, &kernel, Some(&initrd), cmdline, MEM, 2, &[]).unwrap();

    assert_eq!(l.kernel_load, arch::HIMEM_START);
    assert_eq!(l.entry, arch::HIMEM_START + 0x200);
    assert_eq!(l.cmdline_len, cmdline.len());
    let (igpa, ilen) = l.initrd.unwrap();
    assert_eq!(ilen, initrd_data.len() as u64);
    assert_eq!(igpa % 4096, 0);
    assert!(igpa + ilen <= MEM && igpa >= l.kernel_end);

    // Kernel code at its load address.
    let mut code = vec![0u8; GUEST_CODE.len()];
    mem.read_slice(&mut code, GuestAddress(l.entry)).unwrap();
    assert_eq!(code, GUEST_CODE);
    // Initrd contents.
    let mut back = vec![0u8; initrd_data.len()];
    mem.read_slice(&mut back, GuestAddress(igpa)).unwrap();
    assert_eq!(back, initrd_data);
    // Command line, NUL terminated.
    let mut cl = vec![0u8; cmdline.len() + 1];
    mem.read_slice(&mut cl, GuestAddress(arch::CMDLINE_START))
        .unwrap();
    assert_eq!(&cl[..cmdline.len()], cmdline.as_bytes());
    assert_eq!(cl[cmdline.len()], 0);

    // Zero page.
    let bp: boot_params = mem.read_obj(GuestAddress(arch::ZERO_PAGE_START)).unwrap();
    let hdr = bp.hdr;
    assert_eq!({ hdr.boot_flag }, 0xaa55);
    assert_eq!({ hdr.header }, 0x5372_6448);
    assert_eq!({ hdr.type_of_loader }, 0xff);
    assert_eq!({ hdr.cmd_line_ptr }, arch::CMDLINE_START as u32);
    assert_eq!({ hdr.cmdline_size }, cmdline.len() as u32);
    assert_eq!({ hdr.ramdisk_image }, igpa as u32);
    assert_eq!({ hdr.ramdisk_size }, ilen as u32);
    assert_eq!({ hdr.version }, 0x020f);
    let e820: Vec<(u64, u64, u32)> = bp.e820_table[..usize::from(bp.e820_entries)]
        .iter()
        .map(|e| (e.addr, e.size, e.r#type))
        .collect();
    assert_eq!(e820, arch::e820_map(MEM));
    assert_eq!(e820[0], (0, arch::EBDA_START, E820_RAM));
    assert_eq!(
        e820.last().copied(),
        Some((arch::HIMEM_START, MEM - arch::HIMEM_START, E820_RAM))
    );

    // GDT, page tables, MP table.
    for (i, e) in BOOT_GDT.iter().enumerate() {
        let v: u64 = mem
            .read_obj(GuestAddress(arch::BOOT_GDT_START + 8 * i as u64))
            .unwrap();
        assert_eq!(v, *e);
    }
    let pml4: u64 = mem.read_obj(GuestAddress(arch::PML4_START)).unwrap();
    assert_eq!(pml4, arch::PDPTE_START | 3);
    let pde1: u64 = mem.read_obj(GuestAddress(arch::PDE_START + 8)).unwrap();
    assert_eq!(pde1, (1 << 21) | 0x83);
    let mut sig = [0u8; 4];
    mem.read_slice(&mut sig, GuestAddress(arch::EBDA_START))
        .unwrap();
    assert_eq!(&sig, b"_MP_");

    // An initrd that cannot fit is refused with a clear error.
    let big = temp_file("layout-big", &vec![0u8; 70 << 20]);
    let err = arch::load_all(&mem, &kernel, Some(&big), "", MEM, 1, &[]).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    for p in [kernel, initrd, big] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn bad_kernel_is_refused() {
    let ram = GuestRam::new(&arch::ram_layout(32 << 20)).unwrap();
    let mem = guest_memory_of(&ram).unwrap();
    let junk = temp_file(
        "junk-kernel",
        b"this is not a kernel at all, just some text",
    );
    let err = arch::load_all(&mem, &junk, None, "", 32 << 20, 1, &[]).unwrap_err();
    assert!(
        err.to_string().contains("cannot load kernel image"),
        "{err}"
    );
    let err = arch::load_all(
        &mem,
        &PathBuf::from("/nonexistent/bz"),
        None,
        "",
        32 << 20,
        1,
        &[],
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("cannot open kernel image"),
        "{err}"
    );
    let _ = std::fs::remove_file(junk);
}

#[derive(Clone, Default)]
struct SharedBuf(Arc<Mutex<Vec<u8>>>);
impl Write for SharedBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn tiny_kernel_runs_and_resets() {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        eprintln!("skipping: no usable /dev/kvm");
        return;
    }
    let kernel = temp_file("tiny-kernel", &fake_bzimage());
    let cfg = VmConfig {
        kernel: kernel.clone(),
        initrd: None,
        cmdline: "console=ttyS0".into(),
        mem_mib: 64,
        vcpus: 2,
        serial: None,
        vgpu_stub: false,
        vgpu_socket: None,
        vgpu_faults: Default::default(),
    };
    let out = SharedBuf::default();
    let mut vm = LinuxVm::with_serial(&cfg, SerialOut::from_writer(Box::new(out.clone()))).unwrap();

    // Boot vCPU state: long mode at the entry point, %rsi at the zero page.
    let fd = vm.vcpus()[0].vcpu_fd();
    let regs = fd.get_regs().unwrap();
    assert_eq!(regs.rip, arch::HIMEM_START + 0x200);
    assert_eq!(regs.rsi, arch::ZERO_PAGE_START);
    assert_eq!(regs.rflags & 0x2, 0x2);
    let sregs = fd.get_sregs().unwrap();
    assert_eq!(sregs.cr3, arch::PML4_START);
    assert_eq!(sregs.cr0 & 0x8000_0001, 0x8000_0001);
    assert_ne!(sregs.cr4 & 0x20, 0);
    assert_eq!(sregs.efer & 0x500, 0x500);
    assert_eq!((sregs.cs.selector, sregs.cs.l), (0x08, 1));
    assert_eq!(sregs.gdt.base, arch::BOOT_GDT_START);
    // CPUID: APIC ids per vCPU.
    for (i, fd) in vm.vcpus().iter().map(|v| v.vcpu_fd()).enumerate() {
        let cpuid = fd.get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES).unwrap();
        let leaf1 = cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == 1)
            .copied()
            .unwrap();
        assert_eq!(leaf1.ebx >> 24, i as u32);
        assert_ne!(leaf1.ecx & (1 << 31), 0);
    }

    let how = vm.run(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(how, GuestExit::I8042Reset);
    assert_eq!(out.0.lock().unwrap().as_slice(), b"OK\n");
    let _ = std::fs::remove_file(kernel);
}

#[test]
fn binary_reports_missing_kernel() {
    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-vmm"))
        .args(["--kernel", "/nonexistent/vmlinuz", "--mem-mib", "64"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot open kernel image /nonexistent/vmlinuz"),
        "stderr: {err}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_vgpu-vmm"))
        .args(["--kernel", "/dev/null", "--mem-mib", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "bad --mem-mib is a usage error");
}

#[test]
fn pci_bars_in_the_mmio_gap() {
    use vgpu_vmm::virtio_pci::{shm_bar_size, BAR0_SIZE};
    let shm_len = vgpu_protocol::device::SHM_SIZE;
    let p = vgpu_vmm::boot::pci_bar_placement(shm_len).unwrap();
    let shm_size = shm_bar_size(shm_len).unwrap();
    assert_eq!(p.shm % shm_size, 0);
    assert_eq!(p.bar0 % BAR0_SIZE, 0);
    assert!(p.shm >= arch::MMIO_GAP_START);
    assert!(p.shm + shm_size <= p.bar0);
    assert!(p.bar0 + BAR0_SIZE <= u64::from(arch::IOAPIC_ADDR));
    // Nothing of the guest's RAM lies there, at any RAM size.
    for (gpa, len) in arch::ram_layout(8 << 30) {
        assert!(gpa + len <= p.shm || gpa >= p.bar0 + BAR0_SIZE);
    }
    // A region too large for the gap is refused.
    assert!(vgpu_vmm::boot::pci_bar_placement(2 << 30).is_err());
}

/// The binary under its default seccomp filters (`--seccomp kill`) boots the tiny kernel on
/// 2 vCPUs with the vgpu device connected to a real backend: setup, the vCPU threads
/// (KVM_RUN, serial, i8042 reset), the backend-request thread and the shutdown all stay
/// inside their roles' filters (a syscall outside kills the VMM with SIGSYS).
#[test]
fn binary_boots_under_default_seccomp() {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        eprintln!("skipping: no usable /dev/kvm");
        return;
    }
    let gpu = vgpu_host_shim::SimGpu::new(vgpu_host_shim::SimConfig::default()).unwrap();
    let backend = vgpu_backend::VgpuBackend::new(gpu, vgpu_backend::VmLimits::default());
    let sock = std::env::temp_dir().join(format!("vgpu-vmm-seccomp-{}.sock", std::process::id()));
    backend.serve_vm("vm0", &sock).unwrap();
    let kernel = temp_file("tiny-kernel-seccomp", &fake_bzimage());
    // VGPU_VMM_BIN runs the test against another build, e.g. the static (musl) binary
    // the nested rig uses.
    let bin = std::env::var_os("VGPU_VMM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_vgpu-vmm")));
    let out = Command::new(bin)
        .arg("--kernel")
        .arg(&kernel)
        .args(["--mem-mib", "64", "--vcpus", "2", "--timeout", "60"])
        .arg("--vgpu-socket")
        .arg(&sock)
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&kernel);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{err}", out.status);
    assert!(err.contains("seccomp: kill"), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "OK\n");
    backend.shutdown();
}
