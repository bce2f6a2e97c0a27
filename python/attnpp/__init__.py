"""attnpp: attention layers for NumPy with a C++ core (Eigen, OpenMP).

Every attention variant has an autograd-free forward and a hand-written backward; outputs and gradients are
checked against PyTorch. See ``attnpp.functional`` (stateless functions) and ``attnpp.nn`` (layers).
"""
import importlib.metadata
import numbers

from ._checks import check_bool
from ._core import get_num_threads
from ._seeds import get_rng_state, manual_seed, set_rng_state
from .grad_mode import enable_grad, is_grad_enabled, no_grad
from . import _core, functional, nn, optim


def set_num_threads(n):
    """Use ``n`` threads in attnpp's parallel kernels, in every Python thread (as ``torch.set_num_threads``).

    Results do not depend on the thread count (each element is computed by one thread in a fixed order), nor do
    dropout masks. Default: OpenMP's, i.e. ``OMP_NUM_THREADS`` or the number of cores.

    Raises:
        TypeError: ``n`` not an int. ValueError: ``n`` outside [1, 256].
    """
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"set_num_threads: n must be an int, got {n!r} ({type(n).__name__})")
    _core.set_num_threads(int(n))


def allow_reduced_precision_attention(enabled):
    """Whether the attention's backward in bfloat16 may trade accuracy for speed, as PyTorch's
    ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`` does (one setting for the process; default False).

    False (the default): the backward takes the softmax term rowsum(dO * O) from the weights in float32, in a
    pass of its own over the blocks, and multiplies the scores' gradient dS in float32; its errors stay within
    1.5 times PyTorch's in the same dtype whichever PyTorch backend runs (tests/test_half.py). True: the numerics of
    PyTorch's CPU flash attention: rowsum(dO * O) from the rounded output, and at the ``avx512_bf16`` level dS
    rounded to bfloat16 for its products with K and Q (``vdpbf16ps``); the bfloat16 backward then runs faster (the
    benchmark's ``reduced precision`` rows), and dq and dk carry PyTorch's flash kernel's errors: up to 2 to 5
    times those of PyTorch's float32-internal math backend (which PyTorch takes when the value width differs from
    the query's). float16 (whose accurate backward is already several times PyTorch's speed), float32 and float64
    are not affected, nor is the forward.

    Raises:
        TypeError: ``enabled`` not a bool.
    """
    functional._REDUCED_PRECISION = check_bool(enabled, "enabled")


def reduced_precision_attention_allowed():
    """The setting of ``allow_reduced_precision_attention`` (False by default)."""
    return functional._REDUCED_PRECISION


def cpu_capability():
    """The CPU level whose kernels run: ``"default"``, ``"avx2"``, ``"avx512"`` or ``"avx512_bf16"`` (x86-64);
    ``"default"`` elsewhere.

    attnpp's kernels are compiled once per level and the best one the CPU supports is picked at import, as
    PyTorch's ``CPU_CAPABILITY`` and NumPy's dispatch do: ``default`` is the x86-64 baseline (SSE2), ``avx2``
    x86-64-v3 (AVX2, FMA, F16C), ``avx512`` x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), ``avx512_bf16`` that and
    AVX512_BF16 (bfloat16 attention products with ``vdpbf16ps``: Intel Cooper Lake and Sapphire Rapids on, AMD Zen
    4 on); on other architectures, their baseline (NEON on aarch64). The environment variable
    ``ATTNPP_CPU_CAPABILITY=default|avx2|avx512|avx512_bf16``, read at import, forces a level; one the CPU cannot
    run makes ``import attnpp`` raise ImportError. Results differ between levels in the last bits (another order
    of sums, fused multiply-adds; bfloat16 at ``avx512_bf16``: the attention weights rounded for their products),
    never between thread counts.
    """
    return _core.cpu_capability()


def show_config(mode="stdout"):
    """How attnpp was built and what it runs with: the CPU level in use, the levels built and those this CPU
    supports, how the level computes in half precision and the CPU's half-precision extensions, the compiler and
    its flags per level, the Eigen and OpenMP versions, the thread count.

    Args:
        mode (str): ``"stdout"`` (default) prints them; ``"dicts"`` returns them as a dict, as
            ``numpy.show_config`` does (keys ``cpu_capability``, ``levels_built``, ``levels_supported``,
            ``half_precision``, ``cpu_half_features`` (among F16C, AVX512_BF16, AVX512_FP16, AMX-BF16; attnpp uses
            the first two), ``compiler``, ``flags``, ``eigen``, ``openmp``, ``threads``).

    Raises:
        ValueError: another ``mode``.
    """
    if mode not in ("stdout", "dicts"):
        raise ValueError(f"show_config: mode must be 'stdout' or 'dicts', got {mode!r}")
    config = dict(_core.build_config(), threads=get_num_threads())
    if mode == "dicts":
        return config
    print(f"attnpp {__version__}")
    print(f"  cpu_capability: {config['cpu_capability']} (built: {', '.join(config['levels_built'])}; this CPU "
          f"supports: {', '.join(config['levels_supported'])}; ATTNPP_CPU_CAPABILITY forces one)")
    print(f"  half_precision: {config['half_precision']} (this CPU has: "
          f"{', '.join(config['cpu_half_features']) or 'none of F16C, AVX512_BF16, AVX512_FP16, AMX-BF16'})")
    for key in ("compiler", "flags", "eigen", "openmp", "threads"):
        print(f"  {key}: {config[key]}")


def empty_cache():
    """Free the memory attnpp keeps for reuse; returns its size in bytes.

    Large outputs and gradients (1 MiB and more) come from blocks recycled when their arrays are freed (up to
    256 MiB in all), so that a training loop does not fault in fresh pages at every step. Arrays still alive
    are not affected. Like ``torch.cuda.empty_cache``, for when that memory is wanted elsewhere.
    """
    return _core.empty_cache()


__all__ = ["functional", "nn", "optim", "manual_seed", "get_rng_state", "set_rng_state", "no_grad", "enable_grad",
           "is_grad_enabled", "set_num_threads", "get_num_threads", "empty_cache", "cpu_capability", "show_config",
           "allow_reduced_precision_attention", "reduced_precision_attention_allowed"]
# The version is written once, in pyproject.toml; the install (scikit-build-core) copies it into the package's
# metadata, read here. attnpp is importable only installed (its _core is built by the install, editable or not).
__version__ = importlib.metadata.version("attnpp")
