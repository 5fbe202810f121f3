"""Routing traces: each MoE layer's top-k expert ids, step by step, recorded from a real model.

File format (version 1): a NumPy `.npz` archive (zip of `.npy` arrays, read with
allow_pickle=False), arrays

    format       str   "moetune-trace"         (anything else: not a trace file)
    version      int   1
    E, k         int   experts, experts per token
    layers       str   [L]      the experts modules' paths, e.g. "model.layers.3.mlp.experts"
    step_tokens  int64 [S]      real tokens T of each recorded forward call (Σ = N; no padding)
    step_phase   int8  [S]      0 prefill (prompt), 1 decode
    ids          int16|int32 [L, N, k]  top-k ids, token rows of the steps one after the other
    meta         str   JSON object: model class, source, date, …

`Trace.load` checks every array's presence, dtype and shape and names the file in its error
(`TraceError`) for a truncated, foreign or inconsistent file.

`record(model, inputs, steps)` runs a prompt forward and `steps` greedy decode steps with forward
pre-hooks on the hooked experts modules that moetune.ir.capture finds (captured or not: their
routing ids are valid either way; without capture, the modules with the `has_gate`/`is_transposed`
attributes that transformers' experts hook sets), which see
`(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k])`, and keeps the rows of real tokens
only: the attention mask's ones in the prompt, the unfinished sequences' rows in a decode step.
"""

from __future__ import annotations

import json
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import MoetuneError

FORMAT = "moetune-trace"
VERSION = 1
PHASES = {"prefill": 0, "decode": 1}


class TraceError(MoetuneError):
    """A trace file is missing, truncated, of another format or version, or inconsistent; names it."""


@dataclass(frozen=True, eq=False)
class Trace:
    E: int
    k: int
    layers: tuple[str, ...]
    step_tokens: np.ndarray  # [S]
    step_phase: np.ndarray  # [S] 0 prefill, 1 decode
    ids: np.ndarray  # [L, N, k]
    meta: dict = field(default_factory=dict)
    name: str = "trace"

    def __post_init__(self) -> None:
        _check(self, self.name)

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])

    @property
    def steps(self) -> int:
        return int(self.step_tokens.shape[0])

    def pools(self, phase: str = "all") -> list[np.ndarray]:
        """Per layer, the token rows [N', k] of the steps of `phase` ("all", "prefill", "decode")."""
        if phase == "all":
            return [self.ids[i] for i in range(len(self.layers))]
        if phase not in PHASES:
            raise TraceError(f"{self.name}: phase {phase!r}; known: all, prefill, decode")
        keep = np.repeat(self.step_phase == PHASES[phase], self.step_tokens)  # [N]
        if not keep.any():
            raise TraceError(f"{self.name}: no {phase} steps in the trace")
        return [self.ids[i][keep] for i in range(len(self.layers))]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")  # np.savez would add it anyway
        dtype = np.int16 if self.E <= np.iinfo(np.int16).max else np.int32
        np.savez_compressed(
            path, format=np.array(FORMAT), version=np.array(VERSION), E=np.array(self.E),
            k=np.array(self.k), layers=np.array(self.layers, dtype=str),
            step_tokens=self.step_tokens.astype(np.int64), step_phase=self.step_phase.astype(np.int8),
            ids=self.ids.astype(dtype), meta=np.array(json.dumps(self.meta)))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"trace file {path}: not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError, NotImplementedError) as e:
            raise TraceError(f"trace file {path}: not a readable .npz archive (truncated or foreign file): "
                             f"{type(e).__name__}: {e}") from None
        fmt = arrays.get("format")
        if fmt is None or fmt.shape != () or str(fmt) != FORMAT:
            raise TraceError(f"trace file {path}: not a moetune trace (no format={FORMAT!r} entry)")
        need = ("version", "E", "k", "layers", "step_tokens", "step_phase", "ids", "meta")
        missing = [n for n in need if n not in arrays]
        if missing:
            raise TraceError(f"trace file {path}: missing arrays {missing}")
        version = _scalar(arrays, "version", int, path)
        if version != VERSION:
            raise TraceError(f"trace file {path}: version {version}, this moetune reads {VERSION}")
        try:
            meta = json.loads(_scalar(arrays, "meta", str, path))
        except json.JSONDecodeError as e:
            raise TraceError(f"trace file {path}: meta is not JSON: {e}") from None
        if not isinstance(meta, dict):
            raise TraceError(f"trace file {path}: meta is {type(meta).__name__} JSON, expected an object")
        layers = arrays["layers"]
        if layers.ndim != 1 or layers.dtype.kind != "U":
            raise TraceError(f"trace file {path}: layers of dtype {layers.dtype}, shape {layers.shape}; "
                             "expected [L] strings")
        for name in ("step_tokens", "step_phase", "ids"):
            if not np.issubdtype(arrays[name].dtype, np.integer):
                raise TraceError(f"trace file {path}: {name} of dtype {arrays[name].dtype}, expected integers")
        return cls(E=_scalar(arrays, "E", int, path), k=_scalar(arrays, "k", int, path),
                   layers=tuple(str(s) for s in layers), step_tokens=arrays["step_tokens"],
                   step_phase=arrays["step_phase"], ids=arrays["ids"], meta=meta, name=str(path))


def _scalar(arrays: dict, name: str, kind: type, path: Path):
    """The 0-d array `name` of a trace file as an int or a str; TraceError naming the file otherwise."""
    a = arrays[name]
    ok = a.shape == () and (np.issubdtype(a.dtype, np.integer) if kind is int else a.dtype.kind == "U")
    if not ok:
        raise TraceError(f"trace file {path}: {name} of dtype {a.dtype}, shape {a.shape}; expected one "
                         f"{'integer' if kind is int else 'string'}")
    return kind(a)


def _check(t: Trace, where: str) -> None:
    def bad(why: str) -> TraceError:
        return TraceError(f"trace {where}: {why}")

    if not (isinstance(t.E, int) and isinstance(t.k, int) and 1 <= t.k <= t.E):
        raise bad(f"E = {t.E}, k = {t.k}: need 1 ≤ k ≤ E")
    if t.ids.ndim != 3 or t.ids.shape[0] != len(t.layers) or t.ids.shape[2] != t.k:
        raise bad(f"ids shape {t.ids.shape}, need [L = {len(t.layers)}, N, k = {t.k}]")
    if not np.issubdtype(t.ids.dtype, np.integer):
        raise bad(f"ids dtype {t.ids.dtype}, need an integer type")
    if t.step_tokens.ndim != 1 or t.step_tokens.shape != t.step_phase.shape:
        raise bad(f"step_tokens {t.step_tokens.shape} / step_phase {t.step_phase.shape}: need [S] each")
    if (t.step_tokens < 1).any() or int(t.step_tokens.sum()) != t.ids.shape[1]:
        raise bad(f"step token counts sum to {int(t.step_tokens.sum())}, ids hold {t.ids.shape[1]} tokens")
    if not np.isin(t.step_phase, list(PHASES.values())).all():
        raise bad("step_phase values outside {0 prefill, 1 decode}")
    if t.ids.size and (t.ids.min() < 0 or t.ids.max() >= t.E):
        raise bad(f"expert ids span [{t.ids.min()}, {t.ids.max()}], outside [0, E = {t.E})")
    if t.ids.size and t.k > 1:
        s = np.sort(t.ids, axis=-1)
        if (s[..., 1:] == s[..., :-1]).any():
            raise bad("a token lists the same expert twice among its top-k")


# ---------------------------------------------------------------- recording


def experts_modules(model) -> list[tuple[str, object]]:
    """(path, experts module) of each hooked MoE layer, in model order."""
    try:
        from .capture import capture, is_hooked
    except ImportError:  # a build without capture: transformers' hook attributes alone
        capture = None
    if capture is not None:  # hooked experts modules, captured or not (routing ids are valid either way)
        found = [(c.path, c.experts) for c in capture(model, check=False)
                 if c.experts is not None and is_hooked(c.experts)]
        return [(f"{p}.experts" if p else "experts", m) for p, m in found]
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def _num_experts(mod) -> int:
    n = getattr(mod, "num_experts", None)
    if isinstance(n, int):
        return n
    w = next(p for name, p in mod.named_parameters() if "gate_up" in name or "up_proj" in name)
    return int(w.shape[0])


def _eos_ids(model) -> set[int]:
    """The token ids that end a sequence: the generation config's eos_token_id, else the config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _mask_of(ids, attention_mask, model_name: str):
    """The attention mask [B, S] as int64 ones (real tokens) and zeros (padding), checked against `ids`."""
    import torch

    if attention_mask is None:
        return torch.ones_like(ids)
    mask = torch.as_tensor(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise TraceError(f"{model_name}: attention mask of shape {tuple(mask.shape)} for input ids of shape "
                         f"{tuple(ids.shape)}; expected one 0/1 entry per token")
    if not ((mask == 0) | (mask == 1)).all():
        raise TraceError(f"{model_name}: attention mask holds values other than 0 (padding) and 1 (real token)")
    empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
    if empty:
        raise TraceError(f"{model_name}: attention mask rows {empty} have no real token; "
                         "expected at least one 1 per sequence")
    return mask.to(ids.device, torch.int64)


def record(model, inputs, steps: int = 8, attention_mask=None, name: str = "trace") -> Trace:
    """Run `inputs` (token ids [B, S], or a tokenizer's output with input_ids and attention_mask)
    through `model`, then up to `steps` greedy decode steps; trace each hooked MoE layer's routing.

    Only real tokens are recorded: step 0 is the prompt forward (T = the attention mask's ones, phase
    prefill), then one step per decode (T = the sequences not yet finished). Padding, left or right,
    is dropped, and each token gets the position it has in its own sequence (the mask's cumulative
    count), so a padded batch records the routing of each sequence run alone. A sequence that emits
    an end-of-sequence token (the model's generation config) is finished: its later rows are padding.
    Decoding stops early once every sequence has finished. Right padding suits attention layers; a
    recurrent (linear-attention) layer's state also runs over trailing padding, so pad such models on
    the left, as `moetune record` does.
    """
    import torch

    model_name = type(model).__name__
    found = experts_modules(model)
    if not found:
        raise TraceError(f"{model_name}: no hooked MoE experts module to trace "
                         "(unhooked families such as Llama4 and DBRX are not traced)")
    Es = {_num_experts(m) for _, m in found}
    if len(Es) != 1:
        raise TraceError(f"{model_name}: experts modules disagree on E: {sorted(Es)}")
    per_layer: list[list[np.ndarray]] = [[] for _ in found]

    def hook_for(i: int):
        def hook(mod, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            per_layer[i].append(idx.detach().to("cpu", torch.int64).numpy().reshape(-1, idx.shape[-1]))
        return hook

    if hasattr(inputs, "keys") and "input_ids" in inputs:  # a tokenizer's BatchEncoding / dict
        attention_mask = inputs.get("attention_mask", attention_mask)
        inputs = inputs["input_ids"]
    ids = torch.as_tensor(inputs)  # [B, S]
    if ids.ndim == 1:
        ids = ids[None]
    mask = _mask_of(ids, attention_mask, model_name)  # [B, S] 1 real token, 0 padding
    eos = torch.tensor(sorted(_eos_ids(model)), dtype=ids.dtype, device=ids.device)
    real: list[np.ndarray] = []  # per step, which of the hooked rows are real tokens  [T]
    handles = [m.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, (_, m) in enumerate(found)]
    try:
        with torch.no_grad():
            pos = (mask.cumsum(1) - 1).clamp(min=0)  # [B, S] each token's position in its own sequence
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            real.append(mask.flatten().bool().cpu().numpy())
            last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # [B] each sequence's last real token
            logits = out.logits[torch.arange(ids.shape[0], device=last.device), last]  # [B, V]
            live = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)  # [B] sequences not finished
            for _ in range(steps):
                nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
                live &= ~torch.isin(nxt[:, 0], eos)
                if not live.any():
                    break
                pos = mask.sum(1, keepdim=True)  # [B, 1]
                mask = torch.cat([mask, live[:, None].to(mask.dtype)], 1)  # [B, S+1]
                # transformers ≥ 5.2x names the KV cache `cache`; older releases `past_key_values`
                kv = ({"cache": out["cache"]} if "cache" in out
                      else {"past_key_values": out["past_key_values"]})
                out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, use_cache=True, **kv)
                real.append(live.cpu().numpy().copy())
                logits = out.logits[:, -1]  # [B, V]
    finally:
        for h in handles:
            h.remove()
    calls = {len(c) for c in per_layer}
    if calls != {len(real)}:
        raise TraceError(f"{model_name}: experts hooks fired {sorted(calls)} times for "
                         f"{len(real)} forward calls (layers skipped?)")
    rows = [[c[s].shape[0] for s in range(len(real))] for c in per_layer]
    if any(r != [len(keep) for keep in real] for r in rows):
        raise TraceError(f"{model_name}: experts hooks saw {rows[0]} token rows per forward call, the "
                         f"inputs hold {[len(keep) for keep in real]} (batch × length); cannot tell the "
                         "padding rows apart")
    k = per_layer[0][0].shape[1]
    arr = np.stack([np.concatenate([c[s][keep] for s, keep in enumerate(real)]) for c in per_layer])  # [L, N, k]
    step_tokens = [int(keep.sum()) for keep in real]
    meta = {"model": model_name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "batch": int(ids.shape[0]), "prompt_len": int(ids.shape[1]), "prompt_tokens": step_tokens[0],
            "decode_steps": len(real) - 1}
    return Trace(E=Es.pop(), k=int(k), layers=tuple(p for p, _ in found),
                 step_tokens=np.array(step_tokens, np.int64),
                 step_phase=np.array([PHASES["prefill"]] + [PHASES["decode"]] * (len(real) - 1), np.int8),
                 ids=arr, meta=meta, name=name)


def synthetic_trace(E: int, k: int, tokens: int = 4096, layers: int = 1, zipf: float = 1.0,
                    step: int = 64, seed: int = 0) -> Trace:
    """A Zipf-skewed trace: per layer a random ranking of the experts, weight ∝ 1/rank^zipf.

    Each token takes k distinct experts by weighted sampling without replacement (Gumbel top-k);
    `zipf=0` is uniform routing. Steps of `step` tokens, all marked decode.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        logw = -zipf * np.log(np.arange(1, E + 1))[rng.permutation(E)]  # [E]
        g = rng.gumbel(size=(tokens, E)) + logw  # [N, E]
        out.append(np.argpartition(-g, k - 1, axis=1)[:, :k])  # [N, k]
    steps = [step] * (tokens // step) + ([tokens % step] if tokens % step else [])
    return Trace(E=E, k=k, layers=tuple(f"synthetic.{i}" for i in range(layers)),
                 step_tokens=np.array(steps, np.int64), step_phase=np.ones(len(steps), np.int8),
                 ids=np.stack(out), meta={"source": "synthetic", "zipf": zipf, "seed": seed},
                 name=f"synthetic(E={E}, k={k}, zipf={zipf:g})")



def hot_trace(E: int, k: int, tokens: int = 4096, layers: int = 1, share: float = 0.5, step: int = 64,
              seed: int = 0) -> Trace:
    """One hot expert per layer: each token routes to it with probability `share` (so it takes about share·T
    rows; a token's experts are distinct, so T is the most any expert can take), its other experts uniform among
    the rest. Steps of `step` tokens, all marked decode."""
    if not 0.0 < share <= 1.0:
        raise TraceError(f"hot_trace: share {share}: expected 0 < share ≤ 1")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        hot = int(rng.integers(E))
        order = np.argsort(rng.random((tokens, E)), axis=1)  # [N, E] a random permutation per token
        rest = order[order != hot].reshape(tokens, E - 1)  # [N, E-1] the others, in random order
        ids = rest[:, :k].copy()  # [N, k]
        takes = rng.random(tokens) < share
        ids[takes, 0] = hot
        out.append(ids)
    steps = [step] * (tokens // step) + ([tokens % step] if tokens % step else [])
    return Trace(E=E, k=k, layers=tuple(f"hot.{i}" for i in range(layers)),
                 step_tokens=np.array(steps, np.int64), step_phase=np.ones(len(steps), np.int8),
                 ids=np.stack(out), meta={"source": "hot", "share": share, "seed": seed},
                 name=f"hot(E={E}, k={k}, share={share:g})")


ROUTINGS = "uniform, zipf:S (S > 0, e.g. zipf:1.0), hot (one expert in half the tokens) or trace:FILE"


def routing_trace(spec: str, E: int, k: int, seed: int = 0) -> Trace | None:
    """The routing `spec` names, as a trace of E experts, top-k: None for "uniform" (the routing model's own),
    a Zipf-skewed synthetic trace for "zipf:S", a hot-expert trace for "hot", the file for "trace:FILE".
    TraceError for another spec, or a trace file of other E or k."""
    name, _, arg = spec.partition(":")
    if name == "uniform" and not arg:
        return None
    if name == "hot" and not arg:
        return hot_trace(E, k, seed=seed)
    if name == "zipf":
        try:
            s = float(arg)
        except ValueError:
            s = -1.0
        if s > 0:
            return synthetic_trace(E, k, zipf=s, seed=seed)
    if name == "trace" and arg:
        t = Trace.load(arg)
        if (t.E, t.k) != (E, k):
            raise TraceError(f"routing {spec!r}: the trace has E={t.E}, k={t.k}; the block has E={E}, k={k}")
        return t
    raise TraceError(f"routing {spec!r}: expected {ROUTINGS}")
