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
from collections.abc import Callable
from typing import Any

from cula import _dispatch
from cula._warn import warn_once

Prepare = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


class CulaIgnoredArgumentWarning(UserWarning):
    """A keyword argument the op does not know was ignored (FLA ignores unknown ``**kwargs`` too)."""


def public_op(name: str, prepare: Prepare) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make ``stub`` the public op ``name`` (see the module docstring)."""

    def wrap(stub: Callable[..., Any]) -> Callable[..., Any]:
        bind = _binder(stub)

        def prepare_inputs(*args: Any, **kwargs: Any) -> dict[str, Any]:
            arguments, extra = bind(args, kwargs)
            return prepare(arguments, extra)

        @functools.wraps(stub)
        def op(*args: Any, **kwargs: Any) -> Any:
            return _dispatch.call(name, prepare_inputs(*args, **kwargs), stacklevel=3)

        op.prepare_inputs = prepare_inputs
        op.op_name = name
        return op

    return wrap


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
