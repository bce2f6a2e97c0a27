"""attnpp: attention layers for NumPy with a C++ core (Eigen, OpenMP or a pool of threads).

Every attention variant has an autograd-free forward and a hand-written backward; outputs and gradients are
checked against PyTorch. See ``attnpp.functional`` (stateless functions) and ``attnpp.nn`` (layers).
"""
import importlib.metadata
import numbers

from ._checks import check_choice
from ._core import get_num_threads
from ._seeds import get_rng_state, manual_seed, set_rng_state
from .grad_mode import enable_grad, is_grad_enabled, no_grad
from . import _core, functional, nn, optim

_BFLOAT16_NUMERICS = ("pytorch", "flash", "float32")


def set_num_threads(n):
    """Use ``n`` threads in attnpp's parallel kernels, in every Python thread (as ``torch.set_num_threads``).

    Results do not depend on the thread count (each element is computed by one thread in a fixed order), nor do
    dropout masks. Default: ``OMP_NUM_THREADS``, else the number of cores this process may use (in a build
    without OpenMP as well).

    Raises:
        TypeError: ``n`` not an int. ValueError: ``n`` outside [1, 256].
    """
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"set_num_threads: n must be an int, got {n!r} ({type(n).__name__})")
    _core.set_num_threads(int(n))


def set_bfloat16_attention(numerics):
    """How the attention computes in bfloat16 (one setting for the process; default ``"pytorch"``).

    PyTorch's CPU ``scaled_dot_product_attention`` computes bfloat16 inputs two ways: its flash kernel, taken when
    the value width equals the query's (Dv = D) and there is no dropout, rounds the weights P to bfloat16 for P V
    and P^T dO and the scores' gradient dS for dS K and dS^T Q, and takes the softmax term rowsum(dO * O) from the
    rounded output; its math backend, taken otherwise, computes in float32 and rounds its results once. Their
    errors are up to 1.8 times apart in the output and dv, up to 5 times in dq and dk.

    Args:
        numerics (str): ``"pytorch"`` (the default): as the PyTorch kernel of the same call, the flash numerics
            when D = Dv and ``dropout_p`` is 0, the float32 numerics otherwise, so that attnpp's error stays within
            1.5 times PyTorch's own on every call (tests/test_half.py). ``"flash"``: the flash numerics on every
            call, the fastest. ``"float32"``: the float32 numerics on every call: the products of P and dS in
            float32 and rowsum(dO * O) from P and dP in float32, in a pass of its own over the blocks; the most
            accurate, its backward about 1.5 times as long.

    At the ``avx512_bf16`` level ``vdpbf16ps`` multiplies the rounded weights as bfloat16 pairs; the other levels
    multiply in float32, the weights rounded all the same under the flash numerics. The products of two inputs
    (q k^T, dO v^T), the log-sum-exp, the softmax and every sum are float32 in both. float16 attention always
    computes with the float32 numerics (no CPU level here multiplies float16 faster than float32), and float32
    and float64 are not affected.

    Raises:
        ValueError: ``numerics`` not one of the three names.
    """
    functional._args._BFLOAT16_NUMERICS = getattr(_core.Bfloat16Numerics,
                                                  check_choice(numerics, "numerics", _BFLOAT16_NUMERICS))


def get_bfloat16_attention():
    """The setting of ``set_bfloat16_attention``: ``"pytorch"`` (the default), ``"flash"`` or ``"float32"``."""
    return functional._args._BFLOAT16_NUMERICS.name


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
    its flags per level, the Eigen version, the threading runtime (OpenMP, or a pool of ``std::thread`` in a build
    without OpenMP), the thread count.

    Args:
        mode (str): ``"stdout"`` (default) prints them; ``"dicts"`` returns them as a dict, as
            ``numpy.show_config`` does (keys ``cpu_capability``, ``levels_built``, ``levels_supported``,
            ``half_precision``, ``cpu_half_features`` (among F16C, AVX512_BF16, AVX512_FP16, AMX-BF16; attnpp uses
            the first two), ``compiler``, ``flags``, ``eigen``, ``threading``, ``threads``).

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
    for key in ("compiler", "flags", "eigen", "threading", "threads"):
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
           "set_bfloat16_attention", "get_bfloat16_attention"]
# The version is written once, in pyproject.toml; the install (scikit-build-core) copies it into the package's
# metadata, read here. attnpp is importable only installed (its _core is built by the install, editable or not).
__version__ = importlib.metadata.version("attnpp")
