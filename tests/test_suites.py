"""Suite grids (suites/*.toml) and the varlen length generators."""

from __future__ import annotations

import pytest

from cula.suites import (DISTRIBUTIONS, SuiteError, list_suites, load_configs, load_suite,
                         varlen_lengths)
from cula.suites.lengths import RANDOM_LOW


def test_kda_grid_is_the_published_28():
    s = load_suite("kda")
    assert len(s.configs) == 28
    assert s.counts() == {"fixed": 10, "varlen": 18}
    fixed = [(c.B, c.T) for c in s.select("fixed")]
    assert fixed == [(b, t) for b in (1, 2) for t in (512, 1024, 4096, 8192, 16384)]
    varlen = {(c.dist, c.n_seqs, c.T) for c in s.select("varlen")}
    assert varlen == {(d, n, t) for d in DISTRIBUTIONS for n in (10, 20) for t in (4096, 8192, 16384)}
    for c in s.configs:
        assert (c.H, c.HV, c.K, c.V, c.dtype, c.state) == (64, 64, 128, 128, "bfloat16", True)
        f = c.flag_dict
        assert f["use_gate_in_kernel"] and f["use_qk_l2norm_in_kernel"] and f["use_beta_sigmoid_in_kernel"]
        assert f["safe_gate"] and f["lower_bound"] == -5.0
        if c.mode == "varlen":
            assert c.B == 1 and sum(c.lengths) == c.T and len(c.lengths) == c.n_seqs and c.seed == 0


def test_other_suite_counts():
    assert load_suite("lightning").counts() == {"fixed": 4 * 7 * 2, "varlen": 18}
    decode = load_suite("decode")
    assert len(decode.configs) == 48
    assert {c.variant for c in decode.configs} == {"kda", "lightning"}
    assert sorted({c.B for c in decode.configs}) == [1, 4, 8, 16, 32, 64, 128, 256]
    assert sorted({c.H for c in decode.configs}) == [8, 32, 64]
    assert {c.phase for c in load_suite("train").configs} == {"train"}
    assert load_suite("smoke").device == "any" and not load_suite("smoke").gpu_only
    assert load_suite("kda").gpu_only


def test_every_suite_loads_with_unique_ids():
    names = list_suites()
    assert {"kda", "lightning", "decode", "gdn", "gla", "train", "smoke"} <= set(names)
    for name in names:
        ids = [c.config_id for c in load_suite(name).configs]
        assert len(ids) == len(set(ids)), name
        assert all(c.index == i for i, c in enumerate(load_suite(name).configs))


def test_mode_filter_and_dedup():
    s = load_suite("kda")
    assert len(s.select("fixed")) + len(s.select("varlen")) == len(s.select("both"))
    assert len(load_configs(["kda", "kda"], "varlen")) == 18
    with pytest.raises(SuiteError, match="mode"):
        s.select("bogus")


def test_config_hash_tracks_the_measurement():
    a, b = load_suite("kda").configs[:2]
    assert a.config_hash != b.config_hash
    assert a.config_hash == load_suite("kda").configs[0].config_hash  # stable across loads
    assert a.config_id.startswith("kda/prefill/fixed/B1-T512-")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("n,total", [(1, 7), (3, 10), (10, 4096), (20, 16384), (7, 7)])
def test_lengths_sum_and_positive(dist, n, total):
    lengths = varlen_lengths(dist, n, total, seed=0)
    assert len(lengths) == n and sum(lengths) == total and min(lengths) >= 1


def test_lengths_deterministic_and_seeded():
    assert varlen_lengths("random", 10, 8192, 0) == varlen_lengths("random", 10, 8192, 0)
    assert varlen_lengths("random", 10, 8192, 0) != varlen_lengths("random", 10, 8192, 1)
    assert varlen_lengths("uniform", 10, 8192, 0) == varlen_lengths("uniform", 10, 8192, 5)


def test_uniform_and_skewed_shapes():
    u = varlen_lengths("uniform", 10, 4096)
    assert max(u) - min(u) <= 1
    for n, total in ((10, 4096), (20, 16384)):
        s = varlen_lengths("skewed", n, total)
        # n-1 equal short ones, the last one n times their weight: n / (2n - 1) of the tokens
        assert max(s[:-1]) - min(s[:-1]) <= 1
        assert abs(s[-1] - total * n / (2 * n - 1)) <= 1
        assert abs(s[-1] / s[0] - n) < 0.1 * n


def test_random_weights_within_bounds():
    # U(0.02, 1.02): no sequence can be more than 1.02 / 0.02 = 51x another (plus rounding)
    for seed in range(5):
        r = varlen_lengths("random", 20, 16384, seed)
        assert max(r) / min(r) <= (RANDOM_LOW + 1) / RANDOM_LOW + 1
        assert len(set(r)) > 5  # actually random, not uniform


def test_length_errors():
    with pytest.raises(ValueError, match="dist"):
        varlen_lengths("zipf", 3, 10)
    with pytest.raises(ValueError, match="total"):
        varlen_lengths("uniform", 5, 3)
    with pytest.raises(ValueError, match="n"):
        varlen_lengths("uniform", 0, 3)


def test_unknown_suite():
    with pytest.raises(SuiteError, match="unknown suite 'nope'.*kda"):
        load_suite("nope")


def test_malformed_suite_files(tmp_path):
    def write(text):
        p = tmp_path / "bad.toml"
        p.write_text(text)
        return p

    with pytest.raises(SuiteError, match="name"):
        load_suite("bad", write('name = "other"\n[[grid]]\nvariant="kda"\nB=1\nT=1\nH=1\nK=1\nV=1\n'))
    with pytest.raises(SuiteError, match="unknown keys"):
        load_suite("bad", write('name = "bad"\n[[grid]]\nvariant="kda"\nBB=1\n'))
    with pytest.raises(SuiteError, match="variant"):
        load_suite("bad", write('name = "bad"\n[[grid]]\nvariant="rwkv"\nB=1\nT=1\nH=1\nK=1\nV=1\n'))
    with pytest.raises(SuiteError, match="HV"):
        load_suite("bad", write('name = "bad"\n[[grid]]\nvariant="kda"\nB=1\nT=8\nH=4\nHV=6\nK=8\nV=8\n'))
    with pytest.raises(SuiteError, match="n_seqs"):
        load_suite("bad", write('name = "bad"\n[[grid]]\nvariant="kda"\nmode="varlen"\ndist="uniform"\n'
                                'n_seqs=9\nT=8\nH=1\nK=8\nV=8\n'))
    with pytest.raises(SuiteError, match="cannot read"):
        load_suite("bad", write("name = \n"))
    ok = load_suite("bad", write('name = "bad"\n[[grid]]\nvariant="gla"\nB=[1,2]\nT=[8,16,32]\nH=2\nK=8\nV=8\n'))
    assert len(ok.configs) == 6 and [c.B for c in ok.configs] == [1, 1, 1, 2, 2, 2]
