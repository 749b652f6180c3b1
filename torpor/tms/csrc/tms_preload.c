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
 * With TMS_INIT_ENABLE=1 the first cudaMalloc, before any Python code ran, opens torpor's native table
 * itself (libtorpor_alloc.so beside this library, or $TORPOR_NATIVE_LIB) and serves everything from
 * the process start into the tag "default"; torpor.tms adopts that table when it starts (tmsp_ctx).
 *
 * It also exports torch_memory_saver's C entry points (tms_pause, tms_resume, tms_get_cpu_backup_pointer,
 * the tms_set_ and tms_get_ configuration pairs, set_memory_margin_bytes). The configuration lives here,
 * per thread as in TMS (initial values from the TMS_* environment); pause, resume and the backup pointer
 * call back into torpor.tms (tmsp_register: ctypes callbacks), so each stays a logged torpor sleep or wake.
 *
 * Plain C: no Python, no GIL, no CUDA headers or link-time dependency. cudaMalloc and cudaFree never
 * call back into Python; only tms_pause, tms_resume and tms_get_cpu_backup_pointer do.
 * Lock order: g_mu -> tp_ctx.mu (inside tp_alloc_raw) -> the driver's own locks; cudaFree calls the table
 * (tp_free_synchronized, which waits for the device) after it let go of g_mu.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>
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
typedef int (*mem_info_fn)(size_t *free, size_t *total);
typedef void *(*tp_open_fn)(void *err);
typedef void (*tp_configure_fn)(void *ctx, uint64_t slab, uint64_t va_block);
typedef int (*tp_tag_id_fn)(void *ctx, const char *name);
typedef int (*tmsp_command_fn)(int op, const char *tag); /* op 0: pause, 1: resume; 0 when done */
typedef uint64_t (*tmsp_pointer_fn)(uint64_t addr, uint64_t size);

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_ctx;
static tp_alloc_fn g_alloc;
static tp_free_fn g_free;
static uint64_t *g_addrs; /* sorted: what this library handed out from the table */
static int g_n, g_cap;
static int g_default_tag = TMSP_INHERIT; /* atomic; >= 0 with TMS_INIT_ENABLE=1 */
static uint64_t g_tagged_calls;
static __thread int t_tag = TMSP_INHERIT;
static int g_early; /* 1: this library opened the table itself (TMS_INIT_ENABLE=1 before torpor.tms started) */
static uint64_t g_margin; /* atomic: set_memory_margin_bytes */
static tmsp_command_fn g_command; /* atomic: torpor.tms's pause/resume */
static tmsp_pointer_fn g_pointer; /* atomic: torpor.tms's backup lookup */

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

static bool env_true(const char *name) {
  const char *v = getenv(name);
  return v && (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "TRUE") || !strcmp(v, "yes") || !strcmp(v, "YES"));
}

/* TMS's margin: refuse an allocation that would leave less than the margin free on the device. */
static int margin_refuses(size_t n, int dev) {
  uint64_t margin = __atomic_load_n(&g_margin, __ATOMIC_ACQUIRE);
  if (!margin) return 0;
  static mem_info_fn info;
  if (!info) info = (mem_info_fn)dlsym(RTLD_DEFAULT, "cudaMemGetInfo");
  size_t free_b = 0, total = 0;
  if (!info || info(&free_b, &total) != 0) return 0;
  if (margin + n <= free_b) return 0;
  fprintf(stderr, "[torpor.tms] cudaMalloc refused: memory_margin_bytes=%llu allocation_size=%zu free_bytes=%zu device=%d\n",
          (unsigned long long)margin, n, free_b, dev);
  return 1;
}

/* TMS_INIT_ENABLE=1 and no table yet: open torpor's native table here, everything allocated goes to "default". */
static void open_early_once(void);

static void open_early(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, open_early_once);
}

static void open_early_once(void) {
  if (!env_true("TMS_INIT_ENABLE")) return;
  char path[4096];
  const char *override = getenv("TORPOR_NATIVE_LIB");
  if (override && *override) {
    snprintf(path, sizeof path, "%s", override);
  } else {
    Dl_info info;
    if (!dladdr((void *)&open_early, &info) || !info.dli_fname) return;
    snprintf(path, sizeof path, "%s", info.dli_fname);
    char *slash = strrchr(path, '/');
    if (!slash) return;
    snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "../allocator/native/libtorpor_alloc.so");
  }
  void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    fprintf(stderr, "[torpor.tms] TMS_INIT_ENABLE=1: cannot open %s (%s); allocations before torpor.tms starts are not pausable\n", path, dlerror());
    return;
  }
  tp_open_fn open = (tp_open_fn)dlsym(h, "tp_open_cuda");
  tp_configure_fn configure = (tp_configure_fn)dlsym(h, "tp_configure");
  tp_tag_id_fn tag_id = (tp_tag_id_fn)dlsym(h, "tp_tag_id");
  tp_alloc_fn alloc = (tp_alloc_fn)dlsym(h, "tp_alloc_raw");
  tp_free_fn free_fn = (tp_free_fn)dlsym(h, "tp_free_synchronized"); /* cudaFree waits for the device */
  if (!open || !configure || !tag_id || !alloc || !free_fn) return;
  unsigned char err[512];
  void *ctx = open(err);
  if (!ctx) {
    fprintf(stderr, "[torpor.tms] TMS_INIT_ENABLE=1: torpor's native table would not open (%s)\n", (const char *)err + 12 + 16 + 32);
    return;
  }
  configure(ctx, 64ull << 20, 0);
  int tag = tag_id(ctx, "default");
  pthread_mutex_lock(&g_mu);
  if (!g_ctx && tag >= 0) {
    g_ctx = ctx;
    g_alloc = alloc;
    g_free = free_fn;
    g_early = 1;
    __atomic_store_n(&g_default_tag, tag, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&g_mu);
}

TMSP_EXPORT int cudaMalloc(void **ptr, size_t n) {
  if (t_tag == TMSP_INHERIT && !__atomic_load_n(&g_ctx, __ATOMIC_ACQUIRE)) open_early();
  int tag = t_tag == TMSP_INHERIT ? __atomic_load_n(&g_default_tag, __ATOMIC_ACQUIRE) : t_tag;
  if (tag < 0 || n == 0 || !ptr) return call_real_malloc(ptr, n);
  int dev = current_device();
  unsigned char err[512]; /* a tp_err, opaque here */
  uint64_t out = 0;
  if (margin_refuses(n, dev)) {
    *ptr = NULL;
    return CUDA_ERROR_MEMORY_ALLOCATION;
  }
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

/* Torpor's memory goes back to the table, which synchronizes the device first as cudaFree does
 * (tp_free_synchronized): outside g_mu, so other threads' cudaMalloc and cudaFree do not wait on the device. The
 * address leaves this library's list first, so it is not "mine" twice while the table frees it. */
TMSP_EXPORT int cudaFree(void *ptr) {
  if (!ptr) return call_real_free(ptr);
  unsigned char err[512];
  pthread_mutex_lock(&g_mu);
  void *ctx = g_ctx;
  tp_free_fn free_fn = g_free;
  int mine = ctx && take((uint64_t)(uintptr_t)ptr);
  pthread_mutex_unlock(&g_mu);
  if (!mine) return call_real_free(ptr);
  return free_fn(ctx, (uint64_t)(uintptr_t)ptr, err) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* -- torpor.tms's side (ctypes) --------------------------------------------------------------- */

/* Serve tagged cudaMalloc from `ctx` through libtorpor_alloc's tp_alloc_raw/tp_free_synchronized. */
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

/* The table this library opened itself before torpor.tms started (TMS_INIT_ENABLE=1), else NULL. */
TMSP_EXPORT void *tmsp_ctx(void) {
  pthread_mutex_lock(&g_mu);
  void *ctx = g_early ? g_ctx : NULL;
  pthread_mutex_unlock(&g_mu);
  return ctx;
}

/* torpor.tms's callbacks for tms_pause/tms_resume and tms_get_cpu_backup_pointer (NULL: none). */
TMSP_EXPORT void tmsp_register(void *command, void *pointer) {
  __atomic_store_n(&g_command, (tmsp_command_fn)command, __ATOMIC_RELEASE);
  __atomic_store_n(&g_pointer, (tmsp_pointer_fn)pointer, __ATOMIC_RELEASE);
}

/* -- torch_memory_saver's C API --------------------------------------------------------------- */

#define TMSP_UNSET (-1)
#define TMSP_TAG_BYTES 256
#define TMSP_DIR_BYTES 4096

static __thread char t_current_tag[TMSP_TAG_BYTES] = "default";
static __thread int t_interesting = TMSP_UNSET, t_cpu_backup = TMSP_UNSET, t_disk_backup = TMSP_UNSET;
static __thread int t_backend = TMSP_UNSET; /* 0 pinned, 1 mmap */
static int g_retain = TMSP_UNSET;             /* atomic */
static pthread_mutex_t g_dir_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_dir[TMSP_DIR_BYTES];

static int lazy_bool(int *slot, const char *env) {
  if (*slot == TMSP_UNSET) *slot = env_true(env);
  return *slot;
}

static int backend_of(const char *name) { return name && !strcmp(name, "mmap") ? 1 : 0; }

TMSP_EXPORT void tms_set_interesting_region(bool value) { t_interesting = value; }
TMSP_EXPORT bool tms_get_interesting_region(void) { return lazy_bool(&t_interesting, "TMS_INIT_ENABLE"); }

TMSP_EXPORT void tms_set_current_tag(const char *tag) {
  if (tag) snprintf(t_current_tag, sizeof t_current_tag, "%s", tag);
}
TMSP_EXPORT const char *tms_get_current_tag(void) { return t_current_tag; }

TMSP_EXPORT void tms_set_enable_cpu_backup(bool value) { t_cpu_backup = value; }
TMSP_EXPORT bool tms_get_enable_cpu_backup(void) { return lazy_bool(&t_cpu_backup, "TMS_INIT_ENABLE_CPU_BACKUP"); }

TMSP_EXPORT void tms_set_cpu_backup_backend(const char *backend) { t_backend = backend_of(backend); }
TMSP_EXPORT const char *tms_get_cpu_backup_backend(void) {
  if (t_backend == TMSP_UNSET) t_backend = backend_of(getenv("TMS_INIT_CPU_BACKUP_BACKEND"));
  return t_backend ? "mmap" : "pinned";
}

TMSP_EXPORT void tms_set_enable_disk_backup(bool value) { t_disk_backup = value; }
TMSP_EXPORT bool tms_get_enable_disk_backup(void) { return lazy_bool(&t_disk_backup, "TMS_INIT_ENABLE_DISK_BACKUP"); }

TMSP_EXPORT void tms_set_retain_cpu_backup(bool value) { __atomic_store_n(&g_retain, (int)value, __ATOMIC_RELEASE); }
TMSP_EXPORT bool tms_get_retain_cpu_backup(void) {
  int v = __atomic_load_n(&g_retain, __ATOMIC_ACQUIRE);
  if (v == TMSP_UNSET) {
    v = env_true("TMS_RETAIN_CPU_BACKUP");
    __atomic_store_n(&g_retain, v, __ATOMIC_RELEASE);
  }
  return v;
}

TMSP_EXPORT void tms_set_disk_backup_dir(const char *dir) {
  if (!dir) return;
  pthread_mutex_lock(&g_dir_mu);
  snprintf(g_dir, sizeof g_dir, "%s", dir);
  pthread_mutex_unlock(&g_dir_mu);
}

/* torpor's addition: the disk backup directory (TMS_DISK_BACKUP_DIR, default /tmp, until set) into buf. */
TMSP_EXPORT int tmsp_get_disk_backup_dir(char *buf, int n) {
  pthread_mutex_lock(&g_dir_mu);
  if (!g_dir[0]) {
    const char *env = getenv("TMS_DISK_BACKUP_DIR");
    snprintf(g_dir, sizeof g_dir, "%s", env && *env ? env : "/tmp");
  }
  int len = snprintf(buf, (size_t)n, "%s", g_dir);
  pthread_mutex_unlock(&g_dir_mu);
  return len;
}

TMSP_EXPORT void set_memory_margin_bytes(uint64_t value) { __atomic_store_n(&g_margin, value, __ATOMIC_RELEASE); }
TMSP_EXPORT uint64_t tmsp_get_memory_margin_bytes(void) { return __atomic_load_n(&g_margin, __ATOMIC_ACQUIRE); }

static int command(int op, const char *tag) {
  tmsp_command_fn fn = __atomic_load_n(&g_command, __ATOMIC_ACQUIRE);
  if (!fn) {
    fprintf(stderr, "[torpor.tms] %s: torpor.tms is not imported in this process (import torch_memory_saver first)\n",
            op ? "tms_resume" : "tms_pause");
    return 1;
  }
  return fn(op, tag);
}

TMSP_EXPORT int tms_pause(const char *tag) { return command(0, tag); }
TMSP_EXPORT int tms_resume(const char *tag) { return command(1, tag); }

TMSP_EXPORT uint8_t *tms_get_cpu_backup_pointer(const uint8_t *gpu_ptr, uint64_t size) {
  tmsp_pointer_fn fn = __atomic_load_n(&g_pointer, __ATOMIC_ACQUIRE);
  return fn ? (uint8_t *)(uintptr_t)fn((uint64_t)(uintptr_t)gpu_ptr, size) : NULL;
}
