"""The CPU level: picked at import (the best the CPU supports, or ATTNPP_CPU_CAPABILITY), refused when the CPU
cannot run it; every level supported here gives the same results within the parity tolerances. The parity suite
itself runs once per level in CI (.ci/run); this file checks the choice and the levels against each other."""
import os
import subprocess
import sys

import numpy as np
import pytest

import attnpp

CONFIG = attnpp.show_config(mode="dicts")
LEVELS = ["default", "avx2", "avx512", "avx512_bf16"]


def _run(code, level):
    env = dict(os.environ, ATTNPP_CPU_CAPABILITY=level)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_capability_is_the_forced_or_the_best_supported():
    assert CONFIG["levels_built"][0] == "default" and set(CONFIG["levels_built"]) <= set(LEVELS)
    assert set(CONFIG["levels_supported"]) <= set(CONFIG["levels_built"])
    forced = os.environ.get("ATTNPP_CPU_CAPABILITY")
    expected = forced.lower() if forced else CONFIG["levels_supported"][-1]
    assert attnpp.cpu_capability() == CONFIG["cpu_capability"] == expected


@pytest.mark.parametrize("level", LEVELS)
def test_forcing_a_level(level):
    """A supported level is used; one the build has but the CPU lacks is refused at import, naming the level
    and what the CPU supports (on an AVX-512 host every level is supported: that branch runs on older CPUs)."""
    if level not in CONFIG["levels_built"]:
        pytest.skip(f"{level} is not built on this architecture")
    result = _run("import attnpp; print(attnpp.cpu_capability())", level.upper() if level == "avx2" else level)
    if level in CONFIG["levels_supported"]:
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [level]
    else:
        assert result.returncode != 0
        assert "ImportError" in result.stderr and f"cannot run the {level} kernels" in result.stderr


def test_unknown_level_refused():
    result = _run("import attnpp", "avx3")
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "unknown level" in result.stderr
    assert ", ".join(CONFIG["levels_built"]) in result.stderr


def test_show_config_prints_the_level_and_refuses_other_modes(capsys):
    attnpp.show_config()
    out = capsys.readouterr().out
    assert f"cpu_capability: {attnpp.cpu_capability()}" in out and CONFIG["compiler"] in out
    with pytest.raises(ValueError, match="mode"):
        attnpp.show_config(mode="json")


# One computation at every supported level, in a child process each (the level is fixed at import): the attention
# forward and backward with a causal mask, dropout and GQA, a linear layer and an AdamW step, in float64.
LEVEL_RUN = """
import numpy as np, attnpp, attnpp.functional as F
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 4, 70, 24)); k, v = rng.standard_normal((2, 2, 2, 133, 24))
out, lse, _ = F.scaled_dot_product_attention_forward(q, k, v, is_causal=True, dropout_p=0.2, seed=5, enable_gqa=True)
grads = F.scaled_dot_product_attention_backward(np.cos(out), q, k, v, out, lse, is_causal=True, dropout_p=0.2, seed=5,
                                                enable_gqa=True)
x, w = rng.standard_normal((50, 40)), rng.standard_normal((30, 40))
np.save(__import__("sys").argv[1], np.concatenate([a.ravel() for a in (out, lse, *grads, F.linear(x, w))]))
"""

# The float32 computations of article 001's training (attention forward and backward, linear, cross-entropy, the
# fused loss): avx512_bf16 adds bfloat16 instructions only, so it must repeat avx512 bit for bit in float32 and
# float64 (.ci/run relies on it: it runs notebook 001 at one of the two).
FLOAT_RUN = """
import sys, numpy as np, attnpp.functional as F
rng = np.random.default_rng(0)
out = []
for dt in (np.float32, np.float64):
    q, k, v = (rng.standard_normal((2, 3, 77, 64)).astype(dt) for _ in range(3))
    o, lse, _ = F.scaled_dot_product_attention_forward(q, k, v, is_causal=True)
    grads = F.scaled_dot_product_attention_backward(np.cos(o), q, k, v, o, lse, is_causal=True)
    x, w, t = rng.standard_normal((30, 5)).astype(dt), rng.standard_normal((5000, 5)).astype(dt), rng.integers(0, 5000, 30)
    logits = F.linear(x, w)
    loss, stats = F.cross_entropy_forward(logits, t)
    fused = F.linear_cross_entropy_forward(x, w, t)
    out += [o, lse, *grads, logits, loss, stats, fused[0], fused[1]]
np.save(sys.argv[1], np.concatenate([np.asarray(a, np.float64).ravel() for a in out]))
"""


def test_levels_agree(tmp_path):
    results = {}
    for level in CONFIG["levels_supported"]:
        path = tmp_path / f"{level}.npy"
        env = dict(os.environ, ATTNPP_CPU_CAPABILITY=level)
        subprocess.run([sys.executable, "-c", LEVEL_RUN, str(path)], env=env, check=True, timeout=300)
        results[level] = np.load(path)
    base = results["default"]
    for level, r in results.items():
        scale = max(1.0, float(np.abs(base[np.isfinite(base)]).max()))
        assert np.array_equal(np.isfinite(r), np.isfinite(base))
        finite = np.isfinite(base)
        assert np.abs(r[finite] - base[finite]).max() / scale <= 1e-12, level


def test_avx512_bf16_repeats_avx512_in_float32_and_float64(tmp_path):
    if "avx512_bf16" not in CONFIG["levels_supported"]:
        pytest.skip("this CPU has no AVX512_BF16")
    results = []
    for level in ("avx512", "avx512_bf16"):
        path = tmp_path / f"{level}.npy"
        env = dict(os.environ, ATTNPP_CPU_CAPABILITY=level)
        subprocess.run([sys.executable, "-c", FLOAT_RUN, str(path)], env=env, check=True, timeout=300)
        results.append(np.load(path))
    assert np.array_equal(*results)
