/* A driver's error as the library keeps it: the code, the call that failed, a message (the drivers and the table set it).
 *
 * Apart from the table so that the drivers (driver_cuda.c, driver_sim.c) and
 * the table (table.c, which picks a driver) each depend on this file, not on
 * one another.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "tp.h"

void tp_set_err(tp_err *e, int code, const char *call, const char *fmt, ...) {
  if (!e) return;
  e->code = code;
  e->oom = code == TP_CUDA_ERROR_OUT_OF_MEMORY;
  snprintf(e->call, sizeof e->call, "%s", call ? call : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
}

/* Note [Lengths and ranges at the C boundary] (tp.h). */
int tp_check_len(tp_err *e, const char *call, const char *what, uint64_t n, uint64_t least) {
  if (n >= least && n <= TP_MAX_LEN) return 0;
  tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, call, "%s %llu refused: a length runs from %llu to 2**63 - 1%s", what, (unsigned long long)n,
             (unsigned long long)least, n > TP_MAX_LEN ? " (a negative one arrives as 2**64 minus it)" : "");
  return -1;
}

int tp_check_range(tp_err *e, const char *call, const char *what, uint64_t addr, uint64_t n, uint64_t least) {
  unsigned long long a = addr, len = n;
  if (n < least || n > TP_MAX_LEN)
    tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, call, "%s range %#llx+%llu refused: its length runs from %llu to 2**63 - 1", what, a, len,
               (unsigned long long)least);
  else if (n > UINT64_MAX - addr)
    tp_set_err(e, TP_CUDA_ERROR_INVALID_VALUE, call, "%s range %#llx+%llu refused: it runs past 2**64 - 1, the last address", what, a, len);
  else
    return 0;
  return -1;
}
