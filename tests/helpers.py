"""What several test modules share, defined once (test modules import it from here, never from each other or
from conftest, which holds pytest's fixtures, hooks and hypothesis settings only):

- the dtypes under test (``DTYPES``, ``TORCH``), the parity tolerances ``TOL`` and how parity is measured
  (``max_rel_err``, ``assert_close``, relative to max(1, |reference|): docs/design.md), the largest error seen per
  dtype (``LARGEST``, printed at the end of the run);
- the property tests' example counts (``examples``, ``HYPOTHESIS_EXAMPLES``, printed at the end of the run);
- small PyTorch references of the tests: ``T`` (a tensor copy of an array), ``torch_kw``, ``torch_sdpa``
  (PyTorch's scaled_dot_product_attention and its gradients), ``make_mha`` (a torch.nn.MultiheadAttention and
  attnpp's holding the same weights);
- re-exported from ``attnpp.testing`` (the PyTorch references the tests share with the benchmark and the
  notebooks): the attention math from its definitions (``reference``, ``attention_layer_reference``) and the
  articles' PyTorch classes.
"""
import collections
import os

import numpy as np
import torch

import attnpp
from attnpp.testing import (Article000CausalSelfAttention, Article000MultiheadAttention,  # noqa: F401 (re-exported)
                            Article002MultiHeadAttentionWrapper, Article002SelfAttention, Article003CausalAttention,
                            Article003CausalCrossAttention, Article003SingleHeadAttention,
                            Article004MultiHeadAttention, attention_layer_reference, reference)
from attnpp.testing import to_tensor as T

DTYPES = [np.float64, np.float32]
# NumPy dtype (the scalar type or np.dtype) -> torch dtype
TORCH = {np.float64: torch.float64, np.float32: torch.float32}
TORCH.update({np.dtype(d): t for d, t in list(TORCH.items())})

# ------------------------------------------------------------------------------------------------ parity
# Parity tolerances (docs/design.md): relative to the scale of the reference values, max(1, max |ref|).
TOL = {np.float64: 1e-10, np.float32: 1e-5}

# Largest relative error seen per dtype name, printed at the end of the run (conftest.pytest_terminal_summary).
LARGEST = {}


def max_rel_err(ours, ref):
    """Largest |ours - ref| relative to max(1, max |ref|), arrays of one shape; NaN anywhere in ours (and not in
    ref) counts as infinite."""
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    if ours.size == 0:
        return 0.0
    if np.isnan(ours).any() and not np.isnan(ref).any():
        return np.inf
    return float(np.nanmax(np.abs(ours - ref)) / max(1.0, float(np.nanmax(np.abs(ref)))))


def assert_close(ours, ref, dtype, what=""):
    """max_rel_err(ours, ref) within TOL[dtype] (``dtype`` np.float32 or np.float64); recorded in LARGEST."""
    err = max_rel_err(ours, ref)
    name = np.dtype(dtype).name
    LARGEST[name] = max(LARGEST.get(name, 0.0), err)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:g}"


# ------------------------------------------------------------------------------------------------ hypothesis
# The profile HYPOTHESIS_PROFILE (registered and loaded in conftest): "thorough" runs EXAMPLES_FACTOR times as many
# examples as the default.
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
EXAMPLES_FACTOR = int(os.environ.get("HYPOTHESIS_EXAMPLES_FACTOR", 25 if THOROUGH else 1))

# Examples actually run by each property test (each test increments its entry), printed at the end of the run.
HYPOTHESIS_EXAMPLES = collections.Counter()


def examples(n):
    """max_examples of a property test: n in the default profile, n * EXAMPLES_FACTOR in "thorough"."""
    return max(1, n * EXAMPLES_FACTOR)


# ------------------------------------------------------------------------------------------ PyTorch references
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable", -1: "error"}


def torch_kw(kw, dtype=None):
    """Keyword arguments with their arrays as tensors (float masks cast to the torch ``dtype`` if given)."""
    return {n: (T(x, dtype=dtype) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


def torch_backend(tq, tk, tv, kw):
    """The name of the backend PyTorch's scaled_dot_product_attention picks for these tensors, "none" if it
    refuses them."""
    try:
        return BACKENDS.get(int(torch._fused_sdp_choice(tq, tk, tv, **kw)), "?")
    except Exception:  # noqa: BLE001 (a case torch refuses)
        return "none"


def torch_sdpa(q, k, v, g, kw, out_lead=None, dtype=None):
    """PyTorch's output (..., H, L, Dv) and the gradients of query (..., H, L, D), key and value (..., S, D/Dv),
    from torch.nn.functional.scaled_dot_product_attention as a user calls it (its default backend) with the
    keyword arguments ``kw`` (arrays as tensors), computed in the torch ``dtype`` (default: the inputs'), the
    gradients from (out * g).sum().backward(); returns ([output, grad_query, grad_key, grad_value] as arrays,
    the name of the backend it chose).

    With ``out_lead`` (B..., H) given, a call PyTorch refuses (it adds a mask that broadcasts beyond query and
    key in place) is redone with query, key and value expanded to the output's batch shape (the same math)."""
    tq, tk, tv = T(q, True, dtype), T(k, True, dtype), T(v, True, dtype)
    tkw = torch_kw(kw, dtype)
    args = (tq, tk, tv)
    try:
        out = torch.nn.functional.scaled_dot_product_attention(*args, **tkw)
    except RuntimeError as e:
        if out_lead is None:
            raise
        from hypothesis import note  # only the property tests pass out_lead
        lead = out_lead[:-1] if kw.get("enable_gqa") else out_lead
        args = tuple(t.expand(lead + t.shape[len(t.shape) - 3 if kw.get("enable_gqa") else len(t.shape) - 2:])
                     for t in args)
        note(f"torch refused the call ({e}); reference from inputs expanded to {lead}")
        out = torch.nn.functional.scaled_dot_product_attention(*args, **tkw)
    backend = torch_backend(*args, tkw)
    (out * T(g, dtype=dtype)).sum().backward()
    grads = [t.grad.numpy() if t.grad is not None else np.zeros(t.shape, q.dtype) for t in (tq, tk, tv)]
    return [out.detach().numpy()] + grads, backend


def make_mha(dtype, seed=0, std=None, training=True, **options):
    """(attnpp.nn.MultiheadAttention, torch.nn.MultiheadAttention) with ``options`` (embed_dim, num_heads, ...)
    in ``dtype``, the same weights: PyTorch's initialisation after torch.manual_seed(seed), or with ``std`` every
    parameter (biases included) drawn N(0, std^2); both in training mode or, ``training=False``, eval mode."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(dtype=TORCH[dtype], **options).train(training)
    if std is not None:
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0.0, std)
    mha = attnpp.nn.MultiheadAttention(dtype=dtype, **options)
    mha.load_state_dict(ref.state_dict())
    assert list(mha.state_dict()) == list(ref.state_dict())
    return mha.train(training), ref
