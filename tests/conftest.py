import collections
import os

import numpy as np
import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is only needed by the property tests (test_properties.py)
    settings = None

# Hypothesis profiles (property tests, tests/test_properties.py). "default": deterministic (derandomize, no
# database), so CI is reproducible; "thorough": random, EXAMPLES_FACTOR times as many examples, to hunt bugs:
#   HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
EXAMPLES_FACTOR = int(os.environ.get("HYPOTHESIS_EXAMPLES_FACTOR", 25 if HYPOTHESIS_PROFILE == "thorough" else 1))
if settings is not None:
    settings.register_profile("default", derandomize=True, database=None, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", derandomize=False, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(HYPOTHESIS_PROFILE)


def examples(n):
    """max_examples of a property test: n in the default profile, n * EXAMPLES_FACTOR in "thorough"."""
    return max(1, n * EXAMPLES_FACTOR)


# Examples actually run by each property test (each test increments its entry), printed at the end of the run.
HYPOTHESIS_EXAMPLES = collections.Counter()

# Parity tolerances (DESIGN.md): relative to the scale of the reference values.
TOL = {np.float64: 1e-10, np.float32: 1e-5}


def max_rel_err(ours, ref):
    """Largest |ours - ref| relative to max(1, max |ref|); NaN anywhere in ours counts as infinite."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    if ours.size == 0:
        return 0.0
    if np.isnan(ours).any() and not np.isnan(ref).any():
        return np.inf
    return float(np.nanmax(np.abs(ours - ref)) / max(1.0, float(np.nanmax(np.abs(ref)))))


# Largest relative error seen per dtype, printed at the end of the run (see pytest_terminal_summary).
LARGEST = {}


def assert_close(ours, ref, dtype, what=""):
    err = max_rel_err(ours, ref)
    name = np.dtype(dtype).name
    LARGEST[name] = max(LARGEST.get(name, 0.0), err)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:g}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_terminal_summary(terminalreporter):
    import attnpp
    terminalreporter.write_line(f"attnpp CPU level: {attnpp.cpu_capability()} (ATTNPP_CPU_CAPABILITY forces one)")
    if LARGEST:
        figures = ", ".join(f"{k} {v:.2e}" for k, v in sorted(LARGEST.items()))
        terminalreporter.write_line(f"largest parity error against PyTorch (relative to max(1, |ref|)): {figures}")
    if HYPOTHESIS_EXAMPLES:
        per_test = ", ".join(f"{k} {v}" for k, v in sorted(HYPOTHESIS_EXAMPLES.items()))
        terminalreporter.write_line(f"hypothesis examples run: {sum(HYPOTHESIS_EXAMPLES.values())} "
                                    f"(profile {HYPOTHESIS_PROFILE!r}; per test: {per_test})")
