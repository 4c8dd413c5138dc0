"""Bytes moved, per tier, per state and per direction: the numbers the traffic model is checked against."""
from __future__ import annotations

import threading
from collections import defaultdict


class TrafficCounters:
    """Thread-safe byte counters keyed by (tier, state, direction), direction in {"read", "write"}.

    "read" means bytes fetched from the tier toward the device, "write" bytes evicted into it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str, str], int] = defaultdict(int)

    def add(self, tier: str, state: str, direction: str, num_bytes: int) -> None:
        if num_bytes:
            with self._lock:
                self._bytes[(tier, state, direction)] += num_bytes

    def get(self, tier: str | None = None, state: str | None = None, direction: str | None = None) -> int:
        with self._lock:
            return sum(
                n for (t, s, d), n in self._bytes.items()
                if (tier is None or t == tier) and (state is None or s == state) and (direction is None or d == direction)
            )

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return dict(self._bytes)

    def as_flat_dict(self) -> dict[str, int]:
        """``{"ssd/weights/read": bytes, ...}`` for loggers and JSON."""
        return {f"{t}/{s}/{d}": n for (t, s, d), n in sorted(self.snapshot().items())}

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()


def traffic_delta(before: dict, after: dict) -> dict[str, int]:
    """``"tier/state/direction" -> bytes`` moved between two ``TrafficCounters.snapshot()``s."""
    return {"/".join(k): v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}
