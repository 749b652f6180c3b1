/* The CUDA driver through dlopen: one build serves every torch and CUDA 12/13 drivers.
 *
 * Entry points come from an X-macro table (name, parameters) resolved once
 * with dlsym on libcuda.so.1 (the _v2 names where cuda.h maps a call to one).
 * Only ABI-stable calls and structs are used; the structs are declared here
 * (no cuda.h needed to build). Beside the table's VMM calls, the calls the
 * allocator's Python side makes: each device's retained primary context and
 * one non-blocking copy stream (made once, kept for the process), copies
 * enqueued on it, events recorded after them (timing disabled; destroyed by
 * their wait), pinned host memory (faulted in by the calling thread, then
 * cuMemHostRegister'ed portable), and device synchronization.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tp.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
/* The values of cuda.h's enums this file passes (the ABI fixes them). */
enum {
  CU_MEM_HANDLE_TYPE_NONE = 0,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
  CU_STREAM_NON_BLOCKING = 1,
  CU_STREAM_CAPTURE_STATUS_NONE = 0,
  CU_STREAM_CAPTURE_MODE_RELAXED = 2,
  CU_EVENT_DISABLE_TIMING = 2,
  CU_MEMHOSTREGISTER_PORTABLE = 1,
};
typedef struct {
  int type; /* CU_MEM_LOCATION_TYPE_DEVICE */
  int id;   /* the device number */
} CUmemLocation;
typedef struct {
  int type;                    /* CU_MEM_ALLOCATION_TYPE_PINNED */
  int requestedHandleTypes;    /* CU_MEM_HANDLE_TYPE_NONE */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags;                   /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
} CUmemAccessDesc;

#define TP_CU_FUNCS(X)                                                                        \
  X(cuInit, (unsigned int))                                                                   \
  X(cuDeviceGet, (int *, int))                                                                \
  X(cuDevicePrimaryCtxRetain, (CUcontext *, int))                                             \
  X(cuCtxGetCurrent, (CUcontext *))                                                           \
  X(cuCtxSetCurrent, (CUcontext))                                                             \
  X(cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, int))              \
  X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))    \
  X(cuMemAddressFree, (CUdeviceptr, size_t))                                                  \
  X(cuMemCreate, (CUmemHandle *, size_t, const CUmemAllocationProp *, unsigned long long))    \
  X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemHandle, unsigned long long))                 \
  X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                   \
  X(cuMemUnmap, (CUdeviceptr, size_t))                                                        \
  X(cuMemRelease, (CUmemHandle))                                                              \
  X(cuStreamIsCapturing, (CUstream, int *))                                                   \
  X(cuStreamSynchronize, (CUstream))                                                          \
  X(cuStreamCreate, (CUstream *, unsigned int))                                               \
  X(cuEventCreate, (CUevent *, unsigned int))                                                 \
  X(cuEventRecord, (CUevent, CUstream))                                                       \
  X(cuEventSynchronize, (CUevent))                                                            \
  X(cuEventDestroy_v2, (CUevent))                                                             \
  X(cuMemcpyDtoHAsync_v2, (void *, CUdeviceptr, size_t, CUstream))                            \
  X(cuMemcpyHtoDAsync_v2, (CUdeviceptr, const void *, size_t, CUstream))                      \
  X(cuMemcpyDtoH_v2, (void *, CUdeviceptr, size_t))                                           \
  X(cuMemcpyHtoD_v2, (CUdeviceptr, const void *, size_t))                                     \
  X(cuCtxSynchronize, (void))                                                                 \
  X(cuMemGetInfo_v2, (size_t *, size_t *))                                                    \
  X(cuMemHostRegister_v2, (void *, size_t, unsigned int))                                     \
  X(cuMemHostUnregister, (void *))                                                            \
  X(cuThreadExchangeStreamCaptureMode, (int *))                                               \
  X(cuGetErrorName, (CUresult, const char **))                                                \
  X(cuGetErrorString, (CUresult, const char **))

struct tp_cuda {
#define TP_CU_FIELD(name, params) CUresult (*name) params;
  TP_CU_FUNCS(TP_CU_FIELD)
#undef TP_CU_FIELD
  pthread_mutex_t mu;
  CUcontext primary[TP_MAX_DEVICES];
  CUstream stream[TP_MAX_DEVICES]; /* the copy stream of each device, made once */
  int first_dev;                   /* the first device whose context was retained (-1: none yet) */
  pthread_mutex_t hmu;             /* the sizes of pinned host ranges, sorted by address */
  uint64_t *hosts, *host_sizes;
  int nhost, caphost;
};

static tp_cuda g_cuda = {.mu = PTHREAD_MUTEX_INITIALIZER, .hmu = PTHREAD_MUTEX_INITIALIZER, .first_dev = -1};
static int g_cuda_ready;
static tp_driver g_cuda_table;

static int check(tp_cuda *cu, CUresult rc, const char *call, tp_err *e) {
  if (rc == TP_CUDA_SUCCESS) return 0;
  const char *name = "CUDA_ERROR_UNKNOWN", *text = "unknown error";
  if (cu->cuGetErrorName) cu->cuGetErrorName(rc, &name);
  if (cu->cuGetErrorString) cu->cuGetErrorString(rc, &text);
  tp_set_err(e, rc, call, "%s: %s", name, text);
  return -1;
}

/* Retain `dev`'s primary context (cu->mu held; read without it once set). */
static int retain_locked(tp_cuda *cu, int dev, tp_err *e) {
  int d = 0;
  CUcontext ctx = NULL;
  if (check(cu, cu->cuDeviceGet(&d, dev), "cuDeviceGet", e)) return -1;
  if (check(cu, cu->cuDevicePrimaryCtxRetain(&ctx, d), "cuDevicePrimaryCtxRetain", e)) return -1;
  __atomic_store_n(&cu->primary[dev], ctx, __ATOMIC_RELEASE);
  if (cu->first_dev < 0) __atomic_store_n(&cu->first_dev, dev, __ATOMIC_RELEASE);
  return 0;
}

static int cu_ensure(void *self, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUcontext cur = NULL;
  if (check(cu, cu->cuCtxGetCurrent(&cur), "cuCtxGetCurrent", e)) return -1;
  if (cur) return 0;
  if (dev < 0 || dev >= TP_MAX_DEVICES) {
    tp_set_err(e, TP_CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet", "device %d out of range", dev);
    return -1;
  }
  pthread_mutex_lock(&cu->mu);
  int rc = 0;
  if (!cu->primary[dev]) rc = retain_locked(cu, dev, e);
  CUcontext ctx = cu->primary[dev];
  pthread_mutex_unlock(&cu->mu);
  if (rc) return -1;
  return check(cu, cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent", e);
}

static void prop_of(int dev, CUmemAllocationProp *p) {
  memset(p, 0, sizeof *p);
  p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p->location.id = dev;
}

static int cu_granularity(void *self, int dev, uint64_t *out, tp_err *e) {
  tp_cuda *cu = self;
  CUmemAllocationProp p;
  size_t g = 0;
  if (cu_ensure(self, dev, e)) return -1;
  prop_of(dev, &p);
  if (check(cu, cu->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity", e)) return -1;
  *out = g;
  return 0;
}

static int cu_reserve(void *self, int dev, uint64_t n, uint64_t align, uint64_t *out, tp_err *e) {
  tp_cuda *cu = self;
  CUdeviceptr p = 0;
  if (tp_check_len(e, "cuMemAddressReserve", "nbytes", n, 1) || cu_ensure(self, dev, e)) return -1;
  if (check(cu, cu->cuMemAddressReserve(&p, n, align, 0, 0), "cuMemAddressReserve", e)) return -1;
  *out = p;
  return 0;
}

static int cu_unreserve(void *self, uint64_t addr, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
  if (tp_check_range(e, "cuMemAddressFree", "address", addr, n, 1)) return -1;
  return check(cu, cu->cuMemAddressFree(addr, n), "cuMemAddressFree", e);
}

static int cu_create(void *self, int dev, uint64_t n, uint64_t *handle, tp_err *e) {
  tp_cuda *cu = self;
  CUmemAllocationProp p;
  CUmemHandle h = 0;
  if (tp_check_len(e, "cuMemCreate", "nbytes", n, 1) || cu_ensure(self, dev, e)) return -1;
  prop_of(dev, &p);
  if (check(cu, cu->cuMemCreate(&h, n, &p, 0), "cuMemCreate", e)) return -1;
  *handle = h;
  return 0;
}

static int cu_map(void *self, uint64_t addr, uint64_t n, uint64_t handle, tp_err *e) {
  tp_cuda *cu = self;
  if (tp_check_range(e, "cuMemMap", "address", addr, n, 1)) return -1;
  return check(cu, cu->cuMemMap(addr, n, 0, handle, 0), "cuMemMap", e);
}

static int cu_set_access(void *self, uint64_t addr, uint64_t n, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUmemAccessDesc d = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
                       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if (tp_check_range(e, "cuMemSetAccess", "address", addr, n, 1)) return -1;
  return check(cu, cu->cuMemSetAccess(addr, n, &d, 1), "cuMemSetAccess", e);
}

static int cu_unmap(void *self, uint64_t addr, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
  if (tp_check_range(e, "cuMemUnmap", "address", addr, n, 1)) return -1;
  return check(cu, cu->cuMemUnmap(addr, n), "cuMemUnmap", e);
}

static int cu_release(void *self, uint64_t handle, tp_err *e) {
  tp_cuda *cu = self;
  return check(cu, cu->cuMemRelease(handle), "cuMemRelease", e);
}

/* A stream that captures a graph is not waited for: a synchronize would invalidate the capture (the free then
 * unmaps at once; kernels captured are not run, and torch defers the free of blocks a capture used to its end). */
static int cu_wait_stream(void *self, int dev, void *stream, tp_err *e) {
  tp_cuda *cu = self;
  int capturing = CU_STREAM_CAPTURE_STATUS_NONE;
  if (cu_ensure(self, dev, e)) return -1;
  if (check(cu, cu->cuStreamIsCapturing(stream, &capturing), "cuStreamIsCapturing", e)) return -1;
  if (capturing) return 0;
  return check(cu, cu->cuStreamSynchronize(stream), "cuStreamSynchronize", e);
}

static int cu_capturing(void *self, int dev, void *stream, int *out, tp_err *e) {
  tp_cuda *cu = self;
  *out = 0;
  if (cu_ensure(self, dev, e)) return -1;
  return check(cu, cu->cuStreamIsCapturing(stream, out), "cuStreamIsCapturing", e);
}

/* -- the calls of the Python side -------------------------------------------------------------------------- */

static int dev_ok(int dev, tp_err *e) {
  if (dev >= 0 && dev < TP_MAX_DEVICES) return 1;
  tp_set_err(e, TP_CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet", "device %d out of range", dev);
  return 0;
}

/* `dev`'s primary context, retained once for the process (whatever context is current). */
static int cu_primary(tp_cuda *cu, int dev, CUcontext *out, tp_err *e) {
  if (!dev_ok(dev, e)) return -1;
  CUcontext ctx = __atomic_load_n(&cu->primary[dev], __ATOMIC_ACQUIRE);
  int rc = 0;
  if (!ctx) {
    pthread_mutex_lock(&cu->mu);
    if (!cu->primary[dev]) rc = retain_locked(cu, dev, e);
    ctx = cu->primary[dev];
    pthread_mutex_unlock(&cu->mu);
  }
  *out = ctx;
  return rc;
}

/* `dev`'s primary context (retained) made current in this thread when no context is. */
static int cu_context(tp_cuda *cu, int dev, tp_err *e) {
  CUcontext ctx = NULL, cur = NULL;
  if (cu_primary(cu, dev, &ctx, e)) return -1;
  if (check(cu, cu->cuCtxGetCurrent(&cur), "cuCtxGetCurrent", e)) return -1;
  if (cur) return 0;
  return check(cu, cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent", e);
}

/* The device whose context pinned-memory calls use when a thread has none: the first one worked on (else 0).
 * A process driving GPU 1 (one rank of several) must not create a context on GPU 0 just to pin host memory. */
static int host_dev(tp_cuda *cu) {
  int d = __atomic_load_n(&cu->first_dev, __ATOMIC_ACQUIRE);
  return d < 0 ? 0 : d;
}

/* `dev`'s primary context current (whatever was); *prev the one that was, for cu_restore. */
static int cu_use(tp_cuda *cu, int dev, CUcontext *prev, tp_err *e) {
  CUcontext ctx = NULL, cur = NULL;
  if (cu_primary(cu, dev, &ctx, e)) return -1;
  if (check(cu, cu->cuCtxGetCurrent(&cur), "cuCtxGetCurrent", e)) return -1;
  if (cur != ctx && check(cu, cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent", e)) return -1;
  *prev = cur;
  return 0;
}

/* Make `prev` (from cu_use) current again; none was: the primary context stays. `rc` the call's outcome, kept. */
static int cu_restore(tp_cuda *cu, CUcontext prev, int rc, tp_err *e) {
  tp_err spare;
  if (prev && check(cu, cu->cuCtxSetCurrent(prev), "cuCtxSetCurrent", rc ? &spare : e)) return -1;
  return rc;
}

/* The copy stream of `dev`: non-blocking, made once (with the device's primary context current when none is)
 * and kept for the process. Made while awake (prepare_device): a stream holds a little device memory. */
static int cu_stream(tp_cuda *cu, int dev, CUstream *out, tp_err *e) {
  if (!dev_ok(dev, e)) return -1;
  CUstream s = __atomic_load_n(&cu->stream[dev], __ATOMIC_ACQUIRE);
  if (!s) {
    if (cu_context(cu, dev, e)) return -1;
    int rc = 0;
    pthread_mutex_lock(&cu->mu);
    s = cu->stream[dev];
    if (!s) {
      rc = check(cu, cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate", e);
      if (!rc) __atomic_store_n(&cu->stream[dev], s, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&cu->mu);
    if (rc) return -1;
  }
  *out = s;
  return 0;
}

static int cu_prepare_device(void *self, int dev, tp_err *e) {
  CUstream s;
  return cu_stream(self, dev, &s, e);
}

/* A helper thread (pinning, staging): a context, and relaxed capture mode, so that a pin here never breaks a graph
 * capture in another thread. The previous mode is not kept: the thread is torpor's. */
static int cu_prepare_thread(void *self, tp_err *e) {
  tp_cuda *cu = self;
  int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  if (cu_context(cu, host_dev(cu), e)) return -1;
  return check(cu, cu->cuThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode", e);
}

static int cu_copy_d2h(void *self, uint64_t host, uint64_t addr, uint64_t n, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUstream s;
  if (tp_check_range(e, "copy_d2h", "host", host, n, 0) || tp_check_range(e, "copy_d2h", "address", addr, n, 0)) return -1;
  if (cu_stream(cu, dev, &s, e)) return -1;
  return check(cu, cu->cuMemcpyDtoHAsync_v2((void *)(uintptr_t)host, addr, n, s), "cuMemcpyDtoHAsync", e);
}

static int cu_copy_h2d(void *self, uint64_t addr, uint64_t host, uint64_t n, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUstream s;
  if (tp_check_range(e, "copy_h2d", "host", host, n, 0) || tp_check_range(e, "copy_h2d", "address", addr, n, 0)) return -1;
  if (cu_stream(cu, dev, &s, e)) return -1;
  return check(cu, cu->cuMemcpyHtoDAsync_v2(addr, (const void *)(uintptr_t)host, n, s), "cuMemcpyHtoDAsync", e);
}

/* An event after the copies enqueued so far on `dev`'s copy stream (timing disabled); cu_wait_event destroys it. */
static int cu_record(void *self, int dev, uint64_t *event, tp_err *e) {
  tp_cuda *cu = self;
  CUevent ev = NULL;
  CUstream s;
  if (check(cu, cu->cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate", e)) return -1;
  if (cu_stream(cu, dev, &s, e) || check(cu, cu->cuEventRecord(ev, s), "cuEventRecord", e)) {
    cu->cuEventDestroy_v2(ev);
    return -1;
  }
  *event = (uint64_t)(uintptr_t)ev;
  return 0;
}

/* Block until the event completed; a copy before it that failed fails here. The event is destroyed either way. */
static int cu_wait_event(void *self, uint64_t event, tp_err *e) {
  tp_cuda *cu = self;
  CUevent ev = (CUevent)(uintptr_t)event;
  int rc = check(cu, cu->cuEventSynchronize(ev), "cuEventSynchronize", e);
  cu->cuEventDestroy_v2(ev);
  return rc;
}

static int cu_synchronize(void *self, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUcontext prev = NULL;
  if (cu_use(cu, dev, &prev, e)) return -1;
  return cu_restore(cu, prev, check(cu, cu->cuCtxSynchronize(), "cuCtxSynchronize", e), e);
}

static int cu_mem_info(void *self, int dev, int64_t *free_bytes, int64_t *total, tp_err *e) {
  tp_cuda *cu = self;
  CUcontext prev = NULL;
  size_t f = 0, t = 0;
  if (cu_use(cu, dev, &prev, e)) return -1;
  int rc = cu_restore(cu, prev, check(cu, cu->cuMemGetInfo_v2(&f, &t), "cuMemGetInfo", e), e);
  *free_bytes = (int64_t)f;
  *total = (int64_t)t;
  return rc;
}

/* The sizes of pinned host ranges by start (host_free unmaps that many bytes). */
static int host_index(tp_cuda *cu, uint64_t host) { /* first index with hosts[i] >= host (cu->hmu held) */
  int lo = 0, hi = cu->nhost;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (cu->hosts[mid] < host) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static int host_note(tp_cuda *cu, uint64_t host, uint64_t n) {
  pthread_mutex_lock(&cu->hmu);
  int i = host_index(cu, host), rc = 0;
  if (i < cu->nhost && cu->hosts[i] == host) {
    cu->host_sizes[i] = n;
  } else {
    if (cu->nhost == cu->caphost) {
      int cap = cu->caphost ? cu->caphost * 2 : 64;
      uint64_t *a = realloc(cu->hosts, (size_t)cap * sizeof *a);
      if (a) cu->hosts = a;
      uint64_t *b = a ? realloc(cu->host_sizes, (size_t)cap * sizeof *b) : NULL;
      if (b) {
        cu->host_sizes = b;
        cu->caphost = cap;
      }
    }
    if (cu->nhost < cu->caphost) {
      memmove(&cu->hosts[i + 1], &cu->hosts[i], (size_t)(cu->nhost - i) * sizeof *cu->hosts);
      memmove(&cu->host_sizes[i + 1], &cu->host_sizes[i], (size_t)(cu->nhost - i) * sizeof *cu->host_sizes);
      cu->hosts[i] = host;
      cu->host_sizes[i] = n;
      cu->nhost++;
    } else {
      rc = -1;
    }
  }
  pthread_mutex_unlock(&cu->hmu);
  return rc;
}

/* The size pinned at `host` into *n, and forgotten when `drop`; 0 when none is. */
static int host_size(tp_cuda *cu, uint64_t host, uint64_t *n, int drop) {
  pthread_mutex_lock(&cu->hmu);
  int i = host_index(cu, host), found = i < cu->nhost && cu->hosts[i] == host;
  if (found) {
    *n = cu->host_sizes[i];
    if (drop) {
      memmove(&cu->hosts[i], &cu->hosts[i + 1], (size_t)(cu->nhost - i - 1) * sizeof *cu->hosts);
      memmove(&cu->host_sizes[i], &cu->host_sizes[i + 1], (size_t)(cu->nhost - i - 1) * sizeof *cu->host_sizes);
      cu->nhost--;
    }
  }
  pthread_mutex_unlock(&cu->hmu);
  return found;
}

static int cu_host_reserve(void *self, uint64_t n, uint64_t *out, tp_err *e) {
  (void)self;
  return tp_host_pages_reserve(n, out, e);
}

/* Register pages as they are (never populated here: on old kernels that writes zeros over data they hold). */
static int cu_host_register(void *self, uint64_t host, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
  if (!host) {
    tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, "cuMemHostRegister", "host 0 refused: a register names the reserved range that holds the data");
    return -1;
  }
  if (tp_check_range(e, "cuMemHostRegister", "host", host, n, 1) || cu_context(cu, host_dev(cu), e)) return -1;
  void *p = (void *)(uintptr_t)host;
  if (check(cu, cu->cuMemHostRegister_v2(p, tp_round_pages(n), CU_MEMHOSTREGISTER_PORTABLE),
            "cuMemHostRegister", e))
    return -1;
  if (host_note(cu, host, n)) {
    cu->cuMemHostUnregister(p);
    tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "cuMemHostRegister", "no host memory left to note %llu pinned bytes at %#llx",
               (unsigned long long)n, (unsigned long long)host);
    return -1;
  }
  return 0;
}

/* Pinned host memory: faulted in by this thread (huge pages where allowed), then registered with the driver. Not
 * cuMemHostAlloc: it holds the driver's lock while the pages are made, which stalled every CUDA call of the engine
 * for the whole pinning time on the H200 (benchmarks/probes/probe_pinning.py); pages faulted in first (by several
 * threads at once in a sleep) are registered quickly, holding the lock briefly per chunk. A failure pins nothing:
 * fresh pages are unmapped, a reserved range given stays reserved (its owner gives it back). */
static int cu_host_alloc(void *self, uint64_t n, uint64_t host, int write, uint64_t *out, tp_err *e) {
  tp_cuda *cu = self;
  uint64_t address = host;
  if (host ? tp_check_range(e, "host_alloc", "host", host, n, 1) : tp_check_len(e, "host_alloc", "nbytes", n, 1)) return -1;
  if (!address && tp_host_pages_reserve(n, &address, e)) return -1;
  if (cu_context(cu, host_dev(cu), e) || tp_host_pages_fault(address, n, write, NULL, e) ||
      cu_host_register(self, address, n, e)) {
    tp_err spare;
    if (!host) tp_host_pages_free(address, n, &spare);
    return -1;
  }
  *out = address;
  return 0;
}

static int cu_host_free(void *self, uint64_t host, tp_err *e) {
  tp_cuda *cu = self;
  uint64_t n = 0;
  if (cu_context(cu, host_dev(cu), e)) return -1;
  if (!host_size(cu, host, &n, 0)) {
    tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, "host_free", "no pinned host memory at %#llx", (unsigned long long)host);
    return -1;
  }
  if (check(cu, cu->cuMemHostUnregister((void *)(uintptr_t)host), "cuMemHostUnregister", e)) return -1;
  host_size(cu, host, &n, 1);
  return tp_host_pages_free(host, n, e);
}

static int cu_host_unreserve(void *self, uint64_t host, uint64_t n, tp_err *e) {
  (void)self;
  return tp_host_pages_free(host, n, e);
}

static int cu_host_copy(void *self, uint64_t dst, uint64_t src, uint64_t n, tp_err *e) {
  (void)self;
  if (tp_check_range(e, "host_copy", "dst", dst, n, 0) || tp_check_range(e, "host_copy", "src", src, n, 0)) return -1;
  memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return 0;
}

/* Synchronous copies for tests and demos (the slow path), in the calling thread's context. */
static int cu_read(void *self, uint64_t addr, void *buf, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
  if (tp_check_range(e, "cuMemcpyDtoH", "address", addr, n, 0) || tp_check_range(e, "cuMemcpyDtoH", "buffer", (uint64_t)(uintptr_t)buf, n, 0))
    return -1;
  return check(cu, cu->cuMemcpyDtoH_v2(buf, addr, n), "cuMemcpyDtoH", e);
}

static int cu_write(void *self, uint64_t addr, const void *buf, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
  if (tp_check_range(e, "cuMemcpyHtoD", "address", addr, n, 0) || tp_check_range(e, "cuMemcpyHtoD", "buffer", (uint64_t)(uintptr_t)buf, n, 0))
    return -1;
  return check(cu, cu->cuMemcpyHtoD_v2(addr, buf, n), "cuMemcpyHtoD", e);
}

static void cu_host_calls(tp_driver *out) {
  out->prepare_device = cu_prepare_device;
  out->prepare_thread = cu_prepare_thread;
  out->host_reserve = cu_host_reserve;
  out->host_alloc = cu_host_alloc;
  out->host_register = cu_host_register;
  out->host_free = cu_host_free;
  out->host_unreserve = cu_host_unreserve;
  out->host_copy = cu_host_copy;
  out->copy_d2h = cu_copy_d2h;
  out->copy_h2d = cu_copy_h2d;
  out->record = cu_record;
  out->wait_event = cu_wait_event;
  out->synchronize = cu_synchronize;
  out->mem_info = cu_mem_info;
  out->read = cu_read;
  out->write = cu_write;
}

int tp_cuda_driver(tp_driver *out, tp_err *e) {
  tp_cuda *cu = &g_cuda;
  pthread_mutex_lock(&cu->mu);
  if (!g_cuda_ready) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char *why = dlerror();
      tp_set_err(e, TP_CUDA_ERROR_NO_DEVICE, "dlopen", "cannot open libcuda.so.1 (the CUDA driver): %s", why ? why : "not found");
      pthread_mutex_unlock(&cu->mu);
      return -1;
    }
#define TP_CU_LOAD(name, params)                                                   \
  *(void **)(&cu->name) = dlsym(lib, #name);                                       \
  if (!cu->name) {                                                                 \
    tp_set_err(e, TP_CUDA_ERROR_NO_DEVICE, "dlsym", "the CUDA driver has no entry point %s", #name);   \
    pthread_mutex_unlock(&cu->mu);                                                 \
    return -1;                                                                     \
  }
    TP_CU_FUNCS(TP_CU_LOAD)
#undef TP_CU_LOAD
    if (check(cu, cu->cuInit(0), "cuInit", e)) {
      pthread_mutex_unlock(&cu->mu);
      return -1;
    }
    g_cuda_ready = 1;
  }
  pthread_mutex_unlock(&cu->mu);
  out->self = cu;
  out->granularity = cu_granularity;
  out->reserve = cu_reserve;
  out->unreserve = cu_unreserve;
  out->create = cu_create;
  out->map = cu_map;
  out->set_access = cu_set_access;
  out->unmap = cu_unmap;
  out->release = cu_release;
  out->ensure_context = cu_ensure;
  out->wait_stream = cu_wait_stream;
  out->capturing = cu_capturing;
  cu_host_calls(out);
  return 0;
}

tp_driver *tp_cuda_table(tp_err *e) {
  if (__atomic_load_n(&g_cuda_table.self, __ATOMIC_ACQUIRE)) return &g_cuda_table;
  tp_driver d;
  memset(&d, 0, sizeof d);
  if (tp_cuda_driver(&d, e)) return NULL;
  pthread_mutex_lock(&g_cuda.mu);
  if (!g_cuda_table.self) {
    void *self = d.self;
    d.self = NULL;
    g_cuda_table = d;
    __atomic_store_n(&g_cuda_table.self, self, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&g_cuda.mu);
  return &g_cuda_table;
}
