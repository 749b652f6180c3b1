"""The wake check's sums: per chunk of a piece, by the reference on the simulated device and by the kernels on a GPU."""

from __future__ import annotations

import builtins
import random
from typing import Any

import numpy as np
import pytest
from support import RigMaker, cuda_with_triton

from torpor.allocator.squeeze.sum64 import sum64
from torpor.allocator.squeeze.wakecheck import (
    CHECK_CHUNK,
    ReadingSummer,
    Region,
    compare,
    summer_for,
)
from torpor.errors import BadArgument
from torpor.testrig import SimRig
from torpor.units import MiB


def filled(rig: SimRig, tag: str, nbytes: int, seed: int) -> tuple[int, bytes]:
    """An allocation of ``nbytes`` in ``tag`` on the simulated device, filled with seeded random bytes."""
    address = rig.allocator._table.alloc(tag, 0, nbytes)
    data = random.Random(seed).randbytes(nbytes)
    rig.allocator.write(address, data)
    return address, data


def test_reading_summer_sums_each_chunk_as_the_reference_keyed_by_its_offset(make_rig: RigMaker) -> None:
    """A region of 2.5 chunks gives three sums: sum64 of each chunk's bytes, keyed by the chunk's offset in the region."""
    rig = make_rig("default", capacity=64 * MiB)
    nbytes = 2 * CHECK_CHUNK + CHECK_CHUNK // 2
    address, data = filled(rig, "weights", nbytes, seed=1)
    (sums,) = ReadingSummer(rig.driver).sums([Region(address, nbytes, 0)])
    raw = np.frombuffer(data, dtype=np.uint8)
    assert sums == tuple(sum64(raw[k : k + CHECK_CHUNK], start=k) for k in range(0, nbytes, CHECK_CHUNK))
    assert len(sums) == 3


def test_one_changed_byte_is_named_by_its_chunk_and_address(make_rig: RigMaker) -> None:
    """Changing one byte of a region changes only its chunk's sum; compare names that chunk and its address range."""
    rig = make_rig("default", capacity=64 * MiB)
    nbytes = 3 * CHECK_CHUNK
    address, data = filled(rig, "weights", nbytes, seed=2)
    region = Region(address, nbytes, 0)
    summer = ReadingSummer(rig.driver)
    (before,) = summer.sums([region])
    at = CHECK_CHUNK + 12345
    rig.allocator.write(address + at, bytes([data[at] ^ 0x01]))
    (after,) = summer.sums([region])
    (mismatch,) = compare([region], [before], [after])
    assert mismatch.chunk == 1
    assert (mismatch.address, mismatch.nbytes) == (address + CHECK_CHUNK, CHECK_CHUNK)
    assert (mismatch.recorded, mismatch.found) == (before[1], after[1])
    assert compare([region], [before], [before]) == []


def test_compare_refuses_lists_of_different_lengths() -> None:
    """One recorded and one found per region, or BadArgument naming the three counts."""
    with pytest.raises(BadArgument, match="1, 0, 1"):
        compare([Region(0, 1, 0)], [], [(1,)])


def test_the_simulated_device_gets_the_reference_and_cuda_without_triton_none(
    make_rig: RigMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """summer_for gives the reference on the simulated device, and None (unchecked) for CUDA where triton is missing."""
    rig = make_rig("default")
    assert isinstance(summer_for(rig.driver), ReadingSummer)

    class Cuda:
        is_cuda = True

    real_import = builtins.__import__

    def no_triton(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "triton":
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert summer_for(Cuda()) is None


@pytest.mark.gpu
def test_the_gpu_sums_equal_the_reference_over_a_real_allocation() -> None:
    """On a GPU, CudaSummer's sums of a tagged allocation equal the reference's over the same bytes read back."""
    torch = cuda_with_triton()
    from torpor.allocator import TaggedAllocator
    from torpor.allocator.squeeze.wakecheck import CudaSummer

    alloc = TaggedAllocator()
    with alloc.use_memory_pool("weights"):
        x = torch.randn(3 * CHECK_CHUNK // 2 + 1000, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    region = Region(x.data_ptr(), x.numel() * x.element_size(), 0)
    assert CudaSummer().sums([region]) == ReadingSummer(alloc).sums([region])
