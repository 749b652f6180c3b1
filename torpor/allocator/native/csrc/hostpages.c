/* Host memory for backups: anonymous private address space, 2 MiB aligned, huge pages advised, faulted in
 * by writing zeros or by MADV_POPULATE_WRITE. Not a CUDA call: the CUDA driver table (driver_cuda.c) pins
 * these pages with cuMemHostRegister, the Python helpers (torpor/allocator/native/cuda_driver.py) and the
 * probes use them directly.
 *
 * Where the kernel has no transparent huge pages (or they are `never`) the advice does nothing and the pages
 * are 4 KiB: slower to fault in, same result. tp_host_pages_methods turns the advice and populating off, as
 * on such a kernel (a GPU test runs a sleep that way).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tp.h"

#define TP_HUGE (2ull << 20)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14+: fault pages in, writable, without writing them */
#endif

static int g_huge_advice = 1;   /* madvise(MADV_HUGEPAGE) on every reservation */
static int g_populate_works = 1; /* cleared at the first EINVAL (a kernel before 5.14) */

uint64_t tp_round_pages(uint64_t n) {
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  return (n + page - 1) / page * page;
}

/* Turn huge page advice and populating on or off (1/0; -1 leaves one as it is); the previous values. */
TP_EXPORT void tp_host_pages_methods(int huge, int populate, int *was_huge, int *was_populate) {
  if (was_huge) *was_huge = __atomic_load_n(&g_huge_advice, __ATOMIC_RELAXED);
  if (was_populate) *was_populate = __atomic_load_n(&g_populate_works, __ATOMIC_RELAXED);
  if (huge >= 0) __atomic_store_n(&g_huge_advice, huge ? 1 : 0, __ATOMIC_RELAXED);
  if (populate >= 0) __atomic_store_n(&g_populate_works, populate ? 1 : 0, __ATOMIC_RELAXED);
}

TP_EXPORT int tp_host_pages_reserve(uint64_t n, uint64_t *out, tp_err *e) {
  if (tp_check_len(e, "mmap", "nbytes", n, 1)) return -1; /* Note [Lengths and ranges at the C boundary] */
  uint64_t size = tp_round_pages(n);
  void *raw = mmap(NULL, size + TP_HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    int err = errno;
    tp_set_err(e, err == ENOMEM ? TP_CUDA_ERROR_OUT_OF_MEMORY : err, "mmap", "mapping %llu bytes of host memory failed: %s",
               (unsigned long long)size, strerror(err));
    return -1;
  }
  uint64_t start = (uint64_t)(uintptr_t)raw;
  uint64_t address = (start + TP_HUGE - 1) / TP_HUGE * TP_HUGE;
  uint64_t head = address - start, tail = start + size + TP_HUGE - (address + size);
  if (head) munmap(raw, head);
  if (tail) munmap((void *)(uintptr_t)(address + size), tail);
  if (__atomic_load_n(&g_huge_advice, __ATOMIC_RELAXED))
    madvise((void *)(uintptr_t)address, size, MADV_HUGEPAGE); /* EINVAL without THP support: 4 KiB pages then */
  *out = address;
  return 0;
}

TP_EXPORT int tp_host_pages_fault(uint64_t addr, uint64_t n, int write, int *how, tp_err *e) {
  if (tp_check_range(e, "madvise", "host", addr, n, 0) || tp_check_range(e, "madvise", "host", addr, tp_round_pages(n), 0))
    return -1;
  uint64_t size = tp_round_pages(n);
  void *p = (void *)(uintptr_t)addr;
  if (write) {
    memset(p, 0, size);
    if (how) *how = 1;
    return 0;
  }
  if (__atomic_load_n(&g_populate_works, __ATOMIC_RELAXED)) {
    if (madvise(p, size, MADV_POPULATE_WRITE) == 0) {
      if (how) *how = 2;
      return 0;
    }
    int err = errno;
    if (err == ENOMEM || err == EFAULT) {
      tp_set_err(e, TP_CUDA_ERROR_OUT_OF_MEMORY, "madvise", "faulting in %llu host bytes failed: %s", (unsigned long long)size, strerror(err));
      return -1;
    }
    if (err != EINVAL) {
      tp_set_err(e, err, "madvise", "faulting in %llu host bytes failed: %s", (unsigned long long)size, strerror(err));
      if (e) e->oom = 0;
      return -1;
    }
    __atomic_store_n(&g_populate_works, 0, __ATOMIC_RELAXED); /* a kernel before 5.14 */
  }
  memset(p, 0, size);
  if (how) *how = 3;
  return 0;
}

TP_EXPORT int tp_host_pages_free(uint64_t addr, uint64_t n, tp_err *e) {
  if (tp_check_range(e, "munmap", "host", addr, n, 0) || tp_check_range(e, "munmap", "host", addr, tp_round_pages(n), 0))
    return -1;
  if (munmap((void *)(uintptr_t)addr, tp_round_pages(n)) != 0) {
    int err = errno;
    tp_set_err(e, err, "munmap", "unmapping %llu host bytes at %#llx failed: %s", (unsigned long long)n,
               (unsigned long long)addr, strerror(err));
    if (e) e->oom = 0;
    return -1;
  }
  return 0;
}
