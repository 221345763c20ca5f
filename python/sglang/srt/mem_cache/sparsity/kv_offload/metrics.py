"""Prometheus metrics of kv offload, served by SGLang's ``/metrics`` with ``--enable-metrics``.

Created in the scheduler process like upstream's ``SchedulerMetricsCollector`` (same labels, the
multiprocess collector aggregates them) and refreshed from the coordinator's state at most once per
``UPDATE_INTERVAL_S`` from the scheduler loop: host-side counters only, no device sync.
"""

from __future__ import annotations

import time
from typing import Dict, Mapping

# Gauges: the value now. Name -> (documentation, how to read it from the offload state).
GAUGES = {
    "host_pool_free_tokens": ("Free host pool slots (tokens).", lambda s: s["free"]["host"]),
    "host_pool_used_tokens": (
        "Host pool slots holding offloaded KV (tokens).",
        lambda s: s["initial_free"]["host"] - s["free"]["host"],
    ),
    "physical_rows_free": (
        "Free GPU KV rows (sparse slots, decode tails, prompt staging).",
        lambda s: s["free"]["physical"],
    ),
    "sparse_slots_used": ("GPU sparse slots held by requests.", lambda s: s["sparse_slots_held"]),
    "backups_in_flight": (
        "Page backups device -> host not yet complete.",
        lambda s: s["backups_in_flight"],
    ),
    "requests": ("Requests whose KV is offloaded.", lambda s: s["requests"]),
}
# Counters: totals since start; the state holds running totals, the counters grow by the difference.
COUNTERS = {
    "topk_rows_selected": ("Top-k rows attention read (all layers).", "selected"),
    "topk_rows_hit": ("Top-k rows found in the request's GPU sparse slots.", "hits"),
    "topk_rows_tail": ("Top-k rows read from the GPU decode tail (not yet backed up).", "tail"),
    "rows_loaded": ("Rows loaded host -> device (top-k misses).", "loaded"),
    "bytes_loaded": ("Bytes loaded host -> device.", "loaded_bytes"),
    "backup_tokens": ("Tokens backed up device -> host.", "backup_tokens"),
    "deferred_backups": ("Backups deferred because the host pool was full.", "deferred_backups"),
    "prefill_waits": (
        "Prefills that waited for GPU rows (the kv offload admission gate).",
        "prefill_waits",
    ),
}


class KVOffloadMetrics:
    """The ``sglang:kv_offload_*`` metrics of one scheduler process."""

    UPDATE_INTERVAL_S = 1.0

    def __init__(self, labels: Mapping[str, str]) -> None:
        # Imported here, as upstream does, after PROMETHEUS_MULTIPROC_DIR is set for this process.
        from prometheus_client import Counter, Gauge

        self.labels = dict(labels)
        names = list(self.labels)
        self.gauges = {
            key: Gauge(
                name=f"sglang:kv_offload_{key}",
                documentation=doc,
                labelnames=names,
                multiprocess_mode="mostrecent",
            )
            for key, (doc, _) in GAUGES.items()
        }
        self.counters = {
            key: Counter(name=f"sglang:kv_offload_{key}", documentation=doc, labelnames=names)
            for key, (doc, _) in COUNTERS.items()
        }
        for metric in (*self.gauges.values(), *self.counters.values()):
            metric.labels(**self.labels)  # exported (at 0) from the start
        self._last: Dict[str, int] = {key: 0 for key in COUNTERS}
        self._next_update = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._next_update

    def update(self, state: Mapping) -> None:
        self._next_update = time.monotonic() + self.UPDATE_INTERVAL_S
        for key, (_, read) in GAUGES.items():
            self.gauges[key].labels(**self.labels).set(read(state))
        for key, (_, field) in COUNTERS.items():
            value = int(state[field])
            if value > self._last[key]:
                self.counters[key].labels(**self.labels).inc(value - self._last[key])
            self._last[key] = value
