/* torpor's native allocation path: plain C, no Python, no torch headers.
 *
 * A context (tp_ctx) owns one allocation table: allocations, physical
 * mappings, per (device, tag) address arenas and slabs, and each tag's state,
 * all under the context's own mutex. Its VMM calls go through a driver table
 * (tp_driver): the CUDA driver opened with dlopen (driver_cuda.c), or a
 * simulated device on host memory with fault injection (driver_sim.c,
 * sim_host.c). The same table also holds the host-memory, copy and event
 * calls the allocator's Python side makes (drv.c exports them): CUDA is
 * opened once, here.
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

/* Driver call ids: the call_id of each call in torpor/allocator/native/driver.py's CALL_TABLE (Driver.CALLS at its id). */
enum {
  TP_GRANULARITY, TP_RESERVE, TP_UNRESERVE, TP_CREATE, TP_MAP, TP_SET_ACCESS, TP_UNMAP, TP_RELEASE,
  TP_HOST_RESERVE, TP_HOST_ALLOC, TP_HOST_FREE, TP_HOST_UNRESERVE, TP_COPY_D2H, TP_COPY_H2D, TP_RECORD, TP_WAIT,
  TP_SYNCHRONIZE, TP_MEM_INFO, TP_HOST_COPY, TP_HOST_REGISTER,
  TP_NCALLS = 32 /* room for more; the table makes the first eight (and TP_WAIT on a stream), the Python view the rest */
};

/* The CUresult codes the library reports for failures it finds itself (cuda.h's values), so that a code means the
 * same whoever set it: a refused argument here is CUDA_ERROR_INVALID_VALUE as it would be from the driver. A failed
 * driver call carries the driver's own code; a failed host call (mmap, madvise) its errno, out of memory as
 * TP_CUDA_ERROR_OUT_OF_MEMORY. */
enum {
  TP_CUDA_SUCCESS = 0,
  TP_CUDA_ERROR_INVALID_VALUE = 1,     /* an argument refused: a length, range, handle or address */
  TP_CUDA_ERROR_OUT_OF_MEMORY = 2,     /* device or host memory ran out (tp_err.oom is set) */
  TP_CUDA_ERROR_NO_DEVICE = 100,       /* no CUDA driver: libcuda.so.1 or one of its entry points is missing */
  TP_CUDA_ERROR_INVALID_DEVICE = 101,  /* a device number out of range */
  TP_CUDA_ERROR_ILLEGAL_ADDRESS = 700, /* the simulator: a copy touched device memory not mapped and accessible */
  TP_CUDA_ERROR_NOT_SUPPORTED = 801,   /* the simulator: a map with a handle of another size */
  TP_CUDA_ERROR_UNKNOWN = 999,         /* the simulator: a failure injected on purpose (tp_sim_fail) */
};

/* One failure: what failed, the driver's code (TP_CUDA_ERROR_OUT_OF_MEMORY: out of memory), and why. */
typedef struct {
  int code; /* a CUresult (the enum above, or the driver's own), or a host call's errno */
  int oom;  /* 1: out of memory (code TP_CUDA_ERROR_OUT_OF_MEMORY; a host call's ENOMEM is reported so) */
  int tag;  /* tag id the failure concerns (-1: none) */
  char op[16];   /* the allocator's operation that failed: "allocate", "release", "restore", ... */
  char call[32]; /* the driver or host call that failed: "cuMemCreate", "map", "mmap", ... */
  char msg[256]; /* why, in words */
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

  /* What the allocator's Python side calls (torpor/allocator/native/driver.py, through drv.c); the table never
   * does. Copies are enqueued on the device's own copy stream and are done when an event recorded after them
   * is waited for (a failed copy is reported by that wait). A host address of 0 to host_alloc: fresh memory;
   * `write`: fault fresh pages in by writing zeros (the host has room), else by populating. The simulated
   * device neither logs nor fails these: its Python view does both first (tp_sim_hit), so a Ctrl-C between
   * the two lands before the call has any effect, as between two Python calls. */
  int (*prepare_device)(void *self, int dev, tp_err *e);
  int (*prepare_thread)(void *self, tp_err *e);
  int (*host_reserve)(void *self, uint64_t n, uint64_t *out, tp_err *e);
  int (*host_alloc)(void *self, uint64_t n, uint64_t host, int write, uint64_t *out, tp_err *e);
  int (*host_register)(void *self, uint64_t host, uint64_t n, tp_err *e);
  int (*host_free)(void *self, uint64_t host, tp_err *e);
  int (*host_unreserve)(void *self, uint64_t host, uint64_t n, tp_err *e);
  int (*host_copy)(void *self, uint64_t dst, uint64_t src, uint64_t n, tp_err *e);
  int (*copy_d2h)(void *self, uint64_t host, uint64_t addr, uint64_t n, int dev, tp_err *e);
  int (*copy_h2d)(void *self, uint64_t addr, uint64_t host, uint64_t n, int dev, tp_err *e);
  int (*record)(void *self, int dev, uint64_t *event, tp_err *e);
  int (*wait_event)(void *self, uint64_t event, tp_err *e);
  int (*synchronize)(void *self, int dev, tp_err *e);
  int (*mem_info)(void *self, int dev, int64_t *free, int64_t *total, tp_err *e);
  int (*read)(void *self, uint64_t addr, void *buf, uint64_t n, tp_err *e);
  int (*write)(void *self, uint64_t addr, const void *buf, uint64_t n, tp_err *e);
} tp_driver;

typedef struct tp_sim tp_sim;
typedef struct tp_cuda tp_cuda;
typedef struct tp_ctx tp_ctx;

void tp_set_err(tp_err *e, int code, const char *call, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Note [Lengths and ranges at the C boundary]: every length, offset and address a caller hands the library is
 * checked before it is used, as Python checks it before the call (torpor/allocator/native/library.py): a length
 * runs from 0 to TP_MAX_LEN (2**63 - 1; -1 from Python arrives as 2**64 - 1), and a range [addr, addr + n) ends at
 * or before 2**64 - 1. The checks never compute addr + n before they know it cannot wrap (`n > UINT64_MAX - addr`,
 * never `addr + n > end`). A refusal is -1 with *e saying the call, the value and the range (code 1, as
 * CUDA_ERROR_INVALID_VALUE); nothing crosses the C boundary but the code. */
#define TP_MAX_LEN ((uint64_t)INT64_MAX)
/* 1 when [addr, addr + n) is a range the library can work on (n <= TP_MAX_LEN, no wrap past 2**64 - 1). */
static inline int tp_range_ok(uint64_t addr, uint64_t n) { return n <= TP_MAX_LEN && n <= UINT64_MAX - addr; }
/* 0 when [addr, addr + n) is such a range and n >= least, else -1 with *e naming `what` (err.c). */
int tp_check_range(tp_err *e, const char *call, const char *what, uint64_t addr, uint64_t n, uint64_t least);
/* 0 when n runs from least to TP_MAX_LEN, else -1 with *e naming `what`. */
int tp_check_len(tp_err *e, const char *call, const char *what, uint64_t n, uint64_t least);

/* driver_cuda.c / driver_sim.c */
int tp_cuda_driver(tp_driver *out, tp_err *e);
void tp_sim_driver(tp_sim *sim, tp_driver *out);
/* The driver table of the CUDA driver (opened once), or of a simulated device (driver_sim.c). */
tp_driver *tp_cuda_table(tp_err *e);
tp_driver *tp_sim_table(tp_sim *sim);

/* hostpages.c: anonymous host memory for backups, 2 MiB aligned with huge pages advised. */
uint64_t tp_round_pages(uint64_t n);
int tp_host_pages_reserve(uint64_t n, uint64_t *out, tp_err *e);
/* Fault never-written pages in: by writing zeros (`write`), else MADV_POPULATE_WRITE (zeros on kernels before 5.14);
 * *how (may be NULL): 1 written, 2 populated, 3 written as populating is missing. */
int tp_host_pages_fault(uint64_t addr, uint64_t n, int write, int *how, tp_err *e);
int tp_host_pages_free(uint64_t addr, uint64_t n, tp_err *e);

#endif
