/* The allocation table's types and internal helpers, shared by table.c and sleep.c (not exported). */
#ifndef TORPOR_TABLE_H
#define TORPOR_TABLE_H
#include "tp.h"

typedef struct {
  uint64_t addr, size, requested;
  int tag, dev;
  int trimmed; /* torch still holds the segment, free and never to be used again: its memory went back */
  int pending; /* torch holds it free in an idle pool; its trim waits for `stream` (tp_pend; trim.c) */
  int reclaimed; /* trimmed by an allocation under pressure while pending; the next tp_trim/tp_unpend reports it */
  uint64_t pgen; /* which tp_pend: a segment pended again is another wait */
  void *stream;
} tp_alloc;
typedef struct {
  uint64_t start, size, handle, spare, gran;
  int tag, dev, users, slab, mapped;
} tp_map;
typedef struct {
  uint64_t start, size;
} tp_range;
typedef struct {
  int dev, tag, slabs_made;
  tp_range *res, *free;
  int nres, capres, nfree, capfree;
} tp_arena;

struct tp_ctx {
  pthread_mutex_t mu;
  tp_driver drv;
  int closed;
  uint64_t slab_max, va_block;
  uint64_t gran[TP_MAX_DEVICES];
  tp_alloc *a;
  int na, capa;
  tp_map *m;
  int nm, capm;
  tp_arena *ar;
  int nar, capar;
  char tags[TP_MAX_TAGS][64];
  int state[TP_MAX_TAGS];
  int ntags;
  tp_err ring[TP_RING];
  int nring;
  uint64_t pgen;
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
