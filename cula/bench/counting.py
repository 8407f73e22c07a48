"""Counted work of one call: minimal HBM bytes and FLOPs of the chunked algorithm, per variant.

Bytes are the *minimum* traffic: every input read once, every output written once, the initial state
read and the final state written once (fp32); intermediates are assumed to stay on chip. Achieved
TB/s = bytes / time is therefore a lower bound on the real traffic rate, and % of copy bandwidth says
how close a kernel is to being purely memory-bound.

FLOPs count the matrix products of the chunked algorithm with chunk size ``C = 64`` (2 FLOPs per
multiply-add, element-wise work ignored), per value head and per chunk of ``C`` tokens:

- delta rule (KDA, GDN) - the WY/UT form used by FLA and by cula::

      A_kk = K Kᵀ (gated for KDA)          2 C² K
      A_qk = Q Kᵀ (gated for KDA)          2 C² K
      (I + A_kk)⁻¹ by forward substitution (2/3) C³
      W = A (β K),  U = A (β V)            2 C² K + 2 C² V
      V' = U - W S,  O = Q S + A_qk V',  S ← S + Kᵀ V'    3 · 2 C K V + 2 C² V

  total ``6C²K + 4C²V + (2/3)C³ + 6CKV``;
- GLA / Lightning (gated linear attention, no delta rule): ``A_qk`` (2C²K), ``A_qk V`` (2C²V),
  ``Q S`` and ``Kᵀ V`` (2 · 2CKV): total ``2C²K + 2C²V + 4CKV``.

Decode (recurrent, per token and value head): Lightning / GLA ``S ← γS`` (KV) ``+ kᵀv`` (2KV),
``o = qS`` (2KV): 5KV; KDA / GDN ``S ← diag(g)S`` (KV), ``kᵀS`` (2KV), rank-1 update (2KV), ``qS``
(2KV): 7KV.
Train (forward + backward) counts 3x the forward FLOPs (the backward of each product is two products)
and the bytes of the forward plus reading ``dO`` and the inputs again and writing every input gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK = 64
STATE_BYTES = 4  # states are fp32
_ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Work:
    """Counted bytes and FLOPs of one call."""

    bytes: float
    flops: float


def _input_bytes(variant: str, B: int, T: int, H: int, HV: int, K: int, V: int, es: int) -> dict[str, float]:
    tok = B * T
    sizes = {
        "q": tok * H * K * es,
        "k": tok * H * K * es,
        "v": tok * HV * V * es,
    }
    if variant == "kda":
        sizes["g"] = tok * HV * K * es          # per-key gate (raw, gate computed in kernel)
        sizes["beta"] = tok * HV * es
        sizes["params"] = HV * 4 + HV * K * 4   # A_log [HV], dt_bias [HV*K] fp32
    elif variant == "gdn":
        sizes["g"] = tok * HV * 4               # scalar log gate per head, fp32
        sizes["beta"] = tok * HV * es
    elif variant == "gla":
        sizes["g"] = tok * HV * K * es          # per-key log gate
    elif variant == "lightning":
        sizes["decay"] = HV * 4
    else:
        raise ValueError(f"variant: expected kda, lightning, gdn or gla, got {variant!r}")
    return sizes


def _chunk_flops_per_token(variant: str, K: int, V: int, C: int = CHUNK) -> float:
    if variant in ("kda", "gdn"):
        per_chunk = 6 * C * C * K + 4 * C * C * V + (2.0 / 3.0) * C ** 3 + 6 * C * K * V
    else:  # gla, lightning
        per_chunk = 2 * C * C * K + 2 * C * C * V + 4 * C * K * V
    return per_chunk / C


def _decode_flops_per_token(variant: str, K: int, V: int) -> float:
    return {"lightning": 5 * K * V, "gla": 5 * K * V, "kda": 7 * K * V, "gdn": 7 * K * V}[variant]


def count(variant: str, phase: str, *, B: int, T: int, H: int, HV: int, K: int, V: int, dtype: str,
          num_seqs: int, state: bool) -> Work:
    """Minimal bytes and FLOPs of one call of ``variant`` in ``phase`` (prefill, decode, train).

    ``B x T`` tokens in total (varlen: ``B = 1``, ``T`` the packed length), ``num_seqs`` sequences
    (one state each), ``state``: an initial state is read and a final state written.
    """
    if dtype not in _ELEM:
        raise ValueError(f"dtype: expected one of {sorted(_ELEM)}, got {dtype!r}")
    es = _ELEM[dtype]
    tok = B * T
    inputs = _input_bytes(variant, B, T, H, HV, K, V, es)
    in_bytes = sum(inputs.values())
    out_bytes = tok * HV * V * es
    state_bytes = num_seqs * HV * K * V * STATE_BYTES
    states = 2 * state_bytes if state else 0.0
    if phase == "decode":
        # Decode always carries a state: it is the whole point (and most of the traffic).
        states = 2 * state_bytes
        flops = tok * HV * _decode_flops_per_token(variant, K, V)
        return Work(bytes=float(in_bytes + out_bytes + states), flops=float(flops))
    fwd_flops = tok * HV * _chunk_flops_per_token(variant, K, V)
    if phase == "prefill":
        return Work(bytes=float(in_bytes + out_bytes + states), flops=float(fwd_flops))
    if phase == "train":
        grads = in_bytes                   # one gradient per input, same size
        bwd_bytes = out_bytes + in_bytes + grads + states  # read dO, re-read inputs, write grads
        return Work(bytes=float(in_bytes + out_bytes + states + bwd_bytes), flops=float(3 * fwd_flops))
    raise ValueError(f"phase: expected prefill, decode or train, got {phase!r}")
