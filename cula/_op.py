"""The decorator that turns a documented FLA-signature stub into a validated, dispatched public op.

A public op is written as a stub with FLA 0.6.0's exact signature and a docstring::

    @public_op("chunk_kda", prepare=_prepare_chunk_kda)
    def chunk_kda(q, k, v, g, beta, scale=None, ..., **kwargs):
        '''...'''

Calling it binds the arguments to that signature (defaults applied), runs ``prepare(arguments, extra)``
(validation + normalisation into the ``inputs`` dict; ``extra`` holds the ``**kwargs``) and hands the
inputs to :func:`cula._dispatch.call`. ``inspect.signature`` of the op is the stub's.
``op.prepare_inputs(*args, **kwargs)`` does the first two steps only (``cula.backends`` uses it).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch

from cula import _dispatch
from cula import _validate as V
from cula._warn import warn_fallback, warn_once

Prepare = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


class CulaIgnoredArgumentWarning(UserWarning):
    """A keyword argument the op does not know was ignored (FLA ignores unknown ``**kwargs`` too)."""


#: Call plans kept per op; more distinct call signatures than this (a shape sweep) start it afresh.
PLAN_CACHE_MAX = 256

_Tensor = torch.Tensor


def public_op(
    name: str, prepare: Prepare, plan_kwargs: frozenset[str] = frozenset()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make ``stub`` the public op ``name`` (see the module docstring).

    ``plan_kwargs``: the ``**kwargs`` names ``prepare`` takes silently (no warning, no deprecation); a
    call passing any other keyword outside the signature is never planned (see :func:`call_key`).
    """

    def wrap(stub: Callable[..., Any]) -> Callable[..., Any]:
        bind = _binder(stub)
        plannable = frozenset(inspect.signature(stub).parameters) | plan_kwargs
        plans = Plans()
        _dispatch.plan_caches.append(plans)
        # keyword-name tuples seen so far -> whether every name is plannable (a set test per call
        # costs more than this lookup of a tuple whose string hashes are cached)
        named: dict[tuple[str, ...], bool] = {}

        def prepare_inputs(*args: Any, **kwargs: Any) -> dict[str, Any]:
            arguments, extra = bind(args, kwargs)
            return prepare(arguments, extra)

        @functools.wraps(stub)
        def op(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                names = tuple(kwargs)
                ok = named.get(names)
                if ok is None:
                    if len(named) >= PLAN_CACHE_MAX:
                        named.clear()
                    ok = named[names] = plannable.issuperset(names)
                raw = args + tuple(kwargs.values())
                key = call_key(len(args), names, raw) if ok else None
            else:
                raw = args
                key = call_key(len(args), (), raw)
            if key is not None:
                last = plans.last
                # a model calls one signature over and over (every layer, every step): one
                # comparison with the last plan's key instead of hashing the key for the dict
                if last is not None and last[0] == key:
                    return last[1].run(name, raw)
                plan = plans.get(key)
                if plan is not None:
                    plans.last = (key, plan)
                    return plan.run(name, raw)
            previous = V.start_recording_value_checks()
            try:
                inputs = prepare_inputs(*args, **kwargs)
            finally:
                checks = V.stop_recording_value_checks(previous)
            decision = _dispatch.decide(name, inputs)
            if decision.backend is None:
                reasons = "; ".join(f"{s.backend}: {s.reason}" for s in decision.skipped)
                raise NotImplementedError(f"cula {name}: no backend can run these inputs ({reasons})")
            warned = tuple(s for s in decision.skipped if not s.environmental)
            for skip in warned:
                warn_fallback(name, skip.backend, skip.reason, decision.backend, stacklevel=2)
            chosen = next(c for c in _dispatch.TABLE[name] if c.name == decision.backend)
            if key is not None:
                plan = Plan.make(chosen, decision.backend, warned, inputs, checks, raw)
                if plan is not None:
                    if len(plans) >= PLAN_CACHE_MAX:
                        plans.clear()
                    plans[key] = plan
                    plans.last = (key, plan)
            return chosen(inputs)

        op.prepare_inputs = prepare_inputs
        op.op_name = name
        op.plans = plans
        return op

    return wrap


def call_key(n_args: int, names: tuple[str, ...], values: tuple) -> tuple | None:
    """What validation and the dispatch decision of a call can depend on, or None when that cannot
    be captured cheaply (then the call is validated and dispatched in full, as always). ``values`` are
    the raw arguments (``args + kwargs.values()``), ``n_args`` of them positional and the rest passed
    by the keywords ``names``; the public op has already refused to plan a call with a keyword outside
    its signature (``prepare`` warns about those on every call).

    Per tensor: its type, shape, contiguity, dtype, device, 16-byte alignment and (with grad mode on)
    requires_grad; per other argument its type and value (``True`` and ``1`` differ, so do ``0.0``
    and ``-0.0``); which arguments came by position and which by keyword; grad mode, the ``CULA_*``
    environment and the environment probes. Tensor *values* are not in it: the value checks are
    replayed on every call (:class:`Plan`).

    Why that suffices: validation reads shapes, dtypes, devices and (with grad mode on)
    requires_grad; dispatch reads those plus, in the kernels' ``supports()``, contiguity and data
    pointer alignment (16 bytes at most); a decode kernel's runner (``module.runner``) fixes from the
    same facts which inputs it copies dense. Nothing reads strides beyond contiguity (a planned
    non-contiguous input is copied, or handed to FLA / torch, as a fresh call would) nor
    requires_grad with grad mode off. A new check on anything else must extend this key.
    """
    grad = torch.is_grad_enabled()
    parts: list[Any] = [n_args, names, grad, _dispatch.env_key(), _dispatch.probes_key()]
    append = parts.append
    for x in values:
        if isinstance(x, _Tensor):
            # requires_grad is read only with grad mode on: nothing cula does depends on it otherwise
            append((x.__class__, x.shape, x.is_contiguous(), x.dtype, x.device, grad and x.requires_grad,
                    x.data_ptr() & 15))
        elif x is None or x is True or x is False:
            append(x)
        else:
            kind = x.__class__
            if kind is int or kind is str:
                append((kind, x))
            elif kind is float:
                append((kind, x) if x else (kind, str(x)))  # 0.0 == -0.0, yet they may scale differently
            else:
                return None  # any other object (a cp_context, a list): no plan
    return tuple(parts)


class Plans(dict):
    """An op's call plans by :func:`call_key`, and the last one looked up (``(key, plan)``, reset with
    the rest by ``clear``)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple | None = None

    def clear(self) -> None:
        self.last = None
        super().clear()


class Plan:
    """How a validated call signature runs: the backend chosen, where each of its arguments comes
    from in the raw call (``args + kwargs.values()``) or which constant it is, the value checks to
    replay on the new tensors, and the fallback warnings to (once) emit.

    It holds no tensor: constants are the non-tensor inputs the key fixes."""

    __slots__ = ("candidate", "module", "kernel", "names", "pick", "consts", "checks", "warned", "backend",
                 "runner", "runner_pick")

    def __init__(self, candidate, module, recipe, checks, warned, backend, n_raw, runner=None, runner_slots=()):
        self.candidate = candidate
        self.module = module
        self.kernel = candidate.kernel
        # a kernel's prepared launch (``module.runner``), called with the raw tensors it names
        self.runner = runner
        self.runner_pick = getter(runner_slots) if runner is not None else None
        # the arguments are picked from ``raw + consts`` by one itemgetter: no per-argument bytecode
        self.names = tuple(n for n, _, _ in recipe)
        self.consts = tuple(c for _, i, c in recipe if i < 0)
        where, k = [], 0
        for _, i, _ in recipe:
            if i >= 0:
                where.append(i)
            else:
                where.append(n_raw + k)
                k += 1
        self.pick = getter(where)
        self.checks = checks
        self.warned = warned
        self.backend = backend

    @staticmethod
    def make(candidate: _dispatch.Candidate, backend: str, warned: tuple, inputs: dict[str, Any],
             checks: list, raw: tuple) -> Plan | None:
        """The plan of a call that just ran in full, or None when its inputs cannot be rebuilt from
        the raw arguments alone (a tensor made by ``prepare``, or one object passed twice)."""
        slot_of: dict[int, int] = {}
        for i, x in enumerate(raw):
            if isinstance(x, _Tensor):
                if id(x) in slot_of:
                    return None  # aliases: which argument an input came from is ambiguous
                slot_of[id(x)] = i

        def recipe_of(values: dict[str, Any]) -> tuple | None:
            out = []
            for n, x in values.items():
                if isinstance(x, _Tensor):
                    i = slot_of.get(id(x))
                    if i is None:
                        return None
                    out.append((n, i, None))
                else:
                    out.append((n, -1, x))
            return tuple(out)

        module = runner = None
        runner_slots: tuple[int, ...] = ()
        if candidate.kernel is not None:
            module, _ = _dispatch.load_kernel(candidate.kernel)
            kwargs = _dispatch.kernel_kwargs(candidate.kernel, inputs)
            recipe = recipe_of(kwargs)
            make_runner = getattr(module, "runner", None)
            if recipe is not None and make_runner is not None:
                try:
                    runner = make_runner(**kwargs)
                    runner_slots = tuple(slot_of[id(kwargs[name])] for name in runner.names)
                except Exception:  # the host function raises it again when the call runs it
                    runner = None
        else:
            recipe = recipe_of(inputs)
        if recipe is None:
            return None
        replay = []
        for t, key, check in checks:
            i = slot_of.get(id(t))
            if i is None:
                return None
            replay.append((i, key, check))
        return Plan(candidate, module, recipe, tuple(replay), warned, backend, len(raw), runner, runner_slots)

    def run(self, op: str, raw: tuple) -> Any:
        for i, key, check in self.checks:
            V.check_values_once(raw[i], key, check)
        for skip in self.warned:
            warn_fallback(op, skip.backend, skip.reason, self.backend, stacklevel=3)
        if self.runner is not None:
            return self.runner.run(self.runner_pick(raw))
        args = dict(zip(self.names, self.pick(raw + self.consts)))
        if self.kernel is not None:
            return getattr(self.module, self.kernel)(**args)
        return self.candidate(args)


def getter(where: list[int] | tuple[int, ...]) -> Callable[[tuple], tuple]:
    """``seq -> tuple(seq[i] for i in where)`` in one C call (itemgetter gives a bare item for one index);
    the call plans and the decode runners pick their arguments with it."""
    if len(where) == 1:
        return lambda seq, j=where[0]: (seq[j],)
    return operator.itemgetter(*where)


def _binder(stub: Callable[..., Any]) -> Callable[[tuple, dict], tuple[dict[str, Any], dict[str, Any]]]:
    """A fast ``inspect.Signature.bind`` + ``apply_defaults`` for stubs whose parameters are all
    positional-or-keyword plus an optional ``**kwargs`` (inspect's costs ~20 us a call, too much for a
    decode step). Returns ``(arguments, extra_kwargs)``; raises TypeError as Python would."""
    params = list(inspect.signature(stub).parameters.values())
    var_kw = params[-1].name if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD else None
    named = [p for p in params if p.name != var_kw]
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in named):
        raise TypeError(f"{stub.__name__}: public op stubs take positional-or-keyword parameters and **kwargs only")
    names = tuple(p.name for p in named)
    defaults = {p.name: p.default for p in named}
    fn = stub.__name__

    def bind(args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, Any]]:
        if len(args) > len(names):
            raise TypeError(f"{fn}() takes {len(names)} positional arguments but {len(args)} were given")
        arguments = dict(zip(names, args))
        extra: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in defaults:
                if key in arguments:
                    raise TypeError(f"{fn}() got multiple values for argument '{key}'")
                arguments[key] = value
            elif var_kw is not None:
                extra[key] = value
            else:
                raise TypeError(f"{fn}() got an unexpected keyword argument '{key}'")
        if len(arguments) < len(names):
            for name in names:
                if name not in arguments:
                    default = defaults[name]
                    if default is inspect.Parameter.empty:
                        raise TypeError(f"{fn}() missing required argument: '{name}'")
                    arguments[name] = default
        return arguments, extra

    return bind


def pop_known(extra: dict[str, Any], op: str, known: dict[str, Any]) -> dict[str, Any]:
    """Take the known ``**kwargs`` (``known`` maps name -> default) out of ``extra``; warn once about
    the rest, which are ignored as FLA ignores them."""
    taken = {key: extra.pop(key, default) for key, default in known.items()}
    if extra:
        names = ", ".join(sorted(extra))
        warn_once(
            ("ignored", op, names),
            f"cula {op}: ignoring unknown keyword argument(s) {names} (FLA 0.6.0 ignores them too)",
            CulaIgnoredArgumentWarning,
            stacklevel=5,
        )
    return taken


def state_v_first_alias(extra: dict[str, Any], state_v_first: bool) -> bool:
    """FLA's deprecated ``transpose_state_layout`` keyword, renamed ``state_v_first``."""
    if "transpose_state_layout" not in extra:
        return state_v_first
    old = extra.pop("transpose_state_layout")
    if state_v_first:
        raise ValueError(
            "transpose_state_layout: expected it alone (it is the deprecated name of state_v_first), "
            "got both transpose_state_layout and state_v_first=True"
        )
    import warnings

    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=5)
    return bool(old)


def reject_head_first(extra: dict[str, Any]) -> None:
    if "head_first" in extra:
        raise ValueError(
            f"head_first: expected it absent (FLA removed it; inputs are [B, T, H, ...]), got {extra['head_first']!r}"
        )
