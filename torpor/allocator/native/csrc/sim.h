/* The simulated device's state, shared by driver_sim.c (its VMM calls and fault injection) and sim_host.c (its
 * host memory, copies and events). Not exported. */
#ifndef TORPOR_SIM_H
#define TORPOR_SIM_H
#include "tp.h"

typedef struct {
  int dev, fd, mapped, released;
  uint32_t gen;
  uint64_t size;
} sim_handle;
typedef struct {
  uint64_t start, size, handle;
  int accessible;
} sim_map;
typedef struct {
  uint64_t start, size;
  int dev;
} sim_res;
typedef struct {
  uint64_t start, size, left;
} sim_span;
typedef struct {
  int skip, times, oom;
  char reason[128];
} sim_fault;

struct tp_sim {
  pthread_mutex_t mu;
  int ndev;
  uint64_t capacity, gran;
  uint64_t used[TP_MAX_DEVICES];
  sim_handle *h;
  int nh, caph;
  sim_map *m;
  int nm, capm;
  sim_res *r;
  int nr, capr;
  sim_fault faults[TP_NCALLS][16];
  int nfaults[TP_NCALLS];
  unsigned char *log;
  size_t nlog, caplog;
  tp_driver table; /* this device's driver table, for the Python view (tp_sim_table) */
  /* host memory (sim_host.c), under hmu (never held with mu) */
  pthread_mutex_t hmu;
  uint64_t host_capacity, host_used, overhead, host_next, next_event;
  int reuse_host;
  sim_span *buf; /* host memory mapped at a start: a reservation or a fresh pinned buffer */
  int nbuf, capbuf;
  sim_span *holes; /* given back (reuse_host), sorted, adjacent ones merged */
  int nholes, capholes;
  sim_span *resv; /* reservations: start, size, bytes not yet given back */
  int nresv, capresv;
  sim_span *pin; /* pinned ranges, sorted by start */
  int npin, cappin;
};

void *sim_grow(void *p, int *cap, int need, size_t each);
/* Where [addr, addr + n) stops being mapped and accessible (addr + n when all of it is); takes mu. */
uint64_t tp_sim_accessible(tp_sim *s, uint64_t addr, uint64_t n);
void sim_host_calls(tp_sim *s, tp_driver *out);
#endif
