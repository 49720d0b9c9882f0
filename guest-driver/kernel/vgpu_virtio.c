// SPDX-License-Identifier: GPL-2.0 OR BSD-3-Clause
/*
 * vgpu.ko: the virtio side. Probe finds the control and event virtqueues and the
 * shared-memory region, registers /dev/vgpu; control requests are synchronous
 * request/reply chains on queue 0 with a timeout; events from queue 1 are routed to
 * channels by id and wake waiters. A device that asks for a reset (DEVICE_NEEDS_RESET
 * with a configuration interrupt: its backend died, hung or restarted) is rebound: the
 * old instance is removed as on unplug (open files fail with -ENODEV, their mappings
 * are zapped, waiters wake) and a fresh one is probed, so new opens of /dev/vgpu reach
 * the new backend. See docs/guest-driver.md.
 */

#include <linux/device.h>
#include <linux/idr.h>
#include <linux/io.h>
#include <linux/ioport.h>
#include <linux/jiffies.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/virtio.h>
#include <linux/virtio_config.h>
#include <linux/virtio_ring.h>
#include <linux/workqueue.h>

#include "vgpu_drv.h"
#include "vgpu_protocol.h"

static unsigned int request_timeout_ms = 10000;
module_param(request_timeout_ms, uint, 0644);
MODULE_PARM_DESC(request_timeout_ms, "how long a control request may take (ms) before -ETIMEDOUT");

static bool reset_on_timeout = true;
module_param(reset_on_timeout, bool, 0644);
MODULE_PARM_DESC(reset_on_timeout, "reset the device when a request times out (a hung backend)");

/* Runs device resets: their own queue, so that module exit can drain it. */
static struct workqueue_struct *vgpu_wq;

unsigned int vgpu_wait_poll_ms = 2;
module_param_named(wait_poll_ms, vgpu_wait_poll_ms, uint, 0644);
MODULE_PARM_DESC(wait_poll_ms, "WAIT re-checks the control page at least this often (ms)");

static DEFINE_IDA(vgpu_ida);

static void vgpu_dev_free(struct kref *kref)
{
	struct vgpu_dev *dev = container_of(kref, struct vgpu_dev, kref);

	kfree(dev->event_bufs);
	ida_destroy(&dev->fwd_pages);
	kfree(dev);
}

void vgpu_dev_get(struct vgpu_dev *dev)
{
	kref_get(&dev->kref);
}

void vgpu_dev_put(struct vgpu_dev *dev)
{
	kref_put(&dev->kref, vgpu_dev_free);
}

static void vgpu_chan_free(struct kref *kref)
{
	struct vgpu_chan *chan = container_of(kref, struct vgpu_chan, kref);

	/* Every mapping of it was zapped before the channel was forgotten. */
	if (chan->status)
		__free_page(chan->status);
	kfree(chan);
}

void vgpu_chan_put(struct vgpu_chan *chan)
{
	kref_put(&chan->kref, vgpu_chan_free);
}

/* Protocol error code -> errno. */
static int vgpu_errno(u32 status)
{
	switch (status) {
	case VGPU_ERR_INVALID_ARGUMENT:
		return -EINVAL;
	case VGPU_ERR_NOT_FOUND:
		return -ENOENT;
	case VGPU_ERR_NO_MEMORY:
		return -ENOMEM;
	case VGPU_ERR_PERMISSION_DENIED:
		return -EACCES;
	case VGPU_ERR_LIMIT_EXCEEDED:
		return -ENOSPC;
	case VGPU_ERR_BUSY:
		return -EBUSY;
	case VGPU_ERR_UNSUPPORTED:
		return -EOPNOTSUPP;
	case VGPU_ERR_MODULES_NEED_CUDA_GPU:
		return -ENOEXEC;
	case VGPU_ERR_MODULES_NEED_WORKER:
		return -EPERM;
	case VGPU_ERR_BAD_MODULE:
		return -EBADMSG;
	default:
		return -EIO;
	}
}

/* ---- device reset (recovery) ------------------------------------------------------- */

struct vgpu_reset_work {
	struct work_struct work;
	struct virtio_device *vdev; /* a device reference is held */
};

static void vgpu_reset_fn(struct work_struct *work)
{
	struct vgpu_reset_work *rw = container_of(work, struct vgpu_reset_work, work);
	struct device *d = &rw->vdev->dev;

	/* remove (open files see the old instance dead) then probe a fresh one */
	if (device_reprobe(d))
		dev_err(d, "restarting the device failed\n");
	put_device(d);
	kfree(rw);
}

/*
 * Queues a reset of the device (any context). `why` is logged. A device being removed or
 * one with a reset already queued is left alone.
 */
static void vgpu_queue_reset(struct vgpu_dev *dev, const char *why)
{
	struct vgpu_reset_work *rw;

	if (READ_ONCE(dev->dead) || atomic_xchg(&dev->reset_queued, 1))
		return;
	rw = kzalloc(sizeof(*rw), GFP_ATOMIC);
	if (!rw) {
		atomic_set(&dev->reset_queued, 0);
		return;
	}
	dev_warn(&dev->vdev->dev, "%s: resetting the device\n", why);
	INIT_WORK(&rw->work, vgpu_reset_fn);
	rw->vdev = dev->vdev;
	get_device(&dev->vdev->dev);
	queue_work(vgpu_wq, &rw->work);
}

/* Configuration interrupt: the device may ask for a reset (virtio 1.x §2.1.2). */
static void vgpu_config_changed(struct virtio_device *vdev)
{
	struct vgpu_dev *dev = vdev->priv;

	if (dev && vdev->config->get_status(vdev) & VIRTIO_CONFIG_S_NEEDS_RESET)
		vgpu_queue_reset(dev, "the device needs a reset (backend lost)");
}

/* ---- control queue ------------------------------------------------------------------ */

static void vgpu_ctrl_done(struct virtqueue *vq)
{
	struct vgpu_dev *dev = vq->vdev->priv;
	struct vgpu_req *req;
	unsigned long flags;
	unsigned int len;

	spin_lock_irqsave(&dev->ctrl_lock, flags);
	do {
		virtqueue_disable_cb(vq);
		while ((req = virtqueue_get_buf(vq, &len))) {
			req->used_len = len;
			req->completed = true;
			if (req->abandoned)
				kfree(req);
			else
				complete(&req->done);
		}
	} while (!virtqueue_enable_cb(vq));
	spin_unlock_irqrestore(&dev->ctrl_lock, flags);
}

/*
 * Sends one request (header + body) and waits for its reply. On success copies exactly
 * out_len payload bytes to out (the reply must carry at least that many). Returns 0 or
 * a negative errno: the reply's error code mapped, -ETIMEDOUT if the device did not
 * answer within request_timeout_ms (the chain is then abandoned: its buffers stay
 * allocated until the device returns them or is removed), -ENODEV once removed.
 */
static int request(struct vgpu_dev *dev, u32 op, u32 pid, u32 ctx, const void *body,
		   size_t body_len, void *out, size_t out_len, size_t *got);

int vgpu_request(struct vgpu_dev *dev, u32 op, u32 pid, u32 ctx, const void *body,
		 size_t body_len, void *out, size_t out_len)
{
	return request(dev, op, pid, ctx, body, body_len, out, out_len, NULL);
}

/* vgpu_request for replies of variable length: copies up to out_max payload bytes and
 * says how many in *got. */
int vgpu_request_var(struct vgpu_dev *dev, u32 op, u32 pid, u32 ctx, const void *body,
		     size_t body_len, void *out, size_t out_max, size_t *got)
{
	return request(dev, op, pid, ctx, body, body_len, out, out_max, got);
}

static int request(struct vgpu_dev *dev, u32 op, u32 pid, u32 ctx, const void *body,
		   size_t body_len, void *out, size_t out_len, size_t *got)
{
	struct scatterlist out_sg, in_sg, *sgs[2];
	struct vgpu_req_header *hdr;
	struct vgpu_reply_header rh;
	struct vgpu_req *req;
	unsigned long flags, left;
	bool notify = false;
	int err;

	if (body_len > VGPU_MAX_REQUEST_SIZE - VGPU_REQ_HEADER_SIZE ||
	    out_len > VGPU_MAX_REPLY_SIZE - VGPU_REPLY_HEADER_SIZE)
		return -EINVAL;
	req = kzalloc(struct_size(req, buf, VGPU_REQ_HEADER_SIZE + body_len), GFP_KERNEL);
	if (!req)
		return -ENOMEM;
	init_completion(&req->done);
	req->len = VGPU_REQ_HEADER_SIZE + body_len;
	hdr = (struct vgpu_req_header *)req->buf;
	hdr->op = cpu_to_le32(op);
	hdr->pid = cpu_to_le32(pid);
	hdr->ctx = cpu_to_le32(ctx);
	if (body_len)
		memcpy(req->buf + VGPU_REQ_HEADER_SIZE, body, body_len);

	sg_init_one(&out_sg, req->buf, req->len);
	sg_init_one(&in_sg, req->reply, sizeof(req->reply));
	sgs[0] = &out_sg;
	sgs[1] = &in_sg;

	mutex_lock(&dev->req_mutex);
	spin_lock_irqsave(&dev->ctrl_lock, flags);
	if (dev->dead) {
		err = -ENODEV;
	} else {
		err = virtqueue_add_sgs(dev->ctrl_vq, sgs, 1, 1, req, GFP_ATOMIC);
		if (!err) {
			dev->inflight = req;
			notify = virtqueue_kick_prepare(dev->ctrl_vq);
		} else if (err == -ENOSPC) {
			/* The ring is full of abandoned requests: the device is not answering. */
			err = -ETIMEDOUT;
		}
	}
	spin_unlock_irqrestore(&dev->ctrl_lock, flags);
	if (err) {
		mutex_unlock(&dev->req_mutex);
		kfree(req);
		return err;
	}
	atomic64_inc(&dev->requests);
	if (notify)
		virtqueue_notify(dev->ctrl_vq);

	left = wait_for_completion_timeout(&req->done, msecs_to_jiffies(request_timeout_ms));
	spin_lock_irqsave(&dev->ctrl_lock, flags);
	dev->inflight = NULL;
	if (!left && !req->completed) {
		req->abandoned = true;
		spin_unlock_irqrestore(&dev->ctrl_lock, flags);
		mutex_unlock(&dev->req_mutex);
		atomic64_inc(&dev->timeouts);
		pr_warn_ratelimited("%s: request op %u timed out after %u ms\n", dev->name, op,
				    request_timeout_ms);
		if (reset_on_timeout)
			vgpu_queue_reset(dev, "a request timed out");
		return -ETIMEDOUT;
	}
	spin_unlock_irqrestore(&dev->ctrl_lock, flags);
	mutex_unlock(&dev->req_mutex);

	if (req->failed) {
		err = -ENODEV;
		goto out;
	}
	if (req->used_len < sizeof(rh) || req->used_len > sizeof(req->reply)) {
		err = -EIO;
		goto out;
	}
	memcpy(&rh, req->reply, sizeof(rh));
	if (le32_to_cpu(rh.status)) {
		err = vgpu_errno(le32_to_cpu(rh.status));
		goto out;
	}
	if (le32_to_cpu(rh.len) > req->used_len - sizeof(rh)) {
		err = -EIO;
		goto out;
	}
	if (got) {
		*got = min_t(size_t, le32_to_cpu(rh.len), out_len);
		out_len = *got;
	} else if (le32_to_cpu(rh.len) < out_len) {
		err = -EIO;
		goto out;
	}
	if (out_len)
		memcpy(out, req->reply + sizeof(rh), out_len);
	err = 0;
out:
	kfree(req);
	return err;
}

/* ---- event queue -------------------------------------------------------------------- */

static int vgpu_event_post(struct vgpu_dev *dev, struct vgpu_wire_event *ev, gfp_t gfp)
{
	struct scatterlist sg;

	sg_init_one(&sg, ev, sizeof(*ev));
	return virtqueue_add_inbuf(dev->event_vq, &sg, 1, ev, gfp);
}

static void vgpu_event_route(struct vgpu_dev *dev, const struct vgpu_wire_event *ev)
{
	u32 kind = le32_to_cpu(ev->kind), id = le32_to_cpu(ev->channel);
	struct vgpu_chan *chan;
	unsigned long flags;

	atomic64_inc(&dev->events);
	xa_lock_irqsave(&dev->chans, flags);
	chan = xa_load(&dev->chans, id);
	if (!chan || chan->dead) {
		atomic64_inc(&dev->events_unrouted);
	} else if (kind == VGPU_EVENT_NOTIFY) {
		chan->notify_events++;
		chan->last_token = le32_to_cpu(ev->value);
	} else if (kind == VGPU_EVENT_CHANNEL_ERROR) {
		if (!chan->error) {
			chan->error = le32_to_cpu(ev->value) ? le32_to_cpu(ev->value) :
							       VGPU_ERR_INTERNAL;
			chan->error_info = le64_to_cpu(ev->info);
		}
	}
	xa_unlock_irqrestore(&dev->chans, flags);
}

static void vgpu_event_done(struct virtqueue *vq)
{
	struct vgpu_dev *dev = vq->vdev->priv;
	struct vgpu_wire_event *ev;
	unsigned long flags;
	unsigned int len;
	bool notify, got = false;

	spin_lock_irqsave(&dev->event_lock, flags);
	while ((ev = virtqueue_get_buf(vq, &len))) {
		if (len >= sizeof(*ev)) {
			vgpu_event_route(dev, ev);
			got = true;
		}
		memset(ev, 0, sizeof(*ev));
		if (vgpu_event_post(dev, ev, GFP_ATOMIC))
			dev_warn_ratelimited(&dev->vdev->dev, "cannot re-post an event buffer\n");
	}
	notify = virtqueue_kick_prepare(vq);
	spin_unlock_irqrestore(&dev->event_lock, flags);
	if (notify)
		virtqueue_notify(vq);
	if (got) {
		atomic_inc(&dev->event_gen);
		wake_up_all(&dev->event_wq);
	}
}

/* ---- probe / remove ----------------------------------------------------------------- */

static int vgpu_read_config(struct vgpu_dev *dev)
{
	struct virtio_device *vdev = dev->vdev;

	virtio_cread_le(vdev, struct vgpu_virtio_config, version, &dev->protocol_version);
	virtio_cread_le(vdev, struct vgpu_virtio_config, channel_slots, &dev->channel_slots);
	virtio_cread_le(vdev, struct vgpu_virtio_config, aperture_offset, &dev->aperture_offset);
	virtio_cread_le(vdev, struct vgpu_virtio_config, aperture_size, &dev->aperture_size);
	virtio_cread_le(vdev, struct vgpu_virtio_config, vram_bytes, &dev->vram_bytes);

	if (dev->protocol_version >> 16 != VGPU_PROTOCOL_VERSION >> 16) {
		dev_err(&vdev->dev, "device speaks protocol %#x, driver %#x\n",
			dev->protocol_version, VGPU_PROTOCOL_VERSION);
		return -ENODEV;
	}
	/* Trust nothing about the layout that user mappings will be derived from. */
	if (!dev->channel_slots || dev->channel_slots > VGPU_APERTURE_OFFSET / PAGE_SIZE ||
	    (u64)dev->channel_slots * PAGE_SIZE > dev->aperture_offset ||
	    !PAGE_ALIGNED(dev->aperture_offset) || !PAGE_ALIGNED(dev->aperture_size) ||
	    dev->aperture_offset + dev->aperture_size < dev->aperture_offset) {
		dev_err(&vdev->dev, "bad config: %u slots, aperture %#llx+%#llx\n",
			dev->channel_slots, dev->aperture_offset, dev->aperture_size);
		return -ENODEV;
	}
	return 0;
}

static int vgpu_setup_shm(struct vgpu_dev *dev)
{
	struct virtio_device *vdev = dev->vdev;

	if (dev->forwarded)
		return 0; /* no region: forwarded submission */
	if (!virtio_get_shm_region(vdev, &dev->shm, VGPU_SHM_REGION_ID)) {
		dev_err(&vdev->dev, "no shared-memory region %d and no forwarded submission\n",
			VGPU_SHM_REGION_ID);
		return -ENODEV;
	}
	if (dev->shm.len < dev->aperture_offset + dev->aperture_size ||
	    !PAGE_ALIGNED(dev->shm.addr) || !PAGE_ALIGNED(dev->shm.len)) {
		dev_err(&vdev->dev, "shared-memory region %#llx+%#llx does not hold the layout\n",
			dev->shm.addr, dev->shm.len);
		return -ENODEV;
	}
	if (!devm_request_mem_region(&vdev->dev, dev->shm.addr, dev->shm.len, dev->name))
		dev_warn(&vdev->dev, "shared-memory region %#llx+%#llx already claimed\n",
			 dev->shm.addr, dev->shm.len);
	/* Host RAM behind a BAR: cacheable, coherent with the host's view. */
	dev->shm_va = memremap(dev->shm.addr, dev->shm.len, MEMREMAP_WB);
	if (!dev->shm_va) {
		dev_err(&vdev->dev, "cannot map the shared-memory region\n");
		return -ENOMEM;
	}
	return 0;
}

static int vgpu_setup_vqs(struct vgpu_dev *dev)
{
	vq_callback_t *callbacks[VGPU_NUM_QUEUES] = { vgpu_ctrl_done, vgpu_event_done };
	static const char * const names[VGPU_NUM_QUEUES] = { "control", "event" };
	struct virtqueue *vqs[VGPU_NUM_QUEUES];
	int err;

	err = virtio_find_vqs(dev->vdev, VGPU_NUM_QUEUES, vqs, callbacks, names, NULL);
	if (err) {
		/* e.g. -EINVAL from virtio_pci when the function has neither MSI-X nor an IRQ */
		dev_err(&dev->vdev->dev, "cannot set up the virtqueues: %d\n", err);
		return err;
	}
	dev->ctrl_vq = vqs[VGPU_CONTROL_QUEUE];
	dev->event_vq = vqs[VGPU_EVENT_QUEUE];
	return 0;
}

static int vgpu_fill_events(struct vgpu_dev *dev)
{
	unsigned long flags;
	int i, err = 0;

	dev->event_bufs = kcalloc(VGPU_EVENT_BUFS, sizeof(*dev->event_bufs), GFP_KERNEL);
	if (!dev->event_bufs)
		return -ENOMEM;
	spin_lock_irqsave(&dev->event_lock, flags);
	for (i = 0; i < VGPU_EVENT_BUFS && !err; i++)
		err = vgpu_event_post(dev, &dev->event_bufs[i], GFP_ATOMIC);
	spin_unlock_irqrestore(&dev->event_lock, flags);
	/* A smaller queue than VGPU_EVENT_BUFS is fine as long as one buffer went in. */
	return i > 1 || !err ? 0 : err;
}

/* sysfs: /sys/class/misc/vgpu/submission says how this device takes work. */
static ssize_t submission_show(struct device *d, struct device_attribute *attr, char *buf)
{
	struct miscdevice *misc = dev_get_drvdata(d);
	struct vgpu_dev *dev = container_of(misc, struct vgpu_dev, misc);

	return sysfs_emit(buf, "%s\n", dev->forwarded ? "forwarded" : "direct");
}
static DEVICE_ATTR_RO(submission);

/*
 * sysfs: /sys/class/misc/vgpu/rings shows the driver's view of its split rings (the
 * indices and EVENT_IDX words as they are in guest memory) and its request counters:
 * what a stalled guest waits for, read without the device's help.
 */
static void vgpu_ring_show(struct virtio_device *vdev, struct virtqueue *vq, const char *name,
			   char *buf, int *len)
{
	unsigned int num = virtqueue_get_vring_size(vq);
	struct vring_avail *avail = phys_to_virt(virtqueue_get_avail_addr(vq));
	struct vring_used *used = phys_to_virt(virtqueue_get_used_addr(vq));
	/* With EVENT_IDX: used_event trails the avail ring, avail_event the used ring. */
	__virtio16 *used_event = &avail->ring[num];
	__virtio16 *avail_event = (__virtio16 *)&used->ring[num];

	*len += sysfs_emit_at(buf, *len,
			      "%s size=%u avail_idx=%u used_idx=%u avail_flags=%#x used_flags=%#x used_event=%u avail_event=%u broken=%d\n",
			      name, num, virtio16_to_cpu(vdev, READ_ONCE(avail->idx)),
			      virtio16_to_cpu(vdev, READ_ONCE(used->idx)),
			      virtio16_to_cpu(vdev, READ_ONCE(avail->flags)),
			      virtio16_to_cpu(vdev, READ_ONCE(used->flags)),
			      virtio16_to_cpu(vdev, READ_ONCE(*used_event)),
			      virtio16_to_cpu(vdev, READ_ONCE(*avail_event)),
			      virtqueue_is_broken(vq));
}

static ssize_t rings_show(struct device *d, struct device_attribute *attr, char *buf)
{
	struct miscdevice *misc = dev_get_drvdata(d);
	struct vgpu_dev *dev = container_of(misc, struct vgpu_dev, misc);
	int len = 0;

	vgpu_ring_show(dev->vdev, dev->ctrl_vq, "control", buf, &len);
	vgpu_ring_show(dev->vdev, dev->event_vq, "event", buf, &len);
	len += sysfs_emit_at(buf, len,
			     "event_idx=%d requests=%lld timeouts=%lld events=%lld unrouted=%lld\n",
			     virtio_has_feature(dev->vdev, VIRTIO_RING_F_EVENT_IDX),
			     atomic64_read(&dev->requests), atomic64_read(&dev->timeouts),
			     atomic64_read(&dev->events), atomic64_read(&dev->events_unrouted));
	return len;
}
static DEVICE_ATTR_RO(rings);

static struct attribute *vgpu_attrs[] = {
	&dev_attr_submission.attr,
	&dev_attr_rings.attr,
	NULL,
};
ATTRIBUTE_GROUPS(vgpu);

static int vgpu_probe(struct virtio_device *vdev)
{
	struct vgpu_dev *dev;
	int err, index;

	index = ida_alloc(&vgpu_ida, GFP_KERNEL);
	if (index < 0)
		return index;
	dev = kzalloc(sizeof(*dev), GFP_KERNEL);
	if (!dev) {
		ida_free(&vgpu_ida, index);
		return -ENOMEM;
	}
	kref_init(&dev->kref);
	dev->vdev = vdev;
	dev->index = index;
	if (index)
		snprintf(dev->name, sizeof(dev->name), "vgpu%d", index);
	else
		strscpy(dev->name, "vgpu", sizeof(dev->name));
	mutex_init(&dev->req_mutex);
	spin_lock_init(&dev->ctrl_lock);
	spin_lock_init(&dev->event_lock);
	xa_init_flags(&dev->chans, XA_FLAGS_LOCK_IRQ);
	ida_init(&dev->fwd_pages);
	/* validate() left the feature acked only when there is no region. */
	dev->forwarded = virtio_has_feature(vdev, VGPU_F_FORWARDED);
	init_waitqueue_head(&dev->event_wq);
	mutex_init(&dev->files_lock);
	INIT_LIST_HEAD(&dev->files);
	INIT_LIST_HEAD(&dev->orphans);
	vdev->priv = dev;

	err = vgpu_read_config(dev);
	if (err)
		goto err_free;
	err = vgpu_setup_shm(dev);
	if (err)
		goto err_free;
	err = vgpu_setup_vqs(dev);
	if (err)
		goto err_unmap;
	err = vgpu_fill_events(dev);
	if (err) {
		dev_err(&vdev->dev, "cannot post event buffers: %d\n", err);
		goto err_vqs;
	}
	virtio_device_ready(vdev);
	virtqueue_kick(dev->event_vq);

	dev->misc.minor = MISC_DYNAMIC_MINOR;
	dev->misc.name = dev->name;
	dev->misc.fops = &vgpu_fops;
	dev->misc.mode = 0666;
	dev->misc.parent = &vdev->dev;
	dev->misc.groups = vgpu_groups;
	err = misc_register(&dev->misc);
	if (err) {
		dev_err(&vdev->dev, "cannot register /dev/%s: %d\n", dev->name, err);
		goto err_reset;
	}
	dev->misc_registered = true;

	if (dev->forwarded)
		dev_info(&vdev->dev,
			 "/dev/%s: protocol %#x, no shared-memory region: forwarded submission, VRAM %llu MiB\n",
			 dev->name, dev->protocol_version, dev->vram_bytes >> 20);
	else
		dev_info(&vdev->dev,
			 "/dev/%s: protocol %#x, %u slots, region %#llx+%#llx, aperture %#llx+%#llx, VRAM %llu MiB\n",
			 dev->name, dev->protocol_version, dev->channel_slots, dev->shm.addr,
			 dev->shm.len, dev->aperture_offset, dev->aperture_size,
			 dev->vram_bytes >> 20);
	return 0;

err_reset:
	virtio_reset_device(vdev);
err_vqs:
	vdev->config->del_vqs(vdev);
err_unmap:
	if (dev->shm_va)
		memunmap(dev->shm_va);
err_free:
	vdev->priv = NULL;
	ida_free(&vgpu_ida, dev->index);
	vgpu_dev_put(dev);
	return err;
}

static void vgpu_remove(struct virtio_device *vdev)
{
	struct vgpu_dev *dev = vdev->priv;
	struct vgpu_umap *u, *tmp;
	struct vgpu_file *vf;
	struct vgpu_req *req;
	unsigned long flags;
	LIST_HEAD(orphans);

	/* No new opens; open files keep `dev` alive and see it dead. */
	if (dev->misc_registered)
		misc_deregister(&dev->misc);

	/* Stop the device: after the reset it touches no buffer and no guest page. */
	mutex_lock(&dev->files_lock);
	spin_lock_irqsave(&dev->ctrl_lock, flags);
	dev->dead = true;
	spin_unlock_irqrestore(&dev->ctrl_lock, flags);
	mutex_unlock(&dev->files_lock);
	virtio_reset_device(vdev);

	spin_lock_irqsave(&dev->ctrl_lock, flags);
	while ((req = virtqueue_detach_unused_buf(dev->ctrl_vq))) {
		req->completed = true;
		if (req->abandoned) {
			kfree(req);
		} else {
			req->failed = true;
			complete(&req->done);
		}
	}
	spin_unlock_irqrestore(&dev->ctrl_lock, flags);

	/* The waiter of the last request has left once we hold the mutex. */
	mutex_lock(&dev->req_mutex);
	vdev->config->del_vqs(vdev);
	mutex_unlock(&dev->req_mutex);

	/* No process keeps a window onto the region. */
	mutex_lock(&dev->files_lock);
	list_for_each_entry(vf, &dev->files, node)
		unmap_mapping_range(vf->filp->f_mapping, 0, 0, 1);
	mutex_unlock(&dev->files_lock);

	xa_lock_irqsave(&dev->chans, flags);
	dev->shm_gone = true;
	xa_unlock_irqrestore(&dev->chans, flags);
	wake_up_all(&dev->event_wq);
	if (dev->shm_va)
		memunmap(dev->shm_va);

	/* Pages the device never confirmed unmapped can go now that it is reset. */
	mutex_lock(&dev->files_lock);
	list_splice_init(&dev->orphans, &orphans);
	mutex_unlock(&dev->files_lock);
	list_for_each_entry_safe(u, tmp, &orphans, node) {
		list_del(&u->node);
		vgpu_umap_release(u);
	}

	dev_info(&vdev->dev, "removed: %lld requests, %lld timed out, %lld events (%lld unrouted)\n",
		 atomic64_read(&dev->requests), atomic64_read(&dev->timeouts),
		 atomic64_read(&dev->events), atomic64_read(&dev->events_unrouted));
	vdev->priv = NULL;
	/* The name is free now that the misc device is gone: a re-probe gets /dev/vgpu again. */
	ida_free(&vgpu_ida, dev->index);
	vgpu_dev_put(dev);
}

static const struct virtio_device_id vgpu_id_table[] = {
	{ VGPU_VIRTIO_ID, VIRTIO_DEV_ANY_ID },
	{ 0 },
};
MODULE_DEVICE_TABLE(virtio, vgpu_id_table);

static unsigned int vgpu_features[] = { VGPU_F_FORWARDED };

/*
 * Before FEATURES_OK: forwarded submission only where the device shows no shared-memory
 * region (a frontend without vhost-user SHMEM); with a region the driver submits directly.
 */
static int vgpu_validate(struct virtio_device *vdev)
{
	struct virtio_shm_region shm;

	if (virtio_get_shm_region(vdev, &shm, VGPU_SHM_REGION_ID))
		__virtio_clear_bit(vdev, VGPU_F_FORWARDED);
	return 0;
}


static struct virtio_driver vgpu_driver = {
	.driver.name = KBUILD_MODNAME,
	.driver.owner = THIS_MODULE,
	.id_table = vgpu_id_table,
	.feature_table = vgpu_features,
	.feature_table_size = ARRAY_SIZE(vgpu_features),
	.validate = vgpu_validate,
	.probe = vgpu_probe,
	.remove = vgpu_remove,
	.config_changed = vgpu_config_changed,
};

static int __init vgpu_init(void)
{
	int err;

	vgpu_wq = alloc_workqueue("vgpu", 0, 0);
	if (!vgpu_wq)
		return -ENOMEM;
	err = register_virtio_driver(&vgpu_driver);
	if (err)
		destroy_workqueue(vgpu_wq);
	return err;
}

static void __exit vgpu_exit(void)
{
	/* No config interrupt reaches the driver after this; then finish queued resets. */
	unregister_virtio_driver(&vgpu_driver);
	destroy_workqueue(vgpu_wq);
}

module_init(vgpu_init);
module_exit(vgpu_exit);

MODULE_DESCRIPTION("vgpu paravirtual GPU guest driver (resource allocation over virtio)");
MODULE_LICENSE("Dual BSD/GPL");
