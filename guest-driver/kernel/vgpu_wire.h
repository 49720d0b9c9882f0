/* SPDX-License-Identifier: GPL-2.0 OR BSD-3-Clause */
/*
 * vgpu virtio device wire format used by the driver: device id, queues, config space,
 * shared-memory region, control requests/replies and events (docs/protocol.md §9-§13).
 * Every VGPU_ define here is checked against the Rust crate vgpu-protocol by
 * guest-driver/runtime/tests/ioctl_abi.rs. All fields are little-endian.
 */
#ifndef VGPU_WIRE_H
#define VGPU_WIRE_H

#include <linux/types.h>

#define VGPU_VIRTIO_ID 60
#define VGPU_CONTROL_QUEUE 0
#define VGPU_EVENT_QUEUE 1
#define VGPU_NUM_QUEUES 2
#define VGPU_SHM_REGION_ID 0
#define VGPU_CHANNEL_SLOTS 1024
#define VGPU_APERTURE_OFFSET 0x400000
#define VGPU_APERTURE_SIZE 0x10000000
#define VGPU_SHM_SIZE 0x10400000

/* Config space (32 bytes). */
struct vgpu_virtio_config {
	__le32 version;
	__le32 channel_slots;
	__le64 aperture_offset;
	__le64 aperture_size;
	__le64 vram_bytes;
};

/* Control requests. */
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

#define VGPU_REQ_HEADER_SIZE 16
#define VGPU_REPLY_HEADER_SIZE 8
#define VGPU_MAX_SG_ENTRIES 512
#define VGPU_MAX_REQUEST_SIZE 8232
#define VGPU_MAX_REPLY_SIZE 72
#define VGPU_WIRE_PAGE_4K 0
#define VGPU_WIRE_MAP_READ_ONLY 1

struct vgpu_req_header {
	__le32 op;
	__le32 pid;
	__le32 ctx;
	__le32 reserved;
};

struct vgpu_reply_header {
	__le32 status;
	__le32 len;
};

struct vgpu_sg_range {
	__le64 gpa;
	__le64 len;
};

/* Events (24 bytes). */
#define VGPU_EVENT_NOTIFY 1
#define VGPU_EVENT_CHANNEL_ERROR 2
#define VGPU_EVENT_SIZE 24

struct vgpu_wire_event {
	__le32 kind;
	__le32 channel;
	__le32 value;
	__le32 reserved;
	__le64 info;
};

#endif /* VGPU_WIRE_H */
