"""Every check of what a user passes to attnpp, in one place and one wording (PyTorch's where it has one).

The functions, layers and optimizers call these before anything reaches the C++ core; the core keeps only the
guards that memory safety needs (cpp/bindings/arrays.hpp). Each check names the argument, and the shapes when
they are at fault: TypeError for a wrong type or dtype, ValueError for a wrong value or shape, IndexError for
an index out of range, MemoryError for a request too large to allocate. ``ARGUMENTS`` at the end describes the
non-array arguments of every public function and layer by their kind; tests/test_bad_input.py drives each of
them through its kind's refused values.
"""
import functools
import math
import numbers
import sys

import numpy as np

from ._seeds import next_seed

FLOAT_NAMES = "float32, float64, float16 or bfloat16"
MAX_ELEMENTS = np.iinfo(np.intp).max // 8  # more elements than any array can hold
_FLOAT16, _WIDE = np.dtype(np.float16), (np.dtype(np.float32), np.dtype(np.float64))


# -------------------------------------------------------------------------------------------------- dtypes
@functools.lru_cache(maxsize=None)
def bfloat16_dtype():
    """ml_dtypes' bfloat16 (JAX's) as a NumPy dtype, NumPy having none of its own; ml_dtypes is imported at the
    first call, not with attnpp: its import took 0.9 s of ``import attnpp``'s 1.0 s (ml_dtypes 0.7.0)."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype):
    """Whether ``dtype`` is ml_dtypes' bfloat16, without importing ml_dtypes: no dtype is before it is imported."""
    return "ml_dtypes" in sys.modules and dtype == bfloat16_dtype()


def is_half(dtype):
    """Whether ``dtype`` is float16 or bfloat16, the half-precision dtypes the core takes."""
    return dtype == _FLOAT16 or is_bfloat16(dtype)


def is_float(dtype):
    """Whether ``dtype`` is float32, float64, float16 or bfloat16, the dtypes the core takes."""
    return dtype in _WIDE or is_half(dtype)


# -------------------------------------------------------------------------------------------------- arrays
def as_ndarray(x, name, written=False):
    """``x`` as an ndarray without a copy: an ndarray itself, else through ``__dlpack__`` (a CPU tensor, a JAX or
    CuPy array on the host) or ``__array__`` (an ``attnpp.nn.Parameter``, objects that convert themselves); an
    argument the call writes into (``written``) must be an ndarray or a ``__dlpack__`` exporter, whose memory
    is shared for certain. Else TypeError naming ``name`` and saying how to convert."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return bfloat16_tensor_as_ndarray(x) if str(getattr(x, "dtype", "")) == "torch.bfloat16" else \
                np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise TypeError(f"{name}: cannot view {type(x).__name__} as a NumPy array ({e}); pass a CPU array "
                            f"that does not require grad (for a torch tensor: tensor.detach().cpu()), or use "
                            f"attnpp.torch for autograd") from None
    if hasattr(x, "__array__") and not written:
        return np.asarray(x)
    raise TypeError(f"{name}: expected a numpy.ndarray{'' if written else ' or an array with __array__'} or "
                    f"__dlpack__ (a CPU torch tensor), got {type(x).__name__}; convert it with numpy.asarray()")


def bfloat16_tensor_as_ndarray(tensor):
    """A CPU torch.bfloat16 tensor's memory as an ndarray of ``ml_dtypes.bfloat16``, without a copy (NumPy has no
    bfloat16 of its own, so DLPack cannot carry one): its bits viewed as uint16, then as bfloat16. RuntimeError
    from torch for a tensor that requires grad or is not on the CPU."""
    import torch  # (only ever given a torch tensor: torch is there)
    return tensor.view(torch.uint16).numpy().view(bfloat16_dtype())


def check_array(x, name, ndim=None, min_ndim=None, dtype=None, written=False):
    """``x`` as an ndarray (see ``as_ndarray``) of float32, float64, float16 or bfloat16 (and of ``dtype`` when
    given), else TypeError/ValueError.

    ``ndim`` is an int or a tuple of allowed ints. Called on every layer call, so kept to plain comparisons.
    """
    if type(x) is not np.ndarray:
        x = as_ndarray(x, name, written)
    if not is_float(x.dtype):
        raise TypeError(f"{name}: expected dtype {FLOAT_NAMES}, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)} (like the other inputs), got {x.dtype}")
    if ndim is not None and x.ndim != ndim and (type(ndim) is not tuple or x.ndim not in ndim):
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {x.shape}")
    return x


def compute_dtype(dtype):
    """The dtype the core computes and accumulates in for arrays of ``dtype``, and that of the log-sum-exp it
    returns: float32 for float16 and bfloat16 (as PyTorch's CPU kernels), else ``dtype`` itself."""
    return np.dtype(np.float32) if is_half(dtype) else dtype


def broadcast_shape(name, *shapes):
    """NumPy's broadcast of ``shapes`` (without its limit on the total size: a too large result is for the
    caller's MemoryError), else ValueError naming them."""
    ndim = max(map(len, shapes))
    out = []
    for i in range(-ndim, 0):
        sizes = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(sizes) > 1:
            raise ValueError(f"{name}: shapes {', '.join(map(str, shapes))} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def check_cumulative(cu, name, total):
    """Cumulative sequence lengths (B + 1,) of ints from 0 to ``total``, non-decreasing, as int64."""
    cu = as_ndarray(cu, name)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected shape (B + 1,), got {cu.shape}")
    if cu[0] != 0 or cu[-1] != total or (np.diff(cu.astype(np.int64)) < 0).any():
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 to {total} (the packed length), got "
                         f"{cu.tolist() if cu.size <= 10 else cu}")
    return np.ascontiguousarray(cu, dtype=np.int64)


def check_index(index, name, size, allowed=None):
    """``index`` as a C-contiguous int64 array with values in [0, size) (or equal to ``allowed``)."""
    index = as_ndarray(index, name)
    if index.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype, got {index.dtype}")
    bad = (index < 0) | (index >= size)  # (before the cast to int64, which would wrap large uint64 values)
    if allowed is not None:
        bad &= index != allowed
    if bad.any():
        raise IndexError(f"{name}: value {int(index[bad][0])} out of range [0, {size})")
    return np.asarray(index, dtype=np.int64, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)


def check_query_heads(query, option="", **kv):
    """Grouped-query attention's rule: the query's heads Hq (``query[1]``) a multiple of each of ``kv``'s heads,
    ``kv`` naming (shape, heads) pairs (key, value, key_cache...); ``query`` is (shape, Hq). Else ValueError,
    prefixed by ``option`` (the argument that asked for GQA) where there is one."""
    (q_shape, Hq) = query
    for name, (shape, H) in kv.items():
        if H == 0 or Hq % H:
            shapes = ", ".join(f"{n} {tuple(sh)}" for n, (sh, _) in kv.items())
            raise ValueError(f"{option}query heads Hq={Hq} must be a multiple of {name}'s heads (grouped-query "
                             f"attention), got query {tuple(q_shape)}, {shapes}")


def check_cache_dtype(dtype, compute, name):
    """A KV cache's ``dtype``: ``compute`` (the query's or the layer's), or float16/bfloat16 under a float32
    ``compute`` (the cache then holds half precision); else TypeError naming ``name``."""
    dtype = np.dtype(dtype)
    if dtype != compute and not (is_half(dtype) and compute == np.float32):
        raise TypeError(f"{name}: expected dtype {np.dtype(compute)} (the query's or the layer's), or float16 or "
                        f"bfloat16 under a float32 one, got {dtype}")


def check_alibi_slopes(slopes, batch, Hq, dtype, name="alibi_slopes"):
    """ALiBi slopes broadcast to (B..., Hq), as the core's (N or 1, Hq) array of ``dtype``'s compute dtype: finite
    floats, else TypeError/ValueError naming ``name``."""
    dtype = compute_dtype(dtype)
    slopes = as_ndarray(slopes, name)
    if slopes.dtype.kind != "f" and not is_float(slopes.dtype):
        raise TypeError(f"{name}: expected a float array, got dtype {slopes.dtype}")
    full = tuple(batch) + (Hq,)
    if slopes.ndim == 0 or slopes.shape[-1] != Hq or np.broadcast_shapes(slopes.shape, full) != full:
        raise ValueError(f"{name}: expected shape (Hq,) = ({Hq},) or (B..., Hq) = {full}, got {slopes.shape}")
    if not np.isfinite(slopes).all():
        raise ValueError(f"{name}: expected finite slopes, got {slopes.tolist()}")
    if slopes.ndim == 1:
        return np.ascontiguousarray(slopes, dtype=dtype).reshape(1, Hq)
    return np.ascontiguousarray(np.broadcast_to(slopes, full), dtype=dtype).reshape(-1, Hq)


def check_sinks(sinks, Hq, dtype):
    """The sinks, a (Hq,) array of ``dtype``, as the core's array of its compute dtype, else
    TypeError/ValueError."""
    sinks = check_array(sinks, "sinks", ndim=1, dtype=dtype)
    if sinks.shape != (Hq,):
        raise ValueError(f"sinks: expected shape (Hq,) = ({Hq},), got {sinks.shape}")
    return np.ascontiguousarray(sinks, dtype=compute_dtype(dtype))


def is_real(x):
    """Whether ``x`` is a real number (Python's or NumPy's), not a bool; float and int without the abstract-class
    check (a few microseconds when the interpreter's caches are cold, as in a model's decoding step)."""
    t = type(x)
    return t is float or t is int or (isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)))


def check_loss_grad(grad_output, dtype, shape):
    """The gradient of a loss of ``shape``: a real number (when the loss is 0-d) or an ndarray of ``shape`` and
    ``dtype``, else TypeError/ValueError."""
    if is_real(grad_output):
        if shape != ():
            raise ValueError(f"grad_output: expected shape {shape} (the loss's), got a scalar")
        return
    grad_output = check_array(grad_output, "grad_output", dtype=dtype)
    if grad_output.shape != shape:
        raise ValueError(f"grad_output: expected shape {shape} (the loss's), got {grad_output.shape}")


def check_multihead_attention_shapes(query, key, value, key_padding_mask, attn_mask, is_causal, embed_dim, kdim,
                                     vdim, num_heads, batch_first):
    """The shapes of ``MultiheadAttention``'s inputs (``attnpp.nn``'s and ``attnpp.torch``'s: arrays or tensors,
    their types checked by the layer), as ``torch.nn.MultiheadAttention`` takes them: query (L, B, embed_dim),
    key (S, B, kdim) and value (S, B, vdim), batch first with ``batch_first``, or all unbatched (L, E), (S, kdim),
    (S, vdim); key_padding_mask (B, S) or (S,); attn_mask (L, S) or (B * num_heads, L, S); is_causal only with
    attn_mask. Returns (batched, batch_first_layout, B, L, S), batch_first_layout True when the batch is the
    first dimension (or there is none); ValueError naming the input at fault and the shapes."""
    q, k, v = (tuple(t.shape) for t in (query, key, value))
    if len(q) not in (2, 3) or not len(q) == len(k) == len(v):
        raise ValueError(f"query, key and value must all be batched (3-D) or all unbatched (2-D), got "
                         f"query {q}, key {k}, value {v}")
    for name, shape, width, wname in (("query", q, embed_dim, "embed_dim"), ("key", k, kdim, "kdim"),
                                      ("value", v, vdim, "vdim")):
        if shape[-1] != width:
            raise ValueError(f"{name}: expected last dimension {wname}={width}, got shape {shape}")
    if k[:-1] != v[:-1]:
        raise ValueError(f"key and value must have the same batch and sequence dimensions, got key {k} and value {v}")
    batched = len(q) == 3
    bf = batch_first or not batched
    b, t = (0, 1) if bf else (1, 0)
    B, L, S = (q[b], q[t], k[t]) if batched else (1, q[0], k[0])
    if batched and k[b] != B:
        raise ValueError(f"query and key must have the same batch size, got query {q} and key {k} "
                         f"(batch_first={batch_first})")
    if key_padding_mask is not None:
        want = (B, S) if batched else (S,)
        if tuple(key_padding_mask.shape) != want:
            raise ValueError(f"key_padding_mask: expected shape (B, S) = {want}, got {tuple(key_padding_mask.shape)}")
    if attn_mask is not None:
        want = [(L, S), (B * num_heads, L, S)]
        if tuple(attn_mask.shape) not in want:
            raise ValueError(f"attn_mask: expected shape (L, S) = {want[0]} or (B * num_heads, L, S) = {want[1]}, "
                             f"got {tuple(attn_mask.shape)}")
    elif is_causal:
        raise ValueError("is_causal=True is a hint that attn_mask is the causal mask: attn_mask is required, "
                         "as in PyTorch")
    return batched, bf, B, L, S


def check_attention_layer_shapes(x, context, key_padding_mask, embed_dim, kv_dim, context_length):
    """The shapes of an attention layer's inputs (``attnpp.nn.Attention``'s and ``attnpp.torch.Attention``'s:
    arrays or tensors, their types checked by the layer): x (B, L, embed_dim) or (L, embed_dim); context (B, S,
    kv_dim) or (S, kv_dim) like x, or None for x itself (then kv_dim must be embed_dim); key_padding_mask (B, S)
    or (S,), or None; L and S at most ``context_length`` (None: any). Returns the context; ValueError naming the
    input at fault and the shapes."""
    xs = tuple(x.shape)
    if len(xs) not in (2, 3) or xs[-1] != embed_dim:
        raise ValueError(f"x: expected (B, L, embed_dim={embed_dim}) or (L, embed_dim), got shape {xs}")
    if context is None:
        if kv_dim != embed_dim:
            raise ValueError(f"context is required: kv_dim={kv_dim} differs from embed_dim={embed_dim}")
        context = x
    cs = tuple(context.shape)
    if len(cs) != len(xs) or cs[-1] != kv_dim:
        raise ValueError(f"context: expected {len(xs)} dimensions, like x {xs}, the last kv_dim={kv_dim}, got "
                         f"shape {cs}")
    if cs[:-2] != xs[:-2]:
        raise ValueError(f"x and context must have the same batch size, got x {xs} and context {cs}")
    if context_length is not None and max(xs[-2], cs[-2]) > context_length:
        raise ValueError(f"sequence longer than context_length={context_length}: x {xs}, context {cs}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != cs[:-1]:
        raise ValueError(f"key_padding_mask: expected shape (B, S) = {cs[:-1]}, got {tuple(key_padding_mask.shape)}")
    return context


# ------------------------------------------------------------------------------------------------- scalars
def check_choice(value, name, choices):
    """``value`` if it is one of the strings ``choices``, else ValueError naming ``name`` and the choices."""
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ValueError(f"{name} must be {listed}, got {value!r}")
    return value


def check_seed(seed, name="seed", used=True, backward=None):
    """``seed`` as an unsigned 64-bit int (taken modulo 2**64), or a fresh one from attnpp's generator when it is
    None; 0 when not ``used`` (a call without dropout: the seed is checked, and no number is drawn); else
    TypeError. A backward that uses it needs the forward's: ``backward`` names its dropout probability, and None
    gives a ValueError."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"{name}: expected an int or None, got {type(seed).__name__}")
    if backward and used and seed is None:
        raise ValueError(f"{name}: the backward with {backward} > 0 needs the seed given to the forward, got None")
    if not used:
        return 0
    return next_seed() if seed is None else int(seed) % 2**64


def check_hyper(value, name):
    """``value`` as a finite float >= 0 (an optimizer's hyper-parameter), else TypeError/ValueError."""
    if not is_real(value):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value}")
    return float(value)


def check_dtype(dtype):
    """A layer's ``dtype`` (None means float32; NumPy's, ml_dtypes' or torch's float32, float64, float16 or
    bfloat16, or one of those names) as a NumPy dtype, else TypeError."""
    text = str(dtype)
    given = text[6:] if text.startswith("torch.") else getattr(dtype, "numpy_dtype", dtype)  # (torch's: by name)
    if given is not None and str(given) == "bfloat16":  # (a name NumPy knows only once ml_dtypes is imported)
        return bfloat16_dtype()
    try:
        dt = np.dtype(np.float32 if given is None else given)
    except TypeError:
        dt = None
    if dt is None or not is_float(dt):  # (None == np.dtype("float64") is True in NumPy)
        raise TypeError(f"dtype: expected {FLOAT_NAMES}, got {dtype}")
    return dt


def check_probability(p, name):
    """``p`` as a float in [0, 1), else TypeError/ValueError naming ``name``."""
    if not is_real(p):
        raise TypeError(f"{name}: expected a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p!r}")
    return float(p)


def check_label_smoothing(x):
    """``x`` as a float in [0, 1] (cross-entropy's label smoothing, as PyTorch's), else TypeError/ValueError."""
    if not is_real(x):
        raise TypeError(f"label_smoothing: expected a float in [0, 1], got {type(x).__name__}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {x!r}")
    return float(x)


def check_scale(scale):
    """``scale`` as a float or None, else TypeError."""
    if scale is not None and not is_real(scale):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    return None if scale is None else float(scale)


def check_int(value, name, minimum=0):
    """``value`` as an int >= ``minimum``, else TypeError/ValueError naming ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_bool(value, name):
    """``value`` as a bool (Python or NumPy), else TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def check_rotary_base(base, name):
    """``base`` (RoPE's base of frequencies, ``rope_theta``) as a finite float > 0, else TypeError/ValueError naming
    ``name``."""
    if not is_real(base):
        raise TypeError(f"{name}: expected a float, got {type(base).__name__}")
    if not (math.isfinite(base) and base > 0):
        raise ValueError(f"{name} must be finite and > 0, got {base!r}")
    return float(base)


def check_rotary_dim(rotary_dim, head_dim=None):
    """RoPE's ``rotary_dim`` as an even int >= 2 (features are rotated in pairs), at most ``head_dim`` where given
    (a layer's qk_dim / num_heads); else TypeError/ValueError."""
    rotary_dim = check_int(rotary_dim, "rotary_dim", minimum=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (features are rotated in pairs), got {rotary_dim}")
    if head_dim is not None and rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be at most the head width qk_dim / num_heads = {head_dim}, got {rotary_dim}")
    return rotary_dim


def check_written(array, name):
    """``array`` if it is C-contiguous and writeable (an output the call writes in place), else ValueError."""
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"{name}: expected a C-contiguous, writeable array (written in place)")
    return array


def check_window(window):
    """``window`` as (left, right) ints >= -1 (-1: unbounded on that side), or None; else TypeError/ValueError."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected (left, right), two ints (-1 for unbounded), got {window!r}")
    return tuple(check_int(w, f"window[{i}]", minimum=-1) for i, w in enumerate(window))


def check_softcap(softcap):
    """``softcap`` as a float > 0 (finite), or None (0 and None: no cap); else TypeError/ValueError."""
    if softcap is None:
        return None
    if not is_real(softcap):
        raise TypeError(f"softcap: expected a float or None, got {type(softcap).__name__}")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0 or None: no cap), got {softcap!r}")
    return float(softcap) or None


_REDUCTIONS = ("mean", "sum", "none")
_INT64 = np.iinfo(np.int64)


def check_reduction(reduction):
    """``reduction`` if it is 'mean', 'sum' or 'none', else ValueError."""
    return check_choice(reduction, "reduction", _REDUCTIONS)


def check_ignore_index(ignore_index):
    """``ignore_index`` as an int in int64's range, else TypeError/ValueError."""
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if not _INT64.min <= ignore_index <= _INT64.max:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    return int(ignore_index)


# ----------------------------------------------------------------------------------- the arguments described
class Kind:
    """A kind of non-array argument, named in ``ARGUMENTS``: the values its check refuses, each with the exception
    the check raises (whose message names the argument). tests/test_bad_input.py passes each of them, in turn, to
    every argument of the kind in a valid call."""

    def __init__(self, name, refuses):
        self.name, self.refuses = name, tuple(refuses)

    def __repr__(self):
        return self.name


PROBABILITY = Kind("probability in [0, 1)", [(-0.1, ValueError), (1.0, ValueError), (float("nan"), ValueError),
                                               ("0.5", TypeError), (True, TypeError), (None, TypeError)])
FLAG = Kind("bool", [(1, TypeError), ("yes", TypeError), (None, TypeError)])
OPTIONAL_FLAG = Kind("bool or None", [(1, TypeError), ("yes", TypeError)])
SCALE = Kind("float or None", [("1", TypeError), (True, TypeError), (1j, TypeError)])
SEED = Kind("int or None", [(1.5, TypeError), ("1", TypeError), (True, TypeError)])
SIZE = Kind("int >= 0", [(-1, ValueError), (2.0, TypeError), (True, TypeError), ("3", TypeError), (None, TypeError)])
COUNT = Kind("int >= 1", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), ("3", TypeError),
                          (None, TypeError)])
OPTIONAL_COUNT = Kind("int >= 1 or None", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError),
                                           ("3", TypeError)])
WINDOW = Kind("(left, right) ints >= -1, or None", [(3, TypeError), ((1,), TypeError), ((1, -2), ValueError),
                                                     ((1.5, 1), TypeError), ((True, 1), TypeError)])
SOFTCAP = Kind("float >= 0 or None", [(-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
                                      ("5", TypeError), (True, TypeError)])
HYPER = Kind("float >= 0", [(-0.1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                            ("0.1", TypeError), (True, TypeError), (None, TypeError), (0.1j, TypeError),
                            ([0.9], TypeError)])
LABEL_SMOOTHING = Kind("float in [0, 1]", [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                         ("0.1", TypeError), (True, TypeError), (None, TypeError)])
REDUCTION = Kind("'mean', 'sum' or 'none'", [("avg", ValueError), (None, ValueError), ("MEAN", ValueError)])
CAUSAL_ALIGNMENT = Kind("'top_left' or 'bottom_right'", [("top", ValueError), (None, ValueError), (1, ValueError)])
IGNORE_INDEX = Kind("int in int64's range", [(1.5, TypeError), ("x", TypeError), (True, TypeError),
                                              (2 ** 63, ValueError)])
DTYPE = Kind(FLOAT_NAMES, [(np.int32, TypeError), (int, TypeError), (bool, TypeError), (object, TypeError),
                           ("int8", TypeError), ("junk", TypeError), (np.longdouble, TypeError),
                           (np.complex128, TypeError)])

_SDPA = dict(dropout_p=PROBABILITY, is_causal=FLAG, scale=SCALE, seed=SEED, causal_alignment=CAUSAL_ALIGNMENT,
             window=WINDOW, softcap=SOFTCAP)

# The non-array arguments of the public functions, layers and optimizers, by kind (the arrays and the few
# arguments of a kind of their own have their cases in tests/test_bad_input.py's tables).
ARGUMENTS = {
    "functional.scaled_dot_product_attention": dict(_SDPA, enable_gqa=FLAG),
    "functional.scaled_dot_product_attention_forward": dict(_SDPA, enable_gqa=FLAG),
    "functional.scaled_dot_product_attention_backward": dict(_SDPA, enable_gqa=FLAG),
    "functional.scaled_dot_product_attention_weights": dict(_SDPA, enable_gqa=FLAG),
    "functional.scaled_dot_product_attention_varlen": dict(_SDPA),
    "functional.scaled_dot_product_attention_varlen_forward": dict(_SDPA),
    "functional.scaled_dot_product_attention_varlen_backward": dict(_SDPA),
    "functional.scaled_dot_product_attention_with_kvcache": dict(is_causal=FLAG, scale=SCALE, window=WINDOW,
                                                                 softcap=SOFTCAP),
    "functional.dropout": dict(p=PROBABILITY, training=FLAG, seed=SEED),
    "functional.dropout_backward": dict(p=PROBABILITY, seed=SEED),
    "functional.dropout_mask": dict(p=PROBABILITY, seed=SEED),
    "functional.cross_entropy": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION),
    "functional.cross_entropy_forward": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION),
    "functional.cross_entropy_backward": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION),
    "functional.linear_cross_entropy": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION,
                                            label_smoothing=LABEL_SMOOTHING, softcap=SOFTCAP),
    "functional.linear_cross_entropy_forward": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION,
                                                    label_smoothing=LABEL_SMOOTHING, softcap=SOFTCAP,
                                                    compute_grads=FLAG),
    "functional.linear_cross_entropy_backward": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION,
                                                     label_smoothing=LABEL_SMOOTHING, softcap=SOFTCAP),
    "functional.linear_backward": dict(need_input_grad=FLAG),
    "functional.get_alibi_slopes": dict(num_heads=COUNT, dtype=DTYPE),
    "functional.rotary_embedding": dict(interleaved=FLAG),
    "functional.rotary_embedding_backward": dict(interleaved=FLAG),
    "functional.rotary_tables": dict(max_positions=SIZE, dtype=DTYPE),
    "nn.Linear": dict(in_features=SIZE, out_features=SIZE, bias=FLAG, dtype=DTYPE),
    "nn.Embedding": dict(num_embeddings=SIZE, embedding_dim=SIZE, dtype=DTYPE),
    "nn.Dropout": dict(p=PROBABILITY),
    "nn.CrossEntropyLoss": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION),
    "nn.LinearCrossEntropyLoss": dict(ignore_index=IGNORE_INDEX, reduction=REDUCTION,
                                      label_smoothing=LABEL_SMOOTHING),
    "nn.KVCache": dict(batch_size=COUNT, num_heads=COUNT, max_length=COUNT, head_dim=SIZE, dtype=DTYPE),
    "nn.MultiheadAttention": dict(embed_dim=COUNT, num_heads=COUNT, dropout=PROBABILITY, bias=FLAG,
                                  add_bias_kv=FLAG, add_zero_attn=FLAG, kdim=OPTIONAL_COUNT, vdim=OPTIONAL_COUNT,
                                  batch_first=FLAG, dtype=DTYPE),
    "nn.Attention": dict(embed_dim=COUNT, num_heads=COUNT, qk_dim=OPTIONAL_COUNT, v_dim=OPTIONAL_COUNT,
                         kv_dim=OPTIONAL_COUNT, out_dim=OPTIONAL_COUNT, bias=FLAG, out_proj=FLAG,
                         out_bias=OPTIONAL_FLAG, causal=FLAG, causal_alignment=CAUSAL_ALIGNMENT,
                         attn_dropout=PROBABILITY, out_dropout=PROBABILITY, scale=SCALE,
                         context_length=OPTIONAL_COUNT, window=WINDOW, softcap=SOFTCAP, sinks=FLAG, rotary=FLAG,
                         rotary_interleaved=FLAG, dtype=DTYPE),
    "optim.SGD": dict(lr=HYPER, momentum=HYPER, dampening=HYPER, weight_decay=HYPER, master_weights=FLAG),
    "optim.AdamW": dict(lr=HYPER, eps=HYPER, weight_decay=HYPER, master_weights=FLAG),
}
