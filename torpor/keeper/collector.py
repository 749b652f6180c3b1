"""Prometheus metrics of the keeper's side of an engine, for a process without torpor's telemetry.

With torpor's telemetry attached to the controller (``torpor.telemetry.attach``,
vLLM's ``/metrics``) the same ``torpor_keeper_*`` families come through it, per
rank (``torpor_engine``, ``torpor_rank``, ``keeper_engine``), in process and in
multiprocess mode: telemetry finds the backing as the allocator's host provider
(docs/keeper.md, "Metrics"). This collector is for a process that has no
telemetry: read at scrape time from a :class:`~torpor.keeper.backing.KeeperBacking`
and this process's adoptions (:data:`~torpor.keeper.kept.ADOPTED`);
``registry.register(KeeperCollector(backing))``. It describes its families, so a
registry that torpor's telemetry already feeds refuses it (one source per series)
instead of serving each family twice. Nothing else imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from torpor.keeper.backing import KeeperBacking
from torpor.keeper.kept import ADOPTED

__all__ = ["KeeperCollector"]


class KeeperCollector:
    """``torpor_keeper_*`` metrics of one engine's keeper backing (None: only this process's adoptions)."""

    def __init__(self, backing: KeeperBacking | None = None) -> None:
        self.backing = backing

    def describe(self) -> Iterator[Metric]:
        """The families :meth:`collect` yields (no samples), for the registry's duplicate check."""
        for family in self.collect():
            family.samples = []
            yield family

    def collect(self) -> Iterator[Metric]:
        engine = "" if self.backing is None else self.backing.engine
        if self.backing is not None:
            b = self.backing
            kept = GaugeMetricFamily(
                "torpor_keeper_host_bytes", "Host backup bytes held in keeper regions mapped here", labels=["engine"]
            )
            kept.add_metric([engine], b.kept_bytes)
            yield kept
            published = GaugeMetricFamily(
                "torpor_keeper_backup_bytes", "Bytes of the backup published to the keeper now", labels=["engine"]
            )
            published.add_metric([engine], b.published_bytes)
            yield published
            up = GaugeMetricFamily("torpor_keeper_up", "1 while the keeper answers this engine", labels=["engine"])
            up.add_metric([engine], 0 if b.gone else 1)
            yield up
            fallbacks = CounterMetricFamily(
                "torpor_keeper_fallbacks",
                "Host ranges left in the engine's own memory (keeper gone or over budget)",
                labels=["engine"],
            )
            fallbacks.add_metric([engine], b.fallbacks)
            yield fallbacks
        adopted = CounterMetricFamily("torpor_keeper_adopted_bytes", "Bytes adopted from a keeper by this process")
        adopted.add_metric([], ADOPTED["bytes"])
        yield adopted
        count = CounterMetricFamily("torpor_keeper_adoptions", "Backups adopted from a keeper by this process")
        count.add_metric([], ADOPTED["adoptions"])
        yield count
