"""The shared predicate: is the cuMem CUDA-graph pool active? Capture routing, NCCL and all-reduce all read it.

The pool is active only when the option is on, sleep mode is on, the sleep
backend is one of the cuMem family (``cumem``, ``torpor``), CUDA graphs are on
and the platform is CUDA. Opted in but inactive: one warning per process
naming what is missing (however many call sites ask). Not opted in: silence,
and nothing changes anywhere. Engine-neutral: the vLLM plugin feeds it from
vLLM's config, plain PyTorch users from their own settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torpor.hooks._record import record_decision
from torpor.hooks._warn import warn_once

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController

#: Sleep backends whose memory is cuMem (the graph pool needs one of them).
CUMEM_BACKENDS: frozenset[str] = frozenset({"cumem", "torpor"})

#: Requirement names, in the order they are checked and reported.
REQUIREMENTS: tuple[str, ...] = ("offload_cudagraph", "sleep_mode", "cumem_backend", "cudagraphs", "cuda_platform")


@dataclass(frozen=True)
class CudagraphPoolDecision:
    """Whether the cuMem graph pool is active, and if not, which requirements are unmet.

    ``missing`` holds requirement names (see :data:`REQUIREMENTS`) and
    ``reasons`` a sentence for each, in the same order.
    """

    active: bool
    opted_in: bool
    missing: tuple[str, ...]
    reasons: tuple[str, ...]
    backend: str | None
    platform: str

    def describe(self) -> str:
        """One line: active, or inactive with what is missing."""
        if self.active:
            return f"cuMem graph pool active (backend {self.backend!r}, platform {self.platform!r})"
        what = "; ".join(f"{name}: {why}" for name, why in zip(self.missing, self.reasons, strict=True))
        return f"cuMem graph pool inactive ({what})"


def detect_platform() -> str:
    """``cuda``, ``rocm`` or ``cpu``, from the installed torch (``cpu`` without torch)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if getattr(torch.version, "hip", None):
        return "rocm"
    if torch.version.cuda and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _unmet(
    offload_cudagraph: bool, sleep_mode: bool, backend: str | None, cudagraphs: bool, platform: str
) -> list[tuple[str, str]]:
    unmet: list[tuple[str, str]] = []
    if not offload_cudagraph:
        unmet.append(("offload_cudagraph", "the option is off"))
    if not sleep_mode:
        unmet.append(("sleep_mode", "sleep mode is off"))
    name = (backend or "").strip().lower()
    if name not in CUMEM_BACKENDS:
        family = ", ".join(sorted(CUMEM_BACKENDS))
        shown = repr(backend) if backend else "none"
        unmet.append(("cumem_backend", f"sleep backend {shown} is not one of the cuMem backends {family}"))
    if not cudagraphs:
        unmet.append(("cudagraphs", "CUDA graphs are off: eager mode"))
    if platform.strip().lower() != "cuda":
        unmet.append(("cuda_platform", f"platform {platform!r} is not CUDA"))
    return unmet


def cudagraph_pool_decision(
    offload_cudagraph: bool,
    sleep_mode: bool,
    backend: str | None,
    cudagraphs: bool,
    platform: str | None,
    *,
    controller: SleepController | None = None,
) -> CudagraphPoolDecision:
    """Decide whether CUDA graphs are captured into the cuMem graph pool.

    Opted in (``offload_cudagraph``) but inactive logs exactly one warning per
    process for the same missing requirements; not opted in logs nothing. With
    a ``controller`` the decision is also recorded as a ``hook_decision`` event
    (hook ``cudagraph_pool``), whatever it is. ``platform`` None means
    :func:`detect_platform` (it imports torch only when the option is on).
    """
    if platform is None:
        platform = detect_platform() if offload_cudagraph else "unknown"
    unmet = _unmet(bool(offload_cudagraph), bool(sleep_mode), backend, bool(cudagraphs), platform)
    decision = CudagraphPoolDecision(
        active=not unmet,
        opted_in=bool(offload_cudagraph),
        missing=tuple(name for name, _ in unmet),
        reasons=tuple(why for _, why in unmet),
        backend=backend,
        platform=platform,
    )
    if decision.opted_in and not decision.active:
        what = "; ".join(f"{name}: {why}" for name, why in unmet)
        warn_once(
            f"cudagraph_pool:{','.join(decision.missing)}",
            f"offload_cudagraph is on but the cuMem graph pool is not used. Missing {what}. "
            "CUDA graphs stay in plain pools, keep their memory while asleep, "
            "and NCCL and custom all-reduce settings are left as they are.",
        )
    record_decision(controller, "cudagraph_pool", decision.active, decision.describe())
    return decision
