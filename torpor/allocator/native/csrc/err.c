/* A driver's error as the library keeps it: the code, the call that failed, a message (the drivers and the table set it).
 *
 * Apart from the table so that the drivers (driver_cuda.c, driver_sim.c) and
 * the table (table.c, which picks a driver) each depend on this file, not on
 * one another.
 */
#include <stdarg.h>
#include <stdio.h>

#include "tp.h"

void tp_set_err(tp_err *e, int code, const char *call, const char *fmt, ...) {
  if (!e) return;
  e->code = code;
  e->oom = code == 2;
  snprintf(e->call, sizeof e->call, "%s", call ? call : "");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
}
