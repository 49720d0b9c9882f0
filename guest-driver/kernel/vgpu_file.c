// SPDX-License-Identifier: GPL-2.0 OR BSD-3-Clause
/*
 * vgpu.ko: /dev/vgpu. Every open file owns the contexts it created and everything in
 * them; closing it (or the process exiting) destroys them on the device. ioctl
 * arguments are validated here before anything is sent; mmap offsets must name a
 * channel control page or a VRAM aperture window of the calling file's own process.
 *
 * Locking: vf->lock protects the file's object lists and is never held while touching
 * user memory (copy_{from,to}_user, pinning): those take mmap_lock, which mmap holds
 * when it takes vf->lock.
 */

#include <linux/fs.h>
#include <linux/log2.h>
#include <linux/mm.h>
#include <linux/overflow.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "vgpu_drv.h"
#include "vgpu_ioctl.h"
#include "vgpu_protocol.h"

#define VGPU_MIN_ALIGN 4096ULL
#define VGPU_MAX_ALIGN (1ULL << 30)
/* Longest WAIT: one day; longer asks are capped. */
#define VGPU_MAX_WAIT_NS (86400ULL * NSEC_PER_SEC)

static inline u32 vgpu_tgid(void)
{
	return (u32)current->tgid;
}

/* ---- lookups (vf->lock held) -------------------------------------------------------- */

static struct vgpu_ctx *find_ctx(struct vgpu_file *vf, u32 id)
{
	struct vgpu_ctx *c;

	list_for_each_entry(c, &vf->ctxs, node)
		if (c->id == id)
			return c;
	return NULL;
}

/* The caller's context: ENOENT if this file has none by that id, EACCES if another
 * process (e.g. a fork child sharing the file) created it. */
static struct vgpu_ctx *own_ctx(struct vgpu_file *vf, u32 id, int *err)
{
	struct vgpu_ctx *c = find_ctx(vf, id);

	if (!c) {
		*err = -ENOENT;
		return NULL;
	}
	if (c->pid != vgpu_tgid()) {
		*err = -EACCES;
		return NULL;
	}
	return c;
}

static struct vgpu_mem *find_mem(struct vgpu_ctx *c, u32 id)
{
	struct vgpu_mem *m;

	list_for_each_entry(m, &c->mems, node)
		if (m->id == id)
			return m;
	return NULL;
}

static struct vgpu_chan *find_chan(struct vgpu_ctx *c, u32 id)
{
	struct vgpu_chan *ch;

	list_for_each_entry(ch, &c->chans, node)
		if (ch->id == id)
			return ch;
	return NULL;
}

static void zap(struct vgpu_file *vf, u64 offset, u64 len)
{
	unmap_mapping_range(vf->filp->f_mapping, offset, len, 1);
}

/* ---- user mappings ------------------------------------------------------------------ */

void vgpu_umap_release(struct vgpu_umap *u)
{
	if (u->pages) {
		unpin_user_pages_dirty_lock(u->pages, u->npages, u->writable);
		if (u->mm)
			account_locked_vm(u->mm, u->npages, false);
	}
	if (u->mm)
		mmdrop(u->mm);
	kvfree(u->pages);
	kfree(u->chunk_va);
	kfree(u);
}

/* The device never confirmed the unmap: keep the pages pinned until it is reset. */
static void umap_orphan(struct vgpu_dev *dev, struct vgpu_umap *u)
{
	mutex_lock(&dev->files_lock);
	if (dev->dead) {
		mutex_unlock(&dev->files_lock);
		vgpu_umap_release(u);
		return;
	}
	pr_warn("%s: keeping %lu pages pinned: the device did not confirm their unmap\n",
		dev->name, u->npages);
	list_add(&u->node, &dev->orphans);
	mutex_unlock(&dev->files_lock);
}

/* Sends UNMAP for the chunks still mapped, last first. 0 when all are gone. */
static int umap_unmap_chunks(struct vgpu_dev *dev, struct vgpu_ctx *c, struct vgpu_umap *u)
{
	while (u->nchunks) {
		__le64 va = cpu_to_le64(u->chunk_va[u->nchunks - 1]);
		int err = vgpu_request(dev, VGPU_OP_UNMAP, c->pid, c->id, &va, sizeof(va), NULL, 0);

		if (err && err != -ENOENT)
			return err;
		u->nchunks--;
	}
	return 0;
}

/* Pins the user range and builds its guest-physical ranges; no lock held. */
static struct vgpu_umap *umap_pin(const struct vgpu_ioc_map_user *a, int *err)
{
	struct vgpu_umap *u;
	long pinned;

	u = kzalloc(sizeof(*u), GFP_KERNEL);
	if (!u) {
		*err = -ENOMEM;
		return NULL;
	}
	u->va = a->va;
	u->size = a->size;
	u->writable = !(a->flags & VGPU_IOC_MAP_READ_ONLY);
	u->npages = a->size >> PAGE_SHIFT;
	u->pages = kvmalloc_array(u->npages, sizeof(*u->pages), GFP_KERNEL);
	if (!u->pages) {
		*err = -ENOMEM;
		goto fail;
	}
	u->mm = current->mm;
	mmgrab(u->mm);
	*err = account_locked_vm(u->mm, u->npages, true);
	if (*err) {
		kvfree(u->pages);
		u->pages = NULL;
		goto fail;
	}
	pinned = pin_user_pages_fast(a->user_addr, u->npages,
				     FOLL_LONGTERM | (u->writable ? FOLL_WRITE : 0), u->pages);
	if (pinned != u->npages) {
		if (pinned > 0)
			unpin_user_pages(u->pages, pinned);
		account_locked_vm(u->mm, u->npages, false);
		kvfree(u->pages);
		u->pages = NULL;
		*err = pinned < 0 ? (int)pinned : -EFAULT;
		goto fail;
	}
	return u;
fail:
	if (u->mm)
		mmdrop(u->mm);
	kfree(u);
	return NULL;
}

/*
 * Maps the pinned pages with as few MAP_GUEST requests as the scatter-gather limit
 * allows: physically contiguous pages merge into one range, at most
 * VGPU_MAX_SG_ENTRIES ranges per request, chunks back to back in GPU VA.
 */
static int umap_map(struct vgpu_dev *dev, struct vgpu_ctx *c, struct vgpu_umap *u)
{
	size_t body_max = VGPU_MAP_GUEST_FIXED + VGPU_MAX_SG_ENTRIES * sizeof(struct vgpu_sg_range);
	unsigned long i = 0, max_chunks;
	u8 *body;
	int err = 0;

	/* Worst case one chunk per VGPU_MAX_SG_ENTRIES pages. */
	max_chunks = DIV_ROUND_UP(u->npages, VGPU_MAX_SG_ENTRIES);
	u->chunk_va = kcalloc(max_chunks, sizeof(*u->chunk_va), GFP_KERNEL);
	body = kmalloc(body_max, GFP_KERNEL);
	if (!u->chunk_va || !body) {
		kfree(body);
		return -ENOMEM;
	}
	while (i < u->npages) {
		struct vgpu_sg_range *r = (struct vgpu_sg_range *)(body + VGPU_MAP_GUEST_FIXED);
		u64 chunk_va = u->va + ((u64)i << PAGE_SHIFT);
		u32 n = 0;

		while (i < u->npages) {
			u64 pa = page_to_phys(u->pages[i]);

			if (n && le64_to_cpu(r[n - 1].gpa) + le64_to_cpu(r[n - 1].len) == pa) {
				r[n - 1].len = cpu_to_le64(le64_to_cpu(r[n - 1].len) + PAGE_SIZE);
			} else {
				if (n == VGPU_MAX_SG_ENTRIES)
					break;
				r[n].gpa = cpu_to_le64(pa);
				r[n].len = cpu_to_le64(PAGE_SIZE);
				n++;
			}
			i++;
		}
		/* va u64, page u32, flags u32, count u32, reserved u32 */
		*(__le64 *)(body + 0) = cpu_to_le64(chunk_va);
		*(__le32 *)(body + 8) = cpu_to_le32(VGPU_WIRE_PAGE_4K);
		*(__le32 *)(body + 12) = cpu_to_le32(u->writable ? 0 : VGPU_WIRE_MAP_READ_ONLY);
		*(__le32 *)(body + 16) = cpu_to_le32(n);
		*(__le32 *)(body + 20) = 0;
		err = vgpu_request(dev, VGPU_OP_MAP_GUEST, c->pid, c->id, body,
				   VGPU_MAP_GUEST_FIXED + n * sizeof(*r), NULL, 0);
		if (err)
			break;
		u->chunk_va[u->nchunks++] = chunk_va;
	}
	kfree(body);
	return err;
}

/* ---- context teardown --------------------------------------------------------------- */

static void chan_forget(struct vgpu_dev *dev, struct vgpu_chan *ch)
{
	xa_erase_irq(&dev->chans, ch->id);
	list_del(&ch->node);
	/* Its mapping is zapped: the offset may name another channel's page now. */
	if (ch->status)
		ida_free(&dev->fwd_pages, ch->offset >> PAGE_SHIFT);
	vgpu_chan_put(ch);
}

/*
 * CHANNEL_STATUS for `ch` (of process `pid`, context `ctx`); on a forwarded device the
 * fields also go into the channel's page, ordered as the GPU writes its own page
 * (ERROR_INFO before ERROR). The caller keeps `ch` alive (vf->lock or a reference).
 */
static int chan_status(struct vgpu_dev *dev, u32 pid, u32 ctx, struct vgpu_chan *ch,
		       struct vgpu_ioc_channel_status *out)
{
	struct vgpu_wire_channel_status r;
	__le32 body[2];
	int err;

	body[0] = cpu_to_le32(ch->id);
	body[1] = 0;
	err = vgpu_request(dev, VGPU_OP_CHANNEL_STATUS, pid, ctx, body, sizeof(body), &r,
			   sizeof(r));
	if (err)
		return err;
	out->gp_put = le32_to_cpu(r.gp_put);
	out->gp_get = le32_to_cpu(r.gp_get);
	out->ref = le32_to_cpu(r.ref);
	out->notify_seq = le32_to_cpu(r.notify_seq);
	out->error = le32_to_cpu(r.error);
	out->reserved = 0;
	out->error_info = le64_to_cpu(r.error_info);
	if (ch->status) {
		u8 *page = page_address(ch->status);

		WRITE_ONCE(*(u64 *)(page + VGPU_CTRL_ERROR_INFO), r.error_info);
		smp_wmb();
		WRITE_ONCE(*(u32 *)(page + VGPU_CTRL_GP_GET), r.gp_get);
		WRITE_ONCE(*(u32 *)(page + VGPU_CTRL_REF), r.ref);
		WRITE_ONCE(*(u32 *)(page + VGPU_CTRL_NOTIFY_SEQ), r.notify_seq);
		WRITE_ONCE(*(u32 *)(page + VGPU_CTRL_ERROR), r.error);
	}
	return 0;
}

static void chan_set_dead(struct vgpu_dev *dev, struct vgpu_chan *ch, bool dead)
{
	xa_lock_irq(&dev->chans);
	ch->dead = dead;
	xa_unlock_irq(&dev->chans);
}

/*
 * Pinned user mappings are released only after vf->lock is dropped: unaccounting takes
 * mmap_lock, and mmap holds mmap_lock while it takes vf->lock.
 */
struct vgpu_umap_batch {
	struct list_head release;
	struct list_head orphan;
};

static void batch_init(struct vgpu_umap_batch *b)
{
	INIT_LIST_HEAD(&b->release);
	INIT_LIST_HEAD(&b->orphan);
}

static void batch_finish(struct vgpu_dev *dev, struct vgpu_umap_batch *b)
{
	struct vgpu_umap *u, *t;

	list_for_each_entry_safe(u, t, &b->release, node) {
		list_del(&u->node);
		vgpu_umap_release(u);
	}
	list_for_each_entry_safe(u, t, &b->orphan, node) {
		list_del(&u->node);
		umap_orphan(dev, u);
	}
}

/*
 * Destroys a context on the device and forgets it. Process mappings of its pages go
 * first. Pinned user pages are released only once the device confirmed (or is gone);
 * otherwise they stay pinned (orphaned) so the GPU can never reach a page reused by
 * someone else. With `force`, bookkeeping goes even when the device fails (close).
 * The context's user mappings land in `b` (release them after dropping vf->lock).
 */
static int ctx_destroy(struct vgpu_file *vf, struct vgpu_ctx *c, bool force,
		       struct vgpu_umap_batch *b)
{
	struct vgpu_dev *dev = vf->dev;
	struct vgpu_chan *ch, *cht;
	struct vgpu_mem *m, *mt;
	struct vgpu_umap *u, *ut;
	int err;

	list_for_each_entry(ch, &c->chans, node) {
		chan_set_dead(dev, ch, true);
		zap(vf, ch->offset, PAGE_SIZE);
	}
	list_for_each_entry(m, &c->mems, node)
		if (m->has_aperture)
			zap(vf, m->aperture, m->aperture_len);

	err = vgpu_request(dev, VGPU_OP_DESTROY_CONTEXT, c->pid, c->id, NULL, 0, NULL, 0);
	if (err == -ENODEV)
		err = 0; /* reset: nothing of it is left on the device */
	if (err && !force) {
		list_for_each_entry(ch, &c->chans, node)
			chan_set_dead(dev, ch, false);
		return err;
	}
	list_for_each_entry_safe(ch, cht, &c->chans, node)
		chan_forget(dev, ch);
	list_for_each_entry_safe(m, mt, &c->mems, node) {
		list_del(&m->node);
		kfree(m);
	}
	list_for_each_entry_safe(u, ut, &c->umaps, node)
		list_move(&u->node, err ? &b->orphan : &b->release);
	list_del(&c->node);
	kfree(c);
	return err;
}

/* ---- ioctls -------------------------------------------------------------------------- */

static long ioc_get_info(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_dev *dev = vf->dev;
	struct vgpu_ioc_info info = {};
	u8 r[24];
	int err;

	err = vgpu_request(dev, VGPU_OP_GET_INFO, vgpu_tgid(), 0, NULL, 0, r, sizeof(r));
	if (err)
		return err;
	info.abi_version = VGPU_IOCTL_ABI_VERSION;
	info.protocol_version = le32_to_cpup((__le32 *)(r + 0));
	info.compute_engines = le32_to_cpup((__le32 *)(r + 4));
	info.vram_bytes = le64_to_cpup((__le64 *)(r + 8));
	info.channel_slots = le32_to_cpup((__le32 *)(r + 16));
	info.max_contexts = le32_to_cpup((__le32 *)(r + 20));
	info.flags = dev->forwarded ? VGPU_INFO_FORWARDED : 0;
	info.shm_size = dev->forwarded ? 0 : dev->shm.len;
	info.aperture_offset = dev->aperture_offset;
	info.aperture_size = dev->aperture_size;
	return copy_to_user(arg, &info, sizeof(info)) ? -EFAULT : 0;
}

static long ioc_get_stats(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_stats s = {};
	u8 r[40];
	int err;

	err = vgpu_request(vf->dev, VGPU_OP_GET_STATS, vgpu_tgid(), 0, NULL, 0, r, sizeof(r));
	if (err)
		return err;
	s.contexts = le32_to_cpup((__le32 *)(r + 0));
	s.channels = le32_to_cpup((__le32 *)(r + 4));
	s.vram_bytes = le64_to_cpup((__le64 *)(r + 8));
	s.mapped_guest_bytes = le64_to_cpup((__le64 *)(r + 16));
	s.aperture_bytes = le64_to_cpup((__le64 *)(r + 24));
	s.vram_limit = le64_to_cpup((__le64 *)(r + 32));
	return copy_to_user(arg, &s, sizeof(s)) ? -EFAULT : 0;
}

static long ioc_create_context(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_context a = {};
	struct vgpu_ctx *c;
	__le32 r[2];
	int err;

	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c)
		return -ENOMEM;
	INIT_LIST_HEAD(&c->chans);
	INIT_LIST_HEAD(&c->mems);
	INIT_LIST_HEAD(&c->umaps);
	c->pid = vgpu_tgid();

	mutex_lock(&vf->lock);
	err = vgpu_request(vf->dev, VGPU_OP_CREATE_CONTEXT, c->pid, 0, NULL, 0, r, sizeof(r));
	if (!err) {
		c->id = le32_to_cpu(r[0]);
		if (!c->id || find_ctx(vf, c->id)) {
			/* A device that hands out an id twice is broken; do not alias. */
			err = -EIO;
		} else {
			list_add(&c->node, &vf->ctxs);
		}
	}
	mutex_unlock(&vf->lock);
	if (err) {
		kfree(c);
		return err;
	}
	a.ctx = c->id;
	a.huge_slot = le32_to_cpu(r[1]);
	if (copy_to_user(arg, &a, sizeof(a)))
		return -EFAULT; /* the context stays; closing the file destroys it */
	return 0;
}

static long ioc_destroy_context(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_umap_batch b;
	struct vgpu_ioc_context a;
	struct vgpu_ctx *c;
	int err = 0;

	/* huge_slot is CREATE_CONTEXT's output: ignored, so its struct may come back. */
	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	batch_init(&b);
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = ctx_destroy(vf, c, false, &b);
	mutex_unlock(&vf->lock);
	batch_finish(vf->dev, &b);
	return err;
}

static long ioc_alloc_vram(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_alloc_vram a;
	struct vgpu_ctx *c;
	struct vgpu_mem *m;
	__le64 body[2];
	u8 r[16];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	/* The VM's VRAM limit may change after probe: the device judges the size. */
	if (!a.size || a.size > VGPU_GPU_VA_LIMIT || !is_power_of_2(a.align) ||
	    a.align < VGPU_MIN_ALIGN || a.align > VGPU_MAX_ALIGN)
		return -EINVAL;
	m = kzalloc(sizeof(*m), GFP_KERNEL);
	if (!m)
		return -ENOMEM;
	body[0] = cpu_to_le64(a.size);
	body[1] = cpu_to_le64(a.align);

	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = vgpu_request(vf->dev, VGPU_OP_ALLOC_VRAM, c->pid, c->id, body, sizeof(body),
				   r, sizeof(r));
	if (!err) {
		m->id = le32_to_cpup((__le32 *)r);
		m->size = le64_to_cpup((__le64 *)(r + 8));
		if (find_mem(c, m->id) || m->size < a.size) {
			err = -EIO;
		} else {
			list_add(&m->node, &c->mems);
			a.mem = m->id;
			a.alloc_size = m->size;
		}
	}
	mutex_unlock(&vf->lock);
	if (err) {
		kfree(m);
		return err;
	}
	return copy_to_user(arg, &a, sizeof(a)) ? -EFAULT : 0;
}

static long ioc_free_mem(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_mem a;
	struct vgpu_ctx *c;
	struct vgpu_mem *m;
	__le32 body[2];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	m = c ? find_mem(c, a.mem) : NULL;
	if (c && !m)
		err = -ENOENT;
	if (m) {
		/* The process loses its window first; the device frees the object. */
		if (m->has_aperture)
			zap(vf, m->aperture, m->aperture_len);
		body[0] = cpu_to_le32(m->id);
		body[1] = 0;
		err = vgpu_request(vf->dev, VGPU_OP_FREE_MEM, c->pid, c->id, body, sizeof(body),
				   NULL, 0);
		if (!err) {
			list_del(&m->node);
			kfree(m);
		}
	}
	mutex_unlock(&vf->lock);
	return err;
}

static int check_page(u32 page)
{
	return page <= VGPU_IOC_PAGE_2M ? 0 : -EINVAL;
}

static long ioc_map_vram(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_map_vram a;
	struct vgpu_ctx *c;
	u8 body[24];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (check_page(a.page) || (a.flags & ~VGPU_IOC_MAP_READ_ONLY) ||
	    a.va >= VGPU_GPU_VA_LIMIT || !IS_ALIGNED(a.va, PAGE_SIZE))
		return -EINVAL;
	*(__le32 *)(body + 0) = cpu_to_le32(a.mem);
	*(__le32 *)(body + 4) = cpu_to_le32(a.flags);
	*(__le64 *)(body + 8) = cpu_to_le64(a.va);
	*(__le32 *)(body + 16) = cpu_to_le32(a.page);
	*(__le32 *)(body + 20) = 0;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c && !find_mem(c, a.mem))
		err = -ENOENT;
	else if (c)
		err = vgpu_request(vf->dev, VGPU_OP_MAP_VRAM, c->pid, c->id, body, sizeof(body),
				   NULL, 0);
	mutex_unlock(&vf->lock);
	return err;
}

static long ioc_map_user(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_map_user a;
	struct vgpu_umap *u;
	struct vgpu_ctx *c;
	bool orphan = false;
	u64 end;
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (!a.size || a.size > VGPU_IOC_MAX_USER_MAP || (a.flags & ~VGPU_IOC_MAP_READ_ONLY) ||
	    !IS_ALIGNED(a.size, PAGE_SIZE) || !IS_ALIGNED(a.va, PAGE_SIZE) ||
	    !IS_ALIGNED(a.user_addr, PAGE_SIZE) || check_add_overflow(a.va, a.size, &end) ||
	    end > VGPU_GPU_VA_LIMIT || check_add_overflow(a.user_addr, a.size, &end) ||
	    end > TASK_SIZE)
		return -EINVAL;
	/* Cheap ownership check before pinning anything. */
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	mutex_unlock(&vf->lock);
	if (!c)
		return err;

	u = umap_pin(&a, &err);
	if (!u)
		return err;

	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err); /* may have gone meanwhile */
	if (c) {
		err = umap_map(vf->dev, c, u);
		if (!err) {
			list_add(&u->node, &c->umaps);
			u = NULL;
		} else if (umap_unmap_chunks(vf->dev, c, u)) {
			orphan = true;
		}
	}
	mutex_unlock(&vf->lock);
	if (u && orphan)
		umap_orphan(vf->dev, u);
	else if (u)
		vgpu_umap_release(u);
	return err;
}

static long ioc_unmap(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_unmap a;
	struct vgpu_umap *u, *hit = NULL;
	struct vgpu_ctx *c;
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (a.reserved || a.va >= VGPU_GPU_VA_LIMIT)
		return -EINVAL;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (!c)
		goto out;
	list_for_each_entry(u, &c->umaps, node) {
		if (a.va == u->va) {
			hit = u;
			break;
		}
		/* Chunks of a user mapping go only all together (then the pages). */
		if (a.va > u->va && a.va < u->va + u->size) {
			err = -EINVAL;
			goto out;
		}
	}
	if (hit) {
		err = umap_unmap_chunks(vf->dev, c, hit);
		if (!err || err == -ENODEV) {
			list_del(&hit->node);
			err = 0;
		} else {
			hit = NULL; /* stays, with the chunks still mapped: retry later */
		}
	} else {
		__le64 va = cpu_to_le64(a.va);

		err = vgpu_request(vf->dev, VGPU_OP_UNMAP, c->pid, c->id, &va, sizeof(va), NULL, 0);
	}
out:
	mutex_unlock(&vf->lock);
	if (hit)
		vgpu_umap_release(hit);
	return err;
}

static long ioc_map_aperture(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_dev *dev = vf->dev;
	struct vgpu_ioc_map_aperture a;
	struct vgpu_ctx *c;
	struct vgpu_mem *m = NULL;
	__le32 body[2];
	__le64 off;
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c) {
		m = find_mem(c, a.mem);
		if (!m)
			err = -ENOENT;
	}
	if (m && !m->has_aperture) {
		u64 len = PAGE_ALIGN(m->size), o;

		body[0] = cpu_to_le32(m->id);
		body[1] = 0;
		err = vgpu_request(dev, VGPU_OP_MAP_APERTURE, c->pid, c->id, body, sizeof(body),
				   &off, sizeof(off));
		o = le64_to_cpu(off);
		/* The window is what user mappings are derived from: check it. */
		if (!err && (!PAGE_ALIGNED(o) || o < dev->aperture_offset ||
			     o + len < o || o + len > dev->aperture_offset + dev->aperture_size)) {
			pr_err("%s: device gave window %#llx+%#llx outside the aperture\n",
			       dev->name, o, len);
			vgpu_request(dev, VGPU_OP_UNMAP_APERTURE, c->pid, c->id, body, sizeof(body),
				     NULL, 0);
			err = -EIO;
		}
		if (!err) {
			m->has_aperture = true;
			m->aperture = o;
			m->aperture_len = len;
		}
	}
	if (!err && m) {
		a.offset = m->aperture;
		a.size = m->aperture_len;
	}
	mutex_unlock(&vf->lock);
	if (err)
		return err;
	return copy_to_user(arg, &a, sizeof(a)) ? -EFAULT : 0;
}

static long ioc_unmap_aperture(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_mem a;
	struct vgpu_ctx *c;
	struct vgpu_mem *m = NULL;
	__le32 body[2];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		m = find_mem(c, a.mem);
	if (c && (!m || !m->has_aperture))
		err = -ENOENT;
	if (!err) {
		zap(vf, m->aperture, m->aperture_len);
		body[0] = cpu_to_le32(m->id);
		body[1] = 0;
		err = vgpu_request(vf->dev, VGPU_OP_UNMAP_APERTURE, c->pid, c->id, body,
				   sizeof(body), NULL, 0);
		if (!err)
			m->has_aperture = false;
	}
	mutex_unlock(&vf->lock);
	return err;
}

static long ioc_create_channel(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_dev *dev = vf->dev;
	struct vgpu_ioc_create_channel a;
	struct vgpu_chan *ch;
	struct vgpu_ctx *c;
	u8 body[16];
	__le32 r[2], dbody[2];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (!is_power_of_2(a.gp_entries) || a.gp_entries < VGPU_MIN_GP_ENTRIES ||
	    a.gp_entries > VGPU_MAX_GP_ENTRIES || !IS_ALIGNED(a.gp_ring_va, 16) ||
	    a.gp_ring_va >= VGPU_GPU_VA_LIMIT ||
	    a.gp_ring_va + (u64)a.gp_entries * VGPU_GP_ENTRY_SIZE > VGPU_GPU_VA_LIMIT)
		return -EINVAL;
	ch = kzalloc(sizeof(*ch), GFP_KERNEL);
	if (!ch)
		return -ENOMEM;
	kref_init(&ch->kref);
	if (dev->forwarded) {
		u8 *page;
		int idx;

		ch->status = alloc_page(GFP_KERNEL | __GFP_ZERO);
		idx = ch->status ? ida_alloc_max(&dev->fwd_pages, dev->channel_slots - 1,
						 GFP_KERNEL) : -ENOMEM;
		if (idx < 0) {
			if (ch->status)
				__free_page(ch->status);
			kfree(ch);
			return idx == -ENOSPC ? -ENOSPC : -ENOMEM;
		}
		ch->offset = (u64)idx * PAGE_SIZE;
		page = page_address(ch->status);
		WRITE_ONCE(*(u32 *)(page + VGPU_CTRL_VERSION), cpu_to_le32(dev->protocol_version));
		WRITE_ONCE(*(u32 *)(page + VGPU_CTRL_GP_ENTRIES), cpu_to_le32(a.gp_entries));
	}
	*(__le64 *)(body + 0) = cpu_to_le64(a.gp_ring_va);
	*(__le32 *)(body + 8) = cpu_to_le32(a.gp_entries);
	*(__le32 *)(body + 12) = 0;

	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = vgpu_request(dev, VGPU_OP_CREATE_CHANNEL, c->pid, c->id, body, sizeof(body),
				   r, sizeof(r));
	if (!err) {
		ch->id = le32_to_cpu(r[0]);
		ch->slot = le32_to_cpu(r[1]);
		if (!dev->forwarded)
			ch->offset = (u64)ch->slot * PAGE_SIZE;
		/* A forwarded channel has no slot; a direct one must have a real one. */
		if (dev->forwarded ? ch->slot != VGPU_NO_SLOT : ch->slot >= dev->channel_slots)
			err = -EIO;
		else
			err = xa_insert_irq(&dev->chans, ch->id, ch, GFP_KERNEL);
		if (err) {
			pr_err("%s: channel %u slot %u unusable (%d)\n", dev->name, ch->id,
			       ch->slot, err);
			dbody[0] = cpu_to_le32(ch->id);
			dbody[1] = 0;
			vgpu_request(dev, VGPU_OP_DESTROY_CHANNEL, c->pid, c->id, dbody,
				     sizeof(dbody), NULL, 0);
			err = -EIO;
		} else {
			list_add(&ch->node, &c->chans);
			a.channel = ch->id;
			a.slot = ch->slot;
			a.offset = ch->offset;
		}
	}
	mutex_unlock(&vf->lock);
	if (err) {
		if (ch->status) {
			ida_free(&dev->fwd_pages, ch->offset >> PAGE_SHIFT);
			__free_page(ch->status);
		}
		kfree(ch);
		return err;
	}
	return copy_to_user(arg, &a, sizeof(a)) ? -EFAULT : 0;
}

static long ioc_channel_status(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_channel_status a;
	struct vgpu_chan *ch = NULL;
	struct vgpu_ctx *c;
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c) {
		ch = find_chan(c, a.channel);
		if (!ch)
			err = -ENOENT;
		else
			err = chan_status(vf->dev, c->pid, c->id, ch, &a);
	}
	mutex_unlock(&vf->lock);
	if (err)
		return err;
	return copy_to_user(arg, &a, sizeof(a)) ? -EFAULT : 0;
}

static long ioc_destroy_channel(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_channel a;
	struct vgpu_chan *ch = NULL;
	struct vgpu_ctx *c;
	__le32 body[2];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c) {
		ch = find_chan(c, a.channel);
		if (!ch)
			err = -ENOENT;
	}
	if (ch) {
		/* Waiters stop reading the page, the process loses its mapping, then the
		 * device may hand the slot to someone else. */
		chan_set_dead(vf->dev, ch, true);
		zap(vf, ch->offset, PAGE_SIZE);
		body[0] = cpu_to_le32(ch->id);
		body[1] = 0;
		err = vgpu_request(vf->dev, VGPU_OP_DESTROY_CHANNEL, c->pid, c->id, body,
				   sizeof(body), NULL, 0);
		if (!err || err == -ENODEV) {
			chan_forget(vf->dev, ch);
			err = 0;
		} else {
			chan_set_dead(vf->dev, ch, false);
		}
	}
	mutex_unlock(&vf->lock);
	wake_up_all(&vf->dev->event_wq);
	return err;
}

static long ioc_submit(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_submit a;
	struct vgpu_ctx *c;
	__le32 body[2];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (a.reserved)
		return -EINVAL;
	body[0] = cpu_to_le32(a.channel);
	body[1] = cpu_to_le32(a.gp_put);
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c && !find_chan(c, a.channel))
		err = -ENOENT;
	else if (c)
		err = vgpu_request(vf->dev, VGPU_OP_SUBMIT, c->pid, c->id, body, sizeof(body),
				   NULL, 0);
	mutex_unlock(&vf->lock);
	return err;
}

static inline bool counter_reached(u32 now, u32 target)
{
	return (s32)(now - target) >= 0;
}

/* 1 reached, 0 not yet, -EIO channel fault, -ENODEV gone; fills the out fields. */
static int wait_check(struct vgpu_dev *dev, struct vgpu_chan *ch, struct vgpu_ioc_wait *a)
{
	unsigned long flags;
	int ret = 0;

	xa_lock_irqsave(&dev->chans, flags);
	if (ch->dead || dev->shm_gone) {
		ret = -ENODEV;
	} else {
		u8 *page = ch->status ? (u8 *)page_address(ch->status) :
					(u8 *)dev->shm_va + ch->offset;
		u32 ref = READ_ONCE(*(u32 *)(page + VGPU_CTRL_REF));
		u32 seq = READ_ONCE(*(u32 *)(page + VGPU_CTRL_NOTIFY_SEQ));
		u32 error = READ_ONCE(*(u32 *)(page + VGPU_CTRL_ERROR));

		rmb(); /* ERROR before ERROR_INFO, as the GPU writes them in reverse */
		a->ref = le32_to_cpu(ref);
		a->notify_seq = le32_to_cpu(seq);
		if (counter_reached(ch->notify_events, a->notify_seq))
			a->notify_seq = ch->notify_events;
		a->notify_token = ch->last_token;
		a->error = le32_to_cpu(error);
		a->error_info = 0;
		if (a->error) {
			a->error_info = le64_to_cpu(READ_ONCE(*(u64 *)(page + VGPU_CTRL_ERROR_INFO)));
		} else if (ch->error) {
			a->error = ch->error;
			a->error_info = ch->error_info;
		}
		if (a->kind == VGPU_WAIT_FENCE ? counter_reached(a->ref, a->value) :
						 counter_reached(a->notify_seq, a->value))
			ret = 1;
		else if (a->error)
			ret = -EIO;
	}
	xa_unlock_irqrestore(&dev->chans, flags);
	return ret;
}

static long ioc_wait(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_dev *dev = vf->dev;
	struct vgpu_ioc_wait a;
	struct vgpu_chan *ch = NULL;
	struct vgpu_ctx *c;
	unsigned long deadline, step;
	u32 pid = 0, ctx_id = 0;
	int err = 0, r;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (a.kind > VGPU_WAIT_NOTIFY)
		return -EINVAL;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c) {
		ch = find_chan(c, a.channel);
		if (ch)
			kref_get(&ch->kref);
		else
			err = -ENOENT;
		pid = c->pid;
		ctx_id = c->id;
	}
	mutex_unlock(&vf->lock);
	if (!ch)
		return err;

	deadline = jiffies + nsecs_to_jiffies(min_t(u64, a.timeout_ns, VGPU_MAX_WAIT_NS));
	step = max_t(unsigned long, 1, msecs_to_jiffies(vgpu_wait_poll_ms));
	for (;;) {
		int gen = atomic_read(&dev->event_gen);
		long left;

		if (ch->status && !READ_ONCE(ch->dead)) {
			/* Forwarded: the page is ours, fill it from the device first. */
			struct vgpu_ioc_channel_status st;

			r = chan_status(dev, pid, ctx_id, ch, &st);
			if (r == -ENOENT || r == -ENODEV) {
				r = -ENODEV;
				break;
			}
		}
		r = wait_check(dev, ch, &a);
		if (r)
			break;
		if (time_after_eq(jiffies, deadline)) {
			r = -ETIMEDOUT;
			break;
		}
		left = wait_event_interruptible_timeout(dev->event_wq,
							atomic_read(&dev->event_gen) != gen ||
								READ_ONCE(ch->dead) || dev->shm_gone,
							min(step, deadline - jiffies));
		if (left < 0) {
			r = -EINTR;
			break;
		}
	}
	vgpu_chan_put(ch);
	err = r == 1 ? 0 : r;
	if (copy_to_user(arg, &a, sizeof(a)))
		return -EFAULT;
	return err;
}

/* ---- guest modules ------------------------------------------------------------------ */

#ifdef MAX_PAGE_ORDER
#define VGPU_MODULE_MAX_ORDER MAX_PAGE_ORDER
#else
#define VGPU_MODULE_MAX_ORDER (MAX_ORDER - 1)
#endif

struct module_chunk {
	struct page *page;
	unsigned int order;
};

/*
 * MODULE_LOAD: the image is copied from the caller once, into runs of physically
 * contiguous pages (large orders first, so even 32 MiB fits the request's 512 ranges),
 * and the device reads it from there before it answers; the pages go right after.
 */
static long ioc_module_load(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_module_load a;
	struct module_chunk *chunks;
	struct vgpu_sg_range *r;
	struct vgpu_ctx *c;
	unsigned int n = 0, i;
	u64 done = 0;
	__le32 reply[2];
	u8 *body;
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (!a.size || a.size > VGPU_IOC_MAX_MODULE_BYTES)
		return -EINVAL;
	chunks = kcalloc(VGPU_MAX_SG_ENTRIES, sizeof(*chunks), GFP_KERNEL);
	body = kzalloc(8 + VGPU_MAX_SG_ENTRIES * sizeof(*r), GFP_KERNEL);
	if (!chunks || !body) {
		err = -ENOMEM;
		goto out;
	}
	r = (struct vgpu_sg_range *)(body + 8);
	while (done < a.size) {
		u64 left = a.size - done, len;
		unsigned int order = min_t(unsigned int, get_order(left), VGPU_MODULE_MAX_ORDER);
		struct page *p = NULL;

		if (n == VGPU_MAX_SG_ENTRIES) {
			err = -ENOMEM;
			goto out;
		}
		for (;; order--) {
			p = alloc_pages(GFP_KERNEL | __GFP_NOWARN | (order ? __GFP_NORETRY : 0),
					order);
			if (p || !order)
				break;
		}
		if (!p) {
			err = -ENOMEM;
			goto out;
		}
		chunks[n].page = p;
		chunks[n].order = order;
		len = min_t(u64, left, PAGE_SIZE << order);
		if (copy_from_user(page_address(p), u64_to_user_ptr(a.user_addr + done), len)) {
			n++;
			err = -EFAULT;
			goto out;
		}
		r[n].gpa = cpu_to_le64(page_to_phys(p));
		r[n].len = cpu_to_le64(len);
		n++;
		done += len;
	}
	*(__le32 *)(body + 0) = cpu_to_le32(n);
	*(__le32 *)(body + 4) = 0;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = vgpu_request(vf->dev, VGPU_OP_MODULE_LOAD, c->pid, c->id, body,
				   8 + n * sizeof(*r), reply, sizeof(reply));
	mutex_unlock(&vf->lock);
	if (!err) {
		a.module = le32_to_cpu(reply[0]);
		if (copy_to_user(arg, &a, sizeof(a)))
			err = -EFAULT;
	}
out:
	for (i = 0; chunks && i < n; i++)
		__free_pages(chunks[i].page, chunks[i].order);
	kfree(chunks);
	kfree(body);
	return err;
}

static long ioc_module_unload(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_module a;
	struct vgpu_ctx *c;
	__le32 body[2];
	int err = 0;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	body[0] = cpu_to_le32(a.module);
	body[1] = 0;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = vgpu_request(vf->dev, VGPU_OP_MODULE_UNLOAD, c->pid, c->id, body,
				   sizeof(body), NULL, 0);
	mutex_unlock(&vf->lock);
	return err;
}

/* The body of FUNCTION_GET/GLOBAL_GET: module, name length, the name (from the caller). */
static int symbol_body(u32 module, u64 name_addr, u32 name_len, u8 **body, size_t *len)
{
	if (!name_len || name_len > VGPU_IOC_MAX_SYMBOL_LEN)
		return -EINVAL;
	*len = 8 + name_len;
	*body = kmalloc(*len, GFP_KERNEL);
	if (!*body)
		return -ENOMEM;
	*(__le32 *)(*body + 0) = cpu_to_le32(module);
	*(__le32 *)(*body + 4) = cpu_to_le32(name_len);
	if (copy_from_user(*body + 8, u64_to_user_ptr(name_addr), name_len)) {
		kfree(*body);
		return -EFAULT;
	}
	return 0;
}

static long ioc_function_get(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_function_get a;
	struct vgpu_ctx *c;
	size_t len, got = 0;
	u32 count;
	__le32 *reply;
	u8 *body;
	int err;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	err = symbol_body(a.module, a.name_addr, a.name_len, &body, &len);
	if (err)
		return err;
	/* function, count, param bytes, reserved, then (offset, size) per parameter */
	reply = kzalloc(VGPU_MAX_REPLY_SIZE, GFP_KERNEL);
	if (!reply) {
		kfree(body);
		return -ENOMEM;
	}
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = vgpu_request_var(vf->dev, VGPU_OP_FUNCTION_GET, c->pid, c->id, body, len,
				       reply, VGPU_MAX_REPLY_SIZE - VGPU_REPLY_HEADER_SIZE, &got);
	mutex_unlock(&vf->lock);
	kfree(body);
	if (err)
		goto out;
	if (got < 16) {
		err = -EIO;
		goto out;
	}
	a.function = le32_to_cpu(reply[0]);
	count = le32_to_cpu(reply[1]);
	a.param_count = count;
	if (count != VGPU_IOC_PARAMS_UNKNOWN) {
		u32 i, *pairs;

		if (count > a.max_params) {
			err = -ENOSPC;
			goto out;
		}
		if (got < 16 + (size_t)count * 8) {
			err = -EIO;
			goto out;
		}
		pairs = (u32 *)(reply + 4);
		for (i = 0; i < 2 * count; i++)
			pairs[i] = le32_to_cpu((__force __le32)pairs[i]);
		if (count && copy_to_user(u64_to_user_ptr(a.params_addr), pairs,
					  (size_t)count * 8)) {
			err = -EFAULT;
			goto out;
		}
	}
	if (copy_to_user(arg, &a, sizeof(a)))
		err = -EFAULT;
out:
	kfree(reply);
	return err;
}

static long ioc_get_attributes(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_attributes a;
	size_t got = 0;
	__le32 *reply;
	u32 count, i;
	int err;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	/* count, reserved, then (attribute, value) per attribute */
	reply = kzalloc(VGPU_MAX_REPLY_SIZE, GFP_KERNEL);
	if (!reply)
		return -ENOMEM;
	err = vgpu_request_var(vf->dev, VGPU_OP_GET_ATTRIBUTES, vgpu_tgid(), 0, NULL, 0, reply,
			       VGPU_MAX_REPLY_SIZE - VGPU_REPLY_HEADER_SIZE, &got);
	if (err)
		goto out;
	count = got >= 8 ? le32_to_cpu(reply[0]) : 0;
	if (got < 8 || count > VGPU_MAX_ATTRIBUTES || got < 8 + (size_t)count * 8) {
		err = -EIO;
		goto out;
	}
	a.count = count;
	if (count > a.max_pairs) {
		err = -ENOSPC;
		goto out;
	}
	for (i = 0; i < 2 * count; i++)
		reply[2 + i] = (__force __le32)le32_to_cpu(reply[2 + i]);
	if (count && copy_to_user(u64_to_user_ptr(a.pairs_addr), reply + 2, (size_t)count * 8)) {
		err = -EFAULT;
		goto out;
	}
	if (copy_to_user(arg, &a, sizeof(a)))
		err = -EFAULT;
out:
	kfree(reply);
	return err;
}

static long ioc_global_get(struct vgpu_file *vf, void __user *arg)
{
	struct vgpu_ioc_global_get a;
	struct vgpu_ctx *c;
	__le64 reply[2];
	size_t len;
	u8 *body;
	int err;

	if (copy_from_user(&a, arg, sizeof(a)))
		return -EFAULT;
	if (a.reserved)
		return -EINVAL;
	err = symbol_body(a.module, a.name_addr, a.name_len, &body, &len);
	if (err)
		return err;
	mutex_lock(&vf->lock);
	c = own_ctx(vf, a.ctx, &err);
	if (c)
		err = vgpu_request(vf->dev, VGPU_OP_GLOBAL_GET, c->pid, c->id, body, len, reply,
				   sizeof(reply));
	mutex_unlock(&vf->lock);
	kfree(body);
	if (err)
		return err;
	a.addr = le64_to_cpu(reply[0]);
	a.size = le64_to_cpu(reply[1]);
	return copy_to_user(arg, &a, sizeof(a)) ? -EFAULT : 0;
}

/*
 * A control-queue notification with no request on it: the device wakes its front end.
 * Under ctrl_lock, which remove takes to mark the device dead before it deletes the
 * queues. No ownership check: ringing only wakes this VM's own front end.
 */
static long ioc_doorbell(struct vgpu_file *vf)
{
	struct vgpu_dev *dev = vf->dev;
	unsigned long flags;
	long err = 0;

	spin_lock_irqsave(&dev->ctrl_lock, flags);
	if (dev->dead)
		err = -ENODEV;
	else
		virtqueue_notify(dev->ctrl_vq);
	spin_unlock_irqrestore(&dev->ctrl_lock, flags);
	return err;
}

static long vgpu_ioctl(struct file *filp, unsigned int cmd, unsigned long arg)
{
	struct vgpu_file *vf = filp->private_data;
	void __user *p = (void __user *)arg;

	switch (cmd) {
	case VGPU_IOC_GET_INFO:
		return ioc_get_info(vf, p);
	case VGPU_IOC_GET_STATS:
		return ioc_get_stats(vf, p);
	case VGPU_IOC_CREATE_CONTEXT:
		return ioc_create_context(vf, p);
	case VGPU_IOC_DESTROY_CONTEXT:
		return ioc_destroy_context(vf, p);
	case VGPU_IOC_ALLOC_VRAM:
		return ioc_alloc_vram(vf, p);
	case VGPU_IOC_FREE_MEM:
		return ioc_free_mem(vf, p);
	case VGPU_IOC_MAP_VRAM:
		return ioc_map_vram(vf, p);
	case VGPU_IOC_MAP_USER:
		return ioc_map_user(vf, p);
	case VGPU_IOC_UNMAP:
		return ioc_unmap(vf, p);
	case VGPU_IOC_MAP_APERTURE:
		return ioc_map_aperture(vf, p);
	case VGPU_IOC_UNMAP_APERTURE:
		return ioc_unmap_aperture(vf, p);
	case VGPU_IOC_CREATE_CHANNEL:
		return ioc_create_channel(vf, p);
	case VGPU_IOC_DESTROY_CHANNEL:
		return ioc_destroy_channel(vf, p);
	case VGPU_IOC_SUBMIT:
		return ioc_submit(vf, p);
	case VGPU_IOC_WAIT:
		return ioc_wait(vf, p);
	case VGPU_IOC_CHANNEL_STATUS:
		return ioc_channel_status(vf, p);
	case VGPU_IOC_MODULE_LOAD:
		return ioc_module_load(vf, p);
	case VGPU_IOC_MODULE_UNLOAD:
		return ioc_module_unload(vf, p);
	case VGPU_IOC_FUNCTION_GET:
		return ioc_function_get(vf, p);
	case VGPU_IOC_GET_ATTRIBUTES:
		return ioc_get_attributes(vf, p);
	case VGPU_IOC_GLOBAL_GET:
		return ioc_global_get(vf, p);
	case VGPU_IOC_DOORBELL:
		return ioc_doorbell(vf);
	default:
		return -ENOTTY;
	}
}

/* ---- mmap ---------------------------------------------------------------------------- */

static const struct vm_operations_struct vgpu_vm_ops = {
	/* No .fault: a zapped window (object destroyed) gives SIGBUS. */
};

/* The forwarded channel of this process whose page is at mmap offset `off`. */
static struct vgpu_chan *fwd_chan_at(struct vgpu_file *vf, u64 off)
{
	struct vgpu_chan *ch;
	struct vgpu_ctx *c;

	list_for_each_entry(c, &vf->ctxs, node) {
		if (c->pid != vgpu_tgid())
			continue;
		list_for_each_entry(ch, &c->chans, node)
			if (ch->status && off == ch->offset)
				return ch;
	}
	return NULL;
}

/* Does [off, off+len) lie in a channel page or aperture window of this process? */
static bool owns_range(struct vgpu_file *vf, u64 off, u64 len)
{
	struct vgpu_chan *ch;
	struct vgpu_mem *m;
	struct vgpu_ctx *c;

	list_for_each_entry(c, &vf->ctxs, node) {
		if (c->pid != vgpu_tgid())
			continue;
		list_for_each_entry(ch, &c->chans, node)
			if (off == ch->offset && len == PAGE_SIZE)
				return true;
		list_for_each_entry(m, &c->mems, node)
			if (m->has_aperture && off >= m->aperture &&
			    off + len <= m->aperture + m->aperture_len)
				return true;
	}
	return false;
}

static int vgpu_mmap(struct file *filp, struct vm_area_struct *vma)
{
	struct vgpu_file *vf = filp->private_data;
	struct vgpu_dev *dev = vf->dev;
	u64 len = vma->vm_end - vma->vm_start;
	u64 off, end;
	int err;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	if (vma->vm_pgoff > (U64_MAX >> PAGE_SHIFT))
		return -EINVAL;
	off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	if (check_add_overflow(off, len, &end) ||
	    end > (dev->forwarded ? (u64)dev->channel_slots * PAGE_SIZE : dev->shm.len))
		return -EINVAL;

	mutex_lock(&vf->lock);
	if (dev->dead) {
		err = -ENODEV;
	} else if (dev->forwarded) {
		/* No region: only a forwarded channel's page of the driver's, whole. */
		struct vgpu_chan *ch = len == PAGE_SIZE ? fwd_chan_at(vf, off) : NULL;

		if (!ch) {
			err = -EACCES;
		} else {
			vma->vm_flags |= VM_IO | VM_PFNMAP | VM_DONTCOPY | VM_DONTEXPAND |
					 VM_DONTDUMP;
			vma->vm_ops = &vgpu_vm_ops;
			vma->vm_private_data = vf;
			err = remap_pfn_range(vma, vma->vm_start, page_to_pfn(ch->status),
					      PAGE_SIZE, vma->vm_page_prot);
		}
	} else if (!owns_range(vf, off, len)) {
		err = -EACCES;
	} else {
		/* Never inherited by fork children; never grown by mremap. */
		vma->vm_flags |= VM_IO | VM_PFNMAP | VM_DONTCOPY | VM_DONTEXPAND | VM_DONTDUMP;
		vma->vm_ops = &vgpu_vm_ops;
		vma->vm_private_data = vf;
		err = io_remap_pfn_range(vma, vma->vm_start, (dev->shm.addr + off) >> PAGE_SHIFT,
					 len, vma->vm_page_prot);
	}
	mutex_unlock(&vf->lock);
	return err;
}

/* ---- open / release ------------------------------------------------------------------ */

static int vgpu_open(struct inode *inode, struct file *filp)
{
	/* misc_open set private_data to our miscdevice and holds misc_mtx. */
	struct vgpu_dev *dev = container_of(filp->private_data, struct vgpu_dev, misc);
	struct vgpu_file *vf;

	vf = kzalloc(sizeof(*vf), GFP_KERNEL);
	if (!vf)
		return -ENOMEM;
	vgpu_dev_get(dev);
	vf->dev = dev;
	vf->filp = filp;
	mutex_init(&vf->lock);
	INIT_LIST_HEAD(&vf->ctxs);
	mutex_lock(&dev->files_lock);
	list_add(&vf->node, &dev->files);
	mutex_unlock(&dev->files_lock);
	filp->private_data = vf;
	return nonseekable_open(inode, filp);
}

static int vgpu_release(struct inode *inode, struct file *filp)
{
	struct vgpu_file *vf = filp->private_data;
	struct vgpu_dev *dev = vf->dev;
	struct vgpu_umap_batch b;
	struct vgpu_ctx *c, *t;

	batch_init(&b);
	mutex_lock(&vf->lock);
	list_for_each_entry_safe(c, t, &vf->ctxs, node) {
		u32 id = c->id, pid = c->pid;
		int err = ctx_destroy(vf, c, true, &b);

		if (err)
			pr_warn("%s: destroying context %u of pid %u on close: %d\n", dev->name, id,
				pid, err);
	}
	mutex_unlock(&vf->lock);
	batch_finish(dev, &b);

	mutex_lock(&dev->files_lock);
	list_del(&vf->node);
	mutex_unlock(&dev->files_lock);
	vgpu_dev_put(dev);
	kfree(vf);
	return 0;
}

const struct file_operations vgpu_fops = {
	.owner = THIS_MODULE,
	.open = vgpu_open,
	.release = vgpu_release,
	.unlocked_ioctl = vgpu_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.mmap = vgpu_mmap,
	.llseek = no_llseek,
};
