"""The one warning cula emits when it falls back from a preferred backend.

``CulaFallbackWarning`` fires when an input is valid but a preferred backend cannot take it (e.g. an
SM90 kernel that does not handle head dim 64, or gradients requested where cula has no backward
kernel), and cula runs a slower but correct backend instead. It fires once per ``(op, backend, reason)``
per process, so a model calling an op thousands of times gets one line per cause, not thousands.
Filter it as usual: ``warnings.simplefilter("ignore", cula.CulaFallbackWarning)``.
"""

from __future__ import annotations

import threading
import warnings


class CulaFallbackWarning(UserWarning):
    """A valid input could not take the preferred backend; a slower correct one ran instead."""


_seen: set[tuple] = set()
_lock = threading.Lock()


def warn_fallback(op: str, skipped: str, reason: str, chosen: str, stacklevel: int = 2) -> bool:
    """Warn once per process that ``op`` skipped backend ``skipped`` for ``reason`` and ran ``chosen``.

    Returns True when a warning was emitted (False when this ``(op, skipped, reason)`` was seen before).
    ``stacklevel`` counts from the caller of this function, as in :func:`warnings.warn`.
    """
    message = f"cula {op}: backend {skipped!r} cannot take these inputs ({reason}); running {chosen!r} instead."
    return warn_once((op, skipped, reason), message, CulaFallbackWarning, stacklevel + 1)


def warn_once(key: tuple, message: str, category: type[Warning], stacklevel: int = 2) -> bool:
    """``warnings.warn(message, category)`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were already reported (so they warn again); meant for tests."""
    with _lock:
        _seen.clear()
