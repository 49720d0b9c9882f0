/* SPDX-License-Identifier: Apache-2.0 OR BSD-3-Clause */
/*
 * /dev/vgpu ioctl ABI (guest kernel driver vgpu.ko <-> user space).
 *
 * Mirrored by the Rust runtime (guest-driver/runtime/src/devvgpu/abi.rs); the test
 * guest-driver/runtime/tests/ioctl_abi.rs compiles this header and checks every struct
 * size, field offset and ioctl number against the Rust side. Described in
 * docs/guest-driver.md.
 *
 * Rules that hold for every ioctl:
 *  - every struct has explicit padding only; "reserved" fields must be 0 (else EINVAL);
 *  - ids (ctx, mem, channel) are the device's ids; a process may name only objects that
 *    its open file created (others: ENOENT);
 *  - errors are negative errno values: EINVAL bad argument, ENOENT unknown object,
 *    EACCES object of another process, ENOMEM/ENOSPC out of memory / a limit,
 *    EOPNOTSUPP unsupported, ETIMEDOUT the device did not answer in time, EIO the
 *    device failed or the channel faulted, ENODEV the device is gone.
 *  - mmap offsets are region-relative offsets returned by MAP_APERTURE (a VRAM
 *    object's window) and CREATE_CHANNEL (a channel's control page); a mapping must be
 *    MAP_SHARED and lie inside one such object of the calling file.
 */
#ifndef VGPU_IOCTL_H
#define VGPU_IOCTL_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define VGPU_IOCTL_ABI_VERSION 3
#define VGPU_IOCTL_MAGIC 0xC6

/* GET_INFO: what the device offers. */
struct vgpu_ioc_info {
	__u32 abi_version;     /* out: VGPU_IOCTL_ABI_VERSION */
	__u32 protocol_version;/* out: device protocol version (config space / GET_INFO) */
	__u64 vram_bytes;      /* out: VRAM this VM may use */
	__u32 compute_engines; /* out */
	__u32 channel_slots;   /* out: control-page slots of the BAR */
	__u32 max_contexts;    /* out: the VM's context limit */
	__u32 flags;           /* out: VGPU_INFO_* */
	__u64 shm_size;        /* out: size of the shared-memory region (0: forwarded) */
	__u64 aperture_offset; /* out: region offset of the VRAM aperture */
	__u64 aperture_size;   /* out */
};

/*
 * The device has no shared-memory region: channels are forwarded. A channel's mmap
 * offset then names a page of the driver's that CHANNEL_STATUS (and WAIT) fill in; GP_PUT
 * stored there reaches no GPU, so submissions go through SUBMIT. There is no aperture:
 * MAP_APERTURE fails with EOPNOTSUPP.
 */
#define VGPU_INFO_FORWARDED 1

/* GET_STATS: usage of the whole VM, as the backend counts it. */
struct vgpu_ioc_stats {
	__u32 contexts;
	__u32 channels;
	__u64 vram_bytes;
	__u64 mapped_guest_bytes;
	__u64 aperture_bytes;
	__u64 vram_limit;
};

/* CREATE_CONTEXT (ctx and huge_slot out), DESTROY_CONTEXT (ctx in, huge_slot ignored).
 * huge_slot: the device's huge-page slot for the context's 2 MiB-page buffers + 1
 * (0: none; protocol.md, CREATE_CONTEXT). */
struct vgpu_ioc_context {
	__u32 ctx;
	__u32 huge_slot;
};

/* ALLOC_VRAM: size > 0; align a power of two in 4 KiB ..= 1 GiB. */
struct vgpu_ioc_alloc_vram {
	__u32 ctx;
	__u32 mem;        /* out */
	__u64 size;
	__u64 align;
	__u64 alloc_size; /* out: bytes allocated (>= size) */
};

/* FREE_MEM: removes the object's aperture window (and every process mapping of it). */
struct vgpu_ioc_mem {
	__u32 ctx;
	__u32 mem;
};

/* Page-size codes (as in the control protocol) and mapping flags. */
#define VGPU_IOC_PAGE_4K 0
#define VGPU_IOC_PAGE_64K 1
#define VGPU_IOC_PAGE_2M 2
#define VGPU_IOC_MAP_READ_ONLY 1 /* read-only for the GPU */

/* MAP_VRAM: map the whole object at va with pages of the given size. */
struct vgpu_ioc_map_vram {
	__u32 ctx;
	__u32 mem;
	__u64 va;
	__u32 page;
	__u32 flags;
};

/*
 * MAP_USER: pin size bytes of this process's memory at user_addr (both page-aligned;
 * writable unless VGPU_IOC_MAP_READ_ONLY) and map them at GPU va with 4 KiB pages.
 * Unpinned by UNMAP of va, DESTROY_CONTEXT, or closing the file.
 */
#define VGPU_IOC_MAX_USER_MAP (1ULL << 32) /* largest single MAP_USER */
struct vgpu_ioc_map_user {
	__u32 ctx;
	__u32 flags;
	__u64 va;
	__u64 user_addr;
	__u64 size;
};

/* UNMAP: remove the mapping that starts at va (VRAM or user memory). */
struct vgpu_ioc_unmap {
	__u32 ctx;
	__u32 reserved;
	__u64 va;
};

/* MAP_APERTURE: give a VRAM object a window; mmap (offset, size) maps it. */
struct vgpu_ioc_map_aperture {
	__u32 ctx;
	__u32 mem;
	__u64 offset; /* out: mmap offset (region-relative, page-aligned) */
	__u64 size;   /* out: window bytes */
};

/* CREATE_CHANNEL: gp_entries a power of two in 2..=65536, gp_ring_va 16-aligned. */
struct vgpu_ioc_create_channel {
	__u32 ctx;
	__u32 gp_entries;
	__u64 gp_ring_va;
	__u32 channel; /* out */
	__u32 slot;    /* out */
	__u64 offset;  /* out: mmap offset of the 4 KiB control page */
};

/* DESTROY_CHANNEL */
struct vgpu_ioc_channel {
	__u32 ctx;
	__u32 channel;
};

/* SUBMIT: the API-remoting baseline (the host stores gp_put for us). */
struct vgpu_ioc_submit {
	__u32 ctx;
	__u32 channel;
	__u32 gp_put;
	__u32 reserved;
};

/*
 * WAIT: sleep until the channel's REF (VGPU_WAIT_FENCE) or its notify count
 * (VGPU_WAIT_NOTIFY: NOTIFY_SEQ, or the NOTIFY events received) reaches value
 * (wrapping comparison), the channel faults (EIO, error/info filled in), or timeout_ns
 * passes (ETIMEDOUT; 0 = only check). Notify events wake the waiter; fences without a
 * NOTIFY behind them are noticed by periodic re-checks (a few ms).
 */
#define VGPU_WAIT_FENCE 0
#define VGPU_WAIT_NOTIFY 1
struct vgpu_ioc_wait {
	__u32 ctx;
	__u32 channel;
	__u32 kind;
	__u32 value;
	__u64 timeout_ns;
	__u32 ref;          /* out: REF read last */
	__u32 notify_seq;   /* out: max(NOTIFY_SEQ, notify events received) */
	__u32 error;        /* out: channel error code (0 while healthy) */
	__u32 notify_token; /* out: token of the last NOTIFY event */
	__u64 error_info;   /* out */
};

/*
 * CHANNEL_STATUS: the channel's control-page fields as the device reads them (one
 * request). On a forwarded device it also copies them into the channel's mmap page.
 */
struct vgpu_ioc_channel_status {
	__u32 ctx;
	__u32 channel;
	__u32 gp_put;     /* out */
	__u32 gp_get;     /* out */
	__u32 ref;        /* out */
	__u32 notify_seq; /* out */
	__u32 error;      /* out */
	__u32 reserved;   /* out: 0 */
	__u64 error_info; /* out */
};

/*
 * Guest modules (ABI 3). MODULE_LOAD: the image (PTX text, cubin or fatbin) of size bytes
 * at user_addr (1..=VGPU_IOC_MAX_MODULE_BYTES), copied once into driver memory and
 * handed to the device; module (out) names it. The device's refusals have errnos of their
 * own: ENOEXEC (this GPU runs no guest modules), EPERM (only a VM's own GPU worker runs
 * them), EBADMSG (the driver refused the image); ENOSPC: too many modules.
 */
#define VGPU_IOC_MAX_MODULE_BYTES (32ULL << 20)
struct vgpu_ioc_module_load {
	__u32 ctx;
	__u32 module; /* out */
	__u64 user_addr;
	__u64 size;
};

/* MODULE_UNLOAD (after the context's channels finished what they were given). */
struct vgpu_ioc_module {
	__u32 ctx;
	__u32 module;
};

/*
 * FUNCTION_GET: the function named by name_len (1..=VGPU_IOC_MAX_SYMBOL_LEN) bytes at
 * name_addr in module: its id for LAUNCH_FUNCTION (function, out) and its parameter
 * layout: param_count (out) pairs of __u32 {offset, size} written to params_addr, which
 * has room for max_params pairs (ENOSPC if the function has more); param_count is
 * VGPU_IOC_PARAMS_UNKNOWN when the GPU cannot say.
 */
#define VGPU_IOC_MAX_SYMBOL_LEN 512
#define VGPU_IOC_PARAMS_UNKNOWN 0xffffffffu
struct vgpu_ioc_function_get {
	__u32 ctx;
	__u32 module;
	__u64 name_addr;
	__u32 name_len;
	__u32 function; /* out */
	__u64 params_addr;
	__u32 max_params;
	__u32 param_count; /* out */
};

/*
 * GET_ATTRIBUTES: the real GPU's device attributes, (attribute, value) pairs in CUDA's
 * CUdevice_attribute numbering, written to pairs_addr (room for max_pairs); count says
 * how many the device has (ENOSPC when more than max_pairs). None on the sim.
 */
struct vgpu_ioc_attributes {
	__u64 pairs_addr;
	__u32 max_pairs;
	__u32 count; /* out */
};

/* GLOBAL_GET: the device address and size of the module global named at name_addr. */
struct vgpu_ioc_global_get {
	__u32 ctx;
	__u32 module;
	__u64 name_addr;
	__u32 name_len;
	__u32 reserved;
	__u64 addr; /* out */
	__u64 size; /* out */
};

/*
 * DOORBELL (no argument): wakes the device's front end. A process that advanced a
 * channel's GP_PUT and then, after a full fence, finds WANT_DOORBELL set in the channel's
 * page (the front end sleeps instead of polling) rings it; the driver notifies the
 * control queue without a request on it (protocol.md, "Doorbell").
 */

#define VGPU_IOC_GET_INFO _IOR(VGPU_IOCTL_MAGIC, 0x00, struct vgpu_ioc_info)
#define VGPU_IOC_GET_STATS _IOR(VGPU_IOCTL_MAGIC, 0x01, struct vgpu_ioc_stats)
#define VGPU_IOC_CREATE_CONTEXT _IOR(VGPU_IOCTL_MAGIC, 0x02, struct vgpu_ioc_context)
#define VGPU_IOC_DESTROY_CONTEXT _IOW(VGPU_IOCTL_MAGIC, 0x03, struct vgpu_ioc_context)
#define VGPU_IOC_ALLOC_VRAM _IOWR(VGPU_IOCTL_MAGIC, 0x04, struct vgpu_ioc_alloc_vram)
#define VGPU_IOC_FREE_MEM _IOW(VGPU_IOCTL_MAGIC, 0x05, struct vgpu_ioc_mem)
#define VGPU_IOC_MAP_VRAM _IOW(VGPU_IOCTL_MAGIC, 0x06, struct vgpu_ioc_map_vram)
#define VGPU_IOC_MAP_USER _IOW(VGPU_IOCTL_MAGIC, 0x07, struct vgpu_ioc_map_user)
#define VGPU_IOC_UNMAP _IOW(VGPU_IOCTL_MAGIC, 0x08, struct vgpu_ioc_unmap)
#define VGPU_IOC_MAP_APERTURE _IOWR(VGPU_IOCTL_MAGIC, 0x09, struct vgpu_ioc_map_aperture)
#define VGPU_IOC_UNMAP_APERTURE _IOW(VGPU_IOCTL_MAGIC, 0x0a, struct vgpu_ioc_mem)
#define VGPU_IOC_CREATE_CHANNEL _IOWR(VGPU_IOCTL_MAGIC, 0x0b, struct vgpu_ioc_create_channel)
#define VGPU_IOC_DESTROY_CHANNEL _IOW(VGPU_IOCTL_MAGIC, 0x0c, struct vgpu_ioc_channel)
#define VGPU_IOC_SUBMIT _IOW(VGPU_IOCTL_MAGIC, 0x0d, struct vgpu_ioc_submit)
#define VGPU_IOC_WAIT _IOWR(VGPU_IOCTL_MAGIC, 0x0e, struct vgpu_ioc_wait)
#define VGPU_IOC_CHANNEL_STATUS _IOWR(VGPU_IOCTL_MAGIC, 0x0f, struct vgpu_ioc_channel_status)
#define VGPU_IOC_MODULE_LOAD _IOWR(VGPU_IOCTL_MAGIC, 0x10, struct vgpu_ioc_module_load)
#define VGPU_IOC_MODULE_UNLOAD _IOW(VGPU_IOCTL_MAGIC, 0x11, struct vgpu_ioc_module)
#define VGPU_IOC_FUNCTION_GET _IOWR(VGPU_IOCTL_MAGIC, 0x12, struct vgpu_ioc_function_get)
#define VGPU_IOC_GLOBAL_GET _IOWR(VGPU_IOCTL_MAGIC, 0x13, struct vgpu_ioc_global_get)
#define VGPU_IOC_GET_ATTRIBUTES _IOWR(VGPU_IOCTL_MAGIC, 0x14, struct vgpu_ioc_attributes)
#define VGPU_IOC_DOORBELL _IO(VGPU_IOCTL_MAGIC, 0x15)

#endif /* VGPU_IOCTL_H */
