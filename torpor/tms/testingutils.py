"""What ``torch_memory_saver.testing_utils`` gives under the switch: TMS's test helpers, for its example scripts.

``is_xpu()``, ``get_device()``, ``empty_cache()`` and ``get_and_print_gpu_memory(message,
gpu_id=0)``, with TMS's names and output, so TMS's own examples run
unmodified on torpor (CUDA only: torpor has no XPU or ROCm path).
"""

from __future__ import annotations


def is_xpu() -> bool:
    """False: torpor runs on CUDA only (TMS's tests skip their XPU cases on it)."""
    return False


def get_device() -> str:
    """Device string for tests: 'cuda'."""
    return "cuda"


def empty_cache() -> None:
    """torch.cuda.empty_cache()."""
    import torch

    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Print and return device memory in use on ``gpu_id`` (NVML's count, as TMS reads it)."""
    import torch

    mem = int(torch.cuda.device_memory_used(gpu_id))
    print(f"GPU {gpu_id} memory: {mem / 1024**3:.2f} GB ({message})")  # noqa: T201 -- TMS's helper prints
    return mem
