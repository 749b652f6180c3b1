/* The simulated device's host side: pinned host memory with a capacity, copies, events, mem info.
 *
 * Host memory is plain memory at simulated addresses (0x2000_0000_0000 up): never reused unless reuse_host asks
 * for what mmap does (a piece of a reservation given back is unmapped at once and the next reservation that fits
 * takes its address, lowest first). A copy checks both ranges, as CUDA would fail it: the host side inside one
 * pinned buffer (a copy may not span two; host to device also from a reservation, CUDA copies from pageable
 * memory too), the device side mapped and accessible; then it is a memmove, done when the call returns (a wait
 * has nothing left to wait for). These calls neither log nor fail themselves: the Python view does both first
 * (tp_sim_hit in driver_sim.c). Host state is under s->hmu, never held together with s->mu.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "sim.h"

#define HOST_END 0x300000000000ull
#define HOST_GAP (2ull << 20) /* between fresh buffers: a copy past the end fails */
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000 /* never over a live mapping */
#endif

static int span_find(const sim_span *a, int n, uint64_t start) {
  for (int i = 0; i < n; i++)
    if (a[i].start == start) return i;
  return -1;
}

static int span_add(sim_span **a, int *n, int *cap, sim_span v) {
  sim_span *p = sim_grow(*a, cap, *n + 1, sizeof **a);
  if (!p) return -1;
  *a = p;
  p[(*n)++] = v;
  return 0;
}

static void span_drop(sim_span *a, int *n, int i) {
  memmove(&a[i], &a[i + 1], (size_t)(*n - i - 1) * sizeof *a);
  (*n)--;
}

/* Host memory at a fresh address (hmu held): addresses are never reused, so tests are stable. */
static int new_buffer(tp_sim *s, uint64_t n, uint64_t *out, tp_err *e) {
  for (;;) {
    uint64_t address = s->host_next;
    s->host_next += tp_round_pages(n + HOST_GAP);
    void *want = (void *)(uintptr_t)address;
    void *got = mmap(want, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (got == want) {
      if (span_add(&s->buf, &s->nbuf, &s->capbuf, (sim_span){address, n, n})) {
        munmap(got, n);
        tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "host_alloc", "out of host memory for the simulator's records");
        return -1;
      }
      *out = address;
      return 0;
    }
    if (got != MAP_FAILED) munmap(got, n); /* an old kernel took the address as a hint only */
    if (s->host_next > HOST_END) {
      tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "host_alloc", "the simulated host address space is used up (%llu bytes wanted)",
                 (unsigned long long)n);
      return -1;
    }
  }
}

static void drop_buffer(tp_sim *s, uint64_t address) {
  int i = span_find(s->buf, s->nbuf, address);
  if (i < 0) return;
  munmap((void *)(uintptr_t)address, s->buf[i].size);
  span_drop(s->buf, &s->nbuf, i);
}

/* Map `n` bytes at the lowest given-back address where they fit (what mmap may do); 0 when none fits. */
static uint64_t reuse_hole(tp_sim *s, uint64_t n) {
  uint64_t size = tp_round_pages(n);
  for (int i = 0; i < s->nholes; i++) {
    sim_span *h = &s->holes[i];
    if (h->size < size) continue;
    void *want = (void *)(uintptr_t)h->start;
    void *got = mmap(want, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (got != want) {
      if (got != MAP_FAILED) munmap(got, size);
      continue;
    }
    uint64_t start = h->start;
    if (h->size > size) {
      h->start += size;
      h->size -= size;
    } else {
      span_drop(s->holes, &s->nholes, i);
    }
    return start;
  }
  return 0;
}

/* Whether [host, host + n) lies inside span `a` (never computes host + n: it may wrap). */
static int span_holds(const sim_span *a, uint64_t host, uint64_t n) {
  return host >= a->start && host - a->start <= a->size && n <= a->size - (host - a->start);
}

/* Whether [host, host + n) and span `a` share a byte (no sum that may wrap). */
static int spans_overlap(const sim_span *a, uint64_t host, uint64_t n) {
  return a->start >= host ? a->start - host < n : host - a->start < a->size;
}

/* The reservation holding [host, host + n), by index; -1 when none does. */
static int reservation(tp_sim *s, uint64_t host, uint64_t n) {
  for (int i = 0; i < s->nresv; i++)
    if (span_holds(&s->resv[i], host, n)) return i;
  return -1;
}

/* With reuse_host: unmap one piece of the reservation `k` now; its address may be reused. */
static void give_back_piece(tp_sim *s, int k, uint64_t host, uint64_t n) {
  uint64_t start = s->resv[k].start, end = start + s->resv[k].size, cut = tp_round_pages(n);
  span_drop(s->resv, &s->nresv, k);
  int b = span_find(s->buf, s->nbuf, start);
  if (b >= 0) span_drop(s->buf, &s->nbuf, b); /* the reservation is unmapped piece by piece from now on */
  if (host > start) span_add(&s->resv, &s->nresv, &s->capresv, (sim_span){start, host - start, host - start});
  if (end > host + cut)
    span_add(&s->resv, &s->nresv, &s->capresv, (sim_span){host + cut, end - host - cut, end - host - cut});
  munmap((void *)(uintptr_t)host, cut);
  int i = 0;
  while (i < s->nholes && s->holes[i].start < host) i++;
  sim_span *grown = sim_grow(s->holes, &s->capholes, s->nholes + 1, sizeof *s->holes);
  if (!grown) return; /* no room for the record: the hole is not reused */
  s->holes = grown;
  memmove(&s->holes[i + 1], &s->holes[i], (size_t)(s->nholes - i) * sizeof *s->holes);
  s->holes[i] = (sim_span){host, cut, cut};
  s->nholes++;
  for (int j = 0; j + 1 < s->nholes;) { /* merge adjacent holes */
    if (s->holes[j].start + s->holes[j].size == s->holes[j + 1].start) {
      s->holes[j].size += s->holes[j + 1].size;
      span_drop(s->holes, &s->nholes, j + 1);
    } else {
      j++;
    }
  }
}

static int pin_index(tp_sim *s, uint64_t host) { /* first pinned range with start > host */
  int lo = 0, hi = s->npin;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (s->pin[mid].start <= host) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static int sim_host_reserve(void *self, uint64_t n, uint64_t *out, tp_err *e) {
  tp_sim *s = self;
  if (tp_check_len(e, "host_reserve", "nbytes", n, 1)) return -1;
  pthread_mutex_lock(&s->hmu);
  uint64_t address = s->reuse_host ? reuse_hole(s, n) : 0;
  int rc = address ? 0 : new_buffer(s, n, &address, e);
  if (!rc && span_add(&s->resv, &s->nresv, &s->capresv, (sim_span){address, n, n})) {
    tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "host_reserve", "out of host memory for the simulator's records");
    rc = -1;
  }
  pthread_mutex_unlock(&s->hmu);
  if (!rc) *out = address;
  return rc;
}

/* Pin (hmu held): never writes (a pin that holds data is a register). Errors say host_alloc, as the one pin call. */
static int pin_locked(tp_sim *s, uint64_t n, uint64_t host, uint64_t *out, tp_err *e) {
  if (host) {
    if (reservation(s, host, n) < 0) {
      tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, "host_alloc", "host range %#llx+%llu is not inside a reservation", (unsigned long long)host,
                 (unsigned long long)n);
      return -1;
    }
    for (int i = 0; i < s->npin; i++)
      if (spans_overlap(&s->pin[i], host, n)) {
        tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, "host_alloc", "host range %#llx+%llu is pinned already", (unsigned long long)host,
                   (unsigned long long)n);
        return -1;
      }
  }
  if (n > s->host_capacity - s->host_used) {
    tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "host_alloc", "cannot pin %llu host bytes: %llu of %llu pinned", (unsigned long long)n,
               (unsigned long long)s->host_used, (unsigned long long)s->host_capacity);
    return -1;
  }
  sim_span *grown = sim_grow(s->pin, &s->cappin, s->npin + 1, sizeof *s->pin);
  if (!grown) {
    tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "host_alloc", "out of host memory for the simulator's records");
    return -1;
  }
  s->pin = grown;
  if (!host && new_buffer(s, n, &host, e)) return -1;
  int i = pin_index(s, host);
  memmove(&s->pin[i + 1], &s->pin[i], (size_t)(s->npin - i) * sizeof *s->pin);
  s->pin[i] = (sim_span){host, n, n};
  s->npin++;
  s->host_used += n;
  *out = host;
  return 0;
}

static int sim_host_alloc(void *self, uint64_t n, uint64_t host, int write, uint64_t *out, tp_err *e) {
  tp_sim *s = self;
  (void)write; /* simulated pages need no faulting in */
  if (host ? tp_check_range(e, "host_alloc", "host", host, n, 1) : tp_check_len(e, "host_alloc", "nbytes", n, 1)) return -1;
  pthread_mutex_lock(&s->hmu);
  int rc = pin_locked(s, n, host, out, e);
  pthread_mutex_unlock(&s->hmu);
  return rc;
}

static int sim_host_register(void *self, uint64_t host, uint64_t n, tp_err *e) {
  uint64_t out;
  if (!host) {
    tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, "host_alloc", "host 0 refused: a register names the reserved range that holds the data");
    return -1;
  }
  return sim_host_alloc(self, n, host, 0, &out, e);
}

static void unreserve_locked(tp_sim *s, uint64_t host, uint64_t n) {
  int k = reservation(s, host, n);
  if (k < 0) return; /* a fresh pinned buffer (no reservation), or given back already */
  if (s->reuse_host) {
    give_back_piece(s, k, host, n);
    return;
  }
  if (s->resv[k].left <= n) {
    uint64_t start = s->resv[k].start;
    span_drop(s->resv, &s->nresv, k);
    drop_buffer(s, start);
  } else {
    s->resv[k].left -= n;
  }
}

static int sim_host_free(void *self, uint64_t host, tp_err *e) {
  tp_sim *s = self;
  pthread_mutex_lock(&s->hmu);
  int i = pin_index(s, host) - 1;
  if (i < 0 || s->pin[i].start != host) {
    pthread_mutex_unlock(&s->hmu);
    tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, "host_free", "no pinned host buffer at %#llx", (unsigned long long)host);
    return -1;
  }
  uint64_t n = s->pin[i].size;
  span_drop(s->pin, &s->npin, i);
  s->host_used -= n;
  if (reservation(s, host, n) < 0) drop_buffer(s, host); /* a fresh buffer: its memory goes */
  else unreserve_locked(s, host, n);
  pthread_mutex_unlock(&s->hmu);
  return 0;
}

static int sim_host_unreserve(void *self, uint64_t host, uint64_t n, tp_err *e) {
  tp_sim *s = self;
  if (tp_check_range(e, "host_unreserve", "host", host, n, 0)) return -1;
  pthread_mutex_lock(&s->hmu);
  unreserve_locked(s, host, n);
  pthread_mutex_unlock(&s->hmu);
  return 0;
}

/* [host, host + n) inside one pinned buffer; `pageable`: or inside a reservation. */
static int check_host(tp_sim *s, uint64_t host, uint64_t n, const char *call, int pageable, tp_err *e) {
  if (tp_check_range(e, call, "host", host, n, 0)) return -1;
  pthread_mutex_lock(&s->hmu);
  int i = pin_index(s, host) - 1;
  int ok = i >= 0 && span_holds(&s->pin[i], host, n);
  if (!ok && pageable) ok = reservation(s, host, n) >= 0;
  pthread_mutex_unlock(&s->hmu);
  if (ok) return 0;
  tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, call, "host range %#llx+%llu is not inside %s", (unsigned long long)host, (unsigned long long)n,
             pageable ? "a host reservation" : "a pinned buffer");
  return -1;
}

static int check_device(tp_sim *s, uint64_t addr, uint64_t n, const char *call, tp_err *e) {
  if (tp_check_range(e, call, "address", addr, n, 0)) return -1;
  uint64_t pos = tp_sim_accessible(s, addr, n);
  if (pos - addr >= n) return 0;
  tp_set_err(e, TP_CUDA_ERROR_ILLEGAL_ADDRESS, call, "device range %#llx+%llu is not mapped and accessible (stops at %#llx)",
             (unsigned long long)addr, (unsigned long long)n, (unsigned long long)pos);
  return -1;
}

static int check_dev(tp_sim *s, int dev, tp_err *e) {
  if (dev >= 0 && dev < s->ndev) return 0;
  tp_set_err(e, TP_CUDA_ERROR_INVALID_DEVICE, "device", "no simulated device %d (have %d)", dev, s->ndev);
  return -1;
}

static int sim_copy_d2h(void *self, uint64_t host, uint64_t addr, uint64_t n, int dev, tp_err *e) {
  tp_sim *s = self;
  (void)dev;
  if (check_host(s, host, n, "copy_d2h", 0, e) || check_device(s, addr, n, "copy_d2h", e)) return -1;
  memmove((void *)(uintptr_t)host, (const void *)(uintptr_t)addr, n);
  return 0;
}

static int sim_copy_h2d(void *self, uint64_t addr, uint64_t host, uint64_t n, int dev, tp_err *e) {
  tp_sim *s = self;
  (void)dev;
  if (check_host(s, host, n, "copy_h2d", 1, e) || check_device(s, addr, n, "copy_h2d", e)) return -1;
  memmove((void *)(uintptr_t)addr, (const void *)(uintptr_t)host, n);
  return 0;
}

static int sim_host_copy(void *self, uint64_t dst, uint64_t src, uint64_t n, tp_err *e) {
  tp_sim *s = self;
  if (tp_check_range(e, "host_copy", "dst", dst, n, 0) || tp_check_range(e, "host_copy", "src", src, n, 0)) return -1;
  if (check_host(s, src, n, "host_copy", 0, e) || check_host(s, dst, n, "host_copy", 1, e)) return -1;
  memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return 0;
}

static int sim_record(void *self, int dev, uint64_t *event, tp_err *e) {
  tp_sim *s = self;
  if (check_dev(s, dev, e)) return -1;
  pthread_mutex_lock(&s->hmu);
  *event = s->next_event++;
  pthread_mutex_unlock(&s->hmu);
  return 0;
}

static int sim_wait_event(void *self, uint64_t event, tp_err *e) {
  (void)self, (void)event, (void)e; /* every copy was done when it returned */
  return 0;
}

static int sim_mem_info(void *self, int dev, int64_t *free_bytes, int64_t *total, tp_err *e) {
  tp_sim *s = self;
  if (check_dev(s, dev, e)) return -1;
  pthread_mutex_lock(&s->mu);
  int64_t used = (int64_t)s->used[dev];
  pthread_mutex_unlock(&s->mu);
  pthread_mutex_lock(&s->hmu);
  int64_t overhead = (int64_t)s->overhead;
  pthread_mutex_unlock(&s->hmu);
  *free_bytes = (int64_t)s->capacity - used - overhead;
  *total = (int64_t)s->capacity;
  return 0;
}

static int sim_prepare_device(void *self, int dev, tp_err *e) {
  (void)self, (void)dev, (void)e;
  return 0;
}

static int sim_prepare_thread(void *self, tp_err *e) {
  (void)self, (void)e;
  return 0;
}

static int sim_read(void *self, uint64_t addr, void *buf, uint64_t n, tp_err *e) {
  if (check_device(self, addr, n, "read", e)) return -1;
  memcpy(buf, (const void *)(uintptr_t)addr, n);
  return 0;
}

static int sim_write(void *self, uint64_t addr, const void *buf, uint64_t n, tp_err *e) {
  if (check_device(self, addr, n, "write", e)) return -1;
  memcpy((void *)(uintptr_t)addr, buf, n);
  return 0;
}

/* Host bytes pinned, and host address space reserved and not yet given back (pinned or not). */
TP_EXPORT void tp_sim_host_usage(tp_sim *s, uint64_t *pinned, uint64_t *reserved) {
  pthread_mutex_lock(&s->hmu);
  uint64_t r = 0;
  for (int i = 0; i < s->nresv; i++) r += s->resv[i].left;
  *pinned = s->host_used;
  *reserved = r;
  pthread_mutex_unlock(&s->hmu);
}

void sim_host_calls(tp_sim *s, tp_driver *out) {
  (void)s;
  out->prepare_device = sim_prepare_device;
  out->prepare_thread = sim_prepare_thread;
  out->host_reserve = sim_host_reserve;
  out->host_alloc = sim_host_alloc;
  out->host_register = sim_host_register;
  out->host_free = sim_host_free;
  out->host_unreserve = sim_host_unreserve;
  out->host_copy = sim_host_copy;
  out->copy_d2h = sim_copy_d2h;
  out->copy_h2d = sim_copy_h2d;
  out->record = sim_record;
  out->wait_event = sim_wait_event;
  out->mem_info = sim_mem_info;
  out->read = sim_read;
  out->write = sim_write;
}
