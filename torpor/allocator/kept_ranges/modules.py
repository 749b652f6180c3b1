"""The torch side of keeping a module whole across a level-2 discard: what no ``state_dict`` reload restores.

A level-2 sleep discards the ``weights`` tag; the engine then reloads its
parameters with ``load_state_dict``. A reload writes parameters and persistent
buffers, nothing else, so :class:`ModuleTracker` names the rest of what a
module holds in device memory, each storage once:

- non-persistent buffers (``register_buffer(..., persistent=False)``: rotary
  ``inv_freq`` and ``original_inv_freq`` in transformers' models);
- tensors held as plain attributes of a submodule, directly or one level down
  in a list, tuple or dict (caches such as ``cos_cached``), unless they share
  storage with something the reload writes.

:class:`~torpor.allocator.kept_ranges.keeping.KeepBook` asks for these ranges at each discard
and keeps them on the host. After a wake without a backup it calls
:meth:`ModuleTracker.fresh`, which (with ``check``) fills every reloadable
tensor inside the tag with 0xFF bytes (NaN in floating point) so that one the
reload skipped cannot pass for data: :meth:`ModuleTracker.unreloaded` names
each one still filled, :meth:`ModuleTracker.check_reloaded` raises
:class:`NotReloaded`. torch is imported only by the functions that use it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torpor.allocator.kept_ranges.ranges import KeptRange
from torpor.errors import NotReloaded

POISON = 0xFF
_MODULE_DICTS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    }
)


def _storage(t: Any) -> tuple[int, int]:
    s = t.untyped_storage()
    return int(s.data_ptr()), int(s.nbytes())


def _attribute_tensors(module: Any) -> Iterator[tuple[str, Any]]:
    """Tensors held as plain attributes (not parameters, not registered buffers), one container level down."""
    import torch

    for name, value in vars(module).items():
        if name in _MODULE_DICTS:
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            yield name, value
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter):
                    yield f"{name}[{i}]", item
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter):
                    yield f"{name}[{key!r}]", item


def reloadable(module: Any) -> dict[str, Any]:
    """What a ``state_dict`` reload writes: parameters and persistent buffers, by name."""
    return dict(module.state_dict(keep_vars=True))


def unrestorable(module: Any) -> list[tuple[str, Any]]:
    """Tensors of ``module`` that no ``state_dict`` reload restores, each storage once, by qualified name."""
    written = {_storage(t)[0] for t in reloadable(module).values()}
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        found = [(n, b) for n, b in sub._buffers.items() if b is not None and n in sub._non_persistent_buffers_set]
        found += list(_attribute_tensors(sub))
        for name, tensor in found:
            ptr, nbytes = _storage(tensor)
            if nbytes == 0 or ptr in written or ptr in seen:
                continue
            seen.add(ptr)
            out.append((dot + name, tensor))
    return out


class ModuleTracker:
    """A :class:`~torpor.allocator.kept_ranges.keeping.KeepSource` for one module (held weakly), with the reload check."""

    def __init__(self, module: Any, tag: str, *, check: bool = True) -> None:
        self.tag = tag
        self.check = check
        self._module = weakref.ref(module)
        self._filled: list[str] = []
        self.untrack: Callable[[], None] = lambda: None  # set by the allocator that keeps it

    def ranges(self) -> list[KeptRange]:
        """Each unrestorable tensor's whole storage (empty once the module is gone)."""
        module = self._module()
        if module is None:
            return []
        return [KeptRange(name, *_storage(t)) for name, t in unrestorable(module)]

    def fresh(self, inside: Callable[[int, int], bool]) -> None:
        """After a wake without a backup: fill each reloadable tensor inside the tag with 0xFF (``check`` only)."""
        self._filled = []
        module = self._module()
        if not self.check or module is None:
            return
        import torch

        with torch.no_grad():
            for name, t in reloadable(module).items():
                ptr, nbytes = _storage(t)
                if nbytes and t.is_contiguous() and inside(ptr, nbytes):
                    t.detach().view(-1).view(torch.uint8).fill_(POISON)
                    self._filled.append(name)

    def unreloaded(self) -> list[str]:
        """Names of the tensors filled at the last wake and not written since (their first and last bytes 0xFF)."""
        module = self._module()
        if module is None or not self._filled:
            return []
        import torch

        tensors = reloadable(module)
        names, flags = [], []
        for name in self._filled:
            t = tensors.get(name)
            if t is None:
                continue
            b = t.detach().reshape(-1).view(torch.uint8)
            ends = torch.cat([b[:8], b[-8:]])
            names.append(name)
            flags.append(torch.all(ends == POISON))
        if not flags:
            return []
        still = torch.stack(flags).tolist()
        return [n for n, f in zip(names, still, strict=True) if f]

    def check_reloaded(self) -> None:
        """Raise :class:`NotReloaded` naming every tracked tensor the reload left unwritten; forget the fill after."""
        missing = self.unreloaded()
        if missing:
            raise NotReloaded(self.tag, missing)
        self._filled = []
