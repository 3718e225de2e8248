"""The server's counters, gauges and histograms, exposed at /metrics in Prometheus' text format (version 0.0.4).

Hand-written for a dozen series (no prometheus_client dependency): `# HELP` and `# TYPE` per family, counters
ending in `_total`, histograms as cumulative `_bucket{le="..."}` lines ending at `+Inf`, then `_sum` and `_count`.
Updated from the engine's worker and the request handlers, read by the scraper: one lock guards them.
"""

from __future__ import annotations

import bisect
import threading

PREFIX = "tinyvila_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOK_S_BUCKETS = (1, 5, 10, 25, 50, 100, 150, 200, 300, 500, 1000)

# name -> (type, help, histogram buckets)
FAMILIES = {
    "requests_total": ("counter", "Chat-completion requests answered, by HTTP status code.", None),
    "prompt_tokens_total": ("counter", "Prompt tokens of answered requests (each one's whole conversation).", None),
    "prefill_tokens_total": ("counter", "Prompt tokens actually prefilled (the others came from reused chats).", None),
    "completion_tokens_total": ("counter", "Tokens generated.", None),
    "prefix_cache_hits_total": ("counter", "Multi-turn requests whose history matched a cached chat: only their "
                                "new question was prefilled.", None),
    "prefix_cache_misses_total": ("counter", "Multi-turn requests that matched no cached chat and prefilled their "
                                  "whole history.", None),
    "chats_recycled_total": ("counter", "New conversations that reused the oldest cached chat (cleared) instead "
                             "of allocating one: its KV cache and captured CUDA graphs were kept.", None),
    "cancelled_total": ("counter", "Requests whose client left before the answer ended (generation stopped).", None),
    "queue_depth": ("gauge", "Requests waiting for the engine's worker.", None),
    "cached_chats": ("gauge", "Conversations kept for prefix reuse.", None),
    "ttft_seconds": ("histogram", "Time from receiving a request to its first token (queueing, media decoding, "
                     "encoding and prefill).", TTFT_BUCKETS),
    "decode_tokens_per_second": ("histogram", "Decode rate of each answer longer than one token.", TOK_S_BUCKETS),
}


class Metrics:
    """Thread-safe values of FAMILIES; `render()` is the exposition."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}
        self._hist = {n: ([0] * (len(b) + 1), [0.0]) for n, (t, _, b) in FAMILIES.items() if t == "histogram"}

    def inc(self, name: str, by: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + by

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[(name, ())] = value

    def get(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0)

    def observe(self, name: str, value: float) -> None:
        counts, total = self._hist[name]
        with self._lock:
            counts[bisect.bisect_left(FAMILIES[name][2], value)] += 1  # le is inclusive: value == bound counts
            total[0] += value

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (kind, help_, buckets) in FAMILIES.items():
                full = PREFIX + name
                lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
                if kind == "histogram":
                    lines += self._histogram(full, buckets, *self._hist[name])
                    continue
                series = sorted((k[1], v) for k, v in self._values.items() if k[0] == name) or [((), 0)]
                lines += [f"{full}{_labels(labels)} {_num(v)}" for labels, v in series]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _histogram(full: str, buckets: tuple, counts: list[int], total: list[float]) -> list[str]:
        out, running = [], 0
        for le, n in zip([*map(_num, buckets), "+Inf"], counts):
            running += n
            out.append(f'{full}_bucket{{le="{le}"}} {running}')
        return out + [f"{full}_sum {_num(total[0])}", f"{full}_count {running}"]


def _labels(labels: tuple) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


def _num(v: float) -> str:
    return repr(float(v))
