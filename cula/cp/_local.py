"""Shared plumbing of the CP ops: the default local forward, input checks, layout packing."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

import torch

from cula.cp.context import CPContext
from cula.cp.scan import inputs_require_grad

LocalFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]

# variant -> (public op, reference used while the public op is not importable)
_LOCAL_OPS = {
    "lightning": (("cula.lightning", "lightning_attn_fwd"), ("cula.ref.lightning", "chunked")),
    "kda": (("cula.kda", "chunk_kda"), ("cula.ref.kda", "chunked")),
}
_warned_fallback: set[str] = set()


def import_attr(module: str, name: str) -> LocalFn | None:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def default_local_fn(variant: str) -> LocalFn:
    """The local forward CP runs on each rank: the public op (kernels on GPU, references on CPU).

    The public op is called without ``cp_context``, so wiring CP into it does not recurse. If it is not
    importable, the torch reference ``cula.ref.<variant>.chunked`` is used, with one warning.
    """
    (pub_mod, pub_name), (ref_mod, ref_name) = _LOCAL_OPS[variant]
    fn = import_attr(pub_mod, pub_name)
    if fn is not None:
        return fn
    fn = import_attr(ref_mod, ref_name)
    if fn is None:
        raise ImportError(f"cula.cp: neither {pub_mod}.{pub_name} nor {ref_mod}.{ref_name} is importable")
    if variant not in _warned_fallback:
        warnings.warn(f"cula.cp: {pub_mod}.{pub_name} is not available; the local forward uses "
                      f"{ref_mod}.{ref_name} (torch reference)", stacklevel=3)
        _warned_fallback.add(variant)
    return fn


def is_fla_context(cp_context: Any) -> bool:
    """Whether ``cp_context`` is an ``fla.ops.cp.FLACPContext`` (checked by name: FLA stays optional)."""
    return type(cp_context).__name__ == "FLACPContext"


def as_context(cp_context: Any) -> CPContext:
    """Accept a :class:`CPContext` or an ``fla.ops.cp.FLACPContext``."""
    if isinstance(cp_context, CPContext):
        return cp_context
    if is_fla_context(cp_context):
        return CPContext.from_fla(cp_context)
    raise ValueError(
        f"cp_context: expected a cula.cp.CPContext (cula.cp.build_cp_context) or an FLA FLACPContext, "
        f"got {type(cp_context).__name__}"
    )


def check_local_tokens(name: str, x: torch.Tensor, ctx: CPContext) -> None:
    """Under CP a token-wise input is this rank's packed piece ``[1, T_local, ...]``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor [1, {ctx.num_tokens}, ...], got {type(x).__name__}")
    if x.dim() < 3 or x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(
            f"{name}: expected this rank's packed piece [1, T_local={ctx.num_tokens}, ...] under cp_context, "
            f"got shape {list(x.shape)}"
        )


def check_cu_seqlens_arg(cu_seqlens: torch.Tensor | None, ctx: CPContext) -> None:
    """``cu_seqlens`` is optional under CP; if given it must be the context's local (or global) boundaries."""
    if cu_seqlens is None:
        return
    given = cu_seqlens.detach().to("cpu", torch.int64)
    if torch.equal(given, ctx.cu_seqlens_cpu):
        return
    if ctx.cu_seqlens_global_cpu is not None and torch.equal(given, ctx.cu_seqlens_global_cpu):
        return
    raise ValueError(
        f"cu_seqlens: expected None or the cp_context's boundaries (local {ctx.cu_seqlens_cpu.tolist()}), "
        f"got {given.tolist()}"
    )


def check_global_initial_state(initial_state: torch.Tensor | None, ctx: CPContext) -> None:
    """Under CP ``initial_state`` is the global ``[N, HV, ...]`` tensor (the same on every rank)."""
    if initial_state is None:
        return
    if ctx.seq_ids is None:
        raise ValueError("initial_state: expected None with a context converted from FLA (it lacks the global "
                         "sequence ids; FLA's CP does not take initial states either)")
    n = len(ctx.cu_seqlens_global_cpu) - 1
    if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4 or initial_state.shape[0] != n:
        shape = list(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
        raise ValueError(f"initial_state: expected the global states [N={n}, HV, ., .] under cp_context, got {shape}")


def local_initial_states(initial_state: torch.Tensor | None, ctx: CPContext) -> torch.Tensor | None:
    """Rows of the global ``initial_state`` for the local segments; a carried-in first segment gets zeros
    (its true state arrives through the scan; the global row is applied on the rank where it starts)."""
    if initial_state is None:
        return None
    rows = initial_state[list(ctx.seq_ids)]
    if ctx.carries_in:
        rows = torch.cat([torch.zeros_like(rows[:1]), rows[1:]])
    return rows


def pack_batch(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...] -> [1, B*T, ...]``."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def uniform_cu_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Boundaries of ``batch`` packed sequences of ``length`` tokens."""
    return torch.arange(batch + 1, device=device, dtype=torch.int64) * length


def add_state_product(o: torch.Tensor, a: torch.Tensor, h0: torch.Tensor,
                      row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``o[0, t] += w_t * (a_t @ h0)`` per head over the first ``L`` tokens, in o's dtype: the correction of a
    carried-in state ``h0 [HV, K, V]`` (``o [1, T, HV, V]``, ``a [L, HV, K]``, ``row_weight [L, HV]`` or None).

    Half-precision outputs on CUDA (forward only): the weight is folded into ``a`` in o's dtype and one
    tensor-core product accumulates into ``o`` in place (cuBLAS adds ``o`` in fp32 and rounds once); ``h0`` is
    rounded to o's dtype, as the kernels round their state for ``q S``. Elsewhere: the exact product in h0's
    dtype, on a new tensor."""
    L = a.shape[0]
    fast = (o.is_cuda and o.dtype in (torch.bfloat16, torch.float16) and a.dtype == o.dtype
            and not inputs_require_grad(o, a, h0, row_weight))
    if fast:
        if row_weight is not None:
            a = a * row_weight.to(o.dtype)[..., None]
        o[0, :L].transpose(0, 1).baddbmm_(a.transpose(0, 1), h0.to(o.dtype))
        return o
    carried = torch.einsum("thk,hkv->thv", a.to(h0.dtype), h0)
    if row_weight is not None:
        carried = carried * row_weight[..., None]
    o_first = (o[0, :L].to(h0.dtype) + carried).to(o.dtype)
    return o_first[None] if L == o.shape[1] else torch.cat([o_first[None], o[:, L:]], dim=1)
