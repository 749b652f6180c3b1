"""torpor keeper: host backups held by a small local process, so a backup a sleep wrote survives the engine's death.

The keeper (:class:`Keeper`, ``torpor keeper serve``) owns memfd regions and
hands them over a Unix socket (SCM_RIGHTS) to engines of its own user; an
engine's allocator maps them under its host backups (:func:`attach`), so a
sleep copies into keeper memory at the speed it copies into its own. A new
process of the same engine adopts the backup (:func:`adopt` for plain PyTorch,
:func:`open_backup` for anything else) after an identity check; :func:`prefetch`
as it starts pins the backup while its model is built. docs/keeper.md
has the design, the threat model and the limits.
"""

from __future__ import annotations

from torpor.errors import (
    AdoptionRefused,
    KeeperBudgetExceeded,
    KeeperDenied,
    KeeperError,
    KeeperPathRefused,
    KeeperUnavailable,
    KeeperUntrusted,
)
from torpor.keeper.adoption import adopt, identity_of, track_model
from torpor.keeper.backing import KeeperBacking, attach
from torpor.keeper.daemon import Keeper
from torpor.keeper.fingerprint import ModelIdentity, TensorSpec, mismatch
from torpor.keeper.kept import Adopted, KeptBackup, claim_backup, open_backup
from torpor.keeper.link import KeeperLink
from torpor.keeper.prefetching import Pinned, prefetch, wait_released
from torpor.keeper.wire import socket_path

__all__ = [
    "Adopted",
    "AdoptionRefused",
    "Keeper",
    "KeeperBacking",
    "KeeperBudgetExceeded",
    "KeeperDenied",
    "KeeperError",
    "KeeperLink",
    "KeeperPathRefused",
    "KeeperUnavailable",
    "KeeperUntrusted",
    "KeptBackup",
    "ModelIdentity",
    "Pinned",
    "TensorSpec",
    "adopt",
    "attach",
    "claim_backup",
    "identity_of",
    "mismatch",
    "open_backup",
    "prefetch",
    "socket_path",
    "track_model",
    "wait_released",
]
