"""NativeTable: one context of the native library (its allocation table), with Python-shaped calls.

Every method is one library call (or a few), each of which takes the library's
mutex only for its own duration and never calls back into Python; failures come
back as :class:`~torpor.errors.AllocatorError` built from what the
library reported.

Values are checked here, before the C boundary, where ctypes would otherwise
wrap them silently (``2**64 + 4096`` bytes is 4096, device ``2**32`` is device
0, a NUL ends a tag name): sizes run from 1 to 2**63 - 1, addresses from 0 to
2**64 - 1, devices from 0 to 63 (the checks of
:mod:`~torpor.allocator.native.library`), and a tag name is a non-empty ``str``
of at most 63 UTF-8 bytes without control characters. Anything else raises
:class:`~torpor.errors.AllocatorArgumentError` (an ``AllocatorError`` and a
``ValueError``) naming the value, and nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
from functools import partial
from typing import Any, NamedTuple

from torpor.allocator.native import library as native
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.library import check_address, check_device
from torpor.errors import AllocatorArgumentError, AllocatorError

_ALL = native.MAX_ADDRESS


class Live(NamedTuple):
    """A live allocation of the table: ``size`` bytes mapped (or, asleep, reserved) at ``address`` on ``device``."""

    address: int
    size: int  # bytes (a multiple of the device's granularity)
    device: int


class Span(NamedTuple):
    """A device address range: ``size`` bytes from ``start``."""

    start: int
    size: int  # bytes


class TableUsage(NamedTuple):
    """What the table holds of one tag (:meth:`NativeTable.usage`)."""

    state: int  # native.ACTIVE, FROZEN or RELEASED
    nbytes: int  # bytes of its live allocations (mapped or not)
    allocations: int  # how many live allocations


class TableStats(NamedTuple):
    """The table's slabs and mappings, of one tag or of all (:meth:`NativeTable.stats`)."""

    slabs: int  # live slabs (mappings that hold several allocations)
    spare: int  # bytes of those slabs no allocation uses
    mapped: int  # bytes mapped
    mappings: int  # how many mappings


_live = partial(tuple.__new__, Live)  # Live((address, size, device)) made in C: the table lists thousands
_span = partial(tuple.__new__, Span)

logger = logging.getLogger("torpor.allocator")


def check_size(nbytes: object, op: str = "allocate", tag: str | None = None) -> int:
    """A byte count the library takes (1 to 2**63 - 1), else AllocatorArgumentError naming it."""
    n = native.integer(nbytes, "size", op, tag)
    if not 1 <= n <= native.MAX_LENGTH:
        msg = f"cannot allocate {n} bytes: a size is an integer from 1 to 2**63 - 1"
        raise AllocatorArgumentError(op, tag, msg)
    return n


def check_tag(tag: object) -> str:
    """A usable tag name, else AllocatorArgumentError saying what is wrong with it.

    The library keeps names as C strings of up to 63 bytes: a NUL would end
    the name early (``'weights\x00shadow'`` would be ``'weights'``), so NULs
    and every other control character are refused, as are empty names,
    names of more bytes, and text that is not valid UTF-8 (lone surrogates).
    """
    if not isinstance(tag, str):
        msg = f"tag {tag!r} refused: a tag name is a str, not {type(tag).__name__}"
        raise AllocatorArgumentError("tag", None, msg)
    if not tag:
        raise AllocatorArgumentError("tag", None, "tag '' refused: a tag name cannot be empty")
    bad = next((ch for ch in tag if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0), None)
    if bad is not None:
        msg = (
            f"tag {tag[:80]!r} refused: it holds the control character {bad!r} (a NUL would cut the native name short)"
        )
        raise AllocatorArgumentError("tag", None, msg)
    try:
        size = len(tag.encode("utf-8"))
    except UnicodeEncodeError:
        msg = f"tag {tag[:80]!r} refused: it is not valid text (a lone surrogate has no UTF-8 form)"
        raise AllocatorArgumentError("tag", None, msg) from None
    if size > native.MAX_TAG_BYTES:
        msg = f"tag {tag[:80]!r} refused: {size} UTF-8 bytes, over the {native.MAX_TAG_BYTES}-byte limit of a tag name"
        raise AllocatorArgumentError("tag", None, msg)
    return tag


class NativeTable:
    """The allocation table of one :class:`~torpor.allocator.TaggedAllocator`, owned by the native library."""

    def __init__(self, driver: Driver, slab_bytes: int) -> None:
        slab_bytes = native.check_length(slab_bytes, "open", what="slab_bytes")
        self.lib = native.lib()
        err = native.TpErr()
        if driver.is_cuda:
            ctx = self.lib.tp_open_cuda(ctypes.byref(err))
            if not ctx:
                error = native.error_of(err, None)
                if error.call == "dlopen":  # no NVIDIA driver here: say so, and how to run without a GPU
                    msg = (
                        f"CUDA's driver library is missing ({error.reason}); without an NVIDIA GPU and its driver, "
                        "use the simulated device: TaggedAllocator(SimDriver(nbytes)), from torpor.allocator"
                    )
                    raise AllocatorError("open the CUDA driver", None, msg, call="dlopen")
                raise error
        else:
            sim = getattr(driver, "native_sim", None)
            if sim is None:
                msg = f"the native allocation table drives CudaDriver or SimDriver, not {type(driver).__name__}"
                raise AllocatorError("open", None, msg)
            ctx = self.lib.tp_open_sim(sim)
        if not ctx:
            raise AllocatorError("open", None, "the native library could not make a context (out of host memory)")
        self.ctx = ctx
        self.lib.tp_configure(ctx, slab_bytes, 0)
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self.closed = False

    # -- tags and errors --------------------------------------------------------------------

    def tag_id(self, tag: str) -> int:
        """The library's id of ``tag`` (made on first use; at most 64 tags; see :func:`check_tag`)."""
        found = self._ids.get(tag)
        if found is None:
            found = int(self.lib.tp_tag_id(self.ctx, check_tag(tag).encode()))
            if found < 0:
                msg = (
                    f"cannot add tag {tag!r}: the allocator holds at most {native.MAX_TAGS} tags ({len(self._ids)} now)"
                )
                raise AllocatorError("allocate", tag, msg)
            self._ids[tag] = found
            self._names[found] = tag
        return found

    def _check(self, rc: int, err: native.TpErr, tag: str | None = None) -> int:
        if rc < 0:
            raise native.error_of(err, tag if tag is not None else self._names.get(err.tag))
        return rc

    def errors(self) -> list[AllocatorError]:
        """Errors of torch's malloc/free calls since the last call (oldest first), and forget them."""
        buf = (native.TpErr * 16)()
        n = int(self.lib.tp_errors(self.ctx, buf, 16))
        return [native.error_of(buf[i], self._names.get(buf[i].tag)) for i in range(n)]

    def slot(self, tag: str) -> tuple[int, int]:
        """Addresses of a new malloc/free pair that allocates under ``tag`` (for ``torch._C._cuda_customAllocator``).

        The library has :data:`~torpor.allocator.native.library.SLOTS` slots for the
        process. A slot is reused once its allocator is closed and torch holds
        no block it handed out (torch keeps the pointers for the process, so a
        slot torch may still free into stays bound to its closed table, which
        ignores it). Running out names who holds them.
        """
        tid = self.tag_id(tag)
        if self.closed:
            raise AllocatorError("allocate", tag, "the allocator is closed: it binds no new slot")
        index = int(self.lib.tp_slot_bind(self.ctx, tid))
        if index < 0:
            census = (ctypes.c_int * 3)()
            self.lib.tp_slot_census(census)
            msg = (
                f"every native allocator slot is taken ({native.SLOTS} per process, one per tag torch allocates in "
                f"and per graph pool): {census[0]} bound to open allocators, {census[1]} to closed allocators whose "
                "blocks torch still holds (tensors or graphs not yet freed); close() allocators no longer used and "
                "free what torch holds of closed ones"
            )
            raise AllocatorError("allocate", tag, msg)
        return int(self.lib.tp_slot_malloc_fn(index)), int(self.lib.tp_slot_free_fn(index))

    # -- allocate and free ---------------------------------------------------------------------

    def granularity(self, device: int) -> int:
        """Mapping granularity of ``device``."""
        device = check_device(device, "granularity")
        out, err = ctypes.c_uint64(), native.TpErr()
        self._check(self.lib.tp_granularity(self.ctx, device, ctypes.byref(out), ctypes.byref(err)), err)
        return int(out.value)

    def alloc(self, tag: str, device: int, nbytes: int) -> int:
        """Map ``nbytes`` (rounded up to the granularity) under ``tag``; the address."""
        nbytes, device = check_size(nbytes, "allocate", tag), check_device(device, "allocate", tag)
        out, err = ctypes.c_uint64(), native.TpErr()
        rc = self.lib.tp_alloc_raw(self.ctx, self.tag_id(tag), device, nbytes, ctypes.byref(out), ctypes.byref(err))
        self._check(rc, err, tag)
        return int(out.value)

    def free(self, address: int) -> None:
        """Free an allocation (its mapping goes with its last user; asleep: only its address range)."""
        address = check_address(address, "free")
        err = native.TpErr()
        self._check(self.lib.tp_free_raw(self.ctx, address, ctypes.byref(err)), err)

    def trim(self, address: int) -> bool:
        """Give back the memory of a segment torch holds free in an idle pool; False when not now (asleep, done).

        True also when a mapping under it would not unmap: the segment is
        trimmed (not counted, backed up or mapped on a wake) and the mapping
        stays until the tag's next sleep unmaps it; that is logged.
        """
        address = check_address(address, "trim")
        err = native.TpErr()
        rc = self._check(self.lib.tp_trim(self.ctx, address, ctypes.byref(err)), err)
        if rc == 2:
            failure = native.error_of(err, self._names.get(err.tag))
            logger.warning(
                "trimmed the segment at %#x, but its memory stays mapped until the next sleep: %s", address, failure
            )
        return rc >= 1

    def pend(self, address: int, stream: int) -> bool:
        """The segment at ``address`` is free in an idle pool; its trim waits for ``stream``; False: not now.

        An allocation of its tag that runs out of memory waits for ``stream`` and trims it (csrc/trim.c).
        """
        address = check_address(address, "pend")
        err = native.TpErr()
        return (
            self._check(self.lib.tp_pend(self.ctx, address, ctypes.c_void_p(stream or None), ctypes.byref(err)), err)
            == 1
        )

    def unpend(self, address: int) -> bool:
        """The segment at ``address`` is pending no more; True when an allocation under pressure trimmed it meanwhile.

        Not an allocation (torch freed it): False.
        """
        address = check_address(address, "unpend")
        err = native.TpErr()
        return int(self.lib.tp_unpend(self.ctx, address, ctypes.byref(err))) == 1

    def untrim(self, address: int) -> bool:
        """Map memory under a trimmed segment again (its pool serves a block again); False when it was not trimmed."""
        address = check_address(address, "untrim")
        err = native.TpErr()
        return self._check(self.lib.tp_untrim(self.ctx, address, ctypes.byref(err)), err) == 1

    # -- sleep and wake --------------------------------------------------------------------------

    def _tag_call(self, name: str, tag: str, *args: Any) -> int:
        err = native.TpErr()
        rc = getattr(self.lib, name)(self.ctx, self.tag_id(tag), *args, ctypes.byref(err))
        return self._check(int(rc), err, tag)

    def freeze(self, tag: str) -> None:
        """A sleep starts: new allocations in ``tag`` are refused, frees keep their mappings until the release."""
        self._tag_call("tp_freeze", tag)

    def thaw(self, tag: str) -> None:
        """The sleep of ``tag`` was called off: it takes allocations again (mappings freed meanwhile go)."""
        self._tag_call("tp_thaw", tag)

    def unmap_range(self, tag: str, lo: int = 0, hi: int = _ALL) -> int:
        """Unmap the frozen tag's mappings inside ``[lo, hi)``; how many."""
        lo, hi = check_address(lo, "unmap", tag), check_address(hi, "unmap", tag)
        return self._tag_call("tp_unmap_range", tag, lo, hi)

    def map_back(self, tag: str) -> list[Span]:
        """Map back (fresh) what :meth:`unmap_range` unmapped; the ranges."""
        cap = 4096
        starts, sizes, count, err = native.u64s(cap), native.u64s(cap), ctypes.c_int(), native.TpErr()
        rc = self.lib.tp_map_back(
            self.ctx, self.tag_id(tag), starts, sizes, cap, ctypes.byref(count), ctypes.byref(err)
        )
        done = _spans(starts, sizes, count.value, cap)
        self._check(rc, err, tag)
        return done

    def map_back_some(self, tag: str) -> tuple[list[Span], AllocatorError | None]:
        """:meth:`map_back` that never raises: the ranges mapped back (also those before a failure), and the failure."""
        cap = 1 << 16
        starts, sizes, count, err = native.u64s(cap), native.u64s(cap), ctypes.c_int(), native.TpErr()
        rc = self.lib.tp_map_back(
            self.ctx, self.tag_id(tag), starts, sizes, cap, ctypes.byref(count), ctypes.byref(err)
        )
        done = _spans(starts, sizes, count.value, cap)
        if rc < 0:
            return done, native.error_of(err, tag)
        if count.value > cap:
            return done, AllocatorError("release", tag, f"{count.value} ranges mapped back, only {cap} reported")
        return done, None

    def mark_released(self, tag: str) -> None:
        """Every mapping of the frozen tag is unmapped: it is released."""
        self._tag_call("tp_mark_released", tag)

    def map_span(self, tag: str, start: int, size: int, device: int) -> None:
        """Map ``[start, start + size)`` of a released tag with one new handle."""
        start, size = native.check_range(start, size, "restore", what="span", length="size", least=1, tag=tag)
        device = check_device(device, "restore", tag)
        self._tag_call("tp_map_span", tag, start, size, device)

    def unmap_all(self, tag: str) -> int:
        """Unmap every mapping of ``tag`` (a wake's rollback); how many would not unmap."""
        err = native.TpErr()
        return int(self.lib.tp_unmap_all(self.ctx, self.tag_id(tag), ctypes.byref(err)))

    def mark_awake(self, tag: str) -> None:
        """The released tag is mapped again: it takes allocations."""
        self._tag_call("tp_mark_awake", tag)

    # -- queries ----------------------------------------------------------------------------------

    def allocations(self, tag: str | None = None) -> list[Live]:
        """Live allocations (of ``tag``, or all), by address."""
        tid = self.tag_id(tag) if tag is not None else -1
        cap = 1024
        while True:
            addr, size, dev = native.u64s(cap), native.u64s(cap), (ctypes.c_int * cap)()
            n = int(self.lib.tp_list(self.ctx, tid, addr, size, dev, cap))
            if n <= cap:
                return list(map(_live, zip(addr[:n], size[:n], dev[:n], strict=True)))
            cap = n + 1024

    def usage(self, tag: str) -> TableUsage:
        """The state of ``tag`` (native.ACTIVE, FROZEN or RELEASED), the bytes and count of its live allocations."""
        nbytes, count = ctypes.c_uint64(), ctypes.c_int()
        state = self.lib.tp_usage(self.ctx, self.tag_id(tag), ctypes.byref(nbytes), ctypes.byref(count))
        return TableUsage(int(state), int(nbytes.value), int(count.value))

    def stats(self, tag: str | None = None) -> TableStats:
        """Live slabs, their spare bytes, mapped bytes and mappings, of ``tag`` or of all."""
        out = native.u64s(4)
        self.lib.tp_stats(self.ctx, self.tag_id(tag) if tag is not None else -1, out)
        return TableStats._make(out)

    def adopt(self, context: int) -> None:
        """Work on the native table ``context`` (another library opened it) instead of this one's own, closed unused.

        Only before anything was allocated here: the tag numbers learned so far are forgotten and asked
        again of ``context``.
        """
        own, self.ctx = self.ctx, context
        self._ids.clear()
        self._names.clear()
        self.lib.tp_close(own)

    def close(self) -> int:
        """Unmap everything and free the reservations; how many driver calls failed.

        Its slots go back to the library once torch holds no block they handed out.
        """
        self.closed = True
        return int(self.lib.tp_close(self.ctx))


def _spans(starts: Any, sizes: Any, count: int, cap: int) -> list[Span]:
    """The first ``count`` (at most ``cap``) ranges the library wrote into ``starts`` and ``sizes``."""
    n = min(count, cap)
    return list(map(_span, zip(starts[:n], sizes[:n], strict=True)))
