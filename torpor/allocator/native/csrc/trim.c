/* Trimming: the memory of a segment torch holds free in a pool no block allocates from goes back (tp_trim), and
 * comes back when that pool serves a block again (tp_untrim). See torpor/allocator/torchside/trim.py.
 *
 * A trimmed allocation keeps its record (torch still holds the segment) and its address range (reserved until
 * torch frees it); it is neither listed, nor counted, nor backed up, nor mapped on a wake.
 */
#include <stdlib.h>
#include <string.h>

#include "table.h"

/* Torch holds the segment at `addr` free in a pool no block allocates from: give its memory back now.
 * The record stays (torch frees the address later); its mapping goes once no other allocation uses it.
 * 1 when it was trimmed now; 0 when not (trimmed already, or its tag is asleep or going to sleep); 2 when it was
 * trimmed but a mapping would not unmap (`e` says why): the segment is trimmed all the same, since torch records it
 * as trimmed only when this says so, and the mapping stays listed with no user, so the tag's next sleep unmaps it
 * (as it does a mapping whose free failed). */
TP_EXPORT int tp_trim(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0, k = alloc_lower(c, addr);
  if (k >= c->na || c->a[k].addr != addr) {
    rc = fail(e, -1, "trim", "%#llx is not an allocation of this allocator", (unsigned long long)addr);
  } else if (c->a[k].trimmed || c->state[c->a[k].tag] != TP_ACTIVE) {
    rc = 0; /* trimmed already; or asleep or going to sleep: the release takes it */
  } else {
    rc = 1;
    c->a[k].trimmed = 1;
    uint64_t end = addr + c->a[k].size;
    int tag = c->a[k].tag;
    for (int i = map_first_overlap(c, addr); i < c->nm && c->m[i].start < end;) {
      if (--c->m[i].users <= 0) {
        if (drop_mapping(c, i, e)) {
          driver_fail(e, tag, "trim");
          rc = 2;
          i++;
        }
        continue;
      }
      i++;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* The pool holding the trimmed segment at `addr` serves a block again (torch may hand the segment out): map memory
 * under it again. Mappings still overlapping it (a slab, a wake's span) count it as a user again; the parts no
 * mapping covers get one new mapping each (fresh memory). All or nothing (the table's room is made before anything is
 * mapped); 1 when it was trimmed, 0 when not. */
TP_EXPORT int tp_untrim(tp_ctx *c, uint64_t addr, tp_err *e) {
  pthread_mutex_lock(&c->mu);
  int rc = 0, k = alloc_lower(c, addr);
  if (k >= c->na || c->a[k].addr != addr) {
    rc = fail(e, -1, "untrim", "%#llx is not an allocation of this allocator", (unsigned long long)addr);
    goto out;
  }
  tp_alloc *a = &c->a[k];
  if (!a->trimmed) goto out;
  if (c->state[a->tag] != TP_ACTIVE) {
    rc = fail(e, a->tag, "untrim", "tag '%s' is asleep or going to sleep; a trimmed segment cannot be mapped again",
              c->tags[a->tag]);
    goto out;
  }
  uint64_t end = a->addr + a->size, pos = a->addr;
  uint64_t gap_start[64], gap_size[64], handles[64];
  int ngaps = 0, many = 0;
  for (int i = map_first_overlap(c, a->addr); i < c->nm && c->m[i].start < end; i++) {
    if (c->m[i].start > pos) {
      if (ngaps == 64) {
        many = 1;
        break;
      }
      gap_start[ngaps] = pos;
      gap_size[ngaps++] = c->m[i].start - pos;
    }
    uint64_t mend = c->m[i].start + c->m[i].size;
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
    for (int i = map_first_overlap(c, a->addr); i < c->nm && c->m[i].start < end; i++) c->m[i].users++;
    uint64_t gran = c->gran[a->dev >= 0 && a->dev < TP_MAX_DEVICES ? a->dev : 0];
    for (int g = 0; g < ngaps; g++) {
      tp_map m = {gap_start[g], gap_size[g], handles[g], 0, gran, a->tag, a->dev, 1, 0, 1};
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
