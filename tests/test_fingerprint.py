"""The environment fingerprint's code identity: git, or CULA_GIT_SHA when the runner states it."""

from __future__ import annotations

import subprocess

import pytest

from cula.bench.fingerprint import git_state


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.txt").write_text("a\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f.txt"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"],
                   check=True)
    return subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=10", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_git_sha_and_dirty_from_the_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("CULA_GIT_SHA", raising=False)
    sha = _repo(tmp_path)
    assert git_state(tmp_path) == (sha, False)
    (tmp_path / "f.txt").write_text("b\n")
    assert git_state(tmp_path) == (sha, True)


@pytest.mark.parametrize("dirty_env, dirty", [("0", False), ("1", True), (None, None)])
def test_stated_sha_wins_over_a_stale_git(tmp_path, monkeypatch, dirty_env, dirty):
    _repo(tmp_path)  # a .git whose HEAD is not the code that runs (the device's copied tree)
    monkeypatch.setenv("CULA_GIT_SHA", "510df0f2242bc55a71de0c1491dd6e523a6d1544")
    if dirty_env is None:
        monkeypatch.delenv("CULA_GIT_DIRTY", raising=False)
    else:
        monkeypatch.setenv("CULA_GIT_DIRTY", dirty_env)
    assert git_state(tmp_path) == ("510df0f224", dirty)


def test_no_git_no_statement_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("CULA_GIT_SHA", raising=False)
    assert git_state(tmp_path / "nowhere") == ("unknown", None)
