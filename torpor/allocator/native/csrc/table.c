/* The allocation table: allocations, mappings, address arenas and slabs of one context, under its mutex.
 *
 * All arrays are sorted by address. A mapping is one physical handle mapped
 * whole; `users` counts the live allocations inside it. A slab is a mapping
 * of up to 64 granules shared by one-granule allocations (`spare`: a bitmap of
 * its unused granules). A tag is ACTIVE (allocations map memory, frees unmap
 * a mapping once its last user goes), FROZEN (a sleep is in progress: new
 * allocations are refused, frees only drop their record, mappings stay until
 * the sleep unmaps them) or RELEASED (nothing mapped: frees give back only
 * address space). The mutex is never held while calling anything but the
 * driver table.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "table.h"

int fail(tp_err *e, int tag, const char *op, const char *fmt, ...) {
  if (!e) return -1;
  memset(e, 0, sizeof *e);
  e->tag = tag;
  snprintf(e->op, sizeof e->op, "%s", op);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  return -1;
}

int driver_fail(tp_err *e, int tag, const char *op) { /* a driver call filled code, call, msg */
  e->tag = tag;
  snprintf(e->op, sizeof e->op, "%s", op);
  return -1;
}

void ring_push(tp_ctx *c, const tp_err *e) {
  if (c->nring == TP_RING) {
    memmove(c->ring, c->ring + 1, (TP_RING - 1) * sizeof *e);
    c->nring--;
  }
  c->ring[c->nring++] = *e;
}

static int g_fail_growth; /* tests: the nth next growth of a table fails, as realloc does with the host out of memory */

/* Tests only: make the `nth` next table growth (any context) fail; 0 clears it. */
TP_EXPORT void tp_test_fail_growth(int nth) { __atomic_store_n(&g_fail_growth, nth, __ATOMIC_SEQ_CST); }

static void *grow(void *p, int *cap, int need, size_t each) {
  if (__atomic_load_n(&g_fail_growth, __ATOMIC_SEQ_CST) > 0 &&
      __atomic_sub_fetch(&g_fail_growth, 1, __ATOMIC_SEQ_CST) == 0)
    return NULL;
  if (need <= *cap) return p;
  int n = *cap ? *cap * 2 : 16;
  while (n < need) n *= 2;
  void *q = realloc(p, (size_t)n * each);
  if (q) *cap = n;
  return q;
}

/* -- contexts ---------------------------------------------------------------------------------- */

static tp_ctx *ctx_new(const tp_driver *drv) {
  tp_ctx *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  pthread_mutex_init(&c->mu, NULL);
  c->drv = *drv;
  c->slab_max = 64ull << 20;
  c->va_block = 64ull << 30;
  return c;
}

TP_EXPORT tp_ctx *tp_open_cuda(tp_err *e) {
  tp_driver d;
  memset(e, 0, sizeof *e);
  if (tp_cuda_driver(&d, e)) return NULL;
  tp_ctx *c = ctx_new(&d);
  if (!c) fail(e, -1, "open", "out of host memory");
  return c;
}

TP_EXPORT tp_ctx *tp_open_sim(tp_sim *sim) {
  tp_driver d;
  tp_sim_driver(sim, &d);
  return ctx_new(&d);
}

TP_EXPORT void tp_configure(tp_ctx *c, uint64_t slab_max, uint64_t va_block) {
  pthread_mutex_lock(&c->mu);
  c->slab_max = slab_max;
  if (va_block) c->va_block = va_block;
  pthread_mutex_unlock(&c->mu);
}

TP_EXPORT int tp_tag_id(tp_ctx *c, const char *name) {
  pthread_mutex_lock(&c->mu);
  int id = -1;
  for (int i = 0; i < c->ntags; i++)
    if (strcmp(c->tags[i], name) == 0) id = i;
  if (id < 0 && c->ntags < TP_MAX_TAGS && strlen(name) < 64) {
    id = c->ntags++;
    snprintf(c->tags[id], 64, "%s", name);
    c->state[id] = TP_ACTIVE;
  }
  pthread_mutex_unlock(&c->mu);
  return id;
}

static int gran_of(tp_ctx *c, int dev, uint64_t *g, tp_err *e) {
  if (dev < 0 || dev >= TP_MAX_DEVICES) {
    tp_set_err(e, TP_CUDA_ERROR_INVALID_DEVICE, "granularity", "device %d out of range", dev);
    return -1;
  }
  if (!c->gran[dev] && c->drv.granularity(c->drv.self, dev, &c->gran[dev], e)) return -1;
  *g = c->gran[dev];
  return 0;
}

TP_EXPORT int tp_granularity(tp_ctx *c, int dev, uint64_t *out, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = gran_of(c, dev, out, e);
  if (rc) driver_fail(e, -1, "granularity");
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* -- sorted arrays ------------------------------------------------------------------------------ */

int alloc_lower(tp_ctx *c, uint64_t addr) { /* first allocation with addr >= `addr` */
  int lo = 0, hi = c->nallocs;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (c->allocs[mid].addr < addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

int map_first_overlap(tp_ctx *c, uint64_t addr) { /* first mapping ending after `addr` */
  int lo = 0, hi = c->nmaps;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (c->maps[mid].start <= addr) lo = mid + 1;
    else hi = mid;
  }
  if (lo > 0 && c->maps[lo - 1].start + c->maps[lo - 1].size > addr) return lo - 1;
  return lo;
}

int map_room(tp_ctx *c, int more) { /* room for `more` mappings: map_insert of that many cannot fail */
  tp_map *q = grow(c->maps, &c->cap_maps, c->nmaps + more, sizeof *q);
  if (!q) return -1;
  c->maps = q;
  return 0;
}

int map_insert(tp_ctx *c, const tp_map *m) {
  tp_map *q = grow(c->maps, &c->cap_maps, c->nmaps + 1, sizeof *q);
  if (!q) return -1;
  c->maps = q;
  int i = map_first_overlap(c, m->start);
  memmove(&c->maps[i + 1], &c->maps[i], (size_t)(c->nmaps - i) * sizeof *q);
  c->maps[i] = *m;
  c->nmaps++;
  return 0;
}

void map_remove(tp_ctx *c, int i) {
  memmove(&c->maps[i], &c->maps[i + 1], (size_t)(c->nmaps - i - 1) * sizeof *c->maps);
  c->nmaps--;
}

/* -- address arenas ----------------------------------------------------------------------------- */

tp_arena *arena_of(tp_ctx *c, int dev, int tag) {
  for (int i = 0; i < c->narenas; i++)
    if (c->arenas[i].dev == dev && c->arenas[i].tag == tag) return &c->arenas[i];
  tp_arena *q = grow(c->arenas, &c->cap_arenas, c->narenas + 1, sizeof *q);
  if (!q) return NULL;
  c->arenas = q;
  memset(&c->arenas[c->narenas], 0, sizeof *q);
  c->arenas[c->narenas].dev = dev;
  c->arenas[c->narenas].tag = tag;
  return &c->arenas[c->narenas++];
}

static void arena_give(tp_arena *ar, uint64_t start, uint64_t n) {
  if (!n) return;
  int i = 0;
  while (i < ar->nfree && ar->free[i].start < start) i++;
  if (i > 0 && ar->free[i - 1].start + ar->free[i - 1].size == start) {
    ar->free[i - 1].size += n;
    if (i < ar->nfree && start + n == ar->free[i].start) {
      ar->free[i - 1].size += ar->free[i].size;
      memmove(&ar->free[i], &ar->free[i + 1], (size_t)(ar->nfree - i - 1) * sizeof *ar->free);
      ar->nfree--;
    }
    return;
  }
  if (i < ar->nfree && start + n == ar->free[i].start) {
    ar->free[i].start = start;
    ar->free[i].size += n;
    return;
  }
  tp_range *q = grow(ar->free, &ar->capfree, ar->nfree + 1, sizeof *q);
  if (!q) return; /* out of host memory: the range leaks (address space only) */
  ar->free = q;
  memmove(&ar->free[i + 1], &ar->free[i], (size_t)(ar->nfree - i) * sizeof *q);
  ar->free[i] = (tp_range){.start = start, .size = n};
  ar->nfree++;
}

/* Remove [start, start + n) from the free list (a wake maps a span over it). */
void arena_claim(tp_arena *ar, uint64_t start, uint64_t n) {
  uint64_t end = start + n;
  for (int i = 0; i < ar->nfree; i++) {
    tp_range r = ar->free[i];
    uint64_t rend = r.start + r.size;
    if (rend <= start || r.start >= end) continue;
    memmove(&ar->free[i], &ar->free[i + 1], (size_t)(ar->nfree - i - 1) * sizeof r);
    ar->nfree--;
    i--;
    if (r.start < start) arena_give(ar, r.start, start - r.start);
    if (rend > end) arena_give(ar, end, rend - end);
    if (r.start < start || rend > end) i = -1; /* the list changed under us: rescan */
  }
}

static int arena_take(tp_ctx *c, tp_arena *ar, uint64_t n, uint64_t gran, uint64_t *out, tp_err *e) {
  for (int i = 0; i < ar->nfree; i++) {
    if (ar->free[i].size >= n) {
      *out = ar->free[i].start;
      ar->free[i].start += n;
      ar->free[i].size -= n;
      if (!ar->free[i].size) {
        memmove(&ar->free[i], &ar->free[i + 1], (size_t)(ar->nfree - i - 1) * sizeof *ar->free);
        ar->nfree--;
      }
      return 0;
    }
  }
  uint64_t block = c->va_block > n ? c->va_block : n;
  block = (block + gran - 1) / gran * gran;
  tp_range *q = grow(ar->res, &ar->capres, ar->nres + 1, sizeof *q);
  if (!q) return fail(e, -1, "allocate", "out of host memory");
  ar->res = q;
  uint64_t start = 0;
  if (c->drv.reserve(c->drv.self, ar->dev, block, gran, &start, e)) return -1;
  ar->res[ar->nres++] = (tp_range){.start = start, .size = block};
  arena_give(ar, start + n, block - n);
  *out = start;
  return 0;
}

/* Give [start, start + n) back to its arena, except the parts live allocations use. */
void give_gaps(tp_ctx *c, tp_arena *ar, uint64_t start, uint64_t n) {
  uint64_t pos = start, end = start + n;
  int k = alloc_lower(c, start);
  if (k > 0 && c->allocs[k - 1].addr + c->allocs[k - 1].size > start) k--;
  for (; k < c->nallocs && c->allocs[k].addr < end; k++) {
    if (c->allocs[k].addr > pos) arena_give(ar, pos, c->allocs[k].addr - pos);
    uint64_t aend = c->allocs[k].addr + c->allocs[k].size;
    if (aend > pos) pos = aend;
  }
  if (pos < end) arena_give(ar, pos, end - pos);
}

/* -- mappings ------------------------------------------------------------------------------------ */

int new_mapping(tp_ctx *c, uint64_t start, uint64_t n, int dev, uint64_t *handle, tp_err *e, int *stuck) {
  *stuck = 0;
  if (c->drv.ensure_context(c->drv.self, dev, e)) return -1;
  if (c->drv.create(c->drv.self, dev, n, handle, e)) return -1;
  tp_err ignored;
  if (c->drv.map(c->drv.self, start, n, *handle, e)) {
    c->drv.release(c->drv.self, *handle, &ignored);
    return -1;
  }
  if (c->drv.set_access(c->drv.self, start, n, dev, e)) {
    *stuck = c->drv.unmap(c->drv.self, start, n, &ignored) != 0; /* stuck: still mapped, the caller lists it */
    if (!*stuck) c->drv.release(c->drv.self, *handle, &ignored);
    return -1;
  }
  return 0;
}

/* Unmap mapping i and release its handle; 0, or -1 when the unmap failed (it stays mapped). */
int unmap_one(tp_ctx *c, int i, tp_err *e) {
  tp_map *m = &c->maps[i];
  if (c->drv.ensure_context(c->drv.self, m->dev, e)) return -1;
  if (c->drv.unmap(c->drv.self, m->start, m->size, e)) return -1;
  m->mapped = 0;
  tp_err leak;
  memset(&leak, 0, sizeof leak);
  if (c->drv.release(c->drv.self, m->handle, &leak)) { /* the data is safe; report the leaked handle */
    driver_fail(&leak, m->tag, "release");
    ring_push(c, &leak);
  }
  m->handle = 0;
  return 0;
}

/* Unmap mapping i, give its free address space back and drop it. */
int drop_mapping(tp_ctx *c, int i, tp_err *e) {
  if (c->maps[i].mapped && unmap_one(c, i, e)) return -1;
  tp_map m = c->maps[i];
  map_remove(c, i);
  tp_arena *ar = arena_of(c, m.dev, m.tag);
  if (ar) give_gaps(c, ar, m.start, m.size);
  return 0;
}

int count_users(tp_ctx *c, uint64_t start, uint64_t n) {
  int k = alloc_lower(c, start), users = 0;
  if (k > 0 && c->allocs[k - 1].addr + c->allocs[k - 1].size > start) k--;
  for (; k < c->nallocs && c->allocs[k].addr < start + n; k++) users += !c->allocs[k].trimmed;
  return users;
}

/* -- allocate and free ------------------------------------------------------------------------------ */

int tag_allocations(tp_ctx *c, int tag) {
  int n = 0;
  for (int i = 0; i < c->nallocs; i++) n += c->allocs[i].tag == tag;
  return n;
}

static int alloc_locked(tp_ctx *c, int tag, int dev, uint64_t nbytes, uint64_t *out, tp_err *e) {
  if (c->closed) return fail(e, tag, "allocate", "the allocator is closed");
  if (tag < 0 || tag >= c->ntags) return fail(e, tag, "allocate", "unknown tag id %d", tag);
  if (nbytes == 0 || (int64_t)nbytes < 0) return fail(e, tag, "allocate", "cannot allocate %lld bytes", (long long)nbytes);
  if (c->state[tag] == TP_RELEASED)
    return fail(e, tag, "allocate", "tag '%s' is released (asleep, %d allocation(s)); wake it first", c->tags[tag],
                tag_allocations(c, tag));
  if (c->state[tag] == TP_FROZEN)
    return fail(e, tag, "allocate", "tag '%s' is going to sleep (its backup is in flight); wake it first", c->tags[tag]);
  uint64_t gran = 0;
  if (gran_of(c, dev, &gran, e)) return driver_fail(e, tag, "allocate");
  uint64_t size = (nbytes + gran - 1) / gran * gran;
  tp_alloc *qa = grow(c->allocs, &c->cap_allocs, c->nallocs + 1, sizeof *qa);
  if (!qa) return fail(e, tag, "allocate", "out of host memory");
  c->allocs = qa;
  int slab = size == gran && c->slab_max > gran;
  uint64_t addr = 0;
  int found = 0;
  for (int i = 0; slab && i < c->nmaps && !found; i++) {
    tp_map *m = &c->maps[i];
    if (m->slab && m->mapped && m->spare && m->tag == tag && m->dev == dev && c->state[tag] == TP_ACTIVE) {
      int bit = __builtin_ctzll(m->spare);
      m->spare &= ~(1ull << bit);
      m->users++;
      addr = m->start + (uint64_t)bit * gran;
      found = 1;
    }
  }
  if (!found) {
    tp_arena *ar = arena_of(c, dev, tag);
    if (!ar) return fail(e, tag, "allocate", "out of host memory");
    uint64_t span = size;
    if (slab) {
      uint64_t most = c->slab_max / gran;
      if (most > 64) most = 64;
      int shift = ar->slabs_made + 1 < 6 ? ar->slabs_made + 1 : 6;
      span = (1ull << shift) < most ? (1ull << shift) : most;
      span *= gran;
    }
    if (arena_take(c, ar, span, gran, &addr, e)) return driver_fail(e, tag, "allocate");
    uint64_t handle = 0;
    int stuck = 0;
    if (new_mapping(c, addr, span, dev, &handle, e, &stuck)) {
      if (stuck) { /* would not unmap: listed with no user, so a later thaw, wake or close unmaps it */
        tp_map left = {.start = addr, .size = span, .handle = handle, .gran = gran, .tag = tag, .dev = dev, .mapped = 1};
        map_insert(c, &left);
      } else {
        arena_give(ar, addr, span);
      }
      return driver_fail(e, tag, "allocate");
    }
    uint64_t granules = span / gran;
    uint64_t every = granules >= 64 ? ~0ull : (1ull << granules) - 1; /* a bit per granule of the span */
    tp_map m = {.start = addr,
                .size = span,
                .handle = handle,
                .spare = slab ? every & ~1ull : 0, /* a new slab: all but its first granule (this allocation's) */
                .gran = gran,
                .tag = tag,
                .dev = dev,
                .users = 1,
                .slab = slab,
                .mapped = 1};
    if (map_insert(c, &m)) {
      tp_err ignored;
      c->drv.unmap(c->drv.self, addr, span, &ignored);
      c->drv.release(c->drv.self, handle, &ignored);
      arena_give(ar, addr, span);
      return fail(e, tag, "allocate", "out of host memory");
    }
    if (slab) ar->slabs_made++;
  }
  int k = alloc_lower(c, addr);
  memmove(&c->allocs[k + 1], &c->allocs[k], (size_t)(c->nallocs - k) * sizeof *c->allocs);
  c->allocs[k] = (tp_alloc){.addr = addr, .size = size, .requested = nbytes, .tag = tag, .dev = dev};
  c->nallocs++;
  *out = addr;
  return 0;
}

/* Drop the record of the allocation at `addr`; a mapping losing its last user goes too (tag active), unless `keep`
 * (the wait for torch's stream failed: a kernel may still use it; the tag's next sleep or the close unmaps it). */
static int free_locked(tp_ctx *c, uint64_t addr, int keep, tp_err *e) {
  if (c->closed) return 0; /* torch frees its cached segments at exit, after a close */
  int k = alloc_lower(c, addr);
  if (k >= c->nallocs || c->allocs[k].addr != addr)
    return fail(e, -1, "free", "%#llx is not an allocation of this allocator (%d live)", (unsigned long long)addr, c->nallocs);
  tp_alloc rec = c->allocs[k];
  memmove(&c->allocs[k], &c->allocs[k + 1], (size_t)(c->nallocs - k - 1) * sizeof *c->allocs);
  c->nallocs--;
  int state = c->state[rec.tag], rc = 0, overlapped = 0;
  uint64_t end = rec.addr + rec.size;
  for (int i = map_first_overlap(c, rec.addr); i < c->nmaps && c->maps[i].start < end;) {
    tp_map *m = &c->maps[i];
    overlapped = 1;
    if (rec.trimmed) { /* its user count went at the trim; a slab's granule is spare only now */
      if (m->slab)
        for (uint64_t p = rec.addr; p < end; p += m->gran) m->spare |= 1ull << ((p - m->start) / m->gran);
      i++;
      continue;
    }
    m->users--;
    if (m->slab) {
      for (uint64_t p = rec.addr; p < end; p += m->gran) m->spare |= 1ull << ((p - m->start) / m->gran);
    }
    if (m->users <= 0 && state == TP_ACTIVE && !keep) {
      if (drop_mapping(c, i, e)) {
        driver_fail(e, rec.tag, "free");
        rc = -1;
        i++;
      }
      continue;
    }
    i++;
  }
  if (!overlapped) { /* released: nothing mapped, only the address range goes */
    tp_arena *ar = arena_of(c, rec.dev, rec.tag);
    if (ar) arena_give(ar, rec.addr, rec.size);
  }
  return rc;
}

/* alloc_locked, and when creating memory failed for want of it: reclaim the tag's pending segments and retry, as
 * torch's caching allocator frees its cached segments before it gives up (trim.c; the mutex is released while it
 * waits for their streams). */
static int alloc_reclaiming(tp_ctx *c, int tag, int dev, uint64_t nbytes, uint64_t *out, tp_err *e) {
  int rc = alloc_locked(c, tag, dev, nbytes, out, e);
  while (rc && e->oom && tag >= 0 && tag < c->ntags && reclaim_pending(c, tag, dev) > 0) {
    tp_err again;
    memset(&again, 0, sizeof again);
    rc = alloc_locked(c, tag, dev, nbytes, out, &again);
    if (rc) *e = again;
  }
  return rc;
}

TP_EXPORT int tp_alloc_raw(tp_ctx *c, int tag, int dev, uint64_t nbytes, uint64_t *out, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = alloc_reclaiming(c, tag, dev, nbytes, out, e);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

TP_EXPORT int tp_free_raw(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = free_locked(c, addr, 0, e);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* cudaFree's contract for memory torpor handed out as cudaMalloc (the preload library): the device is synchronized
 * first, as cudaFree does implicitly (torch's caching allocator frees a cached segment right after the kernels that
 * used it were queued, counting on that wait; cuMemUnmap does not wait). Waited for outside the mutex. A failed
 * synchronize drops the record but keeps its mapping (a kernel may still use it; the tag's next sleep or the close
 * unmaps it) and returns -1 with the reason, as cudaFree returns the error. */
TP_EXPORT int tp_free_synchronized(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int k = alloc_lower(c, addr), dev = -1, tag = -1, closed = c->closed;
  if (k < c->nallocs && c->allocs[k].addr == addr) dev = c->allocs[k].dev, tag = c->allocs[k].tag;
  pthread_mutex_unlock(&c->mu);
  if (closed || dev < 0) return tp_free_raw(c, addr, e); /* closed: nothing is unmapped; unknown: its refusal */
  tp_err waited;
  memset(&waited, 0, sizeof waited);
  int stuck = c->drv.ensure_context(c->drv.self, dev, &waited) || c->drv.synchronize(c->drv.self, dev, &waited);
  pthread_mutex_lock(&c->mu);
  int rc = free_locked(c, addr, stuck, e);
  if (stuck) {
    driver_fail(&waited, tag, "free");
    ring_push(c, &waited);
    if (!rc) {
      *e = waited;
      rc = -1;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* -- the torch side: one malloc/free pair per slot, each slot bound to (context, tag) ----------------
 *
 * torch keeps the function pointers of a slot for the process, so a slot is
 * rebound to another (context, tag) only when nothing can reach the old one
 * through it: its context is closed (its malloc fails, its free is ignored)
 * and `live`, the blocks its malloc handed out that its free has not had back,
 * is 0. `live` changes under the mutex of the context the slot is bound to,
 * and a rebind checks both under that same mutex, so a block handed out by
 * the old context can never be freed into the new one.
 */

static struct {
  tp_ctx *ctx;
  int tag;
  long live;
} g_slots[TP_SLOTS];
static int g_nslots;
static pthread_mutex_t g_slot_mu = PTHREAD_MUTEX_INITIALIZER;

static void *slot_malloc(int slot, long long size, int dev) {
  tp_ctx *c = __atomic_load_n(&g_slots[slot].ctx, __ATOMIC_ACQUIRE);
  int tag = __atomic_load_n(&g_slots[slot].tag, __ATOMIC_RELAXED);
  uint64_t addr = 0;
  if (!c) return NULL;
  tp_err e;
  memset(&e, 0, sizeof e);
  pthread_mutex_lock(&c->mu);
  int rc = c->drv.ensure_context(c->drv.self, dev, &e) ? driver_fail(&e, tag, "allocate")
                                                        : alloc_reclaiming(c, tag, dev, (uint64_t)size, &addr, &e);
  if (rc) ring_push(c, &e);
  else __atomic_add_fetch(&g_slots[slot].live, 1, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&c->mu);
  return rc ? NULL : (void *)(uintptr_t)addr;
}

static void slot_free(int slot, void *ptr, int dev, void *stream) {
  tp_ctx *c = __atomic_load_n(&g_slots[slot].ctx, __ATOMIC_ACQUIRE);
  if (!ptr || !c) return;
  int tag = __atomic_load_n(&g_slots[slot].tag, __ATOMIC_RELAXED);
  tp_err e, waited;
  memset(&e, 0, sizeof e);
  memset(&waited, 0, sizeof waited);
  /* torch frees a segment (OOM retry, a pool's end) as soon as its blocks are free in stream order: kernels queued
   * on `stream` may still use it, and cuMemUnmap (unlike cudaFree) does not wait. Waited for outside the mutex. */
  int stuck = !__atomic_load_n(&c->closed, __ATOMIC_RELAXED) && /* closed: torch frees at exit, nothing is unmapped */
              (c->drv.ensure_context(c->drv.self, dev, &waited) || c->drv.wait_stream(c->drv.self, dev, stream, &waited));
  pthread_mutex_lock(&c->mu);
  if (stuck) {
    driver_fail(&waited, tag, "free");
    ring_push(c, &waited);
  }
  int rc = c->drv.ensure_context(c->drv.self, dev, &e) ? driver_fail(&e, tag, "free")
                                                        : free_locked(c, (uint64_t)(uintptr_t)ptr, stuck, &e);
  if (rc) ring_push(c, &e);
  __atomic_sub_fetch(&g_slots[slot].live, 1, __ATOMIC_RELAXED); /* torch gave the block back, freed or not */
  pthread_mutex_unlock(&c->mu);
}

#define TP_SLOT(b, k)                                                                                \
  static void *slot_malloc_##b##_##k(long long size, int dev, void *stream) {                        \
    (void)stream;                                                                                    \
    return slot_malloc((b) * 8 + (k), size, dev);                                                    \
  }                                                                                                  \
  static void slot_free_##b##_##k(void *ptr, long long size, int dev, void *stream) {                \
    (void)size;                                                                                      \
    slot_free((b) * 8 + (k), ptr, dev, stream);                                                      \
  }
#define TP_SLOT8(b) TP_SLOT(b, 0) TP_SLOT(b, 1) TP_SLOT(b, 2) TP_SLOT(b, 3) TP_SLOT(b, 4) TP_SLOT(b, 5) TP_SLOT(b, 6) TP_SLOT(b, 7)
TP_SLOT8(0) TP_SLOT8(1) TP_SLOT8(2) TP_SLOT8(3) TP_SLOT8(4) TP_SLOT8(5) TP_SLOT8(6) TP_SLOT8(7)
TP_SLOT8(8) TP_SLOT8(9) TP_SLOT8(10) TP_SLOT8(11) TP_SLOT8(12) TP_SLOT8(13) TP_SLOT8(14) TP_SLOT8(15)
#define TP_PAIR(b, k) {slot_malloc_##b##_##k, slot_free_##b##_##k},
#define TP_PAIR8(b) TP_PAIR(b, 0) TP_PAIR(b, 1) TP_PAIR(b, 2) TP_PAIR(b, 3) TP_PAIR(b, 4) TP_PAIR(b, 5) TP_PAIR(b, 6) TP_PAIR(b, 7)
static const struct {
  void *(*malloc_fn)(long long, int, void *);
  void (*free_fn)(void *, long long, int, void *);
} g_pairs[TP_SLOTS] = {TP_PAIR8(0) TP_PAIR8(1) TP_PAIR8(2) TP_PAIR8(3) TP_PAIR8(4) TP_PAIR8(5) TP_PAIR8(6) TP_PAIR8(7)
                       TP_PAIR8(8) TP_PAIR8(9) TP_PAIR8(10) TP_PAIR8(11) TP_PAIR8(12) TP_PAIR8(13) TP_PAIR8(14) TP_PAIR8(15)};

/* Slot i is bound to a closed context and torch holds nothing of it: nothing can reach it. Takes that context's mutex. */
static int slot_idle(int i, tp_ctx *c, int tag, int rebind) {
  tp_ctx *old = g_slots[i].ctx;
  pthread_mutex_lock(&old->mu);
  int idle = old->closed && __atomic_load_n(&g_slots[i].live, __ATOMIC_RELAXED) == 0;
  if (idle && rebind) {
    __atomic_store_n(&g_slots[i].tag, tag, __ATOMIC_RELAXED);
    __atomic_store_n(&g_slots[i].ctx, c, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&old->mu);
  return idle;
}

/* Bind a slot to (c, tag): a never-used one, else one whose context is closed and holds no block of torch's
 * (see above); its index, or -1 when every slot is taken (tp_slot_census says by whom). */
TP_EXPORT int tp_slot_bind(tp_ctx *c, int tag) {
  pthread_mutex_lock(&g_slot_mu);
  int slot = -1;
  if (g_nslots < TP_SLOTS) {
    slot = g_nslots++;
    __atomic_store_n(&g_slots[slot].tag, tag, __ATOMIC_RELAXED);
    __atomic_store_n(&g_slots[slot].ctx, c, __ATOMIC_RELEASE);
  } else {
    for (int i = 0; i < TP_SLOTS && slot < 0; i++)
      if (slot_idle(i, c, tag, 1)) slot = i;
  }
  pthread_mutex_unlock(&g_slot_mu);
  return slot;
}

/* out[0]: slots bound to open contexts; out[1]: bound to closed contexts torch still holds blocks of; out[2]: free. */
TP_EXPORT void tp_slot_census(int *out) {
  pthread_mutex_lock(&g_slot_mu);
  out[0] = out[1] = 0;
  out[2] = TP_SLOTS - g_nslots;
  for (int i = 0; i < g_nslots; i++) {
    tp_ctx *bound = g_slots[i].ctx;
    pthread_mutex_lock(&bound->mu);
    int closed = bound->closed;
    pthread_mutex_unlock(&bound->mu);
    if (!closed) out[0]++;
    else if (slot_idle(i, NULL, 0, 0)) out[2]++;
    else out[1]++;
  }
  pthread_mutex_unlock(&g_slot_mu);
}

TP_EXPORT void *tp_slot_malloc_fn(int slot) { return slot >= 0 && slot < TP_SLOTS ? (void *)g_pairs[slot].malloc_fn : NULL; }
TP_EXPORT void *tp_slot_free_fn(int slot) { return slot >= 0 && slot < TP_SLOTS ? (void *)g_pairs[slot].free_fn : NULL; }
