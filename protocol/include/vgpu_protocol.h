/* SPDX-License-Identifier: Apache-2.0 OR BSD-3-Clause */
/*
 * vgpu wire formats for C code (the guest kernel driver, C applications).
 *
 * Mirrors the Rust crate `vgpu-protocol` (protocol/src); every value below is checked
 * against the Rust constants by protocol/tests/c_header.rs, which also compiles this
 * header and checks the struct layouts against the Rust encoders. The specification
 * is docs/protocol.md. All multi-byte fields are little-endian. The one C header of the
 * wire format: the guest driver (guest-driver/kernel) includes it too.
 *
 * Not covered: the migration-state format (host only).
 */
#ifndef VGPU_PROTOCOL_H
#define VGPU_PROTOCOL_H

#ifdef __KERNEL__
#include <linux/stddef.h>
#include <linux/types.h>
/* No floating point in the kernel: f32 fields are carried as their IEEE-754 bits. */
typedef uint32_t vgpu_f32;
/* Little-endian wire fields: the kernel's sparse-checked types. */
typedef __le32 vgpu_le32;
typedef __le64 vgpu_le64;
#else
#include <stddef.h>
#include <stdint.h>
typedef float vgpu_f32;
typedef uint32_t vgpu_le32;
typedef uint64_t vgpu_le64;
#endif

/* ---- Protocol version: major in bits 16..31, minor in bits 0..15. ---------------- */
#define VGPU_PROTOCOL_VERSION 0x00010000

/* Size of a channel control page and of the GPU's small page. */
#define VGPU_PAGE_SIZE 4096

/* ---- Channel control page: byte offsets of its fields. ------------------------------
 * All fields are u32 except ERROR_INFO (u64). The application writes GP_PUT and the
 * fence waiter's REF_WAKE and REF_WAKE_ARMED; the GPU writes the rest. Counters wrap and are compared modulo 2^32.
 */
#define VGPU_CTRL_GP_PUT 0x00     /* app: GP entries ever submitted (wrapping)       */
#define VGPU_CTRL_GP_GET 0x04     /* GPU: GP entries ever completed (wrapping)       */
#define VGPU_CTRL_REF 0x08        /* GPU: last SET_REF value                         */
#define VGPU_CTRL_ERROR 0x0c      /* GPU: VGPU_ERR_* once the channel faulted, else 0 */
#define VGPU_CTRL_VERSION 0x10    /* GPU: VGPU_PROTOCOL_VERSION, at creation         */
#define VGPU_CTRL_GP_ENTRIES 0x14 /* GPU: ring size in entries (informational)       */
#define VGPU_CTRL_NOTIFY_SEQ 0x18 /* GPU: NOTIFY methods executed (wrapping)         */
#define VGPU_CTRL_WANT_DOORBELL 0x1c /* GPU: nonzero while the front end sleeps      */
#define VGPU_CTRL_ERROR_INFO 0x20 /* GPU: u64 detail for ERROR                       */
#define VGPU_CTRL_REF_WAKE 0x28   /* app: the REF a sleeping waiter waits for        */
#define VGPU_CTRL_REF_WAKE_ARMED 0x2c /* app sets, GPU clears with a FENCE event    */
#define VGPU_CTRL_USED_BYTES 0x30 /* bytes that carry state; the rest reads as zero  */

/* ---- GP ring. ---------------------------------------------------------------------- */
#define VGPU_GP_ENTRY_SIZE 16
#define VGPU_MIN_GP_ENTRIES 2     /* ring sizes are powers of two in MIN..MAX */
#define VGPU_MAX_GP_ENTRIES 65536
#define VGPU_MAX_PB_WORDS 65536   /* longest push-buffer segment of one entry */
#define VGPU_GPU_VA_LIMIT 0x0001000000000000ULL /* 48-bit GPU virtual addresses */

/* One GP entry: a push-buffer segment of len_words 32-bit words at pb_va. */
struct vgpu_gp_entry {
	uint64_t pb_va;     /* 4-byte aligned; pb_va + 4 * len_words <= VGPU_GPU_VA_LIMIT */
	uint32_t len_words; /* 1..VGPU_MAX_PB_WORDS */
	uint32_t flags;     /* must be 0 */
} __attribute__((packed));
_Static_assert(sizeof(struct vgpu_gp_entry) == VGPU_GP_ENTRY_SIZE, "GP entry size");
_Static_assert(sizeof(struct vgpu_gp_entry) == 16, "GP entry size");

/* ---- Push-buffer methods. ------------------------------------------------------------
 * Header word: bits 0..7 opcode, bits 8..15 number of argument words that follow (must
 * equal the opcode's fixed count), bits 16..31 zero. 64-bit arguments are two words,
 * low word first.
 */
#define VGPU_METHOD_OPCODE_MASK 0xff
#define VGPU_METHOD_ARGS_SHIFT 8
#define VGPU_METHOD_ARGS_MASK 0xff
#define VGPU_METHOD_RESERVED_MASK 0xffff0000

#define VGPU_METHOD_NOP 0x00
#define VGPU_METHOD_NOP_ARGS 0
/* kernel id, grid x, grid y, grid z, args_va lo, args_va hi, args_len (bytes) */
#define VGPU_METHOD_LAUNCH 0x01
#define VGPU_METHOD_LAUNCH_ARGS 7
/* src lo, src hi, dst lo, dst hi, len lo, len hi */
#define VGPU_METHOD_COPY 0x02
#define VGPU_METHOD_COPY_ARGS 6
/* va lo, va hi, value, flags (VGPU_SEM_RELEASE_TIMESTAMP) */
#define VGPU_METHOD_SEM_RELEASE 0x03
#define VGPU_METHOD_SEM_RELEASE_ARGS 4
/* va lo, va hi, value, mode (VGPU_SEM_ACQUIRE_*) */
#define VGPU_METHOD_SEM_ACQUIRE 0x04
#define VGPU_METHOD_SEM_ACQUIRE_ARGS 4
/* value (written to the control page's REF) */
#define VGPU_METHOD_SET_REF 0x05
#define VGPU_METHOD_SET_REF_ARGS 1
/* token (carried by the notify event) */
#define VGPU_METHOD_NOTIFY 0x06
#define VGPU_METHOD_NOTIFY_ARGS 1

/* Launch of a guest-module function: function, grid x/y/z, block x/y/z, dynamic shared
 * memory bytes, parameter bytes, relocation count; then a data tail of the parameter
 * buffer (zero-padded to whole words) and the relocations (VGPU_RELOC_WORDS words each:
 * offset, flags, extent low, extent high). */
#define VGPU_METHOD_LAUNCH_FUNCTION 0x07
#define VGPU_METHOD_LAUNCH_FUNCTION_ARGS 10
#define VGPU_MAX_PARAM_BYTES 4096
#define VGPU_MAX_RELOCS 64
#define VGPU_RELOC_WORDS 4
#define VGPU_RELOC_WRITE 1
#define VGPU_MAX_SHARED_MEM 262144

/* SEM_RELEASE flag: also write the GPU's u64 nanosecond clock at va + 8 (va 8-aligned). */
#define VGPU_SEM_RELEASE_TIMESTAMP 1
/* SEM_ACQUIRE modes. */
#define VGPU_SEM_ACQUIRE_EQUAL 0    /* proceed when *va == value                    */
#define VGPU_SEM_ACQUIRE_AT_LEAST 1 /* proceed when (int32_t)(*va - value) >= 0     */

/* Largest product grid x * y * z of a LAUNCH (the product must also be non-zero). */
#define VGPU_MAX_GRID_THREADS 0x80000000

/* ---- Builtin kernels. ----------------------------------------------------------------- */
#define VGPU_KERNEL_EMPTY 0
#define VGPU_KERNEL_SPIN 1
#define VGPU_KERNEL_MEMSET 2
#define VGPU_KERNEL_MEMCPY 3
#define VGPU_KERNEL_SAXPY 4
#define VGPU_KERNEL_SGEMM 5
#define VGPU_KERNEL_REDUCE_SUM 6
#define VGPU_KERNEL_CHECKSUM 7
#define VGPU_KERNEL_STENCIL2D 8
#define VGPU_KERNEL_TIMESTAMP 9
#define VGPU_KERNEL_COUNT 10

/* Exact argument-block sizes (a LAUNCH's args_len must equal its kernel's). */
#define VGPU_KERNEL_EMPTY_ARGS_SIZE 0
#define VGPU_KERNEL_SPIN_ARGS_SIZE 8
#define VGPU_KERNEL_MEMSET_ARGS_SIZE 24
#define VGPU_KERNEL_MEMCPY_ARGS_SIZE 24
#define VGPU_KERNEL_SAXPY_ARGS_SIZE 32
#define VGPU_KERNEL_SGEMM_ARGS_SIZE 44
#define VGPU_KERNEL_REDUCE_SUM_ARGS_SIZE 24
#define VGPU_KERNEL_CHECKSUM_ARGS_SIZE 24
#define VGPU_KERNEL_STENCIL2D_ARGS_SIZE 32
#define VGPU_KERNEL_TIMESTAMP_ARGS_SIZE 8

/* Argument limits. */
#define VGPU_MAX_SPIN_NS 60000000000ULL        /* longest SPIN                         */
#define VGPU_MAX_KERNEL_BYTES 0x10000000000ULL /* largest operand of one launch (2^40) */
#define VGPU_MAX_DIM 65536                     /* SGEMM m/n/k, STENCIL2D width/height  */

/* CHECKSUM computes FNV-1a 64 with these parameters. */
#define VGPU_FNV1A64_OFFSET 0xcbf29ce484222325ULL
#define VGPU_FNV1A64_PRIME 0x100000001b3ULL

/* Argument blocks. GPU addresses are virtual; "reserved" fields must be 0. */
struct vgpu_spin_args {
	uint64_t ns; /* <= VGPU_MAX_SPIN_NS */
} __attribute__((packed));

struct vgpu_memset_args {
	uint64_t dst; /* 4-byte aligned */
	uint64_t len; /* bytes, multiple of 4, <= VGPU_MAX_KERNEL_BYTES */
	uint32_t pattern;
	uint32_t reserved;
} __attribute__((packed));

struct vgpu_memcpy_args {
	uint64_t dst;
	uint64_t src;
	uint64_t len; /* bytes, <= VGPU_MAX_KERNEL_BYTES; overlap allowed (memmove) */
} __attribute__((packed));

struct vgpu_saxpy_args {
	uint64_t x; /* 4-byte aligned f32[n] */
	uint64_t y; /* 4-byte aligned f32[n], y[i] = a * x[i] + y[i] */
	uint64_t n; /* 4 * n <= VGPU_MAX_KERNEL_BYTES */
	vgpu_f32 a;
	uint32_t reserved;
} __attribute__((packed));

struct vgpu_sgemm_args {
	uint64_t a; /* 4-byte aligned, row-major f32 m x k */
	uint64_t b; /* 4-byte aligned, row-major f32 k x n */
	uint64_t c; /* 4-byte aligned, row-major f32 m x n: C = alpha * A.B + beta * C */
	uint32_t m; /* 1..VGPU_MAX_DIM */
	uint32_t n;
	uint32_t k;
	vgpu_f32 alpha;
	vgpu_f32 beta;
} __attribute__((packed));

struct vgpu_reduce_sum_args {
	uint64_t src; /* 4-byte aligned f32[n] */
	uint64_t n;   /* 4 * n <= VGPU_MAX_KERNEL_BYTES */
	uint64_t dst; /* 4-byte aligned: f32 sum */
} __attribute__((packed));

struct vgpu_checksum_args {
	uint64_t src;
	uint64_t len; /* bytes, <= VGPU_MAX_KERNEL_BYTES */
	uint64_t dst; /* 8-byte aligned: u64 FNV-1a 64 */
} __attribute__((packed));

struct vgpu_stencil2d_args {
	uint64_t src;    /* 4-byte aligned f32[height][width] */
	uint64_t dst;    /* 4-byte aligned f32[height][width] */
	uint32_t width;  /* 1..VGPU_MAX_DIM */
	uint32_t height; /* 1..VGPU_MAX_DIM */
	vgpu_f32 c_center;
	vgpu_f32 c_neighbor;
} __attribute__((packed));

struct vgpu_timestamp_args {
	uint64_t dst; /* 8-byte aligned: u64 GPU clock (ns) at kernel start */
} __attribute__((packed));

_Static_assert(sizeof(vgpu_f32) == 4, "f32 size");
_Static_assert(sizeof(struct vgpu_spin_args) == VGPU_KERNEL_SPIN_ARGS_SIZE, "spin args");
_Static_assert(sizeof(struct vgpu_spin_args) == 8, "spin args");
_Static_assert(sizeof(struct vgpu_memset_args) == VGPU_KERNEL_MEMSET_ARGS_SIZE, "memset args");
_Static_assert(sizeof(struct vgpu_memset_args) == 24, "memset args");
_Static_assert(sizeof(struct vgpu_memcpy_args) == VGPU_KERNEL_MEMCPY_ARGS_SIZE, "memcpy args");
_Static_assert(sizeof(struct vgpu_memcpy_args) == 24, "memcpy args");
_Static_assert(sizeof(struct vgpu_saxpy_args) == VGPU_KERNEL_SAXPY_ARGS_SIZE, "saxpy args");
_Static_assert(sizeof(struct vgpu_saxpy_args) == 32, "saxpy args");
_Static_assert(sizeof(struct vgpu_sgemm_args) == VGPU_KERNEL_SGEMM_ARGS_SIZE, "sgemm args");
_Static_assert(sizeof(struct vgpu_sgemm_args) == 44, "sgemm args");
_Static_assert(sizeof(struct vgpu_reduce_sum_args) == VGPU_KERNEL_REDUCE_SUM_ARGS_SIZE,
	       "reduce_sum args");
_Static_assert(sizeof(struct vgpu_reduce_sum_args) == 24, "reduce_sum args");
_Static_assert(sizeof(struct vgpu_checksum_args) == VGPU_KERNEL_CHECKSUM_ARGS_SIZE,
	       "checksum args");
_Static_assert(sizeof(struct vgpu_checksum_args) == 24, "checksum args");
_Static_assert(sizeof(struct vgpu_stencil2d_args) == VGPU_KERNEL_STENCIL2D_ARGS_SIZE,
	       "stencil2d args");
_Static_assert(sizeof(struct vgpu_stencil2d_args) == 32, "stencil2d args");
_Static_assert(sizeof(struct vgpu_timestamp_args) == VGPU_KERNEL_TIMESTAMP_ARGS_SIZE,
	       "timestamp args");
_Static_assert(sizeof(struct vgpu_timestamp_args) == 8, "timestamp args");

/* ---- Error codes (control page ERROR, channel error events, request replies). -------- */
#define VGPU_ERR_OK 0
#define VGPU_ERR_INVALID_ARGUMENT 1
#define VGPU_ERR_NOT_FOUND 2
#define VGPU_ERR_NO_MEMORY 3
#define VGPU_ERR_PERMISSION_DENIED 4
#define VGPU_ERR_LIMIT_EXCEEDED 5
#define VGPU_ERR_BUSY 6
#define VGPU_ERR_UNSUPPORTED 7
#define VGPU_ERR_MMU_FAULT 8
#define VGPU_ERR_BAD_METHOD 9
#define VGPU_ERR_BAD_KERNEL 10
#define VGPU_ERR_BAD_KERNEL_ARGS 11
#define VGPU_ERR_BAD_GP_ENTRY 12
#define VGPU_ERR_WATCHDOG_KILLED 13
#define VGPU_ERR_CHANNEL_DESTROYED 14
#define VGPU_ERR_VERSION_MISMATCH 15
#define VGPU_ERR_INTERNAL 16
#define VGPU_ERR_DEVICE_LOST 17
#define VGPU_ERR_MODULES_NEED_CUDA_GPU 18
#define VGPU_ERR_MODULES_NEED_WORKER 19
#define VGPU_ERR_BAD_MODULE 20
#define VGPU_ERR_COUNT 21

/* ---- The virtio device (protocol.md §9-§13): id, queues, config space, shared memory. */
#define VGPU_VIRTIO_ID 60
#define VGPU_CONTROL_QUEUE 0
#define VGPU_EVENT_QUEUE 1
#define VGPU_NUM_QUEUES 2
#define VGPU_SHM_REGION_ID 0
#define VGPU_CHANNEL_SLOTS 1024
#define VGPU_APERTURE_OFFSET 0x400000
#define VGPU_APERTURE_SIZE 0xfc00000
#define VGPU_SHM_SIZE 0x10000000
/* Device feature bit: channels without the shared-memory region (forwarded submission). */
#define VGPU_F_FORWARDED 0
/* CREATE_CHANNEL's slot for a channel with no page in the region. */
#define VGPU_NO_SLOT 0xffffffffu

/* Config space (32 bytes). */
struct vgpu_virtio_config {
	vgpu_le32 version;
	vgpu_le32 channel_slots;
	vgpu_le64 aperture_offset;
	vgpu_le64 aperture_size;
	vgpu_le64 vram_bytes;
};

/* ---- Control requests (control queue): a header, an op-specific body. ---------------- */
#define VGPU_OP_GET_INFO 1
#define VGPU_OP_CREATE_CONTEXT 2
#define VGPU_OP_DESTROY_CONTEXT 3
#define VGPU_OP_ALLOC_VRAM 4
#define VGPU_OP_FREE_MEM 5
#define VGPU_OP_MAP_VRAM 6
#define VGPU_OP_MAP_GUEST 7
#define VGPU_OP_UNMAP 8
#define VGPU_OP_MAP_APERTURE 9
#define VGPU_OP_UNMAP_APERTURE 10
#define VGPU_OP_CREATE_CHANNEL 11
#define VGPU_OP_DESTROY_CHANNEL 12
#define VGPU_OP_GET_STATS 13
#define VGPU_OP_SUBMIT 14
#define VGPU_OP_CHANNEL_STATUS 15
#define VGPU_OP_MODULE_LOAD 16
#define VGPU_OP_MODULE_UNLOAD 17
#define VGPU_OP_FUNCTION_GET 18
#define VGPU_OP_GLOBAL_GET 19
#define VGPU_OP_GET_ATTRIBUTES 20
#define VGPU_OP_GLOBAL_WRITE 21
#define VGPU_OP_GLOBAL_READ 22
#define VGPU_MAX_GLOBAL_COPY_BYTES 0x1000000
#define VGPU_MAX_GLOBAL_COPY_RANGES 256
#define VGPU_MAX_ATTRIBUTES 128

/* Guest modules (docs/design/guest-modules.md). */
#define VGPU_MAX_MODULE_BYTES 0x2000000
#define VGPU_MAX_MODULES_PER_CONTEXT 64
#define VGPU_MAX_SYMBOL_LEN 512
#define VGPU_MAX_FUNCTION_PARAMS 128
#define VGPU_PARAMS_UNKNOWN 0xffffffffu

#define VGPU_REQ_HEADER_SIZE 16
#define VGPU_REPLY_HEADER_SIZE 8
#define VGPU_MAX_SG_ENTRIES 512
#define VGPU_MAX_REQUEST_SIZE 8232
#define VGPU_MAX_REPLY_SIZE 1048
#define VGPU_WIRE_PAGE_4K 0
#define VGPU_WIRE_MAP_READ_ONLY 1

struct vgpu_req_header {
	vgpu_le32 op;
	vgpu_le32 pid;
	vgpu_le32 ctx;
	vgpu_le32 reserved;
};

struct vgpu_reply_header {
	vgpu_le32 status;
	vgpu_le32 len;
};

struct vgpu_sg_range {
	vgpu_le64 gpa;
	vgpu_le64 len;
};

/* CHANNEL_STATUS reply body (forwarded submission). */
struct vgpu_wire_channel_status {
	vgpu_le32 gp_put;
	vgpu_le32 gp_get;
	vgpu_le32 ref;
	vgpu_le32 notify_seq;
	vgpu_le32 error;
	vgpu_le32 reserved;
	vgpu_le64 error_info;
};

/* ---- Events (event queue, 24 bytes each). ------------------------------------------ */
#define VGPU_EVENT_NOTIFY 1
#define VGPU_EVENT_CHANNEL_ERROR 2
#define VGPU_EVENT_FENCE 3 /* REF reached the armed REF_WAKE: a wake-up only */
#define VGPU_EVENT_SIZE 24

struct vgpu_wire_event {
	vgpu_le32 kind;
	vgpu_le32 channel;
	vgpu_le32 value;
	vgpu_le32 reserved;
	vgpu_le64 info;
};

#endif /* VGPU_PROTOCOL_H */
