"""What several test modules share, defined once (test modules import it from here, never from each other or
from conftest, which holds pytest's fixtures, hooks and hypothesis settings only):

- the dtypes under test (``DTYPES``, ``TORCH``), the parity tolerances ``TOL`` and how parity is measured
  (``max_rel_err``, ``assert_close``, relative to max(1, |reference|): docs/design.md), the largest error seen per
  dtype (``LARGEST``, printed at the end of the run);
- the property tests' example counts (``examples``, ``HYPOTHESIS_EXAMPLES``, printed at the end of the run);
- small PyTorch references of the tests: ``T`` (a tensor copy of an array), ``torch_kw``, ``torch_sdpa``
  (PyTorch's scaled_dot_product_attention and its gradients), ``make_mha`` (a torch.nn.MultiheadAttention and
  attnpp's holding the same weights);
- Hugging Face models of the transformers tests: ``HF_NAMES`` (the architectures), ``hf_config``, ``hf_model``
  (small random-initialised configurations; transformers imported only when they are called), ``hf_bound`` (the
  bound of their float32 comparisons);
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


# ------------------------------------------------------------------------------------------ Hugging Face models
HF_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128)
HF_WINDOW = 5  # shorter than the batches' 16 tokens: the windowed layers hide keys
HF_NAMES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss", "phi3", "gpt2", "smollm3", "olmo2"]
HF_NO_FLOAT64 = {"gpt_oss"}  # its experts' grouped matmul takes float32 and the halves only


def hf_config(name):
    """A small configuration of the architecture ``name`` (of ``HF_NAMES``): windows of ``HF_WINDOW`` tokens,
    Gemma 2's soft-capping (50 on the scores, 30 on the logits, its defaults), gpt-oss's sinks and experts; no
    dropout (GPT-2's defaults to 0.1: two training steps, or a step and its float64 reference, would draw other
    masks)."""
    import transformers as tf
    base, window = HF_BASE, HF_WINDOW
    return {
        "llama": lambda: tf.LlamaConfig(**base),
        "mistral": lambda: tf.MistralConfig(**base, sliding_window=window),
        "qwen2": lambda: tf.Qwen2Config(**base, use_sliding_window=True, sliding_window=window, max_window_layers=1),
        "qwen3": lambda: tf.Qwen3Config(**base, use_sliding_window=True, sliding_window=window, max_window_layers=1),
        "gemma2": lambda: tf.Gemma2Config(**base, sliding_window=window, head_dim=16),
        "gemma3": lambda: tf.Gemma3TextConfig(**base, sliding_window=window, head_dim=16),
        "gpt_oss": lambda: tf.GptOssConfig(**base, sliding_window=window, head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2),
        "phi3": lambda: tf.Phi3Config(**base, sliding_window=window, pad_token_id=0),
        "gpt2": lambda: tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "smollm3": lambda: tf.SmolLM3Config(**base, pad_token_id=0),
        "olmo2": lambda: tf.Olmo2Config(**base),
    }[name]()


def hf_model(name, impl, dtype=torch.float32, weights=None, config=None, **overrides):
    """The model ``name`` with attention ``impl`` in ``dtype``, in eval mode; the weights of ``weights`` (a
    model) or seed 0's; ``config`` (default ``hf_config(name)``) with ``overrides`` set. (from_config sets the
    config's implementation: each model gets its own copy.)"""
    import copy

    import transformers as tf
    cfg = copy.deepcopy(config) if config is not None else hf_config(name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype)
    if weights is not None:
        model.load_state_dict(weights.state_dict())
    return model.eval()


def hf_bound(plain, float64):
    """The bound of a float32 comparison with ``plain`` (a model's float32 values): twice their error against
    ``float64`` (the float64 values of the same weights), at least float32's epsilon of the largest value (an
    error measured on a few numbers, a loss, a weight near 1, can be 0 by chance: their own rounding is the least);
    1e-4 of the largest value without a float64 reference (``float64`` None: gpt-oss's experts)."""
    scale = plain.abs().max().item()
    if float64 is None:
        return 1e-4 * scale
    return max(2 * (plain - float64).abs().max().item(), torch.finfo(torch.float32).eps * scale)
