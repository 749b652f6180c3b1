/* torpor's preload library for torch_memory_saver's hook_mode="preload": cudaMalloc/cudaFree onto torpor's table.
 *
 * On LD_PRELOAD (torpor.tms.configure_subprocess puts it there, as TMS puts its
 * own), this library defines cudaMalloc and cudaFree. A cudaMalloc made while
 * the calling thread is inside a region (tmsp_set_tag, set by torpor.tms from
 * Python), or, with TMS_INIT_ENABLE=1, outside any region (tmsp_set_default_tag),
 * is served by torpor's native table (tp_alloc_raw of libtorpor_alloc.so,
 * bound once by tmsp_bind), so it is tagged and pausable like every torpor
 * allocation; every other call goes to the real runtime (dlsym RTLD_NEXT).
 * cudaFree of an address this library handed out goes back to the table
 * (while its tag is paused only its address range goes); any other to the runtime.
 *
 * Plain C: no Python, no GIL, no CUDA headers or link-time dependency.
 * Lock order: g_mu -> tp_ctx.mu (inside tp_alloc_raw/tp_free_raw) -> the driver's own locks.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TMSP_EXPORT __attribute__((visibility("default")))
#define TMSP_INHERIT (-1) /* this thread follows the process default */
#define TMSP_OFF (-2)     /* this thread is in disable(): the real runtime */

enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_MEMORY_ALLOCATION = 2, CUDA_ERROR_INIT = 3 };

typedef int (*tp_alloc_fn)(void *ctx, int tag, int dev, uint64_t n, uint64_t *out, void *err);
typedef int (*tp_free_fn)(void *ctx, uint64_t addr, void *err);
typedef int (*real_malloc_fn)(void **ptr, size_t n);
typedef int (*real_free_fn)(void *ptr);
typedef int (*get_device_fn)(int *dev);

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_ctx;
static tp_alloc_fn g_alloc;
static tp_free_fn g_free;
static uint64_t *g_addrs; /* sorted: what this library handed out from the table */
static int g_n, g_cap;
static int g_default_tag = TMSP_INHERIT; /* atomic; >= 0 with TMS_INIT_ENABLE=1 */
static uint64_t g_tagged_calls;
static __thread int t_tag = TMSP_INHERIT;

static void *real(const char *name) { return dlsym(RTLD_NEXT, name); }

static int current_device(void) {
  static get_device_fn get;
  if (!get) get = (get_device_fn)dlsym(RTLD_DEFAULT, "cudaGetDevice");
  int dev = 0;
  if (get && get(&dev) != 0) dev = 0;
  return dev;
}

static int find(uint64_t a) { /* first index with g_addrs[i] >= a */
  int lo = 0, hi = g_n;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (g_addrs[mid] < a) lo = mid + 1; else hi = mid;
  }
  return lo;
}

static int insert(uint64_t a) {
  if (g_n == g_cap) {
    int cap = g_cap ? 2 * g_cap : 256;
    uint64_t *grown = realloc(g_addrs, (size_t)cap * sizeof *grown);
    if (!grown) return -1;
    g_addrs = grown;
    g_cap = cap;
  }
  int i = find(a);
  memmove(&g_addrs[i + 1], &g_addrs[i], (size_t)(g_n - i) * sizeof *g_addrs);
  g_addrs[i] = a;
  g_n++;
  return 0;
}

static int take(uint64_t a) { /* remove a; 1 when it was there */
  int i = find(a);
  if (i >= g_n || g_addrs[i] != a) return 0;
  memmove(&g_addrs[i], &g_addrs[i + 1], (size_t)(g_n - i - 1) * sizeof *g_addrs);
  g_n--;
  return 1;
}

static int call_real_malloc(void **ptr, size_t n) {
  static real_malloc_fn fn;
  if (!fn) fn = (real_malloc_fn)real("cudaMalloc");
  return fn ? fn(ptr, n) : CUDA_ERROR_INIT;
}

static int call_real_free(void *ptr) {
  static real_free_fn fn;
  if (!fn) fn = (real_free_fn)real("cudaFree");
  return fn ? fn(ptr) : CUDA_ERROR_INIT;
}

TMSP_EXPORT int cudaMalloc(void **ptr, size_t n) {
  int tag = t_tag == TMSP_INHERIT ? __atomic_load_n(&g_default_tag, __ATOMIC_ACQUIRE) : t_tag;
  if (tag < 0 || n == 0 || !ptr) return call_real_malloc(ptr, n);
  int dev = current_device();
  unsigned char err[512]; /* a tp_err, opaque here */
  uint64_t out = 0;
  pthread_mutex_lock(&g_mu);
  if (!g_ctx) {
    pthread_mutex_unlock(&g_mu);
    return call_real_malloc(ptr, n); /* torpor.tms has not started yet in this process */
  }
  int rc = g_alloc(g_ctx, tag, dev, (uint64_t)n, &out, err);
  if (rc == 0 && insert(out) != 0) {
    g_free(g_ctx, out, err);
    rc = -1;
  }
  if (rc == 0) g_tagged_calls++;
  pthread_mutex_unlock(&g_mu);
  if (rc != 0) {
    *ptr = NULL;
    return CUDA_ERROR_MEMORY_ALLOCATION;
  }
  *ptr = (void *)(uintptr_t)out;
  return CUDA_SUCCESS;
}

TMSP_EXPORT int cudaFree(void *ptr) {
  if (!ptr) return call_real_free(ptr);
  unsigned char err[512];
  pthread_mutex_lock(&g_mu);
  int mine = g_ctx && take((uint64_t)(uintptr_t)ptr);
  int rc = mine ? g_free(g_ctx, (uint64_t)(uintptr_t)ptr, err) : 0;
  pthread_mutex_unlock(&g_mu);
  if (!mine) return call_real_free(ptr);
  return rc == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* -- torpor.tms's side (ctypes) --------------------------------------------------------------- */

/* Serve tagged cudaMalloc from `ctx` through libtorpor_alloc's tp_alloc_raw/tp_free_raw. */
TMSP_EXPORT void tmsp_bind(void *ctx, void *alloc_fn, void *free_fn) {
  pthread_mutex_lock(&g_mu);
  g_ctx = ctx;
  g_alloc = (tp_alloc_fn)alloc_fn;
  g_free = (tp_free_fn)free_fn;
  pthread_mutex_unlock(&g_mu);
}

/* The calling thread's tag id (>= 0), TMSP_INHERIT (-1) or TMSP_OFF (-2); returns the previous value. */
TMSP_EXPORT int tmsp_set_tag(int tag) {
  int old = t_tag;
  t_tag = tag;
  return old;
}

TMSP_EXPORT int tmsp_get_tag(void) { return t_tag; }

/* The tag of cudaMalloc outside any region, in every thread (TMS_INIT_ENABLE=1); -1: the real runtime. */
TMSP_EXPORT void tmsp_set_default_tag(int tag) { __atomic_store_n(&g_default_tag, tag, __ATOMIC_RELEASE); }

/* Addresses handed out and not freed yet, and tagged calls served since the start. */
TMSP_EXPORT int tmsp_live(void) {
  pthread_mutex_lock(&g_mu);
  int n = g_n;
  pthread_mutex_unlock(&g_mu);
  return n;
}

TMSP_EXPORT uint64_t tmsp_served(void) {
  pthread_mutex_lock(&g_mu);
  uint64_t n = g_tagged_calls;
  pthread_mutex_unlock(&g_mu);
  return n;
}
