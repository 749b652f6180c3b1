/* The CUDA driver through dlopen: one build serves every torch and CUDA 12/13 drivers.
 *
 * Entry points come from an X-macro table (name, parameters) resolved once
 * with dlsym on libcuda.so.1. Only ABI-stable VMM calls and structs are used;
 * the structs are declared here (no cuda.h needed to build).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tp.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;
typedef void *CUcontext;
typedef void *CUstream;
typedef struct {
  int type;
  int id;
} CUmemLocation;
typedef struct {
  int type;                    /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes;    /* CU_MEM_HANDLE_TYPE_NONE = 0 */
  CUmemLocation location;      /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
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
  int flags;                   /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
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
  X(cuGetErrorName, (CUresult, const char **))                                                \
  X(cuGetErrorString, (CUresult, const char **))

struct tp_cuda {
#define TP_CU_FIELD(name, params) CUresult (*name) params;
  TP_CU_FUNCS(TP_CU_FIELD)
#undef TP_CU_FIELD
  pthread_mutex_t mu;
  CUcontext primary[TP_MAX_DEVICES];
};

static tp_cuda g_cuda = {.mu = PTHREAD_MUTEX_INITIALIZER};
static int g_cuda_ready;

static int check(tp_cuda *cu, CUresult rc, const char *call, tp_err *e) {
  if (rc == 0) return 0;
  const char *name = "CUDA_ERROR_UNKNOWN", *text = "unknown error";
  if (cu->cuGetErrorName) cu->cuGetErrorName(rc, &name);
  if (cu->cuGetErrorString) cu->cuGetErrorString(rc, &text);
  tp_set_err(e, rc, call, "%s: %s", name, text);
  return -1;
}

static int cu_ensure(void *self, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUcontext cur = NULL;
  if (check(cu, cu->cuCtxGetCurrent(&cur), "cuCtxGetCurrent", e)) return -1;
  if (cur) return 0;
  if (dev < 0 || dev >= TP_MAX_DEVICES) {
    tp_set_err(e, 101, "cuDeviceGet", "device %d out of range", dev);
    return -1;
  }
  pthread_mutex_lock(&cu->mu);
  int rc = 0;
  if (!cu->primary[dev]) {
    int d = 0;
    rc = check(cu, cu->cuDeviceGet(&d, dev), "cuDeviceGet", e);
    if (!rc) rc = check(cu, cu->cuDevicePrimaryCtxRetain(&cu->primary[dev], d), "cuDevicePrimaryCtxRetain", e);
  }
  CUcontext ctx = cu->primary[dev];
  pthread_mutex_unlock(&cu->mu);
  if (rc) return -1;
  return check(cu, cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent", e);
}

static void prop_of(int dev, CUmemAllocationProp *p) {
  memset(p, 0, sizeof *p);
  p->type = 1;
  p->location.type = 1;
  p->location.id = dev;
}

static int cu_granularity(void *self, int dev, uint64_t *out, tp_err *e) {
  tp_cuda *cu = self;
  CUmemAllocationProp p;
  size_t g = 0;
  if (cu_ensure(self, dev, e)) return -1;
  prop_of(dev, &p);
  if (check(cu, cu->cuMemGetAllocationGranularity(&g, &p, 1), "cuMemGetAllocationGranularity", e)) return -1;
  *out = g;
  return 0;
}

static int cu_reserve(void *self, int dev, uint64_t n, uint64_t align, uint64_t *out, tp_err *e) {
  tp_cuda *cu = self;
  CUdeviceptr p = 0;
  if (cu_ensure(self, dev, e)) return -1;
  if (check(cu, cu->cuMemAddressReserve(&p, n, align, 0, 0), "cuMemAddressReserve", e)) return -1;
  *out = p;
  return 0;
}

static int cu_unreserve(void *self, uint64_t addr, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
  return check(cu, cu->cuMemAddressFree(addr, n), "cuMemAddressFree", e);
}

static int cu_create(void *self, int dev, uint64_t n, uint64_t *handle, tp_err *e) {
  tp_cuda *cu = self;
  CUmemAllocationProp p;
  CUmemHandle h = 0;
  if (cu_ensure(self, dev, e)) return -1;
  prop_of(dev, &p);
  if (check(cu, cu->cuMemCreate(&h, n, &p, 0), "cuMemCreate", e)) return -1;
  *handle = h;
  return 0;
}

static int cu_map(void *self, uint64_t addr, uint64_t n, uint64_t handle, tp_err *e) {
  tp_cuda *cu = self;
  return check(cu, cu->cuMemMap(addr, n, 0, handle, 0), "cuMemMap", e);
}

static int cu_set_access(void *self, uint64_t addr, uint64_t n, int dev, tp_err *e) {
  tp_cuda *cu = self;
  CUmemAccessDesc d = {{1, dev}, 3};
  return check(cu, cu->cuMemSetAccess(addr, n, &d, 1), "cuMemSetAccess", e);
}

static int cu_unmap(void *self, uint64_t addr, uint64_t n, tp_err *e) {
  tp_cuda *cu = self;
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
  int capturing = 0; /* CU_STREAM_CAPTURE_STATUS_NONE */
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

int tp_cuda_driver(tp_driver *out, tp_err *e) {
  tp_cuda *cu = &g_cuda;
  pthread_mutex_lock(&cu->mu);
  if (!g_cuda_ready) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char *why = dlerror();
      tp_set_err(e, 100, "dlopen", "cannot open libcuda.so.1 (the CUDA driver): %s", why ? why : "not found");
      pthread_mutex_unlock(&cu->mu);
      return -1;
    }
#define TP_CU_LOAD(name, params)                                                   \
  *(void **)(&cu->name) = dlsym(lib, #name);                                       \
  if (!cu->name) {                                                                 \
    tp_set_err(e, 100, "dlsym", "the CUDA driver has no entry point %s", #name);   \
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
  return 0;
}
