"""Type stubs of attnpp._core, the pybind11 module built from cpp/bindings/.

Kept in step with the binding by tests/test_core_stubs.py (argument names, defaults, functions both ways).
The kernels write their results into the output arrays passed first; the backward functions add into theirs.
Float arrays are all of one dtype within a call, float32, float64, float16 or bfloat16 (ml_dtypes), but for the
log-sum-exp, slopes, sinks and cross-entropy statistics, which are float32 for the half-precision dtypes (their
compute dtype); index arrays are C-contiguous int64.
"""

from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

_FloatArray = Union[npt.NDArray[np.float32], npt.NDArray[np.float64], npt.NDArray[np.float16], npt.NDArray[Any]]
_IndexArray = npt.NDArray[np.int64]

def cpu_capability() -> str:
    """The CPU level the kernels run at: 'default', 'avx2', 'avx512' or 'avx512_bf16' (all but the first on
    x86-64 only)."""

def build_config() -> Dict[str, Any]:
    """The build: dict of cpu_capability, levels_built, levels_supported, compiler, flags, eigen, threading,
    half_precision (how the level computes in it), cpu_half_features (F16C, AVX512_BF16, AVX512_FP16, AMX-BF16 when
    the CPU has them)."""

def forward_products(head_dim: int, steps: int) -> float:
    """Runs the attention forward's two products alone, q k^T then p v, on the blocks the forward takes for a head of
    width head_dim (in [1, 1024]), `steps` times each in 8 tasks a thread, and returns the flops done: flops /
    seconds is the most the forward's products reach on these threads, without the softmax (attnpp.bench)."""

def multiply_add_peak(steps: int) -> float:
    """Runs `steps` float multiply-adds on each of 14 independent vector accumulators (30 with AVX-512), 8 tasks a
    thread, nothing loaded, and returns the flops done: flops / seconds is the level's peak on these threads
    (attnpp.bench)."""

def set_num_threads(n: int) -> None:
    """Set the number of threads the kernels use, n in [1, 256]."""

def get_num_threads() -> int:
    """The number of threads the kernels use."""

class Causal:
    """Which keys a causal mask hides: none; top_left (query i sees keys j <= i); bottom_right (query i sees keys
    j <= i + S - L)."""

    none: Causal
    top_left: Causal
    bottom_right: Causal
    name: str
    value: int
    def __init__(self, value: int) -> None:
        """The member of this value."""

class Bfloat16Numerics:
    """How bfloat16 attention computes: pytorch (as the PyTorch CPU kernel of the same call: flash when D = Dv and no
    dropout, else float32); flash (the weights and their gradient rounded for their products, the softmax term from
    the rounded output); float32 (those products in float32, the softmax term from the weights)."""

    pytorch: Bfloat16Numerics
    flash: Bfloat16Numerics
    float32: Bfloat16Numerics
    name: str
    value: int
    def __init__(self, value: int) -> None:
        """The member of this value."""

class AttentionMask:
    """An additive mask broadcast to (N, H, L, S): element (n, h, i, j) is the element of data at batch_offsets[n] +
    h * h_stride + i * l_stride + j * s_stride elements from its first (in memory, whatever data's shape); data of
    the attention's dtype, batch_offsets (N,) int64 (attnpp.functional.mask_arg builds one from a broadcast view)."""

    def __init__(
        self, data: _FloatArray, batch_offsets: _IndexArray, h_stride: int, l_stride: int, s_stride: int
    ) -> None:
        """The mask's fields."""
    data: _FloatArray
    batch_offsets: _IndexArray
    h_stride: int
    l_stride: int
    s_stride: int

class AttentionParams:
    """The parameters of sdpa_forward/backward/weights besides the arrays, each an attribute with its default."""

    def __init__(self) -> None:
        """The defaults; the fields are then set as attributes."""
    scale: float  # 1.0; the factor on q k^T
    causal: Causal  # Causal.none
    dropout_p: float  # 0.0
    seed: int  # 0
    masks: List[AttentionMask]  # []; summed into the scores
    window_left: int  # -1 (unbounded); keys [i + S - L - window_left, i + S - L + window_right]
    window_right: int  # -1
    softcap: float  # 0.0 (none)
    bfloat16_numerics: Bfloat16Numerics  # Bfloat16Numerics.pytorch (common.hpp's flash_numerics)
    accumulate: bool  # False; True: the forward merges its keys into the partial result out and logsumexp hold
    alibi_slopes: Optional[_FloatArray]  # (1 or N, Hq)
    sinks: Optional[_FloatArray]  # (Hq,)
    cu_seqlens_q: Optional[_IndexArray]  # (N + 1,): packed sequences in the arrays' one batch entry
    cu_seqlens_k: Optional[_IndexArray]
    seqlens_k: Optional[_IndexArray]  # (N,): keys per batch entry (a KV cache)

def sdpa_forward(
    out: _FloatArray,
    logsumexp: _FloatArray,
    query: _FloatArray,
    key: _FloatArray,
    value: _FloatArray,
    params: AttentionParams,
) -> None:
    """Attention forward into out (N, Hq, L, Dv) and logsumexp (N, Hq, L), of query (N, Hq, L, D), key (N, Hk, S, D),
    value (N, Hk, S, Dv)."""

def sdpa_forward_plain(
    query: Any,
    key: Any,
    value: Any,
    dropout_p: Any,
    causal: Causal,
    scale: float,
    enable_gqa: Any,
    bfloat16_numerics: Bfloat16Numerics,
) -> Optional[tuple]:
    """sdpa_forward of the commonest call in one step: (out, logsumexp) of query (N, Hq, L, D), key (N, Hk, S, D),
    value (N, Hk, S, Dv) ndarrays of one dtype with contiguous rows, Hk = Hq or a divisor of it with enable_gqa (a
    bool), dropout_p 0, with the causal mode and the scale given (functional's); None for any other call."""

def sdpa_backward(
    grad_query: _FloatArray,
    grad_key: _FloatArray,
    grad_value: _FloatArray,
    grad_output: _FloatArray,
    out: _FloatArray,
    logsumexp: _FloatArray,
    query: _FloatArray,
    key: _FloatArray,
    value: _FloatArray,
    params: AttentionParams,
    grad_sinks: Optional[_FloatArray] = None,
) -> None:
    """Attention backward: adds into grad_query (N, Hq, L, D), grad_key (N, Hk, S, D), grad_value (N, Hk, S, Dv)
    and grad_sinks (Hq,) or None, from grad_output and out (N, Hq, L, Dv), logsumexp (N, Hq, L) and sdpa_forward's
    inputs and params."""

def sdpa_weights(
    weights: _FloatArray,
    logsumexp: _FloatArray,
    query: _FloatArray,
    key: _FloatArray,
    params: AttentionParams,
    average_heads: bool = False,
) -> None:
    """The attention weights (after dropout) into weights (N, Hq, L, S), or (N, L, S) averaged over heads."""

def linear_forward(out: _FloatArray, input: _FloatArray, weight: _FloatArray, bias: Optional[_FloatArray]) -> None:
    """out (M, Fout) = input (M, Fin) @ weight (Fout, Fin).T + bias (Fout,) or None; all C-contiguous."""

def linear_backward(
    grad_input: Optional[_FloatArray],
    grad_weight: _FloatArray,
    grad_bias: Optional[_FloatArray],
    grad_output: _FloatArray,
    input: _FloatArray,
    weight: _FloatArray,
) -> None:
    """Linear backward: adds into grad_input (M, Fin) or None, grad_weight (Fout, Fin), grad_bias (Fout,) or None."""

def empty(shape: Sequence[int], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An uninitialized C-contiguous array of a numeric dtype, its memory recycled by attnpp's pool."""

def empty_cache() -> int:
    """Free the pool's cached blocks; returns their size in bytes."""

def dropout_mask(shape: Sequence[int], p: float, seed: int) -> npt.NDArray[np.bool_]:
    """The keep mask (bool, of the given shape) of dropout with probability p and seed."""

def dropout_forward(out: _FloatArray, input: _FloatArray, p: float, seed: int) -> None:
    """Dropout of input into out (same size, C-contiguous), kept elements scaled by 1 / (1 - p)."""

def dropout_backward(grad_input: _FloatArray, grad_output: _FloatArray, p: float, seed: int) -> None:
    """Dropout backward: adds into grad_input from grad_output (same size), by the mask of the same p and seed."""

def rotary_forward(
    out: _FloatArray,
    input: _FloatArray,
    cos: _FloatArray,
    sin: _FloatArray,
    position_offsets: _IndexArray,
    interleaved: bool,
) -> None:
    """Rotary position embedding of input (N, H, L, D) into out (N, H, L, D): the first R = 2 * R2 features of row l
    of sequence n rotated by the angles of row position_offsets[n] + l of cos and sin (P, R2); pairs (d, d + R2), or
    (2d, 2d + 1) when interleaved; the features R.. copied. position_offsets (N,), each in [0, P - L]."""

def rotary_backward(
    grad_input: _FloatArray,
    grad_output: _FloatArray,
    cos: _FloatArray,
    sin: _FloatArray,
    position_offsets: _IndexArray,
    interleaved: bool,
) -> None:
    """Rotary embedding backward: adds into grad_input (N, H, L, D) grad_output rotated by the opposite angles."""

def embedding_forward(out: _FloatArray, index: _IndexArray, weight: _FloatArray) -> None:
    """out (N, E) = weight (V, E)[index], index: N int64 values in [0, V)."""

def embedding_backward(grad_weight: _FloatArray, grad_output: _FloatArray, index: _IndexArray) -> None:
    """Adds the rows of grad_output (N, E) into grad_weight (V, E) at index (N int64 values)."""

def cross_entropy_forward(
    losses: _FloatArray, stats: _FloatArray, input: _FloatArray, target: _IndexArray, ignore_index: int
) -> None:
    """Per-row cross entropy of input (N, C) and target (N,) into losses (N,) and stats (N, 2) for the backward."""

def cross_entropy_backward(
    grad_input: _FloatArray, row_weight: _FloatArray, stats: _FloatArray, input: _FloatArray, target: _IndexArray
) -> None:
    """grad_input (N, C) of the losses weighted by row_weight (N,), from cross_entropy_forward's stats (N, 2)."""

def linear_cross_entropy(
    losses: _FloatArray,
    logsumexp: _FloatArray,
    grad_input: _FloatArray | None,
    grad_weight: _FloatArray | None,
    grad_bias: _FloatArray | None,
    row_weight: _FloatArray | None,
    input: _FloatArray,
    weight: _FloatArray,
    bias: _FloatArray | None,
    target: _IndexArray,
    ignore_index: int,
    label_smoothing: float,
    softcap: float = 0.0,
) -> None:
    """Fused cross_entropy(input (N, E) @ weight (V, E).T + bias, target (N,)) over chunks of rows: losses and
    logsumexp (N,) written; with row_weight, the gradients added in the same pass. softcap > 0: the logits
    soft-capped, softcap * tanh(z / softcap)."""

def linear_cross_entropy_backward(
    logsumexp: _FloatArray,
    grad_input: _FloatArray | None,
    grad_weight: _FloatArray,
    grad_bias: _FloatArray | None,
    row_weight: _FloatArray,
    input: _FloatArray,
    weight: _FloatArray,
    bias: _FloatArray | None,
    target: _IndexArray,
    ignore_index: int,
    label_smoothing: float,
    softcap: float = 0.0,
) -> None:
    """Backward of linear_cross_entropy: each chunk's logits recomputed from logsumexp (N,), the gradients of the
    losses weighted by row_weight (N,) added into grad_input (N, E) or None, grad_weight and grad_bias or None."""

def sgd_step(
    params: List[_FloatArray],
    grads: List[_FloatArray],
    momentum_buffers: List[Optional[_FloatArray]],
    steps: List[int],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
) -> None:
    """One SGD step (torch.optim.SGD's update) on every param of the list in place, in one parallel loop;
    momentum_buffers None only when momentum is 0; steps: 1 on a buffer's first step."""

def adamw_step(
    params: List[_FloatArray],
    grads: List[_FloatArray],
    exp_avgs: List[_FloatArray],
    exp_avg_sqs: List[_FloatArray],
    steps: List[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step (torch.optim.AdamW's update) on every param of the list and its exp_avg and exp_avg_sq in
    place, in one parallel loop; steps count from 1."""
