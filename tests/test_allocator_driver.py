"""Tests of the driver view's bounds: lengths, offsets and addresses are refused before and at the C boundary (issue 51).

A length of -1 crosses ctypes as 2**64 - 1; an address near 2**64 plus a length wraps. Both are
refused by value in Python (:class:`~torpor.errors.AllocatorArgumentError` naming the argument, the
value and the range it must lie in) and by the library itself (``-1`` with the reason, never a copy
past a buffer). A call that would crash the process runs in a subprocess of its own, so a SIGSEGV is
a failing test (exit status -11) and not a dead test run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SETUP = """
import ctypes
from torpor.allocator import SimDriver, TaggedAllocator
from torpor.allocator.native import library as native
from torpor.errors import AllocatorArgumentError
G = 2 << 20
sim = SimDriver(32 * G, granularity=G)
alloc = TaggedAllocator(sim)
x = alloc.allocate(G, "w")
host = sim.host_alloc(G)
resv = sim.host_reserve(4 * G)
lib, table, err = native.lib(), sim._table(), native.TpErr()
ALL = 2**64 - 1
def refused(thunk):
    try:
        thunk()
    except AllocatorArgumentError as exc:
        print("REFUSED", exc)
    else:
        print("ACCEPTED")
def c_call(name, *args):
    rc = getattr(lib, name)(*args, ctypes.byref(err))
    print("RC", rc, err.call.decode() or err.op.decode(), err.msg.decode())
"""


def isolated(code: str) -> str:
    """Run ``code`` after the setup in a fresh interpreter; its output (a crash fails the test with its status)."""
    script = _SETUP + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the process ended with status {done.returncode} (-11 is SIGSEGV):\n{output[-2000:]}"
    return output


# -- through Python: refused by value, naming the argument, the value and its range --------------------------

PYTHON_CASES = {
    "read -1": ("refused(lambda: alloc.read(x, -1))", "nbytes -1 refused"),
    "read 2**63": ("refused(lambda: alloc.read(x, 2**63))", f"nbytes {2**63} refused"),
    "read 2**64 - 1": ("refused(lambda: alloc.read(x, ALL))", f"nbytes {2**64 - 1} refused"),
    "read at -1": ("refused(lambda: alloc.read(-1, 4))", "address -0x1 refused"),
    "read wraps": ("refused(lambda: alloc.read(ALL - 15, 32))", "runs past"),
    "write wraps": ("refused(lambda: alloc.write(ALL - 1, b'abcd'))", "runs past"),
    "driver read -1": ("refused(lambda: sim.read(x, -1))", "nbytes -1 refused"),
    "copy_d2h -1": ("refused(lambda: sim.copy_d2h(host, x, -1, 0))", "nbytes -1 refused"),
    "copy_d2h 2**64 - 1": ("refused(lambda: sim.copy_d2h(host, x, ALL, 0))", f"nbytes {2**64 - 1} refused"),
    "copy_d2h host wraps": ("refused(lambda: sim.copy_d2h(ALL - 15, x, 32, 0))", "host range"),
    "copy_h2d -1": ("refused(lambda: sim.copy_h2d(x, host, -1, 0))", "nbytes -1 refused"),
    "copy_h2d device wraps": ("refused(lambda: sim.copy_h2d(ALL - 15, host, 32, 0))", "address range"),
    "host_copy -1": ("refused(lambda: sim.host_copy(resv, host, -1))", "nbytes -1 refused"),
    "host_copy dst wraps": ("refused(lambda: sim.host_copy(ALL - 7, host, 16))", "dst range"),
    "host_alloc -1": ("refused(lambda: sim.host_alloc(-1))", "nbytes -1 refused"),
    "host_alloc 2**64 - 1": ("refused(lambda: sim.host_alloc(ALL))", f"nbytes {2**64 - 1} refused"),
    "host_reserve -1": ("refused(lambda: sim.host_reserve(-1))", "nbytes -1 refused"),
    "host_register -1": ("refused(lambda: sim.host_register(resv, -1))", "nbytes -1 refused"),
    "host_unreserve 2**64 - 1": ("refused(lambda: sim.host_unreserve(resv, ALL))", f"nbytes {2**64 - 1} refused"),
}


@pytest.mark.parametrize("case", sorted(PYTHON_CASES))
def test_a_length_or_offset_out_of_range_is_refused_in_python(case: str) -> None:
    """A negative, huge or wrapping length or address is refused by value before the C boundary; nothing crashes."""
    code, expected = PYTHON_CASES[case]
    out = isolated(code)
    assert "REFUSED" in out and expected in out, out
    assert re.search(r"from [01] to 2\*\*63 - 1|2\*\*64 - 1", out), out


def test_a_refusal_changes_nothing() -> None:
    """After refused reads, writes and copies the allocation still holds its bytes and the host its pins."""
    out = isolated(
        """
        alloc.write(x, b"kept")
        for thunk in (lambda: alloc.read(x, -1), lambda: alloc.write(ALL - 1, b"ab"), lambda: sim.host_alloc(-5)):
            refused(thunk)
        print("BYTES", alloc.read(x, 4), sim.host_used == G)
        """
    )
    assert out.count("REFUSED") == 3 and "BYTES b'kept' True" in out, out


# -- straight to C: the library refuses what wraps or overruns, with its reason ------------------------------

C_CASES = {
    "tp_drv_read 2**64 - 1": ("c_call('tp_drv_read', table, x, ctypes.create_string_buffer(1), ALL)", "read"),
    "tp_drv_read wraps": ("c_call('tp_drv_read', table, x + 16, ctypes.create_string_buffer(1), ALL - 8)", "read"),
    "tp_drv_read 2**63": ("c_call('tp_drv_read', table, x, ctypes.create_string_buffer(1), 2**63)", "read"),
    "tp_drv_write 2**64 - 1": ("c_call('tp_drv_write', table, x, b'a', ALL)", "write"),
    "tp_drv_copy_d2h 2**64 - 1": ("c_call('tp_drv_copy_d2h', table, host, x, ALL, 0)", "copy_d2h"),
    "tp_drv_copy_d2h host wraps": ("c_call('tp_drv_copy_d2h', table, ALL - 15, x, 32, 0)", "copy_d2h"),
    "tp_drv_copy_h2d 2**64 - 1": ("c_call('tp_drv_copy_h2d', table, x, host, ALL, 0)", "copy_h2d"),
    "tp_drv_host_copy 2**64 - 1": ("c_call('tp_drv_host_copy', table, resv, host, ALL)", "host_copy"),
    "tp_drv_host_alloc 2**64 - 1": (
        "c_call('tp_drv_host_alloc', table, ALL, 0, 0, ctypes.byref(ctypes.c_uint64()))",
        "host_alloc",
    ),
    "tp_drv_host_register 2**64 - 1": ("c_call('tp_drv_host_register', table, resv, ALL)", "host_alloc"),
    "tp_drv_host_unreserve 2**64 - 1": ("c_call('tp_drv_host_unreserve', table, resv, ALL)", "host_unreserve"),
    "tp_host_pages_reserve 2**64 - 1": (
        "c_call('tp_host_pages_reserve', ALL, ctypes.byref(ctypes.c_uint64()))",
        "mmap",
    ),
    "tp_host_pages_fault 2**64 - 1": ("c_call('tp_host_pages_fault', resv, ALL, 1, None)", "madvise"),
    "tp_map_span wraps": (
        "tid = alloc._table.tag_id('r')\n"
        "alloc._table.freeze('r'); alloc._table.mark_released('r')\n"
        "c_call('tp_map_span', alloc._table.ctx, tid, ALL - G + 1, 2 * G, 0)",
        "restore",
    ),
}


@pytest.mark.parametrize("case", sorted(C_CASES))
def test_the_library_refuses_a_wrapping_or_huge_length_itself(case: str) -> None:
    """Straight to C (ctypes, no Python check): a length of 2**63 or more or a range past 2**64 returns -1, no copy."""
    code, call = C_CASES[case]
    out = isolated(code)
    line = next((row for row in out.splitlines() if row.startswith("RC ")), "")
    assert line.startswith(f"RC -1 {call} ") and "refused" in line, out


def test_the_library_takes_no_negative_count_of_errors() -> None:
    """tp_errors with a negative capacity copies nothing (it was a memcpy of a negative size)."""
    out = isolated(
        """
        buf = (native.TpErr * 1)()
        print("COPIED", lib.tp_errors(alloc._table.ctx, buf, -1))
        """
    )
    assert "COPIED 0" in out, out


# -- the CUDA driver: the same refusals, in Python and in its C calls ---------------------------------------


@pytest.mark.gpu
def test_the_cuda_driver_refuses_the_same_lengths_in_python_and_in_c() -> None:
    """On the CUDA driver: read(x, -1), a wrapping copy and a huge pin are refused in Python, and straight to C each returns -1 with its reason."""
    out = isolated(
        """
        from torpor.allocator import CudaDriver
        cuda = TaggedAllocator(CudaDriver())
        y, pinned, table = cuda.allocate(G, "w"), cuda.driver.host_alloc(G), cuda.driver._table()
        refused(lambda: cuda.read(y, -1))
        refused(lambda: cuda.driver.copy_d2h(pinned, ALL - 15, 32, 0))
        refused(lambda: cuda.driver.host_alloc(ALL))
        c_call("tp_drv_read", table, y, ctypes.create_string_buffer(1), ALL)
        c_call("tp_drv_write", table, ALL - 1, b"ab", 2)
        c_call("tp_drv_copy_d2h", table, pinned, y, ALL, 0)
        c_call("tp_drv_copy_h2d", table, ALL - 15, pinned, 32, 0)
        c_call("tp_drv_host_copy", table, pinned, pinned, ALL)
        c_call("tp_drv_host_alloc", table, ALL, 0, 0, ctypes.byref(ctypes.c_uint64()))
        c_call("tp_drv_host_register", table, pinned, ALL)
        print("BYTES", len(cuda.read(y, 16)))
        cuda.close()
        """
    )
    assert out.count("REFUSED") == 3, out
    rows = [row for row in out.splitlines() if row.startswith("RC ")]
    assert len(rows) == 7 and all(row.startswith("RC -1 ") and "refused" in row for row in rows), out
    assert "BYTES 16" in out, out


# -- the call table: one place from a call's name to its id and its C function ------------------------------------

_CSRC = Path(__file__).resolve().parents[1] / "torpor" / "allocator" / "native" / "csrc"


def test_the_call_table_gives_each_call_its_library_id_and_an_exported_function() -> None:
    """CALL_TABLE's ids are csrc/tp.h's call ids, in CALLS at their index, and each view call's symbol is the library's."""
    from torpor.allocator.native import library as native
    from torpor.allocator.native.driver import CALL_TABLE, Driver

    body = re.search(r"enum \{\s*(TP_GRANULARITY,.*?)TP_NCALLS", (_CSRC / "tp.h").read_text(), re.S)
    assert body is not None, "csrc/tp.h lost its enum of call ids"
    ids = {
        name.strip().removeprefix("TP_").lower(): i for i, name in enumerate(body.group(1).split(",")) if name.strip()
    }
    table_ids = {name: call.call_id for name, call in CALL_TABLE.items() if call.call_id is not None}
    assert table_ids == ids
    assert all(Driver.CALLS[i] == name for name, i in ids.items()) and len(Driver.CALLS) == len(ids)
    symbols = [call.symbol for call in CALL_TABLE.values() if call.symbol is not None]
    assert set(symbols) <= set(native._SIGNATURES) and all(hasattr(native.lib(), s) for s in symbols)
    drv = (_CSRC / "drv.c").read_text()
    assert all(re.search(rf"\b{s}\(", drv) for s in symbols), "a view call's function is not in csrc/drv.c"
    assert set(Driver.VIEW_CALLS) == {n for n in Driver.CALLS if CALL_TABLE[n].symbol is not None}


def test_setting_the_library_resolves_every_call_once() -> None:
    """A library put on a driver is asked for each call's function when set, not at each call (a proxy sees no lookup)."""
    from torpor.allocator import SimDriver

    class Proxy:
        def __init__(self, lib: object) -> None:
            self.lib, self.looked_up = lib, []

        def __getattr__(self, name: str) -> object:
            self.looked_up.append(name)
            return getattr(self.lib, name)

    sim = SimDriver(8 << 20, granularity=2 << 20)
    proxy = Proxy(sim.lib)
    sim.lib = proxy
    resolved = [n for n in proxy.looked_up if n.startswith("tp_drv_")]
    assert len(resolved) == len(set(resolved)) and "tp_drv_host_alloc" in resolved
    proxy.looked_up.clear()
    for _ in range(3):
        sim.host_free(sim.host_alloc(2 << 20))
    assert not [n for n in proxy.looked_up if n.startswith("tp_drv_")]
    assert proxy.looked_up.count("tp_sim_hit") == 6  # the simulator still records every call through the library set


@pytest.mark.parametrize("call", ["map", "read", "no_such_call"])
def test_invoking_a_call_the_view_does_not_make_names_the_calls_it_makes(call: str) -> None:
    """invoke() of a table's call, of a library call that is no driver call, or of no call at all names the view's calls."""
    from torpor.allocator import SimDriver
    from torpor.errors import BadArgument

    sim = SimDriver(8 << 20, granularity=2 << 20)
    with pytest.raises(BadArgument, match=rf"cannot invoke '{call}': .*; it invokes granularity, host_reserve, "):
        sim.invoke(call)
    assert sim.count(call) == 0
