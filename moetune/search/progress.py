"""The progress display of `tune_block` on stderr: bucket i of n, candidates, the best time, and an ETA
for the bucket (its share's end) and for the whole run (the budget's end) — both upper bounds, a bucket
stops early when its study converges. One line rewritten in place on a terminal; elsewhere a line every
`every_s` seconds."""

from __future__ import annotations

import math
import sys
import time


class Display:
    def __init__(self, buckets: int, budget_s: float, t0: float, *, stream=None, every_s: float = 5.0):
        self.n, self.budget_s, self.t0 = buckets, budget_s, t0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.last = every_s, -math.inf
        self.width = 0

    def _write(self, line: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        elif force or now - self.last >= self.every_s:
            self.stream.write(line + "\n")
        else:
            return
        self.last = now
        self.stream.flush()

    def __call__(self, ev: dict) -> None:
        """A `progress` event of the round loop (one per candidate evaluated)."""
        lo, hi = ev["bucket"]
        best = ev.get("best_s", math.inf)
        floor = ev.get("floor_s") or 0.0
        pct = f" ({100 * floor / best:.0f}% of floor)" if floor and math.isfinite(best) else ""
        shown = f"{best * 1e6:.1f} µs" if math.isfinite(best) else "–"
        self._write(f"moetune tune [{ev.get('index', 0) + 1}/{self.n}] bucket [{lo},{hi}]: "
                    f"{ev['evaluated']} candidates, best {shown}{pct}; "
                    f"bucket ETA ≤ {ev.get('bucket_left_s', 0.0):.0f} s, all ≤ {self._left():.0f} s")

    def bucket_done(self, i: int, r) -> None:
        self._write(f"moetune tune [{i + 1}/{self.n}] bucket [{r.bucket[0]},{r.bucket[1]}] done in "
                    f"{r.elapsed_s:.1f} s: {r.stopped}; all ≤ {self._left():.0f} s left", force=not self.tty)

    def _left(self) -> float:
        return max(0.0, self.t0 + self.budget_s - time.monotonic())

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
