/* A stand-in libcuda.so.1 for tests without a GPU: every entry point the native library resolves, each logged.
 *
 * Built by tests/test_allocator_cuda_driver.py and put first on LD_LIBRARY_PATH of a subprocess, so the
 * library's CUDA driver table (csrc/driver_cuda.c) runs against it: contexts are per thread, device memory
 * is host memory (copies are memcpy), and the log says which call ran with which stream, event, flags and
 * current context. fake_fail(name, code) makes the next call of `name` return `code`.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[1 << 20];
static size_t log_len;
static char fail_name[64];
static int fail_code;
static __thread void *current;
static int streams, events;

static void note(const char *fmt, ...) {
  pthread_mutex_lock(&mu);
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(log_buf + log_len, sizeof log_buf - log_len, fmt, ap);
  va_end(ap);
  if (n > 0 && log_len + (size_t)n + 1 < sizeof log_buf) {
    log_len += (size_t)n;
    log_buf[log_len++] = '\n';
    log_buf[log_len] = 0;
  }
  pthread_mutex_unlock(&mu);
}

static CUresult failing(const char *name) {
  pthread_mutex_lock(&mu);
  int code = strcmp(fail_name, name) == 0 ? fail_code : 0;
  if (code) fail_name[0] = 0;
  pthread_mutex_unlock(&mu);
  return code;
}

#define ENTER(name, ...)                          \
  note(name " ctx=%p " __VA_ARGS__);              \
  do {                                            \
    CUresult f_ = failing(name);                  \
    if (f_) return f_;                            \
  } while (0)

const char *fake_log(void) { return log_buf; }
void fake_fail(const char *name, int code) {
  pthread_mutex_lock(&mu);
  snprintf(fail_name, sizeof fail_name, "%s", name);
  fail_code = code;
  pthread_mutex_unlock(&mu);
}

CUresult cuInit(unsigned int f) { ENTER("cuInit", "flags=%u", current, f); return 0; }
CUresult cuDeviceGet(int *d, int ord) { *d = ord; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) {
  *c = (void *)(unsigned long)(0x1000 + d);
  ENTER("cuDevicePrimaryCtxRetain", "dev=%d", current, d);
  return 0;
}
CUresult cuCtxGetCurrent(void **c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(void *c) { ENTER("cuCtxSetCurrent", "to=%p", current, c); current = c; return 0; }
CUresult cuMemGetAllocationGranularity(size_t *g, const void *p, int f) { (void)p, (void)f; *g = 2 << 20; return 0; }
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t a, CUdeviceptr h, unsigned long long f) {
  (void)n, (void)a, (void)h, (void)f;
  *p = 0;
  return 2;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t n) { (void)p, (void)n; return 0; }
CUresult cuMemCreate(unsigned long long *h, size_t n, const void *p, unsigned long long f) {
  (void)h, (void)n, (void)p, (void)f;
  return 2;
}
CUresult cuMemMap(CUdeviceptr a, size_t n, size_t o, unsigned long long h, unsigned long long f) {
  (void)a, (void)n, (void)o, (void)h, (void)f;
  return 1;
}
CUresult cuMemSetAccess(CUdeviceptr a, size_t n, const void *d, size_t c) { (void)a, (void)n, (void)d, (void)c; return 1; }
CUresult cuMemUnmap(CUdeviceptr a, size_t n) { (void)a, (void)n; return 1; }
CUresult cuMemRelease(unsigned long long h) { (void)h; return 1; }
CUresult cuStreamIsCapturing(void *s, int *out) { (void)s; *out = 0; return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; return 0; }
CUresult cuStreamCreate(void **s, unsigned int f) {
  ENTER("cuStreamCreate", "flags=%u", current, f);
  if (!current) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
  *s = (void *)(unsigned long)(0x2000 + __sync_add_and_fetch(&streams, 1));
  return 0;
}
CUresult cuEventCreate(void **e, unsigned int f) {
  ENTER("cuEventCreate", "flags=%u", current, f);
  if (!current) return 201;
  *e = (void *)(unsigned long)(0x3000 + __sync_add_and_fetch(&events, 1));
  return 0;
}
CUresult cuEventRecord(void *e, void *s) { ENTER("cuEventRecord", "event=%p stream=%p", current, e, s); return 0; }
CUresult cuEventSynchronize(void *e) { ENTER("cuEventSynchronize", "event=%p", current, e); return 0; }
CUresult cuEventDestroy_v2(void *e) { ENTER("cuEventDestroy", "event=%p", current, e); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
  ENTER("cuMemcpyDtoHAsync", "n=%zu stream=%p", current, n, s);
  memcpy(dst, (const void *)(unsigned long)src, n);
  return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
  ENTER("cuMemcpyHtoDAsync", "n=%zu stream=%p", current, n, s);
  memcpy((void *)(unsigned long)dst, src, n);
  return 0;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  ENTER("cuMemcpyDtoH", "n=%zu", current, n);
  memcpy(dst, (const void *)(unsigned long)src, n);
  return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  ENTER("cuMemcpyHtoD", "n=%zu", current, n);
  memcpy((void *)(unsigned long)dst, src, n);
  return 0;
}
CUresult cuCtxSynchronize(void) { ENTER("cuCtxSynchronize", "", current); return 0; }
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
  ENTER("cuMemGetInfo", "", current);
  *f = 100;
  *t = 200;
  return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int f) {
  ENTER("cuMemHostRegister", "n=%zu flags=%u aligned=%d", current, n, f, (int)((unsigned long)p % 4096 == 0));
  return 0;
}
CUresult cuMemHostUnregister(void *p) { ENTER("cuMemHostUnregister", "at=%p", current, p); return 0; }
CUresult cuThreadExchangeStreamCaptureMode(int *m) {
  ENTER("cuThreadExchangeStreamCaptureMode", "mode=%d", current, *m);
  *m = 0;
  return 0;
}
CUresult cuGetErrorName(CUresult rc, const char **s) {
  *s = rc == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_FAKE";
  return 0;
}
CUresult cuGetErrorString(CUresult rc, const char **s) {
  *s = rc == 700 ? "an illegal memory access was encountered" : "a failure of the stand-in";
  return 0;
}
