"""Environment fingerprint stamped on every stored row: what ran, where, from which commit.

Nothing here may fail a run: every probe falls back to ``"unknown"``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# Keys of the fingerprint; the same names are columns of cula.bench.schema.Row.
KEYS = ("device_kind", "gpu_name", "sm_count", "driver", "cuda", "torch", "triton", "dsl", "fla",
        "python", "cula_sha", "cula_dirty", "host_hash")


def utc_now() -> str:
    """Current UTC time as ISO-8601 with seconds, e.g. ``2026-01-31T12:00:00Z``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _dsl_version() -> str:
    for dist in ("nvidia-cutlass-dsl", "nvidia_cutlass_dsl"):
        v = _version(dist)
        if v != "not installed":
            return v
    try:  # the device machine puts the DSL on PYTHONPATH without dist metadata
        import cutlass  # noqa: F401

        return getattr(cutlass, "__version__", "importable (version unknown)")
    except Exception:
        return "not installed"


def _fla_version() -> str:
    v = _version("fla-core")
    if v == "not installed":
        v = _version("flash-linear-attention")
    if v == "not installed":
        try:
            import importlib.util

            spec = importlib.util.find_spec("fla")
            v = "importable (version unknown)" if spec is not None else v
        except Exception:
            pass
    return v


def git_state(root: Path = REPO_ROOT) -> tuple[str, bool | None]:
    """(short sha, dirty) of the checkout at ``root``.

    ``CULA_GIT_SHA`` (and ``CULA_GIT_DIRTY``), when set, win over git: a copied work tree (the device
    machine's) can carry a stale ``.git`` whose HEAD is not the code that runs.
    """
    env_sha = os.environ.get("CULA_GIT_SHA")
    if env_sha:
        dirty_env = os.environ.get("CULA_GIT_DIRTY")
        return env_sha[:10], None if dirty_env is None else dirty_env not in ("0", "false", "")
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            raise OSError(sha.stderr)
        # Only tracked changes count as dirty: untracked scratch files do not change the code run.
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=20)
        return sha.stdout.strip(), bool(st.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


#: Environment variables that change which code a run measures (and so belong in its reproduce command).
KNOB_PREFIXES = ("CULA_", "FLA_")
#: ... except the ones that only label the run, and CULA_AOT_DIR: a folder of prebuilt modules of the same
#: kernel sources (tests/test_aot.py: bitwise the compiled path's results), a path on the machine that ran.
NOT_KNOBS = ("CULA_GIT_SHA", "CULA_GIT_DIRTY", "FLA_FLASH_KDA", "CULA_AOT_DIR")  # FLA_FLASH_KDA: cula.bench pins it


def knob_env() -> list[str]:
    """``NAME=value`` of every knob variable set in this process, sorted (e.g. ``CULA_KERNELS=kda_fwd``)."""
    return sorted(f"{k}={v}" for k, v in os.environ.items()
                  if k.startswith(KNOB_PREFIXES) and k not in NOT_KNOBS)


def without_labels(command: str) -> str:
    """``command`` without its leading ``NAME=value`` words for :data:`NOT_KNOBS` (runs stored before a
    variable joined that list still carry it)."""
    words = command.split(" ")
    i = 0
    while i < len(words) and "=" in words[i] and not words[i].startswith("-"):
        i += 1
    env = [w for w in words[:i] if w.split("=", 1)[0] not in NOT_KNOBS]
    return " ".join(env + words[i:])


def host_hash() -> str:
    """First 12 hex digits of sha256(hostname): tells machines apart without naming them."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def collect(device: str = "cuda") -> dict[str, Any]:
    """Fingerprint of this process's environment for ``device`` ("cuda" or "cpu")."""
    import torch

    fp: dict[str, Any] = {
        "device_kind": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": _version("triton"),
        "dsl": _dsl_version(),
        "fla": _fla_version(),
        "python": platform.python_version(),
        "host_hash": host_hash(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        fp.update(gpu_name=props.name, sm_count=int(props.multi_processor_count),
                  driver=_driver_version())
    else:
        fp.update(gpu_name=f"cpu ({platform.processor() or platform.machine()})",
                  sm_count=0, driver="none")
    sha, dirty = git_state()
    # dirty is None when git could not tell (no .git, no CULA_GIT_DIRTY): recorded as not dirty,
    # and the sha then comes from CULA_GIT_SHA or reads "unknown".
    fp.update(cula_sha=sha, cula_dirty=bool(dirty))
    return fp


def gpu_slug(gpu_name: str) -> str:
    """Short lowercase tag of a device name for run ids: ``NVIDIA H200`` -> ``h200``."""
    name = gpu_name.lower().replace("nvidia", "").strip()
    if name.startswith("cpu"):
        return "cpu"
    slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug[:24] or "unknown"
