"""Adoption: a new process of an engine takes a dead one's backup from the keeper, after an identity check.

:func:`open_backup` asks the keeper for engine ``engine``'s backup with this
process's :class:`~torpor.keeper.fingerprint.ModelIdentity` (a mismatch is
refused with the reason), maps its regions and gives each tensor's bytes
(:meth:`KeptBackup.view`); :meth:`KeptBackup.done` tells the keeper the copy is
made (it drops the backup) and records ``backup_adopted`` on a controller. For
plain PyTorch, :func:`adopt` does all of it for a freshly built model: it copies
each parameter's and buffer's bytes host-to-device (the regions are pinned
with ``cudaHostRegister`` first, so the copies run at host-link speed), and
with ``fallback`` given, a keeper that is gone or refuses makes it say why and
load the normal way instead. :func:`identity_of` and :func:`track_model` give
a model's identity and its tensors' addresses (what a sleeping engine publishes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torpor.keeper import shmem
from torpor.keeper.backing import KeeperBacking
from torpor.keeper.fingerprint import ModelIdentity, TensorSpec
from torpor.keeper.keeperclient import KeeperLink
from torpor.keeper.pinnedcopy import PinnedPieces, copy_into
from torpor.keeper.refusals import KeeperError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.machine.controller import SleepController

if TYPE_CHECKING:
    import torch

__all__ = ["Adopted", "KeptBackup", "adopt", "identity_of", "open_backup", "track_model"]

logger = logging.getLogger("torpor.keeper")

#: Threads that pin a backup's regions as it is adopted (at most one per CPU).
PIN_THREADS = 16
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context: a model may span GPUs

#: Statistics of this process's adoptions (read by :mod:`torpor.keeper.keepermetrics`).
ADOPTED = {"adoptions": 0, "bytes": 0, "fallbacks": 0}


@dataclass(frozen=True)
class Adopted:
    """One adoption: the keeper's socket, the engine, the backup's id, the dead pid, bytes, tensors and seconds."""

    keeper: str
    engine: str
    backup: str
    from_pid: int
    bytes: int
    tensors: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"adopted backup {self.backup} of engine {self.engine!r} from dead pid {self.from_pid}: "
            f"{self.bytes} bytes in {self.tensors} tensors in {self.seconds:.3f} s"
        )


class KeptBackup:
    """A backup granted to this process: its regions mapped here, each tensor's bytes by name."""

    def __init__(
        self, link: KeeperLink, engine: str, reply: dict[str, Any], started: float, owns_link: bool = False
    ) -> None:
        self.link = link
        self._owns_link = owns_link
        self.engine = engine
        self.id = str(reply["backup"])
        self.from_pid = int(reply["pid"])
        self.nbytes = int(reply["bytes"])
        self._tensors: dict[str, list[list[int]]] = {n: e["segments"] for n, e in reply["tensors"].items()}
        self._started = started
        self._maps: dict[int, tuple[int, int]] = {}  # region -> (address, bytes)
        try:
            for rid, nbytes in reply["regions"].items():
                fd = link.map(int(rid))
                try:
                    self._maps[int(rid)] = (shmem.map_anywhere(fd, int(nbytes)), int(nbytes))
                finally:
                    os.close(fd)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each region mapped here (to pin them, say)."""
        return list(self._maps.values())

    def segments(self, name: str) -> Iterator[tuple[int, int, int]]:
        """(host address, bytes, offset in the tensor) of tensor ``name``'s bytes, in order."""
        at = 0
        for rid, offset, n in self._tensors[name]:
            yield self._maps[int(rid)][0] + int(offset), int(n), at
            at += int(n)

    def view(self, name: str) -> memoryview:
        """Tensor ``name``'s bytes (a copy when they lie in more than one segment)."""
        parts = list(self.segments(name))
        if len(parts) == 1:
            host, n, _ = parts[0]
            return memoryview((ctypes.c_char * n).from_address(host)).cast("B")
        return memoryview(b"".join(ctypes.string_at(h, n) for h, n, _ in parts))

    def done(self, controller: SleepController | None = None, keeper: str = "") -> Adopted:
        """The copy is made: the keeper drops the backup; ``backup_adopted`` goes to ``controller``'s log."""
        seconds = time.perf_counter() - self._started
        self.link.adopted(seconds)
        adopted = Adopted(
            keeper or str(self.link.path), self.engine, self.id, self.from_pid, self.nbytes, len(self._tensors), seconds
        )
        ADOPTED["adoptions"] += 1
        ADOPTED["bytes"] += self.nbytes
        if controller is not None:
            controller.record(
                EventKind.BACKUP_ADOPTED,
                keeper=adopted.keeper,
                engine=adopted.engine,
                backup=adopted.backup,
                from_pid=adopted.from_pid,
                bytes=adopted.bytes,
                tensors=adopted.tensors,
                seconds=adopted.seconds,
            )
        logger.info("%s", adopted)
        return adopted

    def close(self) -> None:
        """Unmap the regions (after the copies are done); close the connection if :func:`open_backup` made it."""
        for address, nbytes in self._maps.values():
            shmem.unmap(address, nbytes)
        self._maps.clear()
        if self._owns_link:
            self.link.close()

    def __enter__(self) -> KeptBackup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_backup(
    identity: ModelIdentity,
    *,
    keeper: str | os.PathLike[str] | None = None,
    engine: str = "default",
    link: KeeperLink | None = None,
) -> KeptBackup:
    """Engine ``engine``'s backup, checked against ``identity`` (raises :class:`AdoptionRefused` with the reason)."""
    started = time.perf_counter()
    owns = link is None
    link = link or KeeperLink(keeper)
    try:
        reply = link.adopt(engine, identity.to_dict())
    except BaseException:
        if owns:
            link.close()
        raise
    return KeptBackup(link, engine, reply, started, owns_link=owns)


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
            raise ValueError(msg)
        addresses[name] = t.data_ptr()
    backing.track(identity, addresses)
    return identity


def _cuda_pinning(device: int) -> tuple[Callable[[int, int], bool], Callable[[int, int], object]]:
    """Register and unregister host memory (portable) from a pool's thread, with ``device`` current in it.

    A thread of its own has no current device: the runtime would make
    device 0's primary context current, and create it on a rank whose model
    is on another GPU (memory on a GPU the rank does not own).
    """
    import torch

    def pin(address: int, nbytes: int) -> bool:
        torch.cuda.set_device(device)
        return int(_cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)) == 0

    def unpin(address: int, _nbytes: int) -> object:
        torch.cuda.set_device(device)
        return _cudart().cudaHostUnregister(address)

    return pin, unpin


def _cudart() -> Any:
    import torch

    return torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch's binding has no annotations


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
    ``pin``: register the regions with CUDA (cudaHostRegister) so the copies
    to a GPU run at host-link speed: in pieces, on :data:`PIN_THREADS` threads,
    each copy enqueued once the pieces under it are pinned
    (:mod:`torpor.keeper.pinnedcopy`).
    """
    import torch

    identity = identity_of(model, source)
    try:
        kept = open_backup(identity, keeper=keeper, engine=engine)
    except KeeperError as exc:
        if fallback is None:
            raise
        ADOPTED["fallbacks"] += 1
        logger.warning("nothing adopted (%s); loading the model the normal way", exc)
        fallback()
        return None
    pieces: PinnedPieces | None = None
    devices = sorted({t.device.index or 0 for _, t in _tensors(model) if t.is_cuda})
    on_cuda = bool(devices)
    try:
        if pin and on_cuda:
            pin_one, unpin_one = _cuda_pinning(devices[0])
            pieces = PinnedPieces(
                kept.regions(),
                pin_one,
                unpin_one,
                threads=min(PIN_THREADS, os.cpu_count() or 1),
                populate=shmem.populate,
            )
        with torch.no_grad():
            copy_into(kept, _tensors(model), pieces)
        if on_cuda:
            torch.cuda.synchronize()
        return kept.done(controller)
    finally:
        if _copies_finished(on_cuda):
            if pieces is not None:
                pieces.release()
            kept.close()
        # else: a copy may still read the regions; they stay pinned and mapped (logged) rather than be pulled away


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
