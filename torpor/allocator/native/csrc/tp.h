/* torpor's native allocation path: plain C, no Python, no torch headers.
 *
 * A context (tp_ctx) owns one allocation table: allocations, physical
 * mappings, per (device, tag) address arenas and slabs, and each tag's state,
 * all under the context's own mutex. Its VMM calls go through a driver table
 * (tp_driver): the CUDA driver opened with dlopen (driver_cuda.c), or a
 * simulated device on host memory with fault injection (driver_sim.c).
 * Lock order: torch's allocator mutex -> tp_ctx.mu -> the driver's own locks.
 * Nothing here calls into Python or into torch. See docs/allocator.md.
 */
#ifndef TORPOR_TP_H
#define TORPOR_TP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define TP_EXPORT __attribute__((visibility("default")))
#define TP_MAX_TAGS 64
#define TP_MAX_DEVICES 64
#define TP_SLOTS 128
#define TP_RING 16

enum { TP_ACTIVE = 0, TP_FROZEN = 1, TP_RELEASED = 2 };

/* Driver call ids: the order of torpor.allocator.native.driver.Driver.CALLS. */
enum {
  TP_GRANULARITY, TP_RESERVE, TP_UNRESERVE, TP_CREATE, TP_MAP, TP_SET_ACCESS, TP_UNMAP, TP_RELEASE,
  TP_HOST_RESERVE, TP_HOST_ALLOC, TP_HOST_FREE, TP_HOST_UNRESERVE, TP_COPY_D2H, TP_COPY_H2D, TP_RECORD, TP_WAIT,
  TP_SYNCHRONIZE, TP_MEM_INFO,
  TP_NCALLS = 32 /* room for calls the Python side adds; the first eight and TP_WAIT (a stream) run in the library */
};

/* One failure: what failed, the driver's code (2: out of memory), and why. */
typedef struct {
  int code;
  int oom;
  int tag;
  char op[16];
  char call[32];
  char msg[256];
} tp_err;

typedef struct {
  void *self;
  int (*granularity)(void *self, int dev, uint64_t *out, tp_err *e);
  int (*reserve)(void *self, int dev, uint64_t n, uint64_t align, uint64_t *out, tp_err *e);
  int (*unreserve)(void *self, uint64_t addr, uint64_t n, tp_err *e);
  int (*create)(void *self, int dev, uint64_t n, uint64_t *handle, tp_err *e);
  int (*map)(void *self, uint64_t addr, uint64_t n, uint64_t handle, tp_err *e);
  int (*set_access)(void *self, uint64_t addr, uint64_t n, int dev, tp_err *e);
  int (*unmap)(void *self, uint64_t addr, uint64_t n, tp_err *e);
  int (*release)(void *self, uint64_t handle, tp_err *e);
  int (*ensure_context)(void *self, int dev, tp_err *e);
  /* Wait for the work queued on `stream` (torch's, for a segment it frees); 0 at once while it captures a graph. */
  int (*wait_stream)(void *self, int dev, void *stream, tp_err *e);
  /* *out = 1 while `stream` captures a graph (it cannot be waited for then). */
  int (*capturing)(void *self, int dev, void *stream, int *out, tp_err *e);
} tp_driver;

typedef struct tp_sim tp_sim;
typedef struct tp_cuda tp_cuda;
typedef struct tp_ctx tp_ctx;

void tp_set_err(tp_err *e, int code, const char *call, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* driver_cuda.c / driver_sim.c */
int tp_cuda_driver(tp_driver *out, tp_err *e);
void tp_sim_driver(tp_sim *sim, tp_driver *out);

#endif
