"""`moetune tune --devices 0,1,…`: one `moetune tune` worker process per device of this host, one shared study.

Each worker is the same command line without `--devices`, with `CUDA_VISIBLE_DEVICES` set to its device and
`--storage` the shared Optuna storage (the one given, else a journal file beside the table), so the workers
share the trials of every bucket's study and write to the one table (search/tune.py says how). Their lines
are printed as they come, each prefixed by its device; their own progress displays are replaced by one line
for all of them: trials finished over the studies of the storage, and the time left of the budget.

A worker that dies (a signal, a crash) costs only its running trial, which a live worker retries (RDB
storages; on a journal file the trial stays running and is counted by nobody): the run goes on with the
others. The exit status is the worst of the workers that finished (2, then 1, then 0); every worker
dying is 1.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

from ..ir import ConfigError

# set in a worker's environment: its progress display stays off (the parent draws one for all)
WORKER_ENV = "MOETUNE_TUNE_WORKER"


def parse_devices(text: str) -> list[str]:
    """"0,1,3" → ["0", "1", "3"]: distinct non-negative device indices, each visible here where CUDA is."""
    items = [t.strip() for t in text.split(",")]
    if not items or not all(t.isdigit() for t in items):
        raise ConfigError(f"--devices {text!r}: expected device indices, e.g. 0,1")
    if len(set(items)) != len(items):
        raise ConfigError(f"--devices {text!r}: a device is named twice")
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        over = [t for t in items if int(t) >= n]
        if over:
            raise ConfigError(f"--devices {text!r}: device {over[0]} is not visible here ({n} CUDA device(s))")
    return items


def worker_argv(argv: list[str], storage: str) -> list[str]:
    """The command line of one worker: `argv` (tune's own arguments, the subcommand first) without
    `--devices`, with `--storage storage`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--devices":
            skip = True
            continue
        if a.startswith("--devices="):
            continue
        out.append(a)
    if "--storage" not in out and not any(a.startswith("--storage=") for a in out):
        out += ["--storage", storage]
    return out


class _Progress:
    """One line on stderr for all workers: trials finished over the storage's studies, time left."""

    def __init__(self, storage: str, n: int, budget_s: float, t0: float, stream=None, every_s: float = 5.0):
        self.storage, self.n, self.budget_s, self.t0 = storage, n, budget_s, t0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.width, self.opened = every_s, 0, None

    def _trials(self) -> tuple[int, int] | None:
        try:
            import optuna

            from ..search.study import open_storage

            if self.opened is None:
                self.opened = open_storage(self.storage)
            studies = optuna.get_all_study_summaries(self.opened, include_best_trial=False)
        except Exception:  # noqa: BLE001 - the storage not created yet, or busy: no count this time
            return None
        return len(studies), sum(s.n_trials for s in studies)

    def draw(self, alive: int) -> None:
        got = self._trials()
        left = max(0.0, self.t0 + self.budget_s - time.monotonic())
        done = f"{got[1]} trials over {got[0]} bucket studies" if got else "no study yet"
        line = f"moetune tune: {alive} of {self.n} workers running, {done}; budget ≤ {left:.0f} s left"
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()
    stream.close()


def run_workers(argv: list[str], devices: list[str], storage: str, budget_s: float, *,
                every_s: float = 5.0) -> int:
    """Start one worker per device (module doc), print their lines and one progress line, wait for all;
    the exit status (module doc)."""
    cmd = [sys.executable, "-m", "moetune.cli", *worker_argv(argv, storage)]
    print(f"moetune tune: {len(devices)} workers (devices {', '.join(devices)}), shared storage {storage}",
          flush=True)
    lock, pumps, procs = threading.Lock(), [], []
    t0 = time.monotonic()
    for d in devices:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=d, **{WORKER_ENV: d})
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, bufsize=1)
        procs.append((d, p))
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            th = threading.Thread(target=_pump, args=(stream, f"[device {d}] ", out, lock), daemon=True)
            th.start()
            pumps.append(th)
    bar = _Progress(storage, len(devices), budget_s, t0, every_s=every_s)
    last = -math.inf
    try:
        while any(p.poll() is None for _, p in procs):
            if time.monotonic() - last >= every_s:
                with lock:
                    bar.draw(sum(p.poll() is None for _, p in procs))
                last = time.monotonic()
            time.sleep(0.2)
    except KeyboardInterrupt:
        for _, p in procs:
            p.terminate()
        raise
    finally:
        for th in pumps:
            th.join(5)
        bar.close()
    codes = {d: p.returncode for d, p in procs}
    died = {d: c for d, c in codes.items() if c < 0}
    finished = [c for c in codes.values() if c >= 0]
    for d, c in died.items():
        print(f"moetune tune: the worker on device {d} died (signal {-c}); its running trial is retried by the "
              "others", flush=True)
    rc = max(finished) if finished else 1
    print(f"moetune tune: {len(devices)} workers done in {time.monotonic() - t0:.0f} s, exit statuses "
          + ", ".join(f"device {d}: {c}" for d, c in codes.items()) + f"; exit status {rc}", flush=True)
    return rc
