"""Server counters, rendered in Prometheus' text exposition format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class Metrics:
    """Counters the app and the runner update; ``render`` adds the gauges read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.tokens: Counter[str] = Counter()
        self.seconds = 0.0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record(self, result: Any) -> None:
        with self._lock:
            self.tokens["prompt"] += result.prompt_tokens
            self.tokens["cached"] += result.cached_tokens
            self.tokens["completion"] += result.completion_tokens
            self.seconds += result.seconds

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """``gauges``: name -> (help, value)."""
        with self._lock:
            requests, tokens, seconds = dict(self.requests), dict(self.tokens), self.seconds
        lines = ["# HELP kvstate_requests_total HTTP requests answered, by endpoint and status.",
                 "# TYPE kvstate_requests_total counter"]
        lines += [f'kvstate_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(requests.items())]
        for kind, what in (("prompt", "Prompt tokens of completed requests."),
                           ("cached", "Prompt tokens reused from a pooled or stored state instead of recomputed."),
                           ("completion", "Tokens generated.")):
            lines += [f"# HELP kvstate_{kind}_tokens_total {what}", f"# TYPE kvstate_{kind}_tokens_total counter",
                      f"kvstate_{kind}_tokens_total {tokens.get(kind, 0)}"]
        lines += ["# HELP kvstate_generation_seconds_total Seconds the model spent on completed requests.",
                  "# TYPE kvstate_generation_seconds_total counter", f"kvstate_generation_seconds_total {seconds:.6f}"]
        for name, (what, value) in gauges.items():
            lines += [f"# HELP kvstate_{name} {what}", f"# TYPE kvstate_{name} gauge", f"kvstate_{name} {value:g}"]
        return "\n".join(lines) + "\n"
