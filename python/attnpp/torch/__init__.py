"""attnpp inside PyTorch: attention on CPU tensors, with torch autograd running attnpp's hand-written backward.

``import attnpp.torch`` (``import attnpp`` alone never imports torch). Each operation is a registered PyTorch
operator (``torch.library.custom_op``, namespace ``attnpp``: ``attnpp.torch._ops``) whose forward and backward
(an operator of its own) are attnpp's C++ (``attnpp.functional``); the tensors' memory is read as NumPy views (no
copy, non-contiguous tensors included; bfloat16 through ``ml_dtypes.bfloat16``) and the results are wrapped
without a copy either. The operators have fake kernels (shapes and dtypes), autograd formulas and vmap rules, so
``torch.compile(fullgraph=True)``, ``torch.export``, meta tensors and ``torch.func`` (vmap, grad, jacrev) see
through attnpp. Double backward is not supported (the backward is not itself differentiable).

Layout: ``_convert`` (tensor checks, NumPy views, error classes, PyTorch's mask objects), ``_ops`` (the
operators), ``functional`` (the functions), ``modules`` (the modules), ``distributed`` (ring attention).

- ``scaled_dot_product_attention``: as ``torch.nn.functional.scaled_dot_product_attention``.
- ``scaled_dot_product_attention_varlen``: packed sequences of different lengths, as FlashAttention's
  ``flash_attn_varlen_func``.
- ``linear`` and ``Linear``: as ``torch.nn.functional.linear`` and ``torch.nn.Linear``.
- ``linear_cross_entropy``: ``cross_entropy(linear(...))`` fused, without the (N, V) logits.
- ``MultiheadAttention``: as ``torch.nn.MultiheadAttention`` (its subclass: same parameters, state dict and
  initialisation), attnpp's compute.
- ``Attention``: ``attnpp.nn.Attention`` with torch parameters.
- ``from_numpy``, ``to_numpy``: ``torch.from_numpy`` and ``Tensor.numpy`` (no copy) for every dtype attnpp takes,
  bfloat16 included (NumPy's bfloat16 is ``ml_dtypes.bfloat16``).

Shape letters: B... batch dimensions, H heads (Hq of the query, Hk of key and value), L query length, S key/value
length, D query/key head width, Dv value head width, E embedding width.

Tensors: float32, float64, float16 or bfloat16 (masks may be bool), on the CPU; half precision is computed and
accumulated in float32 and rounded once per output, as PyTorch's CPU kernels do, and the log-sum-exp is float32.
Masks follow PyTorch's conventions, which differ between functions: in ``scaled_dot_product_attention`` a bool
``attn_mask`` is True where a key *takes part*; in ``MultiheadAttention`` and ``Attention`` a bool mask is True
where a key is *masked out*. Float masks are added to the scores everywhere; masks get no gradient.

Dropout: the seed of each call with dropout is drawn from torch's default CPU generator (one
``torch.randint`` per call), so ``torch.manual_seed(s)`` makes a run reproducible, whatever the thread count;
the backward reuses the forward's mask. The mask of seed ``seed`` is ``attnpp.functional.dropout_mask``'s.

Raises (every function and module): ``TorchValueError`` (a ValueError and a RuntimeError, the class PyTorch
raises for the same input) for a tensor not on the CPU ("attnpp runs on the CPU: move the tensors with
.cpu()"); ``TorchTypeError`` (a TypeError and a RuntimeError) for another dtype than float32, float64, float16 or
bfloat16, mixed dtypes, a non-tensor, a tensor subclass (other than PyTorch's ``CausalBias`` masks, read as
causal flags) or a sparse tensor; the same classes, messages unchanged, for ``attnpp.functional``'s errors on
shapes, masks and arguments that do not agree.

Method: Vaswani et al., "Attention Is All You Need" (2017); computed as FlashAttention-2 (Dao, 2023): only the
output and the log-sum-exp are saved for the backward, memory grows with L, not L*S.
"""

from ._convert import TorchTypeError, TorchValueError, from_numpy, to_numpy
from ._convert import check_tensor as _check_tensor  # noqa: F401 (attnpp.torch.distributed imports it from here)
from .functional import (linear, linear_cross_entropy, scaled_dot_product_attention,
                         scaled_dot_product_attention_varlen)
from .modules import Attention, Linear, MultiheadAttention

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_varlen", "linear", "linear_cross_entropy",
           "Linear", "MultiheadAttention", "Attention", "from_numpy", "to_numpy", "TorchValueError", "TorchTypeError"]
