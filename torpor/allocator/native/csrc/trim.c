/* Trimming: the memory of a segment torch holds free in a pool no block allocates from goes back (tp_trim), and
 * comes back when that pool serves a block again (tp_untrim). See torpor/allocator/torchside/trim.py.
 *
 * A trimmed allocation keeps its record (torch still holds the segment) and its address range (reserved until
 * torch frees it); it is neither listed, nor counted, nor backed up, nor mapped on a wake. A released tag's segment
 * is trimmed too (nothing of it is mapped: it only stops being listed), so that a wake never maps memory under a
 * segment torch holds free, such as one whose tensors were deleted while the tag was asleep (issue 51): mapped
 * there, it would share a wake's span with live allocations and its memory could not go back until they all went.
 */
#include <stdlib.h>
#include <string.h>

#include "table.h"

/* Trim allocation k (the mutex held): 1 when trimmed now, 2 when trimmed but a mapping would not unmap (`e` says
 * why), 0 when not (trimmed already; or its tag is going to sleep: its backup and release take it). */
int trim_locked(tp_ctx *c, int k, tp_err *e) {
  if (c->allocs[k].trimmed || c->state[c->allocs[k].tag] == TP_FROZEN) return 0;
  int rc = 1;
  c->allocs[k].trimmed = 1;
  c->allocs[k].pending = 0;
  uint64_t addr = c->allocs[k].addr, end = addr + c->allocs[k].size;
  int tag = c->allocs[k].tag;
  for (int i = map_first_overlap(c, addr); i < c->nmaps && c->maps[i].start < end;) {
    if (--c->maps[i].users <= 0) {
      if (drop_mapping(c, i, e)) {
        driver_fail(e, tag, "trim");
        rc = 2;
        i++;
      }
      continue;
    }
    i++;
  }
  return rc;
}

/* Torch holds the segment at `addr` free in a pool no block allocates from: give its memory back now.
 * The record stays (torch frees the address later); its mapping goes once no other allocation uses it.
 * 1 when it was trimmed now, or was trimmed under pressure while pending (tp_pend) and not yet reported; 0 when not
 * (trimmed already; or its tag is going to sleep); 2 when it was trimmed but a mapping would not unmap (`e`
 * says why): the segment is trimmed all the same, since torch records it as trimmed only when this says so, and the
 * mapping stays listed with no user, so the tag's next sleep unmaps it (as it does a mapping whose free failed).
 * Either way the segment is no longer pending. */
TP_EXPORT int tp_trim(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0, k = alloc_lower(c, addr);
  if (k >= c->nallocs || c->allocs[k].addr != addr) {
    rc = fail(e, -1, "trim", "%#llx is not an allocation of this allocator", (unsigned long long)addr);
  } else if (c->allocs[k].reclaimed) {
    c->allocs[k].reclaimed = 0;
    rc = 1;
  } else {
    c->allocs[k].pending = 0;
    rc = trim_locked(c, k, e);
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* -- pending segments: reclaimed when an allocation of their tag runs out of memory -------------------------------
 *
 * A segment torch holds free in an idle pool, freed while a kernel on `stream` may still use it, is *pending*: its
 * trim waits for that work (torpor/allocator/torchside/trim.py). When creating memory for its tag fails, the allocation
 * does what torch's caching allocator does before it gives up (it frees cached segments, cudaFree waiting for the
 * device): it waits for the pending segments' streams outside the mutex, trims those still pending as they were, and
 * retries (reclaim_pending). Python learns of each such trim from the next tp_trim or tp_unpend of the segment, which
 * it makes before the pool can serve a block again. A stream that captures a graph is not waited for: its segments
 * stay. */

/* The segment at `addr` is free in an idle pool; its trim waits for `stream`. 1 when pending now, 0 when not (trimmed,
 * or its tag is not awake), -1 when not an allocation. */
TP_EXPORT int tp_pend(tp_ctx *c, uint64_t addr, void *stream, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0, k = alloc_lower(c, addr);
  if (k >= c->nallocs || c->allocs[k].addr != addr) {
    rc = fail(e, -1, "pend", "%#llx is not an allocation of this allocator", (unsigned long long)addr);
  } else if (!c->allocs[k].trimmed && c->state[c->allocs[k].tag] == TP_ACTIVE) {
    c->allocs[k].pending = 1;
    c->allocs[k].stream = stream;
    c->allocs[k].pgen = ++c->pgen;
    rc = 1;
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* The segment at `addr` is pending no more (its pool serves a block again, or it is no longer free). 1 when it was
 * trimmed under pressure meanwhile (the caller must map it again before torch may hand it out), 0 when not, -1 when
 * not an allocation (torch freed it: nothing to do). */
TP_EXPORT int tp_unpend(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0, k = alloc_lower(c, addr);
  if (k >= c->nallocs || c->allocs[k].addr != addr) {
    rc = fail(e, -1, "unpend", "%#llx is not an allocation of this allocator", (unsigned long long)addr);
  } else {
    rc = c->allocs[k].reclaimed;
    c->allocs[k].reclaimed = 0;
    c->allocs[k].pending = 0;
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

#define TP_RECLAIM 256

/* Creating memory for `tag` on `dev` failed (the mutex held): wait for the streams of the tag's pending segments on
 * `dev` (the mutex released meanwhile), trim those still pending from the same tp_pend, and return how many were
 * trimmed (0: nothing to retry). A failed wait leaves its segments pending; it is reported in the error ring. */
int reclaim_pending(tp_ctx *c, int tag, int dev) {
  uint64_t addr[TP_RECLAIM], gen[TP_RECLAIM];
  void *stream[TP_RECLAIM];
  int n = 0;
  for (int i = 0; i < c->nallocs && n < TP_RECLAIM; i++) {
    tp_alloc *a = &c->allocs[i];
    if (a->pending && !a->trimmed && a->tag == tag && a->dev == dev) {
      addr[n] = a->addr;
      gen[n] = a->pgen;
      stream[n++] = a->stream;
    }
  }
  if (!n || c->state[tag] != TP_ACTIVE) return 0;
  int ok[TP_RECLAIM];
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; i < n; i++) {
    ok[i] = -1; /* not yet waited for */
    for (int j = 0; j < i; j++)
      if (stream[j] == stream[i]) ok[i] = ok[j];
    if (ok[i] >= 0) continue;
    tp_err e;
    memset(&e, 0, sizeof e);
    int capturing = 0;
    ok[i] = !c->drv.capturing(c->drv.self, dev, stream[i], &capturing, &e) && !capturing &&
            !c->drv.wait_stream(c->drv.self, dev, stream[i], &e);
    if (!ok[i] && e.code) {
      driver_fail(&e, tag, "reclaim");
      pthread_mutex_lock(&c->mu);
      ring_push(c, &e);
      pthread_mutex_unlock(&c->mu);
    }
  }
  pthread_mutex_lock(&c->mu);
  int trimmed = 0;
  for (int i = 0; i < n; i++) {
    int k = alloc_lower(c, addr[i]);
    if (!ok[i] || k >= c->nallocs || c->allocs[k].addr != addr[i] || !c->allocs[k].pending || c->allocs[k].pgen != gen[i]) continue;
    tp_err e;
    memset(&e, 0, sizeof e);
    int rc = trim_locked(c, k, &e);
    if (rc == 2) ring_push(c, &e);
    if (rc) {
      c->allocs[k].reclaimed = 1;
      trimmed++;
    }
  }
  return trimmed;
}

/* The pool holding the trimmed segment at `addr` serves a block again (torch may hand the segment out): map memory
 * under it again. Mappings still overlapping it (a slab, a wake's span) count it as a user again; the parts no
 * mapping covers get one new mapping each (fresh memory). All or nothing (the table's room is made before anything is
 * mapped); 1 when it was trimmed, 0 when not. */
TP_EXPORT int tp_untrim(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0, k = alloc_lower(c, addr);
  if (k >= c->nallocs || c->allocs[k].addr != addr) {
    rc = fail(e, -1, "untrim", "%#llx is not an allocation of this allocator", (unsigned long long)addr);
    goto out;
  }
  tp_alloc *a = &c->allocs[k];
  if (!a->trimmed) goto out;
  if (c->state[a->tag] != TP_ACTIVE) {
    rc = fail(e, a->tag, "untrim", "tag '%s' is asleep or going to sleep; a trimmed segment cannot be mapped again",
              c->tags[a->tag]);
    goto out;
  }
  uint64_t end = a->addr + a->size, pos = a->addr;
  uint64_t gap_start[64], gap_size[64], handles[64];
  int ngaps = 0, many = 0;
  for (int i = map_first_overlap(c, a->addr); i < c->nmaps && c->maps[i].start < end; i++) {
    if (c->maps[i].start > pos) {
      if (ngaps == 64) {
        many = 1;
        break;
      }
      gap_start[ngaps] = pos;
      gap_size[ngaps++] = c->maps[i].start - pos;
    }
    uint64_t mend = c->maps[i].start + c->maps[i].size;
    if (mend > pos) pos = mend;
  }
  if (!many && pos < end && ngaps == 64) many = 1;
  if (many) {
    rc = fail(e, a->tag, "untrim", "the segment at %#llx lies across more than 64 unmapped parts",
              (unsigned long long)addr);
    goto out;
  }
  if (pos < end) {
    gap_start[ngaps] = pos;
    gap_size[ngaps++] = end - pos;
  }
  if (map_room(c, ngaps)) { /* the table's room first: once memory is mapped, nothing below can fail */
    rc = fail(e, a->tag, "untrim", "out of host memory");
    goto out;
  }
  int made = 0;
  for (; made < ngaps; made++) {
    int stuck = 0;
    if (new_mapping(c, gap_start[made], gap_size[made], a->dev, &handles[made], e, &stuck)) {
      rc = driver_fail(e, a->tag, "untrim");
      break;
    }
  }
  if (!rc) {
    for (int i = map_first_overlap(c, a->addr); i < c->nmaps && c->maps[i].start < end; i++) c->maps[i].users++;
    uint64_t gran = c->gran[a->dev >= 0 && a->dev < TP_MAX_DEVICES ? a->dev : 0];
    for (int g = 0; g < ngaps; g++) {
      tp_map m = {.start = gap_start[g],
                  .size = gap_size[g],
                  .handle = handles[g],
                  .gran = gran,
                  .tag = a->tag,
                  .dev = a->dev,
                  .users = 1,
                  .mapped = 1};
      map_insert(c, &m); /* cannot fail: map_room above */
    }
    a->trimmed = 0;
    rc = 1;
  } else {
    tp_err ignored;
    for (int g = 0; g < made; g++) {
      c->drv.unmap(c->drv.self, gap_start[g], gap_size[g], &ignored);
      c->drv.release(c->drv.self, handles[g], &ignored);
    }
  }
out:
  pthread_mutex_unlock(&c->mu);
  return rc;
}
