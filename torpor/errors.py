"""torpor's errors: each one is built with the data it names, then raised."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class TorporError(Exception):
    """Base of every error torpor raises."""


class InvalidTransition(TorporError, RuntimeError):
    """A command the current state does not allow: ``command``, ``state``, ``since`` (event #), ``allowed`` states."""

    def __init__(
        self,
        command: str,
        state: str,
        since: int,
        allowed: Iterable[str],
        detail: str = "",
        since_wall: str = "",
    ) -> None:
        self.command = command
        self.state = state
        self.since = since
        self.allowed = tuple(allowed)
        self.detail = detail
        at = f" at {since_wall}" if since_wall else ""
        allowed_txt = ", ".join(self.allowed) if self.allowed else "nowhere"
        extra = f"; {detail}" if detail else ""
        msg = f"cannot {command} from {state!r} (event #{since}{at}); allowed from: {allowed_txt}{extra}"
        super().__init__(msg)


class CommandInFlight(TorporError, RuntimeError):
    """A command arrived while another command held the controller."""

    def __init__(self, command: str, in_flight: str, state: str) -> None:
        self.command = command
        self.in_flight = in_flight
        self.state = state
        msg = f"cannot {command}: {in_flight!r} is in flight (state {state!r}); retry when it ends"
        super().__init__(msg)


class PoolBusy(TorporError, RuntimeError):
    """The graph pool cannot be released: ``holders`` names each (a live graph and its site, or other references)."""

    def __init__(self, reason: str, holders: Sequence[str] = ()) -> None:
        self.reason = reason
        self.holders = tuple(holders)
        super().__init__(reason)


class UnknownTag(TorporError, ValueError):
    """A tag that the memory does not hold."""

    def __init__(self, tags: Iterable[str], known: Iterable[str]) -> None:
        self.tags = tuple(tags)
        self.known = tuple(sorted(known))
        msg = f"unknown tag(s) {', '.join(repr(t) for t in self.tags)}; known tags: {', '.join(self.known) or 'none'}"
        super().__init__(msg)


class NoTagsNamed(TorporError, ValueError):
    """``tags=[]`` names no tag (``None`` names every tag): refused, naming the state and the asleep tags."""

    def __init__(self, command: str, state: str, since: int, asleep: Sequence[str]) -> None:
        self.command, self.state, self.since, self.asleep = command, state, since, tuple(asleep)
        held = f"; asleep: {', '.join(asleep)}" if asleep else ""
        msg = f"cannot {command} tags=[]: it names no tag (state {state!r} since event #{since}{held}); "
        super().__init__(f"{msg}name the tags to {command}, or pass None for all")


class InvalidLevel(TorporError, ValueError):
    """A sleep level other than 1 or 2."""

    def __init__(self, level: object) -> None:
        self.level = level
        super().__init__(f"sleep level must be 1 or 2, got {level!r}")


class MemoryOperationFailed(TorporError, RuntimeError):
    """A memory operation failed: ``operation`` (the step), ``tag``, ``call`` (the driver call, when known)."""

    def __init__(self, operation: str, tag: str | None, reason: str, call: str | None = None) -> None:
        self.operation, self.tag, self.call, self.reason = operation, tag, call, reason
        where = f" of tag {tag!r}" if tag else ""
        via = f" ({call})" if call else ""
        super().__init__(f"{operation}{where} failed{via}: {reason}")


class OutOfMemory(MemoryOperationFailed):
    """Device or host memory ran out during a memory operation."""


class LogCorrupted(TorporError, ValueError):
    """An event log line that is not a valid event (not the torn last line)."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: corrupted event log line: {reason}")


class UnknownSchemaVersion(TorporError, ValueError):
    """An event written by a schema this torpor does not read."""

    def __init__(self, path: str, line: int, version: object, supported: int) -> None:
        self.path, self.line, self.version, self.supported = path, line, version, supported
        super().__init__(
            f"{path}:{line}: event schema version {version!r} is not supported "
            f"(this torpor reads version {supported}); upgrade torpor to read this log"
        )


class EventTooLarge(TorporError, ValueError):
    """An event whose encoded form exceeds the log's line limit."""

    def __init__(self, kind: str, size: int, limit: int) -> None:
        self.kind, self.size, self.limit = kind, size, limit
        super().__init__(f"event {kind!r} encodes to {size} bytes, over the {limit}-byte line limit")


class NotRecovered(TorporError, RuntimeError):
    """The log ends inside a transition: the engine is not in a clean state."""

    def __init__(self, state: str, last_seq: int, step: str, cause: str = "") -> None:
        self.state = state
        self.last_seq = last_seq
        self.step = step
        self.cause = cause
        if cause:  # this process: the log could not record a rollback
            super().__init__(
                f"the event log ends in {state!r} at event #{last_seq} ({step}): {cause}; once the log can be "
                "written again, call controller.recover(), which takes each tag's residency from the memory"
            )
            return
        super().__init__(
            f"the event log ends in {state!r} at event #{last_seq} ({step}): the process "
            "was interrupted mid-transition and memory may be partly released; call "
            "controller.recover() after restarting the engine, or start a new log"
        )


class MissingExtra(TorporError, ImportError):
    """A GPU feature without its optional dependencies: ``feature``, ``module`` (the failed import), ``extra``."""

    def __init__(self, feature: str, module: str, extra: str = "cuda", cause: str = "") -> None:
        self.feature = feature
        self.module = module
        self.extra = extra
        why = f" ({cause})" if cause else ""
        also = " (or '.[vllm]', which brings vLLM's torch)" if extra == "cuda" else ""
        msg = (
            f"{feature} needs {module}, which cannot be imported here{why}; "
            f"install the {extra!r} extra: pip install '.[{extra}]' from a torpor checkout{also}"
        )
        super().__init__(msg, name=module)


class ControllerClosed(TorporError, RuntimeError):
    """A command or record on a controller that was closed."""

    def __init__(self, command: str, engine: str, rank: int, closed_at: int) -> None:
        self.command = command
        self.engine = engine
        self.rank = rank
        self.closed_at = closed_at
        super().__init__(
            f"cannot {command}: the controller of engine {engine!r} rank {rank} was closed at event #{closed_at}; "
            "open a new SleepController on its log to continue"
        )


class UnsafeLogPath(TorporError, PermissionError):
    """An event log path torpor will not write: a link, not a regular file, or owned or writable by someone else."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing to write the event log {path}: {reason}")


class NotAnEventLog(TorporError, ValueError):
    """An existing file passed as an event log that is not one: torpor will not truncate or append to it."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"refusing to write the event log {path}: the file exists and is not a torpor event log ({reason}); "
            "give a new path or a directory"
        )


class LogLocked(TorporError, RuntimeError):
    """Another writer holds the event log (one writer per log, locked for the writer's lifetime)."""

    def __init__(self, path: str, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(
            f"cannot write the event log {path}: it is held by another writer ({holder}); "
            "each engine rank needs its own log (set a different engine name, rank or log directory)"
        )


class LogWriteFailed(TorporError, OSError):
    """An event could not be written (a full disk, an I/O error); the log was cut back to its last whole line."""

    def __init__(self, path: str, kind: str, seq: int, reason: str) -> None:
        self.path = path
        self.kind = kind
        self.seq = seq
        self.reason = reason
        super().__init__(
            f"writing event #{seq} ({kind}) to {path} failed: {reason}; the log ends at its last whole line "
            "and the event is not recorded"
        )


class GroupFailed(TorporError, RuntimeError):
    """A collective command failed on some rank, so every rank undid its part (raised on every rank alike).

    ``ranks``: each failed rank -> why; ``command``, ``group``, ``round`` (its command number), ``size``.
    """

    def __init__(self, command: str, group: str, round: int, size: int, ranks: dict[int, str]) -> None:
        self.command = command
        self.group = group
        self.round = round
        self.size = size
        self.ranks = dict(sorted(ranks.items()))
        which = ", ".join(str(r) for r in self.ranks)
        why = "; ".join(f"rank {r}: {reason}" for r, reason in self.ranks.items())
        super().__init__(
            f"{command} failed on rank {which} of group {group!r} ({size} ranks, command #{round}), so every "
            f"rank rolled back to its state before the command ({why}); fix the cause and retry on every rank"
        )


class EndpointError(TorporError, RuntimeError):
    """An endpoint refused a request or could not be reached: ``url``, ``status`` (None: no answer), ``reason``."""

    def __init__(self, url: str, status: int | None, reason: str) -> None:
        self.url = url
        self.status = status
        self.reason = reason
        answer = f"answered {status}" if status is not None else "did not answer"
        super().__init__(f"{url} {answer}: {reason}")


class StateTimeout(TorporError, TimeoutError):
    """``Client.wait_for`` ran out of time: names the state wanted and the state seen last."""

    def __init__(self, wanted: str, seen: str, timeout: float, url: str) -> None:
        self.wanted = wanted
        self.seen = seen
        self.timeout = timeout
        self.url = url
        super().__init__(f"{url}: the rank did not reach {wanted!r} within {timeout:g} s; it is {seen!r}")


class HostBudgetExceeded(TorporError, RuntimeError):
    """A sleep whose backups would pin more host memory than the host-memory budget allows (nothing was touched).

    ``needed`` (per tag in ``offloading``), ``budget``, ``held`` (by tags asleep already), ``holders`` (``tag: bytes``).
    """

    def __init__(self, command: str, state: str, offloading: dict[str, int], held: dict[str, int], budget: int) -> None:
        self.command = command
        self.state = state
        self.offloading = dict(offloading)
        self.needed = sum(offloading.values())
        self.held = sum(held.values())
        self.budget = budget
        self.holders = [f"backup of {t} (asleep): {n} bytes" for t, n in sorted(held.items())] + [
            f"{t} to offload: {n} bytes" for t, n in sorted(offloading.items())
        ]
        asleep = ", ".join(f"{t} {n} B" for t, n in sorted(held.items())) or "none"
        wanted = ", ".join(f"{t} {n} B" for t, n in sorted(offloading.items()))
        msg = (
            f"cannot {command} from {state!r}: its backups need {self.needed} bytes of pinned host memory "
            f"({wanted}) and backups already hold {self.held} ({asleep}); the host budget is {budget} bytes. "
            "Nothing was released. Raise the budget (HostMemoryPolicy.budget_bytes, TORPOR_HOST_BUDGET), "
            "sleep at level 2 (discards weights), or wake the asleep tags first"
        )
        super().__init__(msg)


class DriverError(MemoryOperationFailed):
    """A driver call failed; ``call`` names it and ``code`` is the driver's error code when known."""

    def __init__(self, call: str, reason: str, code: int | None = None) -> None:
        self.code = code
        super().__init__("driver call", None, reason, call=call)


class DriverOutOfMemory(DriverError, OutOfMemory):
    """A driver call ran out of device or pinned host memory."""


class AllocatorError(MemoryOperationFailed):
    """An allocator operation (allocate, backup, release, restore, capture) failed or was refused."""


class AllocatorOutOfMemory(AllocatorError, OutOfMemory):
    """An allocator operation ran out of device or pinned host memory; nothing was lost."""


class AllocatorArgumentError(AllocatorError, ValueError):
    """An allocator call got a value it cannot take (a size, address or device out of range, an unusable tag name); nothing changed."""


class TagNotAwake(AllocatorError):
    """A block (or raw ``operation``, ``detail`` what) into a tag asleep or going to sleep (``state``; ``cause``: the sleep)."""

    def __init__(self, tag: str, state: str, cause: str, operation: str = "use_memory_pool", detail: str = "") -> None:
        self.state, self.cause = state, cause
        by, what = f" ({cause})" if cause else "", f"{detail}: " if detail else ""
        then = "before allocating in it" if operation == "use_memory_pool" else "first"
        super().__init__(operation, tag, f"{what}tag {tag!r} is {state}{by}; wake it {then}")


class BlocksOpen(AllocatorError):
    """A sleep found blocks of its tags open (another thread's past the wait, or its own); ``holders``: tag and thread."""

    def __init__(self, reason: str, holders: Sequence[str]) -> None:
        self.holders = tuple(holders)
        super().__init__("sleep", None, reason)


class TelemetryError(TorporError):
    """Base of the errors torpor.telemetry raises."""


class DuplicateRank(TelemetryError, ValueError):
    """A second controller with the same engine and rank attached where the first is still exposed.

    Two sources with the same labels would give duplicate series, which
    Prometheus rejects. Carries ``engine``, ``rank`` and ``where`` (the registry
    or the multiprocess directory).
    """

    def __init__(self, engine: str, rank: int, where: str) -> None:
        self.engine = engine
        self.rank = rank
        self.where = where
        super().__init__(
            f"cannot attach engine {engine!r} rank {rank} to {where}: a controller with the same engine and rank "
            "is already attached there (its series would be duplicated); detach it first or use another engine name"
        )


class BadRequest(TorporError, ValueError):
    """A query the endpoint refuses; the message is the 400 body's reason."""


class CaptureRoutingError(TorporError, RuntimeError):
    """A capture could not be routed (the pool is active but no controller was given)."""


class GroupUnsupported(TorporError, ValueError):
    """A process group torpor cannot agree over (torch.distributed not initialized, or this process not in it)."""


class FleetError(TorporError, ValueError):
    """A directory that holds no per-rank event logs (or is not a directory)."""


class NotWired(TorporError, RuntimeError):
    """torpor was selected but vLLM in this process does not use torpor's allocator."""


class ActivationError(TorporError, RuntimeError):
    """torpor cannot take over vLLM's allocator in this process (vLLM's CuMemAllocator already holds memory)."""


class DemoError(TorporError, RuntimeError):
    """The demo cannot run here (a missing piece, or a device it cannot use)."""


class NotReloaded(TorporError, RuntimeError):
    """Tracked tensors that no reload wrote after a wake without a backup; ``names`` lists them."""

    def __init__(self, tag: str, names: list[str]) -> None:
        self.tag = tag
        self.names = list(names)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        msg = (
            f"{len(names)} tracked tensor(s) of tag {tag!r} were not written since the wake that discarded them: "
            f"{shown}; their memory holds 0xFF filler, not weights: load them (load_state_dict(..., strict=True)) "
            "before the next forward"
        )
        super().__init__(msg)


class TrackRefused(TorporError, ValueError):
    """``track`` refused: the memory cannot keep ranges, or the policy never discards the tag."""
