/* What sleep and wake ask of the table: tag states, unmapping for a sleep, mapping back for a wake, queries.
 *
 * Python orchestrates a sleep (backup copies, then release) and a wake; each
 * call here takes the context's mutex for its own duration only and calls
 * nothing but the driver table, so torch's allocator threads never wait on
 * Python and Python never waits on torch while it holds this mutex.
 *   sleep:  tp_freeze -> (copies) -> tp_unmap_range... -> tp_mark_released
 *           on a failed unmap: tp_map_back -> (copies back) -> tp_thaw
 *   wake:   tp_map_span... (copies in) -> tp_mark_awake; on failure tp_unmap_all
 */
#include <stdlib.h>
#include <string.h>

#include "table.h"

#define LOCK pthread_mutex_lock(&c->mu)
#define UNLOCK pthread_mutex_unlock(&c->mu)

static int check_tag(tp_ctx *c, int tag, const char *op, tp_err *e) {
  if (tag < 0 || tag >= c->ntags) return fail(e, tag, op, "unknown tag id %d", tag);
  if (c->closed) return fail(e, tag, op, "the allocator is closed");
  return 0;
}

/* Unmap (and drop) every mapping of `tag` no live allocation uses; -1 when an unmap failed. */
static int drop_unused(tp_ctx *c, int tag, tp_err *e) {
  int rc = 0;
  for (int i = 0; i < c->nmaps;) {
    if (c->maps[i].tag == tag && c->maps[i].users <= 0 && c->maps[i].mapped) {
      if (drop_mapping(c, i, e)) {
        rc = -1;
        i++;
      }
      continue;
    }
    i++;
  }
  return rc;
}

TP_EXPORT int tp_freeze(tp_ctx *c, int tag, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "backup", e);
  if (!rc && c->state[tag] == TP_RELEASED)
    rc = fail(e, tag, "backup", "tag '%s' is released; nothing resident to back up", c->tags[tag]);
  if (!rc) c->state[tag] = TP_FROZEN;
  UNLOCK;
  return rc;
}

TP_EXPORT int tp_thaw(tp_ctx *c, int tag, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "thaw", e);
  if (!rc && c->state[tag] == TP_FROZEN) {
    int unmapped = 0;
    for (int i = 0; i < c->nmaps; i++) unmapped += c->maps[i].tag == tag && !c->maps[i].mapped;
    if (unmapped) rc = fail(e, tag, "thaw", "%d mapping(s) of tag '%s' are unmapped; map them back first", unmapped, c->tags[tag]);
    if (!rc) {
      c->state[tag] = TP_ACTIVE;
      if (drop_unused(c, tag, e)) rc = driver_fail(e, tag, "free");
    }
  }
  UNLOCK;
  return rc;
}

/* Unmap the mappings of a frozen tag that lie inside [lo, hi); the number unmapped, or -1. */
TP_EXPORT int tp_unmap_range(tp_ctx *c, int tag, uint64_t lo, uint64_t hi, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "release", e), n = 0;
  if (!rc && c->state[tag] != TP_FROZEN) rc = fail(e, tag, "release", "tag '%s' is not frozen for a sleep", c->tags[tag]);
  for (int i = map_first_overlap(c, lo); !rc && i < c->nmaps && c->maps[i].start < hi; i++) {
    tp_map *m = &c->maps[i];
    if (m->tag != tag || !m->mapped || m->start < lo || m->start + m->size > hi) continue;
    if (unmap_one(c, i, e)) rc = driver_fail(e, tag, "release");
    else n++;
  }
  UNLOCK;
  return rc ? -1 : n;
}

/* Map back what tp_unmap_range unmapped (fresh memory; the caller copies the backup in); ranges go to start/size. */
TP_EXPORT int tp_map_back(tp_ctx *c, int tag, uint64_t *start, uint64_t *size, int cap, int *count, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "release", e);
  *count = 0;
  for (int i = 0; !rc && i < c->nmaps; i++) {
    tp_map *m = &c->maps[i];
    if (m->tag != tag || m->mapped) continue;
    int stuck = 0;
    if (new_mapping(c, m->start, m->size, m->dev, &m->handle, e, &stuck)) {
      if (stuck) m->mapped = 1; /* mapped without access: thaw refuses nothing, the next sleep unmaps it */
      rc = driver_fail(e, tag, "release");
      break;
    }
    m->mapped = 1;
    if (*count < cap) {
      start[*count] = m->start;
      size[*count] = m->size;
    }
    (*count)++;
  }
  UNLOCK;
  return rc;
}

TP_EXPORT int tp_mark_released(tp_ctx *c, int tag, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "release", e);
  if (!rc && c->state[tag] != TP_FROZEN) rc = fail(e, tag, "release", "tag '%s' is not frozen for a sleep", c->tags[tag]);
  for (int i = 0; !rc && i < c->nmaps; i++)
    if (c->maps[i].tag == tag && c->maps[i].mapped)
      rc = fail(e, tag, "release", "tag '%s' still has a mapping at %#llx", c->tags[tag], (unsigned long long)c->maps[i].start);
  if (!rc) {
    for (int i = 0; i < c->nmaps;) {
      if (c->maps[i].tag == tag) drop_mapping(c, i, e); /* unmapped already: gives its free space back */
      else i++;
    }
    c->state[tag] = TP_RELEASED;
  }
  UNLOCK;
  return rc;
}

/* Map [start, start + size) of a released tag with one new handle (a wake maps span by span). */
TP_EXPORT int tp_map_span(tp_ctx *c, int tag, uint64_t start, uint64_t size, int dev, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "restore", e);
  if (!rc && c->state[tag] != TP_RELEASED) rc = fail(e, tag, "restore", "tag '%s' is not released", c->tags[tag]);
  if (!rc && (dev < 0 || dev >= TP_MAX_DEVICES))
    rc = fail(e, tag, "restore", "device %d refused: devices are numbered 0 to %d", dev, TP_MAX_DEVICES - 1);
  if (!rc && (size == 0 || !tp_range_ok(start, size))) /* Note [Lengths and ranges at the C boundary] (tp.h) */
    rc = fail(e, tag, "restore", "span %#llx+%llu refused: a span is 1 to 2**63 - 1 bytes ending by 2**64 - 1",
              (unsigned long long)start, (unsigned long long)size);
  if (rc) {
    UNLOCK;
    return rc;
  }
  uint64_t handle = 0, gran = c->gran[dev];
  int stuck = 0;
  if (!rc && new_mapping(c, start, size, dev, &handle, e, &stuck)) rc = driver_fail(e, tag, "restore");
  if (!rc || stuck) { /* stuck: mapped but would not unmap; listed so that the rollback or next wake unmaps it */
    tp_map m = {.start = start,
                .size = size,
                .handle = handle,
                .gran = gran,
                .tag = tag,
                .dev = dev,
                .users = count_users(c, start, size),
                .mapped = 1};
    tp_arena *ar = arena_of(c, dev, tag);
    if (ar) arena_claim(ar, start, size);
    if (map_insert(c, &m)) {
      tp_err ignored;
      c->drv.unmap(c->drv.self, start, size, &ignored);
      c->drv.release(c->drv.self, handle, &ignored);
      rc = fail(e, tag, "restore", "out of host memory");
    }
  }
  UNLOCK;
  return rc;
}

/* Roll a wake back: unmap every mapping of the tag; the number that would not unmap (they stay listed). */
TP_EXPORT int tp_unmap_all(tp_ctx *c, int tag, tp_err *e) {
  LOCK;
  int failed = 0;
  for (int i = 0; i < c->nmaps;) {
    if (c->maps[i].tag == tag) {
      if (drop_mapping(c, i, e)) {
        driver_fail(e, tag, "restore");
        ring_push(c, e);
        failed++;
        i++;
      }
      continue;
    }
    i++;
  }
  UNLOCK;
  return failed;
}

TP_EXPORT int tp_mark_awake(tp_ctx *c, int tag, tp_err *e) {
  LOCK;
  int rc = check_tag(c, tag, "restore", e);
  if (!rc) {
    c->state[tag] = TP_ACTIVE;
    if (drop_unused(c, tag, e)) { /* allocations freed during the wake */
      driver_fail(e, tag, "free");
      ring_push(c, e);
    }
  }
  UNLOCK;
  return rc;
}

/* -- queries ---------------------------------------------------------------------------------------- */

/* Live (untrimmed) allocations of `tag` (all tags when -1), by address: up to `cap` written; returns how many there are. */
TP_EXPORT int tp_list(tp_ctx *c, int tag, uint64_t *addr, uint64_t *size, int *dev, int cap) {
  LOCK; /* a negative cap writes nothing (n < cap never holds) */
  int n = 0;
  for (int i = 0; i < c->nallocs; i++) {
    if ((tag >= 0 && c->allocs[i].tag != tag) || c->allocs[i].trimmed) continue;
    if (n < cap) {
      addr[n] = c->allocs[i].addr;
      size[n] = c->allocs[i].size;
      dev[n] = c->allocs[i].dev;
    }
    n++;
  }
  UNLOCK;
  return n;
}

/* Bytes and count of live allocations of `tag`; returns its state (or -1 when unknown). */
TP_EXPORT int tp_usage(tp_ctx *c, int tag, uint64_t *bytes, int *count) {
  LOCK;
  int state = tag >= 0 && tag < c->ntags ? c->state[tag] : -1;
  *bytes = 0;
  *count = 0;
  for (int i = 0; i < c->nallocs; i++)
    if (c->allocs[i].tag == tag && !c->allocs[i].trimmed) {
      *bytes += c->allocs[i].size;
      (*count)++;
    }
  UNLOCK;
  return state;
}

/* Live slabs and their spare bytes (of `tag`, or all when -1); mapped bytes and mappings (same filter). */
TP_EXPORT void tp_stats(tp_ctx *c, int tag, uint64_t out[4]) {
  LOCK;
  memset(out, 0, 4 * sizeof *out);
  for (int i = 0; i < c->nmaps; i++) {
    tp_map *m = &c->maps[i];
    if ((tag >= 0 && m->tag != tag) || !m->mapped) continue;
    if (m->slab) {
      out[0]++;
      out[1] += (uint64_t)__builtin_popcountll(m->spare) * m->gran;
    }
    out[2] += m->size;
    out[3]++;
  }
  UNLOCK;
}

/* Take the errors recorded by torch's calls (newest last); returns how many were copied. */
TP_EXPORT int tp_errors(tp_ctx *c, tp_err *out, int cap) {
  LOCK;
  int n = c->nring < cap ? c->nring : cap < 0 ? 0 : cap;
  memcpy(out, c->ring + (c->nring - n), (size_t)n * sizeof *out);
  c->nring = 0;
  UNLOCK;
  return n;
}

/* Teardown: unmap everything, free the reservations; later frees from torch are ignored. Failures counted. */
TP_EXPORT int tp_close(tp_ctx *c) {
  LOCK;
  int failed = 0;
  tp_err e;
  for (int i = 0; i < c->nmaps; i++)
    if (c->maps[i].mapped && unmap_one(c, i, &e)) failed++;
  c->nmaps = 0;
  c->nallocs = 0;
  for (int i = 0; i < c->narenas; i++) {
    tp_arena *ar = &c->arenas[i];
    for (int r = 0; r < ar->nres; r++)
      if (c->drv.unreserve(c->drv.self, ar->res[r].start, ar->res[r].size, &e)) failed++;
    free(ar->res);
    free(ar->free);
  }
  c->narenas = 0;
  c->closed = 1; /* the context itself stays: slots bound to it may still be called by torch */
  UNLOCK;
  return failed;
}
