"""Adoption into a PyTorch model: a new process of an engine takes a dead one's backup from the keeper.

For plain PyTorch, :func:`adopt` copies engine ``engine``'s kept backup
(:mod:`torpor.keeper.kept`) into a freshly built model's parameters and
buffers after the keeper checked the model's identity: host-to-device from
regions pinned in pieces on threads (:mod:`torpor.keeper.pinnedcopy`), so the
copies run at host-link speed; with ``fallback`` given, a keeper that is gone
or refuses makes it say why and load the normal way instead. A backup
:func:`~torpor.keeper.prefetching.prefetch`-ed as the process started is taken
over (pinned while the model was built). :func:`identity_of` and
:func:`track_model` give a model's identity and its tensors' addresses (what a
sleeping engine publishes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from torpor.errors import BadArgument, KeeperError
from torpor.keeper.backing import KeeperBacking
from torpor.keeper.fingerprint import ModelIdentity, TensorSpec
from torpor.keeper.kept import ADOPTED, Adopted, open_backup
from torpor.keeper.pinnedcopy import copy_into
from torpor.keeper.prefetching import Pinned, taken
from torpor.statemachine.machine.controller import SleepController

if TYPE_CHECKING:
    import torch

__all__ = ["adopt", "identity_of", "track_model"]

logger = logging.getLogger("torpor.keeper")


# -- plain PyTorch -------------------------------------------------------------------------


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def identity_of(model: torch.nn.Module, source: str) -> ModelIdentity:
    """``model``'s identity: every parameter's and buffer's name, shape and dtype, and ``source``."""
    specs = [
        TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        for name, t in _tensors(model)
    ]
    return ModelIdentity.of(source, specs)


def track_model(backing: KeeperBacking, model: torch.nn.Module, source: str) -> ModelIdentity:
    """Have ``backing`` publish ``model``'s parameters and buffers after each sleep; its identity."""
    identity = identity_of(model, source)
    addresses = {}
    for name, t in _tensors(model):
        if not t.is_contiguous():
            msg = f"tensor {name!r} is not contiguous: a keeper backup is read back as contiguous bytes"
            raise BadArgument(msg)
        addresses[name] = t.data_ptr()
    backing.track(identity, addresses)
    return identity


def adopt(
    model: torch.nn.Module,
    *,
    source: str,
    keeper: str | os.PathLike[str] | None = None,
    engine: str = "default",
    controller: SleepController | None = None,
    fallback: Callable[[], object] | None = None,
    pin: bool = True,
) -> Adopted | None:
    """Copy engine ``engine``'s kept backup into freshly built ``model`` (its parameters and buffers, on any device).

    The backup must be of the same model (``source``, every tensor's name,
    shape and dtype): otherwise :class:`AdoptionRefused` says how they differ.
    ``fallback``: called instead of raising when there is nothing to adopt
    (no keeper, no backup, a mismatch); the reason is logged and None returned.
    ``pin``: register the regions with CUDA so the copies to a GPU run at
    host-link speed: in pieces, on threads, each copy enqueued once the pieces
    under it are pinned (:mod:`torpor.keeper.pinnedcopy`); a backup
    :func:`~torpor.keeper.prefetching.prefetch`-ed for ``keeper`` and ``engine``
    was pinned while the model was built. Returns once the weights are
    resident; the regions are unpinned and unmapped after, on a thread
    (:func:`~torpor.keeper.prefetching.wait_released`).
    """
    import torch

    identity = identity_of(model, source)
    devices = sorted({t.device.index or 0 for _, t in _tensors(model) if t.is_cuda})
    on_cuda = bool(devices)
    held = taken(keeper, engine)
    try:
        if held is not None:
            held.kept.verify(identity)
        else:
            held = Pinned(open_backup(identity, keeper=keeper, engine=engine), None)
    except KeeperError as exc:
        if held is not None:
            held.close()
        if fallback is None:
            raise
        ADOPTED["fallbacks"] += 1
        logger.warning("nothing adopted (%s); loading the model the normal way", exc)
        fallback()
        return None
    if pin and on_cuda:
        held.pin(devices[0])
    try:
        with torch.no_grad():
            copy_into(held.kept, _tensors(model), held.pieces)
        if on_cuda:
            torch.cuda.synchronize()
        adopted = held.kept.done(controller)
    except BaseException:
        if _copies_finished(on_cuda):
            held.close()
        # else: a copy may still read the regions; they stay pinned and mapped (logged) rather than be pulled away
        raise
    held.close_later()
    return adopted


def _copies_finished(on_cuda: bool) -> bool:
    """Whether no copy of the adoption can still read host memory (synchronized; False if that fails)."""
    if not on_cuda:
        return True
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:
        logger.exception("synchronizing after an adoption failed; its kept regions stay pinned and mapped")
        return False
    return True
