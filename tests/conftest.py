"""pytest's fixtures, hooks and hypothesis settings, nothing else: what test modules share is in helpers.py.
It imports neither helpers nor PyTorch, so that the tests that need no PyTorch (finite differences, bad input,
threads, ...) run without it."""
import os
import sys

import numpy as np
import pytest

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is only needed by the property tests
    settings = None

# Hypothesis profiles: "default": deterministic (derandomize, no database), so CI is reproducible; "thorough":
# random, with more examples (helpers.examples), to hunt bugs:
#   HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
if settings is not None:
    settings.register_profile("default", derandomize=True, database=None, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", derandomize=False, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(HYPOTHESIS_PROFILE)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def threads():
    """attnpp.set_num_threads, to set attnpp's thread count inside a test; restored afterwards."""
    import attnpp
    before = attnpp.get_num_threads()
    yield attnpp.set_num_threads
    attnpp.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """PyTorch on one thread for a module of tiny models (the transformers tests): as fast on a quiet host, and on
    a busy one far faster (its threads wait for one another at every small op: a Trainer step 20 times slower)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter):
    import attnpp
    helpers = sys.modules.get("helpers")  # imported by the tests that record parity errors and examples
    LARGEST, HYPOTHESIS_EXAMPLES = getattr(helpers, "LARGEST", {}), getattr(helpers, "HYPOTHESIS_EXAMPLES", {})
    terminalreporter.write_line(f"attnpp CPU level: {attnpp.cpu_capability()} (ATTNPP_CPU_CAPABILITY forces one)")
    if LARGEST:
        figures = ", ".join(f"{k} {v:.2e}" for k, v in sorted(LARGEST.items()))
        terminalreporter.write_line(f"largest parity error against PyTorch (relative to max(1, |ref|)): {figures}")
    if HYPOTHESIS_EXAMPLES:
        per_test = ", ".join(f"{k} {v}" for k, v in sorted(HYPOTHESIS_EXAMPLES.items()))
        terminalreporter.write_line(f"hypothesis examples run: {sum(HYPOTHESIS_EXAMPLES.values())} "
                                    f"(profile {HYPOTHESIS_PROFILE!r}; per test: {per_test})")
