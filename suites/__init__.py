"""Benchmark suites: grids stored as TOML data beside this module, expanded into configs.

    >>> from cula.suites import load_suite
    >>> len(load_suite("kda").configs)
    28
"""

from .grid import (DEFAULT_TOLERANCE, MODES, PHASES, SUITE_DIR, VARIANTS, Config, Suite, SuiteError,
                   list_suites, load_configs, load_suite)
from .lengths import DISTRIBUTIONS, cu_seqlens_from_lengths, varlen_lengths

__all__ = [
    "Config", "Suite", "SuiteError", "list_suites", "load_suite", "load_configs", "varlen_lengths",
    "cu_seqlens_from_lengths", "DISTRIBUTIONS", "DEFAULT_TOLERANCE", "MODES", "PHASES", "VARIANTS",
    "SUITE_DIR",
]
