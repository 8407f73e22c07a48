"""The eager probe picks its config from the shipped decode suite (the GPU part runs on the device)."""

import pytest

from cula.bench import eager_probe


def test_probe_finds_the_suite_config():
    cfg = eager_probe._config("lightning", 1, 8)
    assert (cfg.variant, cfg.B, cfg.H, cfg.phase) == ("lightning", 1, 8, "decode")


def test_probe_refuses_a_shape_the_suite_does_not_have():
    with pytest.raises(SystemExit, match="no decode config"):
        eager_probe._config("lightning", 3, 8)
