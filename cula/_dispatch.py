"""The one table that decides which backend runs each public op.

Every public op (``cula.kda.chunk_kda``, ...) validates its arguments into an ``inputs`` dict (the FLA
0.6.0 argument names, plus ``A_log`` / ``dt_bias`` / ``chunk_size`` / ``state_indices`` / ``inplace``
where the op takes them) and hands it to :func:`call`, which walks the op's candidates in order and runs
the first that can take the inputs:

1. ``cula-sm90``: our CuTe DSL kernel ``cula.kernels.sm90.<module>``, imported lazily. Unavailable when
   the inputs are not on a CUDA device, the GPU is not Hopper (sm_90), the module is missing or fails to
   import (e.g. no CuTe DSL), gradients are requested (no backward kernels yet), or the module's own
   ``supports(...)`` gives a reason (kernels say "not validated" until their GPU tests pass). A kernel
   that is correct but measured slower than FLA sets ``DISPATCH_OFF`` (the measured reason) and is
   passed over silently unless ``CULA_KERNELS=<name>`` (or ``all``) opts in.
   Calls needing gradients may first take ``cula-sm90+fla-bwd`` (chunk_kda): our forward kernel under
   FLA's backward (``cula/kda/_train.py``), considered only for them.
2. ``fla-triton``: FLA 0.6.0's Triton op on CUDA tensors.
3. ``torch-ref``: the exact torch references in :mod:`cula.ref` (any device; the CPU path; differentiable).

Each candidate answers ``supports(inputs) -> str | None`` (None = usable, else the human reason).
Reasons that only say "this machine / device cannot run it" (CPU inputs, no GPU, no kernel module) skip
silently; a reason specific to the inputs (a head dim the kernel lacks, gradients, fp64 on FLA) makes
:func:`call` emit one :class:`cula.CulaFallbackWarning` per ``(op, backend, reason)`` per process.
``cula.backends()`` reads this same table.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from cula._warn import warn_fallback

CULA_SM90 = "cula-sm90"
# Our forward kernel under FLA's backward (calls needing gradients; cula/kda/_train.py).
CULA_SM90_FLA_BWD = "cula-sm90+fla-bwd"
FLA_TRITON = "fla-triton"
TORCH_REF = "torch-ref"
# Context parallel (cula.cp): runs the op's local pass through this same table, on any device.
CULA_CP = "cula-cp"
KERNEL_PACKAGE = "cula.kernels.sm90"
HOPPER = (9, 0)

# Host-function keyword arguments of each kernel module (docs/INTERFACES.md), read from the inputs.
KERNEL_ARGS: dict[str, tuple[str, ...]] = {
    "lightning_fwd": (
        "q", "k", "v", "decay", "scale", "initial_state", "output_final_state", "cu_seqlens",
    ),
    "lightning_decode": (
        "q", "k", "v", "decay", "scale", "initial_state", "output_final_state", "state_indices", "inplace",
    ),
    "kda_decode": (
        "q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
        "lower_bound", "state_v_first", "state_indices", "inplace",
    ),
    "kda_fwd": (
        "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
        "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first", "cu_seqlens",
    ),
}


# ---------------------------------------------------------------------------------------------------
# Environment probes (module-level functions so tests can monkeypatch a fake GPU).


_archs: dict[torch.device, tuple[int, int]] = {}


def device_arch(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of ``device``, or None when it is not a CUDA device."""
    if device.type != "cuda":
        return None
    arch = _archs.get(device)
    if arch is None:
        # a device's capability never changes; "cuda" without an index means the current device
        arch = tuple(torch.cuda.get_device_capability(device))
        if device.index is not None:
            _archs[device] = arch
    return arch


def cuda_available() -> bool:
    """Whether this process sees a CUDA device at all."""
    return torch.cuda.is_available()


_fla_found: list[bool] = []


def fla_installed() -> bool:
    """Whether FLA can be imported (checked without importing it; a search of sys.path, so a found
    FLA is remembered, while a missing one is looked for again)."""
    if _fla_found:
        return True
    if importlib.util.find_spec("fla") is None:
        return False
    _fla_found.append(True)
    return True


_resolved: dict[str, Any] = {}


def resolve(target: str) -> Any:
    """Import ``"module:attr"`` once and return the attribute."""
    hit = _resolved.get(target)
    if hit is None:
        module, _, attr = target.partition(":")
        hit = getattr(importlib.import_module(module), attr)
        _resolved[target] = hit
    return hit


_kernels: dict[str, tuple[Any, str | None]] = {}


def load_kernel(name: str) -> tuple[Any, str | None]:
    """Import ``cula.kernels.sm90.<name>`` once; returns ``(module, None)`` or ``(None, reason)``."""
    if name not in _kernels:
        full = f"{KERNEL_PACKAGE}.{name}"
        try:
            module = importlib.import_module(full)
            if not callable(getattr(module, name, None)) or not callable(getattr(module, "supports", None)):
                _kernels[name] = (None, f"{full} has no {name}() / supports() entry points")
            else:
                _kernels[name] = (module, None)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (full == missing or full.startswith(missing + ".")):  # it (or its package) is absent
                _kernels[name] = (None, f"no kernel module {full} ({exc})")
            else:
                _kernels[name] = (None, f"{full} failed to import ({type(exc).__name__}: {exc})")
        except Exception as exc:  # a broken kernel build must not break the op: fall back
            _kernels[name] = (None, f"{full} failed to import ({type(exc).__name__}: {exc})")
    return _kernels[name]


#: Environment variable naming kernels to dispatch to although their module sets ``DISPATCH_OFF``
#: (comma list of kernel names, or ``all``).
OPT_IN_ENV = "CULA_KERNELS"


def _env_names(env: str, kernel: str) -> bool:
    """Whether the comma list in ``env`` names ``kernel`` or ``all``."""
    names = {w.strip() for w in os.environ.get(env, "").split(",") if w.strip()}
    return kernel in names or "all" in names


def opted_in(kernel: str) -> bool:
    """Whether the user asked for ``kernel`` through ``CULA_KERNELS``."""
    return _env_names(OPT_IN_ENV, kernel)


#: Environment variable naming kernels or paths dispatch passes over although they are on (comma list of kernel
#: or opt-in names, or ``all``): the way back to FLA for an op without changing the import. It wins over
#: ``CULA_KERNELS``; naming a kernel (``kda_fwd``) also turns off the paths that run it (``kda_fwd_train``).
OPT_OUT_ENV = "CULA_KERNELS_OFF"


def opted_out(kernel: str) -> bool:
    """Whether the user turned ``kernel`` (or a path of that opt-in name) off through ``CULA_KERNELS_OFF``."""
    return _env_names(OPT_OUT_ENV, kernel)


def default_off_reason(kernel: str, module: Any) -> str | None:
    """Why dispatch passes over a working kernel by default (its module's ``DISPATCH_OFF``: a kernel
    that is correct but measured slower than FLA), or None when it is on or opted in."""
    off = getattr(module, "DISPATCH_OFF", None)
    if not off or opted_in(kernel):
        return None
    return f"{off}; opt in with {OPT_IN_ENV}={kernel}"


#: The public ops' call-plan caches (cula._op): a plan holds a decision, so it goes with the kernels.
plan_caches: list[dict] = []

_DEBUG_ENV = "CULA_DEBUG_CHECKS"
# os.environ.get costs ~0.7 us (key encoding, a Mapping method); the posix environ keeps a plain dict
# of bytes that os.environ writes through (monkeypatch.setenv included), read here in ~0.1 us.
_ENV_NAMES = (OPT_IN_ENV, OPT_OUT_ENV, _DEBUG_ENV)
_ENV_KEYS = tuple(os.fsencode(n) for n in _ENV_NAMES) if os.name == "posix" else None


def env_key() -> tuple[Any, ...]:
    """The environment variables a dispatch decision or validation reads (``CULA_KERNELS``,
    ``CULA_KERNELS_OFF``, ``CULA_DEBUG_CHECKS``), as a cheap hashable value for the call-plan caches."""
    data = getattr(os.environ, "_data", None)
    if _ENV_KEYS is not None and type(data) is dict:
        return data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]), data.get(_ENV_KEYS[2])
    return tuple(os.environ.get(n) for n in _ENV_NAMES)


def probes_key() -> tuple[Any, ...]:
    """The environment probes themselves: patching one (tests fake a GPU) must not reuse a plan."""
    return device_arch, cuda_available, _current_arch, fla_installed


def clear_caches() -> None:
    """Forget imported kernels, resolved runners and the ops' call plans (tests inject fake kernel
    modules)."""
    _kernels.clear()
    _resolved.clear()
    for cache in plan_caches:
        cache.clear()


def needs_grad(inputs: Mapping[str, Any]) -> bool:
    """True when grad mode is on and any tensor input requires grad."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs.values())


def device_of(inputs: Mapping[str, Any]) -> torch.device:
    return inputs["q"].device


def resolved_scale(inputs: Mapping[str, Any]) -> float:
    """``scale`` or its default ``K ** -0.5``."""
    scale = inputs.get("scale")
    return inputs["q"].shape[-1] ** -0.5 if scale is None else float(scale)


# ---------------------------------------------------------------------------------------------------
# Candidates


@dataclass(frozen=True)
class Candidate:
    """One way to run an op.

    ``run`` / ``limits`` are ``"module:function"`` targets imported on first use: ``run(inputs)`` returns
    what the public op returns; ``limits(inputs) -> str | None`` says what this path lacks for these
    inputs. Kernel candidates name their module in ``kernel`` and run its host function directly.
    """

    name: str
    run: str | None = None
    limits: str | None = None
    kernel: str | None = None
    #: an input that must be given (not None) for this candidate to be considered at all; a call
    #: without it does not skip the candidate (no reason, no warning), it never sees it
    only_with: str | None = None
    #: considered only for calls needing gradients (the same silence as ``only_with`` otherwise)
    grad_only: bool = False
    #: the kernel module a ``run`` candidate needs (checked like ``kernel``'s; FLA is needed too)
    uses_kernel: str | None = None
    #: ``"module:attr"`` naming ``(opt-in name, reason or None)``: a path that is off (silently, as a
    #: kernel's ``DISPATCH_OFF``) while the reason is set, unless ``CULA_KERNELS`` names it
    switch: str | None = None

    # -- environment (no inputs): why this candidate can never run here, or None

    def environment(self, device: torch.device | None = None) -> str | None:
        """Why this candidate cannot run on this machine (for ``device``, when given), or None."""
        if self.name in (TORCH_REF, CULA_CP):
            return None
        if device is not None:
            if device_arch(device) is None:
                return f"inputs are on {device}; {self.name} needs CUDA tensors"
        elif not cuda_available():
            return "no CUDA device"
        if self.name == FLA_TRITON:
            return None if fla_installed() else "FLA (fla-core) is not installed"
        if self.name == CULA_SM90_FLA_BWD and not fla_installed():
            return "FLA (fla-core), whose backward it runs, is not installed"
        arch = device_arch(device) if device is not None else _current_arch()
        if arch != HOPPER:
            return f"GPU is sm_{arch[0]}{arch[1]}, the cula kernels need Hopper (sm_90)"
        kernel = self.kernel or self.uses_kernel
        if opted_out(kernel):  # before the import: a kernel turned off is not even loaded
            return f"turned off with {OPT_OUT_ENV}"
        module, reason = load_kernel(kernel)
        if reason is not None:
            return reason
        if self.switch is not None:
            name, off = resolve(self.switch)
            if opted_out(name):
                return f"turned off with {OPT_OUT_ENV}={name}"
            if off and not opted_in(name):
                return f"{off}; opt in with {OPT_IN_ENV}={name}"
        return default_off_reason(kernel, module)

    # -- inputs: why these inputs cannot take this candidate, or None

    def supports(self, inputs: Mapping[str, Any]) -> str | None:
        """None when this candidate can run ``inputs``, else the reason (environment or input)."""
        reason = self.environment(device_of(inputs))
        return reason if reason is not None else self.input_reason(inputs)

    def input_reason(self, inputs: Mapping[str, Any]) -> str | None:
        """The input-specific part of :meth:`supports` (the environment already checked)."""
        if self.name == CULA_SM90 and needs_grad(inputs):
            return "gradients requested and cula has no backward kernel for this op yet"
        if self.name == FLA_TRITON and inputs["q"].dtype == torch.float64:
            return "FLA's Triton kernels take fp16/bf16/fp32, got float64"
        if self.limits is not None:
            reason = resolve(self.limits)(inputs)
            if reason is not None:
                return reason
        if self.kernel is not None:
            module, _ = load_kernel(self.kernel)
            try:
                reason = module.supports(**kernel_kwargs(self.kernel, inputs))
            except Exception as exc:  # a kernel's supports() bug: do not use the kernel
                return f"{KERNEL_PACKAGE}.{self.kernel}.supports raised {type(exc).__name__}: {exc}"
            if reason is not None:
                return f"kernel: {reason}"
        return None

    def __call__(self, inputs: Mapping[str, Any]) -> Any:
        if self.kernel is not None:
            module, _ = load_kernel(self.kernel)
            return getattr(module, self.kernel)(**kernel_kwargs(self.kernel, inputs))
        return resolve(self.run)(inputs)


def _current_arch() -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability())


def kernel_kwargs(kernel: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The host function's keyword arguments (``scale`` resolved to a float)."""
    kwargs = {name: inputs.get(name) for name in KERNEL_ARGS[kernel]}
    kwargs["scale"] = resolved_scale(inputs)
    return kwargs


def _kernel(module: str, limits: str | None = None) -> Candidate:
    return Candidate(CULA_SM90, kernel=module, limits=limits)


def _fla(run: str, limits: str | None = None) -> Candidate:
    return Candidate(FLA_TRITON, run=run, limits=limits)


def _ref(run: str, limits: str | None = None) -> Candidate:
    return Candidate(TORCH_REF, run=run, limits=limits)


def _cp(run: str, limits: str | None = None) -> Candidate:
    return Candidate(CULA_CP, run=run, limits=limits, only_with="cp_context")


def _kernel_fla_bwd(kernel: str, run: str, limits: str, switch: str) -> Candidate:
    return Candidate(CULA_SM90_FLA_BWD, run=run, limits=limits, grad_only=True, uses_kernel=kernel, switch=switch)


# ---------------------------------------------------------------------------------------------------
# THE TABLE: op name -> ordered candidates. Runners live next to each public op (cula/<variant>/_paths.py).

_L = "cula.lightning._paths"
_K = "cula.kda._paths"
_G = "cula.gdn._paths"
_A = "cula.gla._paths"

TABLE: dict[str, tuple[Candidate, ...]] = {
    "lightning_attn_fwd": (
        _cp(f"{_L}:cp_fwd"),
        _kernel("lightning_fwd"),
        _fla(f"{_L}:fla_fwd", f"{_L}:fla_fwd_limits"),
        _ref(f"{_L}:ref_fwd"),
    ),
    "lightning_attn_decode": (
        _kernel("lightning_decode"),
        _fla(f"{_L}:fla_decode", f"{_L}:fla_fwd_limits"),
        _ref(f"{_L}:ref_decode"),
    ),
    "chunk_kda": (
        _cp(f"{_K}:cp_chunk", f"{_K}:cp_chunk_limits"),
        _kernel_fla_bwd("kda_fwd", "cula.kda._train:chunk", "cula.kda._train:limits", "cula.kda._train:SWITCH"),
        _kernel("kda_fwd", f"{_K}:kernel_chunk_limits"),
        _fla(f"{_K}:fla_chunk", f"{_K}:fla_chunk_limits"),
        _ref(f"{_K}:ref_chunk", f"{_K}:ref_chunk_limits"),
    ),
    "fused_recurrent_kda": (
        _kernel("kda_decode", f"{_K}:kernel_decode_limits"),
        _fla(f"{_K}:fla_recurrent", f"{_K}:fla_recurrent_limits"),
        _ref(f"{_K}:ref_recurrent"),
    ),
    "chunk_gated_delta_rule": (
        _fla(f"{_G}:fla_chunk"),
        _ref(f"{_G}:ref_chunk", f"{_G}:ref_chunk_limits"),
    ),
    "fused_recurrent_gated_delta_rule": (
        _fla(f"{_G}:fla_recurrent"),
        _ref(f"{_G}:ref_recurrent"),
    ),
    "chunk_gla": (
        _fla(f"{_A}:fla_chunk"),
        _ref(f"{_A}:ref_chunk"),
    ),
    "fused_recurrent_gla": (
        _fla(f"{_A}:fla_recurrent"),
        _ref(f"{_A}:ref_recurrent"),
    ),
}

#: Where each op's public function lives (``cula.backends(op, **inputs)`` binds inputs to it).
PUBLIC: dict[str, str] = {
    "lightning_attn_fwd": "cula.lightning:lightning_attn_fwd",
    "lightning_attn_decode": "cula.lightning:lightning_attn_decode",
    "chunk_kda": "cula.kda:chunk_kda",
    "fused_recurrent_kda": "cula.kda:fused_recurrent_kda",
    "chunk_gated_delta_rule": "cula.gdn:chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "cula.gdn:fused_recurrent_gated_delta_rule",
    "chunk_gla": "cula.gla:chunk_gla",
    "fused_recurrent_gla": "cula.gla:fused_recurrent_gla",
}


# ---------------------------------------------------------------------------------------------------
# Decisions


class Skip(NamedTuple):
    """A candidate passed over: its name, the reason, and whether the reason is about this machine
    (``environmental``: no warning) rather than about these inputs."""

    backend: str
    reason: str
    environmental: bool


class BackendStatus(NamedTuple):
    """Whether a candidate can run on this machine at all (``reason`` says why not)."""

    backend: str
    available: bool
    reason: str | None


@dataclass(frozen=True)
class Decision:
    """Which backend the inputs of ``op`` take (``backend``; None when none can), and why the
    candidates before it were skipped."""

    op: str
    backend: str | None
    skipped: tuple[Skip, ...] = field(default_factory=tuple)

    @property
    def selected(self) -> str | None:
        return self.backend

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "selected": self.backend,
            "skipped": [{"backend": s.backend, "reason": s.reason} for s in self.skipped],
        }

    def __str__(self) -> str:
        head = f"{self.op} -> {self.backend or 'no backend'}"
        if not self.skipped:
            return head
        return head + " (" + "; ".join(f"{s.backend} skipped: {s.reason}" for s in self.skipped) + ")"


def candidates(op: str) -> tuple[Candidate, ...]:
    try:
        return TABLE[op]
    except KeyError:
        raise ValueError(f"op: expected one of {sorted(TABLE)}, got {op!r}") from None


def decide(op: str, inputs: Mapping[str, Any]) -> Decision:
    """Walk ``op``'s candidates and pick the first that supports ``inputs``."""
    device = device_of(inputs)
    skipped: list[Skip] = []
    for cand in candidates(op):
        if cand.only_with is not None and inputs.get(cand.only_with) is None:
            continue
        if cand.grad_only and not needs_grad(inputs):
            continue
        reason = cand.environment(device)
        if reason is not None:
            skipped.append(Skip(cand.name, reason, True))
            continue
        reason = cand.input_reason(inputs)
        if reason is not None:
            skipped.append(Skip(cand.name, reason, False))
            continue
        return Decision(op, cand.name, tuple(skipped))
    return Decision(op, None, tuple(skipped))


def call(op: str, inputs: Mapping[str, Any], stacklevel: int = 3) -> Any:
    """Run ``op`` on the first candidate that supports ``inputs``.

    Warns once per ``(op, backend, reason)`` for input-specific skips; raises NotImplementedError when
    no candidate can take the inputs. ``stacklevel`` points the warning at the user's call (counted
    from the caller of this function).
    """
    decision = decide(op, inputs)
    if decision.backend is None:
        reasons = "; ".join(f"{s.backend}: {s.reason}" for s in decision.skipped)
        raise NotImplementedError(f"cula {op}: no backend can run these inputs ({reasons})")
    for skip in decision.skipped:
        if not skip.environmental:
            warn_fallback(op, skip.backend, skip.reason, decision.backend, stacklevel=stacklevel)
    chosen = next(c for c in TABLE[op] if c.name == decision.backend)
    return chosen(inputs)


def availability() -> dict[str, list[BackendStatus]]:
    """Per op, each candidate and whether it can run on this machine (inputs aside)."""
    out: dict[str, list[BackendStatus]] = {}
    for op, cands in TABLE.items():
        out[op] = [
            BackendStatus(c.name, reason is None, reason) for c in cands for reason in [c.environment()]
        ]
    return out


def explain(op: str, *args: Any, **inputs: Any) -> Decision:
    """The :class:`Decision` the public op would make for these arguments (validated as by the op)."""
    candidates(op)
    public = resolve(PUBLIC[op])
    return decide(op, public.prepare_inputs(*args, **inputs))


OpPrepare = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
