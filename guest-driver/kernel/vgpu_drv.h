/* SPDX-License-Identifier: GPL-2.0 OR BSD-3-Clause */
/*
 * vgpu.ko internals: the device (virtqueues, shared-memory region, request/reply,
 * event routing) and the per-open-file bookkeeping of /dev/vgpu.
 */
#ifndef VGPU_DRV_H
#define VGPU_DRV_H

#include <linux/completion.h>
#include <linux/idr.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/miscdevice.h>
#include <linux/mutex.h>
#include <linux/spinlock.h>
#include <linux/types.h>
#include <linux/virtio.h>
#include <linux/virtio_config.h>
#include <linux/wait.h>
#include <linux/xarray.h>

#include "vgpu_protocol.h"

#define VGPU_EVENT_BUFS 64

/* Largest request this driver builds: a MAP_GUEST with VGPU_MAX_SG_ENTRIES ranges. */
#define VGPU_MAP_GUEST_FIXED 24

struct vgpu_dev {
	struct virtio_device *vdev;
	struct kref kref;
	int index;
	char name[16];
	struct miscdevice misc;
	bool misc_registered;

	/* Config space, read at probe. */
	u32 protocol_version;
	u32 channel_slots;
	u64 aperture_offset;
	u64 aperture_size;
	u64 vram_bytes;

	/* The shared-memory region (BAR window) and the driver's own mapping of it. */
	struct virtio_shm_region shm;
	void *shm_va;
	/*
	 * No region (VGPU_F_FORWARDED acked): channels have no slot; each gets a page of the
	 * driver's at an mmap offset from `fwd_pages`, filled from CHANNEL_STATUS replies,
	 * and submissions go out as SUBMIT requests.
	 */
	bool forwarded;
	struct ida fwd_pages;

	struct virtqueue *ctrl_vq;
	struct virtqueue *event_vq;
	/* Serializes requests: one in flight (plus abandoned ones) at a time. */
	struct mutex req_mutex;
	/* Protects ctrl_vq and the completion state of requests. */
	spinlock_t ctrl_lock;
	struct vgpu_req *inflight;
	/* Protects event_vq. */
	spinlock_t event_lock;
	struct vgpu_wire_event *event_bufs;
	/*
	 * Channel id -> struct vgpu_chan, for event routing. Its xa_lock (irq-safe) also
	 * protects every channel's event state and `shm_gone`.
	 */
	struct xarray chans;
	wait_queue_head_t event_wq;
	atomic_t event_gen;

	/* Open files (for zapping their mappings when the device goes). */
	struct mutex files_lock;
	struct list_head files;
	/* User mappings whose unmap the device never confirmed: pinned until remove. */
	struct list_head orphans;

	bool dead;     /* removed: every request fails with -ENODEV */
	/* A reset of the device (remove + probe) is queued: ask only once. */
	atomic_t reset_queued;
	bool shm_gone; /* shm_va unmapped (under chans' xa_lock) */

	atomic64_t requests;
	atomic64_t timeouts;
	atomic64_t events;
	atomic64_t events_unrouted;
};

/* One control request and its reply buffer; freed by the waiter or, once abandoned
 * after a timeout, by whoever sees it completed (callback or remove). */
struct vgpu_req {
	struct completion done;
	bool completed;
	bool abandoned;
	bool failed; /* the device went away */
	u32 used_len;
	size_t len;
	u8 reply[VGPU_MAX_REPLY_SIZE];
	u8 buf[]; /* header + body */
};

struct vgpu_ctx;

struct vgpu_chan {
	struct kref kref;
	struct list_head node; /* in ctx->chans */
	u32 id;
	u32 slot;
	u64 offset;
	/* Forwarded device: the page the process maps (freed with the channel). */
	struct page *status;
	/* Event state: under dev->chans' xa_lock. */
	bool dead;
	u32 notify_events;
	u32 last_token;
	u32 error;
	u64 error_info;
};

struct vgpu_mem {
	struct list_head node;
	u32 id;
	u64 size;
	bool has_aperture;
	u64 aperture; /* region offset of the window */
	u64 aperture_len;
};

struct vgpu_umap {
	struct list_head node;
	u64 va;
	u64 size;
	bool writable;
	struct mm_struct *mm; /* for locked_vm accounting */
	unsigned long npages;
	struct page **pages;
	u32 nchunks;   /* chunks still mapped on the device */
	u64 *chunk_va; /* GPU VA of each MAP_GUEST chunk */
};

struct vgpu_ctx {
	struct list_head node;
	u32 id;
	u32 pid;
	struct list_head chans;
	struct list_head mems;
	struct list_head umaps;
};

struct vgpu_file {
	struct vgpu_dev *dev;
	struct file *filp;
	struct mutex lock; /* never held while touching user memory */
	struct list_head ctxs;
	struct list_head node; /* in dev->files */
};

/* vgpu_virtio.c */
int vgpu_request(struct vgpu_dev *dev, u32 op, u32 pid, u32 ctx, const void *body,
		 size_t body_len, void *out, size_t out_len);
int vgpu_request_var(struct vgpu_dev *dev, u32 op, u32 pid, u32 ctx, const void *body,
		     size_t body_len, void *out, size_t out_max, size_t *got);
void vgpu_dev_put(struct vgpu_dev *dev);
void vgpu_dev_get(struct vgpu_dev *dev);
void vgpu_chan_put(struct vgpu_chan *chan);
extern unsigned int vgpu_wait_poll_ms;

/* vgpu_file.c */
extern const struct file_operations vgpu_fops;
void vgpu_umap_release(struct vgpu_umap *u);

#endif /* VGPU_DRV_H */
