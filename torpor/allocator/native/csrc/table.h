/* The allocation table's types and internal helpers, shared by table.c, sleep.c and trim.c (not exported).
 *
 * Addresses are device virtual addresses and sizes are bytes unless a field says otherwise; every array below is
 * sorted by address and guarded by tp_ctx.mu.
 */
#ifndef TORPOR_TABLE_H
#define TORPOR_TABLE_H
#include "tp.h"

/* One allocation the table handed out (a segment torch's allocator asked for, or a raw allocation). */
typedef struct {
  uint64_t addr;      /* where it starts */
  uint64_t size;      /* bytes it covers: `requested` rounded up to the device's granularity */
  uint64_t requested; /* bytes asked for */
  int tag;            /* tag id (index into tp_ctx.tags) */
  int dev;            /* device number */
  int trimmed;   /* torch still holds the segment, free and never to be used again: its memory went back */
  int pending;   /* torch holds it free in an idle pool; its trim waits for `stream` (tp_pend; trim.c) */
  int reclaimed; /* trimmed by an allocation under pressure while pending; the next tp_trim/tp_unpend reports it */
  uint64_t pgen; /* which tp_pend (a value of tp_ctx.pgen): a segment pended again is another wait */
  void *stream;  /* pending: torch's stream whose queued work may still use it (a CUstream) */
} tp_alloc;

/* One physical handle mapped whole at [start, start + size), or unmapped by a sleep and listed until released. */
typedef struct {
  uint64_t start;  /* where it is mapped */
  uint64_t size;   /* bytes mapped: a multiple of `gran` */
  uint64_t handle; /* the driver's handle of the physical memory (0 once released) */
  uint64_t spare;  /* slabs only: bitmap of the granules no allocation uses (bit i: the i-th granule from `start`) */
  uint64_t gran;   /* bytes per granule of its device (the unit of `spare`) */
  int tag;         /* tag id of the allocations inside it */
  int dev;         /* device number */
  int users;       /* live, untrimmed allocations inside it: at 0 an active tag unmaps it */
  int slab;        /* 1: a slab, shared by up to 64 one-granule allocations; 0: one allocation (or a wake's span) */
  int mapped;      /* 1: mapped now; 0: a sleep unmapped it (tp_unmap_range) and tp_map_back may map it again */
} tp_map;

/* An address range: `size` bytes from `start`. */
typedef struct {
  uint64_t start;
  uint64_t size;
} tp_range;

/* The address space of one (device, tag): reservations from the driver and the free ranges inside them. */
typedef struct {
  int dev;        /* device number */
  int tag;        /* tag id */
  int slabs_made; /* slabs made so far: the n-th (from 1) spans 2**n granules, at most 64 and tp_ctx.slab_max */
  tp_range *res;  /* reservations (driver reserve calls), given back at tp_close: `nres` of `capres` */
  tp_range *free; /* free ranges inside them, sorted and merged: `nfree` of `capfree` */
  int nres, capres, nfree, capfree;
} tp_arena;

struct tp_ctx {
  pthread_mutex_t mu;            /* guards every field below (lock order: tp.h) */
  tp_driver drv;                 /* the driver table every VMM call goes through */
  int closed;                    /* 1 after tp_close: allocations are refused, torch's frees ignored */
  uint64_t slab_max;             /* bytes: the largest slab (a slab needs more than one granule: 0 makes none) */
  uint64_t va_block;             /* bytes of address space an arena reserves at a time (more for a larger allocation) */
  uint64_t gran[TP_MAX_DEVICES]; /* bytes per granule of each device (0: not asked yet) */
  tp_alloc *allocs;              /* live allocations, sorted by address: `nallocs` of `cap_allocs` */
  int nallocs, cap_allocs;
  tp_map *maps; /* mappings, sorted by start (including those a sleep unmapped): `nmaps` of `cap_maps` */
  int nmaps, cap_maps;
  tp_arena *arenas; /* address arenas, one per (device, tag) used: `narenas` of `cap_arenas` */
  int narenas, cap_arenas;
  char tags[TP_MAX_TAGS][64]; /* tag names (NUL-terminated, up to 63 bytes), by tag id */
  int state[TP_MAX_TAGS];     /* TP_ACTIVE, TP_FROZEN or TP_RELEASED, by tag id */
  int ntags;                  /* tag ids given out (0 to ntags - 1) */
  tp_err ring[TP_RING];       /* failures of torch's malloc/free calls, oldest first, until tp_errors takes them */
  int nring;                  /* how many of `ring` are filled */
  uint64_t pgen;              /* tp_pend calls so far: each pend's generation (tp_alloc.pgen) */
};

int fail(tp_err *e, int tag, const char *op, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
int driver_fail(tp_err *e, int tag, const char *op);
void ring_push(tp_ctx *c, const tp_err *e);
int alloc_lower(tp_ctx *c, uint64_t addr);
int map_first_overlap(tp_ctx *c, uint64_t addr);
int map_room(tp_ctx *c, int more);
int map_insert(tp_ctx *c, const tp_map *m);
void map_remove(tp_ctx *c, int i);
tp_arena *arena_of(tp_ctx *c, int dev, int tag);
void arena_claim(tp_arena *ar, uint64_t start, uint64_t n);
void give_gaps(tp_ctx *c, tp_arena *ar, uint64_t start, uint64_t n);
int new_mapping(tp_ctx *c, uint64_t start, uint64_t n, int dev, uint64_t *handle, tp_err *e, int *stuck);
int unmap_one(tp_ctx *c, int i, tp_err *e);
int drop_mapping(tp_ctx *c, int i, tp_err *e);
int count_users(tp_ctx *c, uint64_t start, uint64_t n);
int tag_allocations(tp_ctx *c, int tag);
int trim_locked(tp_ctx *c, int k, tp_err *e);
int reclaim_pending(tp_ctx *c, int tag, int dev);
#endif
