"""A model's identity for adoption: the tagged tensors' names, shapes and dtypes, and the model it started from.

The values are not part of it (an RL engine's weights are the trainer's latest
push, not the checkpoint: that is why the backup is worth adopting). Two
identities match when every field is equal; :func:`mismatch` says how they
differ, in words an operator can act on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torpor.errors import BadArgument

__all__ = ["ModelIdentity", "TensorSpec", "mismatch"]


@dataclass(frozen=True)
class TensorSpec:
    """One tagged tensor: its ``name``, ``shape``, ``dtype`` (a name such as ``bfloat16``) and ``nbytes``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(str(data["name"]), tuple(int(n) for n in data["shape"]), str(data["dtype"]), int(data["nbytes"]))


@dataclass(frozen=True)
class ModelIdentity:
    """What an adopter must match: ``source`` (the model it started from: a name, a path, a revision) and ``tensors``."""

    source: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def digest(self) -> str:
        """A SHA-256 of the identity (the same for the same source, names, shapes and dtypes, in any order)."""
        body = json.dumps(
            [self.source, sorted([t.name, list(t.shape), t.dtype] for t in self.tensors)], separators=(",", ":")
        )
        return hashlib.sha256(body.encode()).hexdigest()

    def summary(self) -> str:
        """One line: the source, how many tensors, their bytes and the digest's first 12 digits."""
        return f"{self.source or '(no source)'}: {len(self.tensors)} tensors, {self.nbytes} bytes, {self.digest()[:12]}"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "digest": self.digest(), "tensors": [t.to_dict() for t in self.tensors]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelIdentity:
        return cls(str(data.get("source", "")), tuple(TensorSpec.from_dict(t) for t in data.get("tensors", ())))

    @classmethod
    def of(cls, source: str, tensors: Sequence[TensorSpec]) -> ModelIdentity:
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            msg = f"tensor names must be unique in a model identity; named more than once: {', '.join(twice[:5])}"
            raise BadArgument(msg)
        return cls(source, tuple(tensors))


def _shown(names: Sequence[str], n: int = 3) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def mismatch(kept: ModelIdentity, asked: ModelIdentity) -> str | None:
    """How the adopter's identity ``asked`` differs from the backup's ``kept`` (None: they match)."""
    reasons = []
    if kept.source != asked.source:
        reasons.append(f"the backup is of {kept.source!r}, this process built {asked.source!r}")
    mine = {t.name: t for t in kept.tensors}
    theirs = {t.name: t for t in asked.tensors}
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if missing:
        reasons.append(f"{len(missing)} tensor(s) of the backup are not in this model ({_shown(missing)})")
    if extra:
        reasons.append(f"{len(extra)} tensor(s) of this model are not in the backup ({_shown(extra)})")
    differ = [
        f"{name}: {list(mine[name].shape)} {mine[name].dtype} kept, {list(t.shape)} {t.dtype} here"
        for name, t in theirs.items()
        if name in mine and (mine[name].shape != t.shape or mine[name].dtype != t.dtype)
    ]
    if differ:
        reasons.append(f"{len(differ)} tensor(s) differ in shape or dtype ({_shown(differ)})")
    return "; ".join(reasons) or None
