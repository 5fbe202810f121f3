"""Where a decode step's time goes (`bench.decode`): the experts' kernels of profiled uncompiled steps, the kernels,
idle gaps and host calls of the compiled steps, and a step with the experts switched off.
"""

from __future__ import annotations

import torch

from bench.models import generate_once, generation_config

SCOPE = "moetune.bench::experts"  # the profiler scope around each experts call


class ProfileWindow:
    """A logits processor that runs `prof` over the forwards of decode steps 1..`steps` of a `generate` call
    (started once the prefill's logits are there, stopped once step `steps`' are)."""

    def __init__(self, prof, steps: int, cuda: bool):
        self.prof, self.steps, self.cuda, self.calls, self.running = prof, steps, cuda, 0, False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.cuda:
            torch.cuda.synchronize()  # no prefill kernel in the window, every step's kernel in it
        if self.calls == 1:
            self.prof.start()
            self.running = True
        elif self.calls == self.steps + 1 and self.running:
            self.prof.stop()
            self.running = False
        return scores


def profile_moe(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> dict:
    """`steps` decode steps of an uncompiled `generate` of `ids` under torch.profiler, each experts module's call
    in a `record_function` scope (hooks that exist for this call only): {moe_us, kernels_us} per step, device
    time on a GPU (the scopes' kernels; all kernels), CPU time on the CPU (the scopes; every top-level op)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from moetune.testing import moe_blocks

    cuda = ids.device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    scopes: list = []

    def enter(mod, args):
        scope = torch.profiler.record_function(SCOPE)
        scope.__enter__()
        scopes.append(scope)

    def leave(mod, args, out):
        scopes.pop().__exit__(None, None, None)

    hooks = []
    for _, block in moe_blocks(model):
        hooks += [block.experts.register_forward_pre_hook(enter), block.experts.register_forward_hook(leave)]
    window = ProfileWindow(prof, steps, cuda)
    try:
        generate_once(model, ids, generation_config(steps + 1, "none", cuda), (window,))
    finally:
        for h in hooks:
            h.remove()
        if window.running:
            prof.stop()
    events = prof.events()
    mine = [e for e in events if e.name == SCOPE and e.device_type == DeviceType.CPU]
    if cuda:
        work = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.name != SCOPE]
        kernels = sum(e.time_range.elapsed_us() for e in work)
        spans = [e.time_range for e in events if e.name == SCOPE and e.device_type == DeviceType.CUDA]
        if spans:  # the kernels inside a scope's span on the GPU timeline (one stream: the scope's own), so that
            # kernels no aten op launches (Triton's) count too, and the host's gaps inside the span do not
            moe = sum(e.time_range.elapsed_us() for e in work if any(
                s.start <= e.time_range.start and e.time_range.end <= s.end for s in spans))
        else:  # the scope's linked kernels
            moe = sum(e.device_time_total for e in mine)
    else:
        moe = sum(e.cpu_time_total for e in mine)
        kernels = sum(e.cpu_time_total for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None)
    return dict(moe_us=moe / steps, kernels_us=kernels / steps, profiled_steps=steps, scopes=len(mine))


def compiled_kernels(model: torch.nn.Module, ids: torch.Tensor, new: int, mode: str, steps: int, top: int) -> dict:
    """The GPU kernels of decode steps 1..`steps` of a `generate` under the compile `mode` (the graphs the timed runs
    replayed; kernels inside CUDA graphs are traced as themselves): `timeline` of the kernels, with host_calls, the
    `top` CUDA runtime and driver calls of the host per step by count."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    window = ProfileWindow(prof, steps, True)
    try:
        generate_once(model, ids, generation_config(new, mode, True), (window,))
    finally:
        if window.running:
            prof.stop()
    events = prof.events()
    work = [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    line = timeline(work, steps, top)
    host: dict[str, int] = {}
    for e in events:  # the host's launches: graph replays, kernels launched outside a graph, copies, syncs
        if e.device_type == DeviceType.CPU and e.name.startswith(("cuda", "cu")) and not e.is_user_annotation:
            host[e.name] = host.get(e.name, 0) + 1
    return dict(line, host_calls={n: c / steps for n, c in sorted(host.items(), key=lambda kv: -kv[1])[:top]},
                steps=steps)


def timeline(work: list[tuple[str, float, float]], steps: int, top: int) -> dict:
    """The device's time of `steps` steps from its activities `work` [(name, start, end)] in µs: busy_us (the
    union of their intervals) and kernels_us (their sum) per step; kernels, the `top` names by time
    [{name, calls, us}] per step; idle_us, the time per step between the end of all earlier work and the start of
    the next, and gaps, the `top` of it keyed by the activities either side [{after, before, count, us}]."""
    by: dict[str, list[float]] = {}
    gaps: dict[tuple[str, str], list[float]] = {}
    busy, end, last = 0.0, None, None
    for name, a, b in sorted(work, key=lambda w: w[1]):
        by.setdefault(name, []).append(b - a)
        if end is not None and a > end:
            gaps.setdefault((last[:60], name[:60]), []).append(a - end)
        if end is None or a >= end:
            busy += b - a
            end, last = b, name
        elif b > end:
            busy += b - end
            end, last = b, name
    rows = sorted(({"name": n[:120], "calls": len(v) / steps, "us": sum(v) / steps} for n, v in by.items()),
                  key=lambda r: -r["us"])
    idle = sorted(({"after": a, "before": b, "count": len(v) / steps, "us": sum(v) / steps}
                   for (a, b), v in gaps.items()), key=lambda r: -r["us"])
    return dict(busy_us=busy / steps, kernels_us=sum(r["us"] for r in rows), kernels=rows[:top],
                idle_us=sum(r["us"] for r in idle), gaps=idle[:top])


class ExpertsOff:
    """Within the context every experts module of `model` returns zeros of its input's shape (the router, the
    attention and the rest of the step unchanged): a step without the experts, so that a variant's MoE time is its
    step time less this one's under the same compile."""

    def __init__(self, model: torch.nn.Module):
        from moetune.testing import moe_blocks

        self.experts = [block.experts for _, block in moe_blocks(model)]

    def __enter__(self):
        for m in self.experts:
            m.forward = lambda hidden, *args, **kw: torch.zeros_like(hidden)
        return self

    def __exit__(self, *exc):
        for m in self.experts:
            del m.forward
