/* A simulated device on host memory, with a capacity and failures injectable at any driver call.
 *
 * Device memory is real memory at real addresses: a reservation is a
 * PROT_NONE mapping, a physical handle a memfd, cuMemMap an mmap of the memfd
 * at a fixed address, set_access an mprotect, unmap puts the PROT_NONE
 * placeholder back. So copies are plain memcpy and a handle's bytes live until
 * it is released and unmapped, as with CUDA. The same rules as the CUDA VMM
 * API where the allocator depends on them: a mapping needs a reservation and a
 * live handle and takes the handle whole, an unmap takes a whole mapping.
 * Every call (also the host and copy calls the Python side makes, through
 * tp_sim_hit) is logged and can be failed (tp_sim_fail). Host memory, copies
 * and events are in sim_host.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim.h"

static const char *call_names[TP_NCALLS] = {"granularity", "reserve", "unreserve", "create",
                                            "map",         "set_access", "unmap",   "release",
                                            [TP_WAIT] = "wait", [TP_SYNCHRONIZE] = "synchronize"};

void *sim_grow(void *p, int *cap, int need, size_t each) {
  if (need <= *cap) return p;
  int n = *cap ? *cap * 2 : 16;
  while (n < need) n *= 2;
  void *q = realloc(p, (size_t)n * each);
  if (!q) return NULL;
  *cap = n;
  return q;
}

TP_EXPORT tp_sim *tp_sim_new(int ndev, uint64_t capacity, uint64_t granularity) {
  if (ndev < 1 || ndev > TP_MAX_DEVICES || granularity == 0 || granularity % (uint64_t)sysconf(_SC_PAGESIZE))
    return NULL;
  tp_sim *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->hmu, NULL);
  s->ndev = ndev;
  s->capacity = capacity;
  s->gran = granularity;
  s->host_capacity = 4 * capacity;
  s->host_next = 0x200000000000ull; /* simulated pinned host memory lives here, at ever higher addresses */
  s->next_event = 1;
  tp_sim_driver(s, &s->table);
  return s;
}

/* The host side of the simulated device: pinned bytes it takes, device bytes in use outside any handle (a CUDA
 * context, libraries), and whether host address space given back is reused (as munmap then mmap may do). */
TP_EXPORT void tp_sim_host_config(tp_sim *s, uint64_t host_capacity, uint64_t overhead, int reuse_host) {
  pthread_mutex_lock(&s->hmu);
  s->host_capacity = host_capacity;
  s->overhead = overhead;
  s->reuse_host = reuse_host;
  pthread_mutex_unlock(&s->hmu);
}

tp_driver *tp_sim_table(tp_sim *s) { return &s->table; }

/* Teardown after the allocator closed: close the memory of every handle still open (a release failed on purpose
 * leaves its handle, as a real driver would keep the memory); the number closed. The simulator takes no handle
 * calls after this. */
TP_EXPORT int tp_sim_drop_handles(tp_sim *s) {
  pthread_mutex_lock(&s->mu);
  int n = 0;
  for (int i = 0; i < s->nh; i++) {
    sim_handle *h = &s->h[i];
    if (h->fd >= 0) {
      close(h->fd);
      h->fd = -1;
      s->used[h->dev] -= h->size;
      n++;
    }
  }
  pthread_mutex_unlock(&s->mu);
  return n;
}

/* Record call `call` and consume an armed fault: 0 run it, 1 fail it, 2 fail it as out of memory (why: `reason`).
 * Every armed fault of the call counts this invocation, also when another one fails it: fail(c, 1) and
 * fail(c, 3) armed together fail the first and the third invocation (a double-fault matrix arms both at once). */
static int hit_locked(tp_sim *s, int call, char *reason, size_t cap) {
  int out = 0;
  for (int i = 0; i < s->nfaults[call];) {
    sim_fault *f = &s->faults[call][i];
    if (f->skip > 0) {
      f->skip--;
      i++;
      continue;
    }
    if (!out) {
      out = f->oom ? 2 : 1;
      if (reason && cap) snprintf(reason, cap, "%s", f->reason);
    }
    if (--f->times <= 0) {
      memmove(f, f + 1, (size_t)(s->nfaults[call] - i - 1) * sizeof *f);
      s->nfaults[call]--;
    } else {
      i++;
    }
  }
  if (s->nlog == s->caplog) {
    size_t n = s->caplog ? s->caplog * 2 : 1024;
    unsigned char *q = realloc(s->log, n);
    if (q) {
      s->log = q;
      s->caplog = n;
    }
  }
  if (s->nlog < s->caplog) s->log[s->nlog++] = (unsigned char)(call | (out ? 0x80 : 0));
  return out;
}

TP_EXPORT int tp_sim_hit(tp_sim *s, int call, char *reason, size_t cap) {
  if (call < 0 || call >= TP_NCALLS) return 1;
  pthread_mutex_lock(&s->mu);
  int out = hit_locked(s, call, reason, cap);
  pthread_mutex_unlock(&s->mu);
  return out;
}

TP_EXPORT int tp_sim_fail(tp_sim *s, int call, int nth, int times, int oom, const char *reason) {
  if (call < 0 || call >= TP_NCALLS || nth < 1 || times < 1) return -1;
  pthread_mutex_lock(&s->mu);
  int rc = -1;
  if (s->nfaults[call] < 16) {
    sim_fault *f = &s->faults[call][s->nfaults[call]++];
    *f = (sim_fault){nth - 1, times, oom, {0}};
    snprintf(f->reason, sizeof f->reason, "%s", reason && *reason ? reason : "injected failure");
    rc = 0;
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

TP_EXPORT void tp_sim_clear_faults(tp_sim *s) {
  pthread_mutex_lock(&s->mu);
  memset(s->nfaults, 0, sizeof s->nfaults);
  pthread_mutex_unlock(&s->mu);
}

/* Copy up to `cap` log entries from `from` on (call id | 0x80 when failed); return how many there are from `from`. */
TP_EXPORT size_t tp_sim_log(tp_sim *s, size_t from, unsigned char *out, size_t cap) {
  pthread_mutex_lock(&s->mu);
  size_t n = from < s->nlog ? s->nlog - from : 0;
  if (out) memcpy(out, s->log + from, n < cap ? n : cap);
  pthread_mutex_unlock(&s->mu);
  return n;
}

TP_EXPORT uint64_t tp_sim_used(tp_sim *s, int dev) {
  if (dev < 0 || dev >= s->ndev) return 0;
  pthread_mutex_lock(&s->mu);
  uint64_t n = s->used[dev];
  pthread_mutex_unlock(&s->mu);
  return n;
}

TP_EXPORT int tp_sim_mappings(tp_sim *s, uint64_t *start, uint64_t *size, int cap) {
  pthread_mutex_lock(&s->mu);
  int n = s->nm;
  for (int i = 0; i < n && i < cap; i++) {
    start[i] = s->m[i].start;
    size[i] = s->m[i].size;
  }
  pthread_mutex_unlock(&s->mu);
  return n;
}

static int first_after(tp_sim *s, uint64_t addr) { /* index of the first mapping with start > addr */
  int lo = 0, hi = s->nm;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (s->m[mid].start <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Where [addr, addr + n) stops being mapped and accessible (addr + n when all of it is; a range past 2**64 - 1 is
 * cut there, Note [Lengths and ranges at the C boundary] in tp.h). */
static uint64_t covered_locked(tp_sim *s, uint64_t addr, uint64_t n, int need_access) {
  uint64_t pos = addr, end = n > UINT64_MAX - addr ? UINT64_MAX : addr + n;
  int i = first_after(s, addr) - 1;
  if (i < 0) i = 0;
  for (; i < s->nm && pos < end; i++) {
    sim_map *m = &s->m[i];
    if (m->start + m->size <= pos) continue;
    if (m->start > pos || (need_access && !m->accessible)) break;
    pos = m->start + m->size;
  }
  return pos < end ? pos : end;
}

TP_EXPORT uint64_t tp_sim_accessible(tp_sim *s, uint64_t addr, uint64_t n) {
  pthread_mutex_lock(&s->mu);
  uint64_t pos = covered_locked(s, addr, n, 1);
  pthread_mutex_unlock(&s->mu);
  return pos;
}

static sim_handle *handle_of(tp_sim *s, uint64_t id) {
  uint32_t slot = (uint32_t)(id & 0xffffffffu);
  if (slot == 0 || (int)slot > s->nh) return NULL;
  sim_handle *h = &s->h[slot - 1];
  if (h->gen != (uint32_t)(id >> 32) || h->fd < 0) return NULL;
  return h;
}

static void maybe_free(tp_sim *s, sim_handle *h) {
  if (h->released && h->mapped == 0 && h->fd >= 0) {
    close(h->fd);
    h->fd = -1;
    s->used[h->dev] -= h->size;
  }
}

#define SIM_ENTER(call)                                                                        \
  tp_sim *s = self;                                                                            \
  pthread_mutex_lock(&s->mu);                                                                  \
  char why[128];                                                                               \
  int injected = hit_locked(s, call, why, sizeof why);                                         \
  if (injected) {                                                                              \
    tp_set_err(e, injected == 2 ? TP_CUDA_ERROR_OUT_OF_MEMORY : TP_CUDA_ERROR_UNKNOWN, call_names[call], injected == 2 ? "%s (out of memory)" : "%s", why); \
    pthread_mutex_unlock(&s->mu);                                                              \
    return -1;                                                                                 \
  }
#define SIM_FAIL(code, ...)                                                                    \
  do {                                                                                         \
    tp_set_err(e, code, call_name, __VA_ARGS__);                                               \
    pthread_mutex_unlock(&s->mu);                                                              \
    return -1;                                                                                 \
  } while (0)
#define SIM_DONE()                                                                             \
  pthread_mutex_unlock(&s->mu);                                                                \
  return 0

static int check_dev(tp_sim *s, int dev) { return dev >= 0 && dev < s->ndev; }

static int sim_granularity(void *self, int dev, uint64_t *out, tp_err *e) {
  const char *call_name = "granularity";
  SIM_ENTER(TP_GRANULARITY);
  if (!check_dev(s, dev)) SIM_FAIL(TP_CUDA_ERROR_INVALID_DEVICE, "no simulated device %d (have %d)", dev, s->ndev);
  *out = s->gran;
  SIM_DONE();
}

static int sim_reserve(void *self, int dev, uint64_t n, uint64_t align, uint64_t *out, tp_err *e) {
  const char *call_name = "reserve";
  (void)align;
  SIM_ENTER(TP_RESERVE);
  if (!check_dev(s, dev)) SIM_FAIL(TP_CUDA_ERROR_INVALID_DEVICE, "no simulated device %d (have %d)", dev, s->ndev);
  if (n == 0 || n % s->gran || n > TP_MAX_LEN)
    SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "%llu bytes is not a positive multiple of the granularity up to 2**63 - 1", (unsigned long long)n);
  void *p = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "reserving %llu bytes of address space: %s", (unsigned long long)n, strerror(errno));
  sim_res *r = sim_grow(s->r, &s->capr, s->nr + 1, sizeof *r);
  if (!r) {
    munmap(p, n);
    SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "out of host memory");
  }
  s->r = r;
  s->r[s->nr++] = (sim_res){(uint64_t)(uintptr_t)p, n, dev};
  *out = (uint64_t)(uintptr_t)p;
  SIM_DONE();
}

static int sim_unreserve(void *self, uint64_t addr, uint64_t n, tp_err *e) {
  const char *call_name = "unreserve";
  SIM_ENTER(TP_UNRESERVE);
  if (!tp_range_ok(addr, n)) SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "range %#llx+%llu refused: it runs past 2**64 - 1", (unsigned long long)addr, (unsigned long long)n);
  for (int i = 0; i < s->nr; i++) {
    if (s->r[i].start == addr && s->r[i].size == n) {
      int j = first_after(s, addr - 1);
      if (j < s->nm && s->m[j].start < addr + n)
        SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "reservation at %#llx still has mappings", (unsigned long long)addr);
      munmap((void *)(uintptr_t)addr, n);
      s->r[i] = s->r[--s->nr];
      SIM_DONE();
    }
  }
  SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "no reservation of %llu bytes at %#llx", (unsigned long long)n, (unsigned long long)addr);
}

/* `n` bytes as a person reads them ("4.00 MiB", "512 B"), into `out` (32 bytes). */
static const char *size_text(uint64_t n, char *out) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)n;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(out, 32, "%llu B", (unsigned long long)n);
  else
    snprintf(out, 32, "%.2f %s", v, units[u]);
  return out;
}

static int sim_create(void *self, int dev, uint64_t n, uint64_t *handle, tp_err *e) {
  const char *call_name = "create";
  SIM_ENTER(TP_CREATE);
  if (!check_dev(s, dev)) SIM_FAIL(TP_CUDA_ERROR_INVALID_DEVICE, "no simulated device %d (have %d)", dev, s->ndev);
  if (n == 0 || n % s->gran || n > TP_MAX_LEN)
    SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "%llu bytes is not a positive multiple of the granularity up to 2**63 - 1", (unsigned long long)n);
  if (s->used[dev] > s->capacity || n > s->capacity - s->used[dev]) {
    char want[32], used[32], cap[32];
    SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "cannot create %s: %s of %s in use on device %d", size_text(n, want), size_text(s->used[dev], used),
             size_text(s->capacity, cap), dev);
  }
  int slot = -1;
  for (int i = 0; i < s->nh; i++)
    if (s->h[i].fd < 0) {
      slot = i;
      break;
    }
  if (slot < 0) {
    sim_handle *h = sim_grow(s->h, &s->caph, s->nh + 1, sizeof *h);
    if (!h) SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "out of host memory");
    s->h = h;
    slot = s->nh++;
    s->h[slot].gen = 0;
  }
  int fd = memfd_create("torpor-sim", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)n) != 0) {
    if (fd >= 0) close(fd);
    s->h[slot].fd = -1;
    SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "memfd for %llu bytes: %s", (unsigned long long)n, strerror(errno));
  }
  sim_handle *h = &s->h[slot];
  h->gen++;
  h->dev = dev;
  h->fd = fd;
  h->size = n;
  h->mapped = 0;
  h->released = 0;
  s->used[dev] += n;
  *handle = ((uint64_t)h->gen << 32) | (uint64_t)(slot + 1);
  SIM_DONE();
}

static int sim_map_(void *self, uint64_t addr, uint64_t n, uint64_t handle, tp_err *e) {
  const char *call_name = "map";
  SIM_ENTER(TP_MAP);
  sim_handle *h = handle_of(s, handle);
  if (!h || h->released) SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "handle %#llx is not a live handle", (unsigned long long)handle);
  if (n != h->size) SIM_FAIL(TP_CUDA_ERROR_NOT_SUPPORTED, "map of %llu bytes with a handle of %llu", (unsigned long long)n, (unsigned long long)h->size);
  if (!tp_range_ok(addr, n)) SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "range %#llx+%llu refused: it runs past 2**64 - 1", (unsigned long long)addr, (unsigned long long)n);
  int inside = 0;
  for (int i = 0; i < s->nr; i++) {
    sim_res *r = &s->r[i];
    if (r->dev == h->dev && addr >= r->start && addr - r->start <= r->size && n <= r->size - (addr - r->start)) inside = 1;
  }
  if (!inside)
    SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "%#llx+%llu is outside every reservation on device %d", (unsigned long long)addr, (unsigned long long)n, h->dev);
  int i = first_after(s, addr);
  if ((i > 0 && s->m[i - 1].start + s->m[i - 1].size > addr) || (i < s->nm && s->m[i].start < addr + n))
    SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "%#llx+%llu overlaps a mapping", (unsigned long long)addr, (unsigned long long)n);
  sim_map *m = sim_grow(s->m, &s->capm, s->nm + 1, sizeof *m);
  if (!m) SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "out of host memory");
  s->m = m;
  void *p = mmap((void *)(uintptr_t)addr, n, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0);
  if (p == MAP_FAILED) SIM_FAIL(TP_CUDA_ERROR_OUT_OF_MEMORY, "mmap of a handle: %s", strerror(errno));
  memmove(&s->m[i + 1], &s->m[i], (size_t)(s->nm - i) * sizeof *m);
  s->m[i] = (sim_map){addr, n, handle, 0};
  s->nm++;
  h->mapped++;
  SIM_DONE();
}

static int sim_set_access(void *self, uint64_t addr, uint64_t n, int dev, tp_err *e) {
  const char *call_name = "set_access";
  SIM_ENTER(TP_SET_ACCESS);
  (void)dev;
  if (!tp_range_ok(addr, n)) SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "range %#llx+%llu refused: it runs past 2**64 - 1", (unsigned long long)addr, (unsigned long long)n);
  if (covered_locked(s, addr, n, 0) - addr < n)
    SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "set_access on %#llx+%llu: not all of it is mapped", (unsigned long long)addr, (unsigned long long)n);
  for (int i = first_after(s, addr) - 1; i < s->nm; i++) {
    if (i < 0) continue;
    if (s->m[i].start >= addr + n) break;
    if (s->m[i].start + s->m[i].size > addr) s->m[i].accessible = 1;
  }
  mprotect((void *)(uintptr_t)addr, n, PROT_READ | PROT_WRITE);
  SIM_DONE();
}

static int sim_unmap(void *self, uint64_t addr, uint64_t n, tp_err *e) {
  const char *call_name = "unmap";
  SIM_ENTER(TP_UNMAP);
  if (!tp_range_ok(addr, n)) SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "range %#llx+%llu refused: it runs past 2**64 - 1", (unsigned long long)addr, (unsigned long long)n);
  int i = first_after(s, addr) - 1;
  if (i < 0 || s->m[i].start != addr || s->m[i].size != n)
    SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "no mapping of %llu bytes at %#llx", (unsigned long long)n, (unsigned long long)addr);
  sim_handle *h = handle_of(s, s->m[i].handle);
  mmap((void *)(uintptr_t)addr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  memmove(&s->m[i], &s->m[i + 1], (size_t)(s->nm - i - 1) * sizeof *s->m);
  s->nm--;
  if (h) {
    h->mapped--;
    maybe_free(s, h);
  }
  SIM_DONE();
}

static int sim_release(void *self, uint64_t handle, tp_err *e) {
  const char *call_name = "release";
  SIM_ENTER(TP_RELEASE);
  sim_handle *h = handle_of(s, handle);
  if (!h || h->released) SIM_FAIL(TP_CUDA_ERROR_INVALID_VALUE, "handle %#llx released twice or unknown", (unsigned long long)handle);
  h->released = 1;
  maybe_free(s, h);
  SIM_DONE();
}

static int sim_ensure(void *self, int dev, tp_err *e) {
  (void)self;
  (void)dev;
  (void)e;
  return 0;
}

/* A stream wait (torch's free of a segment): logged as TP_WAIT and failable; the simulated device runs nothing. */
static int sim_wait_stream(void *self, int dev, void *stream, tp_err *e) {
  (void)dev;
  (void)stream;
  SIM_ENTER(TP_WAIT);
  SIM_DONE();
}

/* A device synchronize (the Python view's, or the table's before a free, as cudaFree waits): logged and failable here,
 * for both callers alike; the simulated device runs nothing, so there is nothing to wait for. */
static int sim_synchronize_logged(void *self, int dev, tp_err *e) {
  const char *call_name = "synchronize";
  SIM_ENTER(TP_SYNCHRONIZE);
  if (!check_dev(s, dev)) SIM_FAIL(TP_CUDA_ERROR_INVALID_DEVICE, "no simulated device %d (have %d)", dev, s->ndev);
  SIM_DONE();
}

static int sim_capturing(void *self, int dev, void *stream, int *out, tp_err *e) {
  (void)self, (void)dev, (void)stream, (void)e;
  *out = 0; /* the simulated device captures no graph */
  return 0;
}

void tp_sim_driver(tp_sim *sim, tp_driver *out) {
  out->self = sim;
  out->granularity = sim_granularity;
  out->reserve = sim_reserve;
  out->unreserve = sim_unreserve;
  out->create = sim_create;
  out->map = sim_map_;
  out->set_access = sim_set_access;
  out->unmap = sim_unmap;
  out->release = sim_release;
  out->ensure_context = sim_ensure;
  out->wait_stream = sim_wait_stream;
  out->capturing = sim_capturing;
  sim_host_calls(sim, out);
  out->synchronize = sim_synchronize_logged;
}

/* The simulated VMM calls, for tests of the simulator's VMM rules (tests/simvmm.py; each returns 0, or -1 with *e
 * set). The allocator's Python side makes no VMM call: the table does. */
TP_EXPORT int tp_sim_reserve(tp_sim *s, int dev, uint64_t n, uint64_t *out, tp_err *e) { return sim_reserve(s, dev, n, 0, out, e); }
TP_EXPORT int tp_sim_unreserve(tp_sim *s, uint64_t a, uint64_t n, tp_err *e) { return sim_unreserve(s, a, n, e); }
TP_EXPORT int tp_sim_create(tp_sim *s, int dev, uint64_t n, uint64_t *h, tp_err *e) { return sim_create(s, dev, n, h, e); }
TP_EXPORT int tp_sim_map(tp_sim *s, uint64_t a, uint64_t n, uint64_t h, tp_err *e) { return sim_map_(s, a, n, h, e); }
TP_EXPORT int tp_sim_set_access(tp_sim *s, uint64_t a, uint64_t n, int dev, tp_err *e) { return sim_set_access(s, a, n, dev, e); }
TP_EXPORT int tp_sim_unmap(tp_sim *s, uint64_t a, uint64_t n, tp_err *e) { return sim_unmap(s, a, n, e); }
TP_EXPORT int tp_sim_release(tp_sim *s, uint64_t h, tp_err *e) { return sim_release(s, h, e); }
TP_EXPORT int tp_sim_granularity(tp_sim *s, int dev, uint64_t *out, tp_err *e) { return sim_granularity(s, dev, out, e); }
