import numpy as np
import pytest

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
    if LARGEST:
        figures = ", ".join(f"{k} {v:.2e}" for k, v in sorted(LARGEST.items()))
        terminalreporter.write_line(f"largest parity error against PyTorch (relative to max(1, |ref|)): {figures}")
