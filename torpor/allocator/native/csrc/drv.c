/* The driver table's calls, exported for the allocator's Python side (torpor/allocator/native/driver.py).
 *
 * One table per driver: the CUDA driver's (opened once, tp_drv_cuda) or a simulated device's (tp_drv_sim). Each
 * call returns 0, or -1 with *e saying the call that failed, why, and the driver's code; nothing here raises or
 * calls back into Python, and ctypes lets go of the GIL around every call (so pinning threads run at once).
 * The VMM calls are not here: only the allocation table (table.c, sleep.c, trim.c) makes them.
 */
#include "tp.h"

TP_EXPORT tp_driver *tp_drv_cuda(tp_err *e) { return tp_cuda_table(e); }
TP_EXPORT tp_driver *tp_drv_sim(tp_sim *s) { return tp_sim_table(s); }

TP_EXPORT int tp_drv_granularity(tp_driver *d, int dev, uint64_t *out, tp_err *e) {
  return d->granularity(d->self, dev, out, e);
}
TP_EXPORT int tp_drv_ensure_context(tp_driver *d, int dev, tp_err *e) { return d->ensure_context(d->self, dev, e); }
TP_EXPORT int tp_drv_prepare_device(tp_driver *d, int dev, tp_err *e) { return d->prepare_device(d->self, dev, e); }
TP_EXPORT int tp_drv_prepare_thread(tp_driver *d, tp_err *e) { return d->prepare_thread(d->self, e); }
TP_EXPORT int tp_drv_host_reserve(tp_driver *d, uint64_t n, uint64_t *out, tp_err *e) {
  return d->host_reserve(d->self, n, out, e);
}
TP_EXPORT int tp_drv_host_alloc(tp_driver *d, uint64_t n, uint64_t host, int write, uint64_t *out, tp_err *e) {
  return d->host_alloc(d->self, n, host, write, out, e);
}
TP_EXPORT int tp_drv_host_register(tp_driver *d, uint64_t host, uint64_t n, tp_err *e) {
  return d->host_register(d->self, host, n, e);
}
TP_EXPORT int tp_drv_host_free(tp_driver *d, uint64_t host, tp_err *e) { return d->host_free(d->self, host, e); }
TP_EXPORT int tp_drv_host_unreserve(tp_driver *d, uint64_t host, uint64_t n, tp_err *e) {
  return d->host_unreserve(d->self, host, n, e);
}
TP_EXPORT int tp_drv_host_copy(tp_driver *d, uint64_t dst, uint64_t src, uint64_t n, tp_err *e) {
  return d->host_copy(d->self, dst, src, n, e);
}
TP_EXPORT int tp_drv_copy_d2h(tp_driver *d, uint64_t host, uint64_t addr, uint64_t n, int dev, tp_err *e) {
  return d->copy_d2h(d->self, host, addr, n, dev, e);
}
TP_EXPORT int tp_drv_copy_h2d(tp_driver *d, uint64_t addr, uint64_t host, uint64_t n, int dev, tp_err *e) {
  return d->copy_h2d(d->self, addr, host, n, dev, e);
}
TP_EXPORT int tp_drv_record(tp_driver *d, int dev, uint64_t *event, tp_err *e) {
  return d->record(d->self, dev, event, e);
}
TP_EXPORT int tp_drv_wait(tp_driver *d, uint64_t event, tp_err *e) { return d->wait_event(d->self, event, e); }
TP_EXPORT int tp_drv_synchronize(tp_driver *d, int dev, tp_err *e) { return d->synchronize(d->self, dev, e); }
TP_EXPORT int tp_drv_mem_info(tp_driver *d, int dev, int64_t *free_bytes, int64_t *total, tp_err *e) {
  return d->mem_info(d->self, dev, free_bytes, total, e);
}
TP_EXPORT int tp_drv_read(tp_driver *d, uint64_t addr, void *buf, uint64_t n, tp_err *e) {
  return d->read(d->self, addr, buf, n, e);
}
TP_EXPORT int tp_drv_write(tp_driver *d, uint64_t addr, const void *buf, uint64_t n, tp_err *e) {
  return d->write(d->self, addr, buf, n, e);
}
