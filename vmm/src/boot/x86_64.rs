//! x86_64 boot setup for the Linux 64-bit boot protocol: guest-physical memory layout,
//! kernel/initrd/cmdline loading (linux-loader), the zero page with its e820 map, an
//! MP table, and the initial vCPU state (GDT, identity page tables, registers, CPUID,
//! MSRs, FPU, LAPIC LINT pins).
//!
//! The layout and the register values follow Firecracker (`src/vmm/src/arch/x86_64`) and
//! rust-vmm's vmm-reference: the vCPU starts in long mode at the kernel's 64-bit entry
//! point (`load address + 0x200`) with `%rsi` pointing at the zero page.

use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;

use kvm_bindings::{
    kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, CpuId, Msrs,
};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::{self, BzImage, Cmdline, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::BootError;

// ---------------------------------------------------------------------------------------
// Guest-physical layout.

/// GDT: null, 64-bit code, data, TSS.
pub const BOOT_GDT_START: u64 = 0x500;
/// An empty IDT (the kernel installs its own before enabling interrupts).
pub const BOOT_IDT_START: u64 = 0x520;
/// The zero page (`struct boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer (the kernel switches stacks at once).
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity page tables: PML4, PDPT, PD (2 MiB pages), mapping the first GiB.
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// `COMMAND_LINE_SIZE` of x86 Linux, NUL included.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area: the MP table lives here; RAM below it is usable.
pub const EBDA_START: u64 = 0x9fc00;
/// First address above the legacy hole (ROMs, VGA): where the kernel is loaded.
pub const HIMEM_START: u64 = 0x10_0000;
/// The 32-bit MMIO gap (PCI BARs, IOAPIC, LAPIC): RAM above it is moved above 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Default IOAPIC and LAPIC addresses (KVM's in-kernel irqchip sits there).
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const APIC_DEFAULT_PHYS_BASE: u32 = 0xfee0_0000;
/// Where KVM puts its TSS for real-mode emulation on Intel (3 pages below the BIOS).
pub const KVM_TSS_ADDRESS: usize = 0xfffb_d000;
/// Smallest guest RAM we accept: the kernel needs room to decompress itself.
pub const MIN_MEM_MIB: u64 = 32;

/// E820 memory types.
pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
/// Offset of a bzImage's 64-bit entry point (`startup_64`) from its load address.
pub const KERNEL_64BIT_ENTRY_OFFSET: u64 = 0x200;

/// The guest RAM regions `(gpa, len)` for `mem_bytes` of RAM: everything below the MMIO gap
/// first, the rest above 4 GiB.
pub fn ram_layout(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
        ]
    }
}

/// The e820 map for `mem_bytes` of RAM laid out as [`ram_layout`] does.
pub fn e820_map(mem_bytes: u64) -> Vec<(u64, u64, u32)> {
    let mut map = vec![
        (0, EBDA_START, E820_RAM),
        (EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED),
    ];
    for (gpa, len) in ram_layout(mem_bytes) {
        let start = gpa.max(HIMEM_START);
        let end = gpa + len;
        if end > start {
            map.push((start, end - start, E820_RAM));
        }
    }
    map
}

// ---------------------------------------------------------------------------------------
// Kernel, initrd, command line, zero page.

/// Where things were put in guest memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BootLayout {
    /// Guest-physical address the protected-mode kernel was loaded at.
    pub kernel_load: u64,
    /// First byte after the loaded kernel.
    pub kernel_end: u64,
    /// 64-bit entry point (initial `%rip`).
    pub entry: u64,
    /// Initrd `(gpa, len)`, if any.
    pub initrd: Option<(u64, u64)>,
    /// Length of the command line, without the NUL.
    pub cmdline_len: usize,
}

/// Loads the kernel into guest memory: an uncompressed `vmlinux` ELF (faster to boot: no
/// decompression in the guest) or a bzImage. Returns the loader result and the 64-bit
/// entry point.
pub fn load_kernel<M: GuestMemoryBackend>(
    mem: &M,
    kernel: &Path,
) -> Result<(KernelLoaderResult, u64), BootError> {
    let mut file = File::open(kernel).map_err(|source| BootError::KernelOpen {
        path: kernel.to_owned(),
        source,
    })?;
    let mut magic = [0u8; 4];
    let is_elf = file.read_exact(&mut magic).is_ok() && magic == *b"\x7fELF";
    file.rewind().map_err(|source| BootError::KernelOpen {
        path: kernel.to_owned(),
        source,
    })?;
    let load_err = |source| BootError::KernelLoad {
        path: kernel.to_owned(),
        source,
    };
    if is_elf {
        let res =
            Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))).map_err(load_err)?;
        // The ELF entry is the physical address of `startup_64`.
        let entry = res.kernel_load.raw_value();
        Ok((res, entry))
    } else {
        let res = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
            .map_err(load_err)?;
        if res.setup_header.is_none() {
            return Err(load_err(loader::Error::Bzimage(
                loader::bzimage::Error::InvalidBzImage,
            )));
        }
        let entry = res.kernel_load.raw_value() + KERNEL_64BIT_ENTRY_OFFSET;
        Ok((res, entry))
    }
}

/// Loads the initrd at the top of low RAM (below the MMIO gap and below the kernel's
/// `initrd_addr_max`), page aligned, above the kernel. Returns `(gpa, len)`.
pub fn load_initrd<M: GuestMemoryBackend>(
    mem: &M,
    initrd: &Path,
    mem_bytes: u64,
    kernel_end: u64,
    initrd_addr_max: u32,
) -> Result<(u64, u64), BootError> {
    let data = std::fs::read(initrd).map_err(|source| BootError::InitrdOpen {
        path: initrd.to_owned(),
        source,
    })?;
    let len = data.len() as u64;
    if len == 0 {
        return Err(BootError::InitrdEmpty(initrd.to_owned()));
    }
    let lowmem_end = mem_bytes.min(MMIO_GAP_START);
    // initrd_addr_max is the highest address the initrd may *end* at (inclusive).
    let limit = if initrd_addr_max == 0 {
        0x37ff_ffff
    } else {
        u64::from(initrd_addr_max)
    };
    let top = lowmem_end.min(limit + 1);
    let too_big = BootError::InitrdTooBig {
        path: initrd.to_owned(),
        len,
        mem_bytes,
    };
    let gpa = top.checked_sub(len).ok_or(too_big)? & !0xfff;
    if gpa < kernel_end.next_multiple_of(0x1000) {
        return Err(BootError::InitrdTooBig {
            path: initrd.to_owned(),
            len,
            mem_bytes,
        });
    }
    mem.write_slice(&data, GuestAddress(gpa))
        .map_err(|e| BootError::GuestWrite("initrd", e.to_string()))?;
    Ok((gpa, len))
}

/// Builds a [`Cmdline`] from a user string.
pub fn make_cmdline(cmdline: &str) -> Result<Cmdline, BootError> {
    let mut cl = Cmdline::new(CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    if !cmdline.trim().is_empty() {
        cl.insert_str(cmdline.trim()).map_err(BootError::Cmdline)?;
    }
    Ok(cl)
}

/// Writes the command line and the zero page (setup header from the kernel, initrd, e820).
pub fn write_boot_params<M: GuestMemoryBackend>(
    mem: &M,
    kernel: &KernelLoaderResult,
    cmdline: &Cmdline,
    initrd: Option<(u64, u64)>,
    mem_bytes: u64,
) -> Result<usize, BootError> {
    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline)
        .map_err(|e| BootError::GuestWrite("command line", e.to_string()))?;
    let cmdline_len = cmdline
        .as_cstring()
        .map_err(BootError::Cmdline)?
        .as_bytes()
        .len();

    let mut params = boot_params::default();
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    if params.hdr.kernel_alignment == 0 {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    }
    if let Some((gpa, len)) = initrd {
        params.hdr.ramdisk_image = gpa as u32;
        params.hdr.ramdisk_size = len as u32;
    }
    let map = e820_map(mem_bytes);
    if map.len() > params.e820_table.len() {
        return Err(BootError::GuestWrite("e820 map", "too many entries".into()));
    }
    for (i, &(addr, size, type_)) in map.iter().enumerate() {
        params.e820_table[i].addr = addr;
        params.e820_table[i].size = size;
        params.e820_table[i].r#type = type_;
    }
    params.e820_entries = map.len() as u8;

    LinuxBootConfigurator::write_bootparams::<M>(
        &BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_START)),
        mem,
    )
    .map_err(|e| BootError::GuestWrite("zero page", e.to_string()))?;
    Ok(cmdline_len)
}

/// Loads kernel, initrd and command line and writes the zero page, GDT, IDT, page tables
/// and MP table. The vCPU state comes from [`setup_vcpu`](super::setup_vcpu).
pub fn load_all<M: GuestMemoryBackend>(
    mem: &M,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
    mem_bytes: u64,
    vcpus: u8,
    pci_intx: &[(u8, u8)],
) -> Result<BootLayout, BootError> {
    let cl = make_cmdline(cmdline)?;
    let (k, entry) = load_kernel(mem, kernel)?;
    let initrd_addr_max = k.setup_header.map(|h| h.initrd_addr_max).unwrap_or(0);
    let initrd = initrd
        .map(|p| load_initrd(mem, p, mem_bytes, k.kernel_end, initrd_addr_max))
        .transpose()?;
    let cmdline_len = write_boot_params(mem, &k, &cl, initrd, mem_bytes)?;
    write_gdt_idt(mem)?;
    write_page_tables(mem)?;
    write_mptable(mem, vcpus, pci_intx)?;
    Ok(BootLayout {
        kernel_load: k.kernel_load.raw_value(),
        kernel_end: k.kernel_end,
        entry,
        initrd,
        cmdline_len,
    })
}

// ---------------------------------------------------------------------------------------
// GDT, IDT, page tables.

/// A GDT entry from flags, base and limit (the layout of Firecracker's `gdt_entry`).
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The boot GDT: null, 64-bit code (0x08), data (0x10), TSS (0x18).
pub const BOOT_GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

/// The `kvm_segment` a GDT entry at `index` describes.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let g = ((entry >> 55) & 1) as u8;
    let raw_limit = (((entry >> 32) & 0x000f_0000) | (entry & 0xffff)) as u32;
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base: ((entry >> 32) & 0xff00_0000) | ((entry >> 16) & 0x00ff_ffff),
        limit: if g == 1 {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from(present == 0),
    }
}

fn write_gdt_idt<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    for (i, e) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + 8 * i as u64))
            .map_err(|e| BootError::GuestWrite("GDT", e.to_string()))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(|e| BootError::GuestWrite("IDT", e.to_string()))?;
    Ok(())
}

/// Identity-maps the first GiB with 2 MiB pages.
fn write_page_tables<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    let w = |v: u64, at: u64| {
        mem.write_obj(v, GuestAddress(at))
            .map_err(|e| BootError::GuestWrite("page tables", e.to_string()))
    };
    // Present | writable.
    w(PDPTE_START | 0x03, PML4_START)?;
    w(PDE_START | 0x03, PDPTE_START)?;
    for i in 0..512u64 {
        // Present | writable | page size (2 MiB).
        w((i << 21) | 0x83, PDE_START + i * 8)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// MP table (Intel MultiProcessor Specification 1.4): tells the kernel about the vCPUs,
// the IOAPIC and the ISA interrupt routing, so that SMP works without ACPI.

const MPTABLE_START: u64 = EBDA_START;
const MP_IRQ_SRC_COUNT: u8 = 16;
/// IOAPIC id: after the vCPUs' LAPIC ids.
fn ioapic_id(vcpus: u8) -> u8 {
    vcpus + 1
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, &b| a.wrapping_add(b)))
}

/// MP bus id of PCI bus 0 when there is one. Linux looks PCI interrupts up by comparing
/// the PCI bus *number* with the MP source bus *id*, so PCI bus 0 must be MP bus 0 (as
/// in SeaBIOS's tables); the ISA bus then takes the next id.
const MP_PCI_BUS_ID: u8 = 0;

/// The MP floating pointer structure followed by the MP configuration table, as bytes
/// to place at `MPTABLE_START`. `pci_intx` lists `(slot, ioapic pin)`: INTA# of PCI
/// slot `slot` on bus 0 is wired to that IOAPIC pin, edge-triggered and active high
/// (the VMM pulses the line through an irqfd; a level-triggered pin could drop a pulse
/// that arrives while the previous interrupt is still being handled).
pub fn build_mptable(vcpus: u8, pci_intx: &[(u8, u8)]) -> Result<Vec<u8>, BootError> {
    if vcpus == 0 || vcpus > super::MAX_VCPUS {
        return Err(BootError::Vcpus(vcpus));
    }
    let table_addr = MPTABLE_START as u32 + 16;
    // Configuration table entries.
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    // Processors: type 0, 20 bytes.
    for cpu in 0..vcpus {
        entries.push(0); // MP_PROCESSOR
        entries.push(cpu); // apicid
        entries.push(0x14); // apicver
        entries.push(if cpu == 0 { 0x3 } else { 0x1 }); // CPU_ENABLED | CPU_BOOTPROCESSOR
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // cpufeature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // featureflag: APIC | FPU
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    // Buses: type 1, 8 bytes. PCI bus 0 (if any) as MP bus 0, then ISA.
    let isa_bus = if pci_intx.is_empty() {
        0
    } else {
        entries.push(1);
        entries.push(MP_PCI_BUS_ID);
        entries.extend_from_slice(b"PCI   ");
        count += 1;
        MP_PCI_BUS_ID + 1
    };
    entries.push(1);
    entries.push(isa_bus);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    // IOAPIC: type 2, 8 bytes.
    entries.push(2);
    entries.push(ioapic_id(vcpus));
    entries.push(0x11); // apicver
    entries.push(1); // MPC_APIC_USABLE
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 1;
    // I/O interrupts: ISA IRQ n -> IOAPIC pin n. Type 3, 8 bytes.
    for irq in 0..MP_IRQ_SRC_COUNT {
        entries.push(3);
        entries.push(0); // mp_INT
        entries.extend_from_slice(&0u16.to_le_bytes()); // flags: conforming polarity/trigger
        entries.push(isa_bus); // source bus
        entries.push(irq); // source bus irq
        entries.push(ioapic_id(vcpus));
        entries.push(irq); // dest pin
        count += 1;
    }
    // PCI INTA# lines. Source bus irq = slot << 2 | (pin - 1).
    for &(slot, pin) in pci_intx {
        entries.push(3);
        entries.push(0); // mp_INT
        entries.extend_from_slice(&0x0005u16.to_le_bytes()); // active high, edge
        entries.push(MP_PCI_BUS_ID);
        entries.push((slot & 0x1f) << 2);
        entries.push(ioapic_id(vcpus));
        entries.push(pin);
        count += 1;
    }
    // Local interrupts: LINT0 = ExtINT, LINT1 = NMI, to all LAPICs. Type 4, 8 bytes.
    for (kind, pin) in [(3u8, 0u8), (1u8, 1u8)] {
        entries.push(4);
        entries.push(kind); // mp_ExtINT / mp_NMI
        entries.extend_from_slice(&0u16.to_le_bytes());
        entries.push(0); // source bus
        entries.push(0); // source irq
        entries.push(0xff); // all LAPICs
        entries.push(pin);
        count += 1;
    }

    // Configuration table header, 44 bytes.
    let mut table: Vec<u8> = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    let len = u16::try_from(44 + entries.len()).map_err(|_| BootError::Vcpus(vcpus))?;
    table.extend_from_slice(&len.to_le_bytes());
    table.push(4); // spec 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"VGPU-VMM");
    table.extend_from_slice(b"000000000000");
    table.extend_from_slice(&0u32.to_le_bytes()); // oem table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // oem table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_DEFAULT_PHYS_BASE.to_le_bytes());
    table.extend_from_slice(&[0u8; 4]); // extended table length, checksum, reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    // Floating pointer, 16 bytes.
    let mut mpf: Vec<u8> = Vec::with_capacity(16 + table.len());
    mpf.extend_from_slice(b"_MP_");
    mpf.extend_from_slice(&table_addr.to_le_bytes());
    mpf.push(1); // length in 16-byte units
    mpf.push(4); // spec 1.4
    mpf.push(0); // checksum, below
    mpf.extend_from_slice(&[0u8; 5]); // feature bytes: 0 = a configuration table is present
    mpf[10] = checksum(&mpf[..16]);
    mpf.extend_from_slice(&table);
    if mpf.len() as u64 > HIMEM_START - MPTABLE_START {
        return Err(BootError::Vcpus(vcpus));
    }
    Ok(mpf)
}

fn write_mptable<M: GuestMemoryBackend>(
    mem: &M,
    vcpus: u8,
    pci_intx: &[(u8, u8)],
) -> Result<(), BootError> {
    let bytes = build_mptable(vcpus, pci_intx)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))
        .map_err(|e| BootError::GuestWrite("MP table", e.to_string()))
}

// ---------------------------------------------------------------------------------------
// vCPU state.

/// Initial general-purpose registers of the boot vCPU.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Turns `sregs` (as read from the vCPU) into long mode with the boot GDT and page tables.
pub fn boot_sregs(sregs: &mut kvm_sregs) {
    let code = segment_from_gdt(BOOT_GDT[1], 1);
    let data = segment_from_gdt(BOOT_GDT[2], 2);
    let tss = segment_from_gdt(BOOT_GDT[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&BOOT_GDT) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
}

/// x87/SSE state at boot.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// MSRs set at boot (Firecracker's `create_boot_msr_entries`).
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_IA32_SYSENTER_CS: u32 = 0x174;
    const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
    const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
    const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
    const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
    const MSR_STAR: u32 = 0xc000_0081;
    const MSR_LSTAR: u32 = 0xc000_0082;
    const MSR_CSTAR: u32 = 0xc000_0083;
    const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
    const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
    const MISC_ENABLE_FAST_STRING: u64 = 1;
    // MTRRs enabled, default type write-back.
    const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

/// The MSR list as the `KVM_SET_MSRS` wrapper wants it.
pub fn boot_msrs_fam() -> Result<Msrs, BootError> {
    Msrs::from_entries(&boot_msrs()).map_err(|e| BootError::Fam(format!("{e:?}")))
}

/// Patches the host-supported CPUID for vCPU `cpu` of `count`: APIC ids, logical
/// processor count, the hypervisor bit.
pub fn patch_cpuid(cpuid: &mut CpuId, cpu: u8, count: u8) {
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            0x1 => {
                // EBX: [31:24] initial APIC id, [23:16] logical processors, [15:8] CLFLUSH
                // line size in 8-byte units.
                e.ebx = (u32::from(cpu) << 24) | (u32::from(count) << 16) | (8 << 8);
                // ECX bit 31: running under a hypervisor.
                e.ecx |= 1 << 31;
                // EDX bit 28 (HTT): more than one logical processor per package.
                if count > 1 {
                    e.edx |= 1 << 28;
                } else {
                    e.edx &= !(1 << 28);
                }
            }
            0xb | 0x1f => {
                // x2APIC id.
                e.edx = u32::from(cpu);
            }
            _ => {}
        }
    }
}

/// The XCR0 value that enables every state component CPUID leaf 0xd offers (x87 and SSE
/// at least), or `None` without XSAVE.
pub fn xcr0_of(cpuid: &CpuId) -> Option<u64> {
    let has_xsave = cpuid
        .as_slice()
        .iter()
        .any(|e| e.function == 1 && e.ecx & (1 << 26) != 0);
    let leaf = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0xd && e.index == 0)?;
    has_xsave.then(|| (u64::from(leaf.edx) << 32 | u64::from(leaf.eax)) | 0x3)
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(l: &kvm_lapic_state, off: usize) -> u32 {
    let b = &l.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(l: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        l.regs[off + i] = *b as _;
    }
}

/// LINT0 = ExtINT (the PIC's virtual wire), LINT1 = NMI.
pub fn set_lint(l: &mut kvm_lapic_state) {
    let set_mode = |reg: u32, mode: u32| (reg & !0x700) | (mode << 8);
    let lint0 = lapic_reg(l, APIC_LVT0);
    set_lapic_reg(l, APIC_LVT0, set_mode(lint0, APIC_MODE_EXTINT));
    let lint1 = lapic_reg(l, APIC_LVT1);
    set_lapic_reg(l, APIC_LVT1, set_mode(lint1, APIC_MODE_NMI));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_segments() {
        let cs = segment_from_gdt(BOOT_GDT[1], 1);
        assert_eq!(cs.selector, 0x08);
        assert_eq!((cs.l, cs.db, cs.present, cs.s, cs.type_), (1, 0, 1, 1, 0xb));
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = segment_from_gdt(BOOT_GDT[2], 2);
        assert_eq!((ds.selector, ds.l, ds.db, ds.type_), (0x10, 0, 1, 3));
        let tr = segment_from_gdt(BOOT_GDT[3], 3);
        assert_eq!((tr.selector, tr.type_, tr.s), (0x18, 0xb, 0));
        assert_eq!(segment_from_gdt(BOOT_GDT[0], 0).unusable, 1);
    }

    #[test]
    fn e820_with_and_without_gap() {
        let m = e820_map(256 << 20);
        assert_eq!(m[0], (0, EBDA_START, E820_RAM));
        assert_eq!(m[2], (HIMEM_START, (256 << 20) - HIMEM_START, E820_RAM));
        let m = e820_map(4 << 30);
        assert_eq!(m.len(), 4);
        assert_eq!(m[3], (MMIO_GAP_END, 1 << 30, E820_RAM));
        assert_eq!(ram_layout(4 << 30)[1], (MMIO_GAP_END, 1 << 30));
    }

    #[test]
    fn mptable_checksums() {
        let t = build_mptable(4, &[]).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, &b| a.wrapping_add(b)), 0);
        let len = u16::from_le_bytes([t[20], t[21]]) as usize;
        assert_eq!(&t[16..20], b"PCMP");
        assert_eq!(len, t.len() - 16);
        assert_eq!(t[16..].iter().fold(0u8, |a, &b| a.wrapping_add(b)), 0);
        // 4 CPUs + bus + ioapic + 16 irqs + 2 lints.
        assert_eq!(
            u16::from_le_bytes([t[16 + 34], t[16 + 35]]),
            4 + 1 + 1 + 16 + 2
        );
        assert!(build_mptable(0, &[]).is_err());
        // With a PCI function: one more bus and one more I/O interrupt entry, checksums
        // still right, and the entry names slot 1 INTA# -> pin 17.
        let t = build_mptable(2, &[(1, 17)]).unwrap();
        assert_eq!(t[16..].iter().fold(0u8, |a, &b| a.wrapping_add(b)), 0);
        assert_eq!(
            u16::from_le_bytes([t[16 + 34], t[16 + 35]]),
            2 + 2 + 1 + 16 + 1 + 2
        );
        let entries = &t[16 + 44..];
        // PCI bus first as MP bus 0, ISA as bus 1 with its IRQ entries.
        assert_eq!(&entries[2 * 20..2 * 20 + 8], b"\x01\x00PCI   ");
        assert_eq!(&entries[2 * 20 + 8..2 * 20 + 16], b"\x01\x01ISA   ");
        let pci_int = entries
            .windows(8)
            .find(|e| e[0] == 3 && e[4] == MP_PCI_BUS_ID && e[5] == 1 << 2)
            .unwrap();
        assert_eq!(pci_int[5], 1 << 2);
        assert_eq!(pci_int[7], 17);
    }

    #[test]
    fn lint_pins() {
        let mut l = kvm_lapic_state::default();
        set_lint(&mut l);
        assert_eq!(lapic_reg(&l, APIC_LVT0) & 0x700, 0x700);
        assert_eq!(lapic_reg(&l, APIC_LVT1) & 0x700, 0x400);
    }
}
