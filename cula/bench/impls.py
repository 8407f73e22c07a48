"""Implementations the runner times, by name: ``cula``, ``fla``, ``flashkda``, ``ref``.

- ``cula``: the public ops (``cula.kda.chunk_kda``, ...), i.e. whatever cula's dispatch picks; the
  row records which backend ran (``cula.backends``) and any fallback warning.
- ``fla``: FLA 0.6.0's Triton ops with ``FLA_FLASH_KDA=0``, so ``chunk_kda`` never silently runs the
  FlashKDA CUTLASS backend. Lightning maps to ``chunk_simple_gla(g_gamma=-decay)``.
- ``flashkda``: the FlashKDA CUTLASS forward (``flash_kda.fwd``) when the package is importable;
  KDA prefill only.
- ``ref``: cula's torch references (``cula.ref.<variant>.chunked``, ``recurrent`` for decode) in fp32.

Every op module is imported lazily inside :meth:`Impl.prepare`, so the runner (and its tests) work
before the ops exist: a missing op makes the row ``unavailable`` with the import error.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Before anything imports fla: the fla impl must be FLA's Triton path, never FlashKDA.
os.environ["FLA_FLASH_KDA"] = "0"

import torch  # noqa: E402

from cula.bench.inputs import Inputs  # noqa: E402

IMPL_NAMES = ("cula", "fla", "flashkda", "ref")

# (variant, kind) -> {impl: (module, function)}; kind is "chunk" (prefill, train) or "decode".
OPS: dict[tuple[str, str], dict[str, tuple[str, str]]] = {
    ("kda", "chunk"): {"cula": ("cula.kda", "chunk_kda"), "fla": ("fla.ops.kda", "chunk_kda"),
                       "ref": ("cula.ref.kda", "chunked")},
    ("kda", "decode"): {"cula": ("cula.kda", "fused_recurrent_kda"),
                        "fla": ("fla.ops.kda", "fused_recurrent_kda"),
                        "ref": ("cula.ref.kda", "recurrent")},
    ("gdn", "chunk"): {"cula": ("cula.gdn", "chunk_gated_delta_rule"),
                       "fla": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                       "ref": ("cula.ref.gdn", "chunked")},
    ("gdn", "decode"): {"cula": ("cula.gdn", "fused_recurrent_gated_delta_rule"),
                        "fla": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                        "ref": ("cula.ref.gdn", "recurrent")},
    ("gla", "chunk"): {"cula": ("cula.gla", "chunk_gla"), "fla": ("fla.ops.gla", "chunk_gla"),
                       "ref": ("cula.ref.gla", "chunked")},
    ("gla", "decode"): {"cula": ("cula.gla", "fused_recurrent_gla"),
                        "fla": ("fla.ops.gla", "fused_recurrent_gla"),
                        "ref": ("cula.ref.gla", "recurrent")},
    ("lightning", "chunk"): {"cula": ("cula.lightning", "lightning_attn_fwd"),
                             "fla": ("fla.ops.simple_gla", "chunk_simple_gla"),
                             "ref": ("cula.ref.lightning", "chunked")},
    ("lightning", "decode"): {"cula": ("cula.lightning", "lightning_attn_decode"),
                              "fla": ("fla.ops.simple_gla", "fused_recurrent_simple_gla"),
                              "ref": ("cula.ref.lightning", "recurrent")},
}

# Flags each variant's ops understand (taken from the config's flags when present).
_VARIANT_FLAGS = {
    "kda": ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
            "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first"),
    "gdn": ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first"),
    "gla": ("state_v_first",),
    "lightning": (),
}


class Unavailable(Exception):
    """This implementation cannot run this config (the message says why)."""


Outputs = tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor | None, ...] | None]


@dataclass
class Prepared:
    """A ready-to-time call of one impl on one config's inputs.

    ``call()`` runs the op (train: forward + backward) and returns its raw outputs; ``post`` turns
    them into ``(o, final_state_K_first, grads)`` for the correctness check, outside the timing.
    """

    call: Callable[[], Any]
    backend: str
    post: Callable[[Any], Outputs] = field(default=lambda out: out)
    note: str = ""


def kind_of(phase: str) -> str:
    return "decode" if phase == "decode" else "chunk"


def _load(module: str, name: str) -> Callable[..., Any]:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise Unavailable(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise Unavailable(f"{module} has no {name}")
    return fn


def _accepts(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    params = sig.parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return set(params), var_kw


def fit_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep the kwargs ``fn`` takes. Dropping a flag that changes the math is refused (Unavailable):
    a benchmark must never time a different computation than the config says."""
    names, var_kw = _accepts(fn)
    if var_kw:
        return kwargs
    out = {}
    for key, val in kwargs.items():
        if key in names:
            out[key] = val
        elif val is not None and val is not False and key != "cu_seqlens_cpu":
            raise Unavailable(f"{getattr(fn, '__qualname__', fn)} takes no argument {key}={val!r}")
    return out


def op_kwargs(inputs: Inputs, api: str) -> dict[str, Any]:
    """Keyword arguments of the op for ``api`` ("public" = cula/FLA signature, "fla", "ref")."""
    cfg, t = inputs.cfg, inputs.tensors
    kind = kind_of(cfg.phase)
    kw: dict[str, Any] = {"q": t["q"], "k": t["k"], "v": t["v"]}
    if cfg.variant in ("kda", "gdn"):
        kw["g"], kw["beta"] = t["g"], t["beta"]
    if cfg.variant == "kda":
        if "A_log" in t:
            kw["A_log"], kw["dt_bias"] = t["A_log"], t["dt_bias"]
    if cfg.variant == "gla":
        kw["gk" if (api == "fla" and kind == "decode") else "g"] = t["g"]
    if cfg.variant == "lightning":
        if api == "fla":
            kw["g_gamma"] = -t["decay"]
        else:
            kw["decay"] = t["decay"]
    for name in _VARIANT_FLAGS[cfg.variant]:
        if name in inputs.flags:
            kw[name] = inputs.flags[name]
    if kind == "decode" and api != "ref":
        kw.pop("safe_gate", None)  # fused_recurrent_* has no safe_gate: lower_bound alone bounds the gate
    kw["scale"] = None
    kw["initial_state"] = inputs.h0
    kw["output_final_state"] = bool(cfg.state or cfg.phase == "decode")
    if inputs.cu_seqlens is not None:
        kw["cu_seqlens"] = inputs.cu_seqlens
        if api != "ref" and kind == "chunk":
            kw["cu_seqlens_cpu"] = inputs.cu_seqlens_cpu
    if api == "ref":
        kw["dtype"] = torch.float32
    return kw


def _two(out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(out, (tuple, list)):
        return out[0], (out[1] if len(out) > 1 else None)
    return out, None


def _wrap(fn: Callable[..., Any], kwargs: dict[str, Any], inputs: Inputs) -> Callable[[], Any]:
    """The timed callable: a no-grad forward, or forward + backward for train."""
    if inputs.cfg.phase != "train":
        def forward() -> Any:
            with torch.no_grad():
                return _two(fn(**kwargs)) + (None,)
        return forward

    leaves = [inputs.tensors[n] for n in inputs.leaves]
    do = inputs.do

    def train_step() -> Any:
        o, ht = _two(fn(**kwargs))
        grads = torch.autograd.grad([o], leaves, [do], allow_unused=True)
        return o, ht, grads
    return train_step


def _cula_backend(op: str, kwargs: dict[str, Any]) -> tuple[str, str]:
    """(backend, why) cula's dispatch picks for these inputs, via ``cula.backends(op, **inputs)``;
    ``why`` lists the candidates it skipped (empty when the first one runs)."""
    try:
        import cula

        backends = getattr(cula, "backends", None)
        if backends is None:
            return "unknown (cula.backends not available)", ""
        info = backends(op, **kwargs)
    except Exception as exc:  # informational only: never fail a row over it
        return f"unknown (cula.backends failed: {type(exc).__name__})", ""
    skipped = getattr(info, "skipped", ())
    why = "; ".join(f"{getattr(s, 'backend', '?')} skipped: {getattr(s, 'reason', s)}" for s in skipped)
    return describe_backends(info), why


def describe_backends(info: Any) -> str:
    """Selected backend of a ``cula.backends`` answer (a Decision, dict, list of pairs/objects, str)."""
    if isinstance(info, str):
        return info
    if hasattr(info, "backend") and not isinstance(info, (list, tuple, dict)):
        return str(info.backend) if info.backend else "none"
    items: list[tuple[str, Any]] = []
    if isinstance(info, dict):
        if "selected" in info:
            return str(info["selected"])
        items = [(str(k), v) for k, v in info.items()]
    elif isinstance(info, (list, tuple)):
        for it in info:
            if isinstance(it, (tuple, list)) and len(it) >= 2:
                items.append((str(it[0]), it[1]))
            else:
                name = getattr(it, "name", str(it))
                reason = getattr(it, "reason", None)
                items.append((str(name), reason))
    for name, reason in items:
        if reason is None or reason == "" or reason is True:
            return name
    return "unknown"


class Impl:
    """A named implementation: ``prepare(inputs)`` returns a :class:`Prepared` or raises Unavailable."""

    name = "?"

    def prepare(self, inputs: Inputs) -> Prepared:  # pragma: no cover - interface
        raise NotImplementedError


class TableImpl(Impl):
    """cula / fla / ref: an op looked up in :data:`OPS`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def prepare(self, inputs: Inputs) -> Prepared:
        cfg = inputs.cfg
        entry = OPS.get((cfg.variant, kind_of(cfg.phase)), {}).get(self.name)
        if entry is None:
            raise Unavailable(f"{self.name} has no {cfg.variant} {cfg.phase} op")
        if self.name == "fla" and inputs.device != "cuda":
            raise Unavailable("FLA's Triton kernels need a CUDA device")
        if self.name == "fla" and cfg.variant == "lightning" and cfg.HV != cfg.H:
            raise Unavailable("FLA's simple_gla has no grouped value heads (HV != H)")
        fn = _load(*entry)
        api = {"cula": "public", "fla": "fla", "ref": "ref"}[self.name]
        kwargs = fit_kwargs(fn, op_kwargs(inputs, api))
        note = ""
        if self.name == "cula":
            backend, note = _cula_backend(entry[1], kwargs)
        elif self.name == "fla":
            backend = "fla-triton"
        else:
            backend = "torch-ref"
        return Prepared(call=_wrap(fn, kwargs, inputs), backend=backend, note=note)


class FlashKDAImpl(Impl):
    """FlashKDA's fused CUTLASS forward, called directly (the FLA backend wrapper is bypassed so the
    fla impl stays pure Triton). Its states are V-first; we transpose h0 once before timing and the
    final state after, so the timed call is exactly ``flash_kda.fwd``."""

    name = "flashkda"

    def prepare(self, inputs: Inputs) -> Prepared:
        cfg, t, f = inputs.cfg, inputs.tensors, inputs.flags
        if cfg.variant != "kda" or cfg.phase != "prefill":
            raise Unavailable("flashkda only implements the KDA prefill forward")
        try:
            flash_kda = importlib.import_module("flash_kda")
        except Exception as exc:
            raise Unavailable(f"flash_kda is not importable: {type(exc).__name__}: {exc}") from None
        need = ("use_gate_in_kernel", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate")
        missing = [n for n in need if not f.get(n)]
        if missing or f.get("allow_neg_eigval"):
            raise Unavailable(f"flashkda needs {', '.join(need)} and no allow_neg_eigval")
        if cfg.dtype != "bfloat16" or cfg.K != 128 or cfg.V != 128 or cfg.HV != cfg.H:
            raise Unavailable("flashkda needs bf16, K = V = 128 and HV == H")
        N, HV, K, V = cfg.num_seqs, cfg.HV, cfg.K, cfg.V
        h0_vf = inputs.h0.transpose(-1, -2).contiguous() if inputs.h0 is not None else None
        out = torch.empty_like(t["v"])
        ht = torch.empty(N, HV, V, K, dtype=torch.float32, device=t["q"].device) if cfg.state else None
        dt_bias = t["dt_bias"].view(HV, K)
        scale = K ** -0.5

        def call() -> Any:
            with torch.no_grad():
                flash_kda.fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], scale, out, A_log=t["A_log"],
                              dt_bias=dt_bias, lower_bound=f.get("lower_bound"), initial_state=h0_vf,
                              final_state=ht, cu_seqlens=inputs.cu_seqlens)
            return out, ht, None

        def post(res: Any) -> Outputs:
            o, state, _ = res
            return o, (state.transpose(-1, -2) if state is not None else None), None
        return Prepared(call=call, backend="flashkda-cutlass", post=post)


def registry() -> dict[str, Impl]:
    """All known implementations by name."""
    return {"cula": TableImpl("cula"), "fla": TableImpl("fla"), "flashkda": FlashKDAImpl(),
            "ref": TableImpl("ref")}


def flashkda_importable() -> bool:
    return importlib.util.find_spec("flash_kda") is not None


def capture_warnings(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``fn`` once and return its result with the messages of the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fn()
    msgs = []
    for w in caught:
        msg = f"{w.category.__name__}: {w.message}"
        if msg not in msgs:
            msgs.append(msg)
    return res, msgs

