"""Tensors in and out of attnpp: the checks every tensor argument of ``attnpp.torch`` passes, the NumPy views of
their memory (no copy), the errors' classes, the masks PyTorch defines as tensor subclasses.

The one place where attnpp reads a tensor's memory is ``to_numpy``, called by the operators' CPU kernels
(``attnpp.torch._ops``) only: tensors that are not plain strided CPU memory (a tensor subclass such as
``CausalBias``, whose storage is not its meaning; sparse or mkldnn layouts; meta, fake and functorch-wrapped
tensors, whose storage is absent) are refused there before their storage is read. The public functions check
their arguments earlier with ``check_tensor``, which also lets meta tensors and the tracing tensors of
``torch.compile`` and ``torch.export`` through to the operators' fake kernels.
"""
import math

import numpy as np
import torch

from .._checks import FLOAT_NAMES, bfloat16_tensor_as_ndarray, is_bfloat16

__all__ = ["TorchValueError", "TorchTypeError", "torch_errors", "check_tensor", "check_plain", "check_same_device",
           "check_dtype", "to_numpy", "from_numpy", "draw_seed", "additive_mask", "causal_bias_flags", "FLOATS",
           "FLOAT_NAMES", "CPU_ONLY"]

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
CPU_ONLY = "attnpp runs on the CPU: move the tensors with .cpu()"


# ------------------------------------------------------------------------------------------------- errors
class TorchValueError(ValueError, RuntimeError):
    """attnpp.torch's ValueError: also a RuntimeError, the class PyTorch raises for the same bad input (shapes,
    masks, dropout_p, attn_mask with is_causal), so that code catching PyTorch's errors catches attnpp's."""


class TorchTypeError(TypeError, RuntimeError):
    """attnpp.torch's TypeError: also a RuntimeError, as PyTorch's for mixed or unsupported dtypes."""


def torch_errors(function):
    """``function`` raising ``TorchValueError``/``TorchTypeError`` (message unchanged) where it raised a plain
    ValueError/TypeError (attnpp.functional's checks among them)."""
    import functools

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (TorchValueError, TorchTypeError):
            raise
        except ValueError as e:
            raise TorchValueError(*e.args).with_traceback(e.__traceback__) from None
        except TypeError as e:
            raise TorchTypeError(*e.args).with_traceback(e.__traceback__) from None
    return wrapped


# ------------------------------------------------------------------------------------------------- tensors
_TRACING = ()  # the tensor subclasses of torch's own tracing (fake, functional), filled on first use


def _tracing_types():
    global _TRACING
    if not _TRACING:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor
        _TRACING = (FakeTensor, FunctionalTensor)
    return _TRACING


def _plain_type(t):
    """True for a torch.Tensor or Parameter that is no other subclass."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def check_tensor(t, name, mask=False):
    """``t`` if it is a tensor attnpp can compute on: a plain strided tensor (or ``torch.nn.Parameter``) on the CPU
    (or meta, or a tracing tensor of torch.compile / torch.export, for shapes only), of a float dtype attnpp
    computes in (or bool for a ``mask``), else TorchValueError/TorchTypeError. A mask that requires grad is
    refused while grad mode is on (attnpp gives masks no gradient; PyTorch gives a float mask one)."""
    check_plain(t, name)
    if not (t.is_cpu or t.is_meta):  # (not t.device.type: a device object per call, ~5 us of a decoding step)
        raise TorchValueError(f"{name}: {CPU_ONLY} (got device {t.device})")
    if t.dtype not in FLOATS and not (mask and t.dtype == torch.bool):
        raise TorchTypeError(f"{name}: attnpp computes in {FLOAT_NAMES}{' (masks may be bool)' if mask else ''}, "
                             f"got {t.dtype}")
    if mask and t.requires_grad and torch.is_grad_enabled():
        raise TorchValueError(f"{name}: attnpp gives masks no gradient, and this one requires grad (PyTorch would "
                              f"compute its gradient): detach it (mask.detach()) or use "
                              f"torch.nn.functional.scaled_dot_product_attention")
    return t


def check_plain(t, name):
    """``t`` if it is a torch.Tensor attnpp may read: no subclass (but Parameter and torch's tracing tensors), a
    strided layout; else TorchTypeError."""
    if not isinstance(t, torch.Tensor):
        raise TorchTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not _plain_type(t) and not isinstance(t, _tracing_types()):
        raise TorchTypeError(f"{name}: attnpp reads plain tensors only, got the tensor subclass "
                             f"{type(t).__module__}.{type(t).__qualname__} (its memory is not its meaning); pass a "
                             f"plain torch.Tensor")
    if t.layout != torch.strided:
        raise TorchTypeError(f"{name}: attnpp reads strided (dense) tensors only, got layout {t.layout}; convert "
                             f"it with .to_dense()")
    return t


def check_same_device(first, *named):
    """TorchValueError unless each (name, tensor or None) of ``named`` is on ``first``'s device (the CPU, or meta
    for shapes only)."""
    for name, t in named:
        if t is not None and t.is_meta != first.is_meta:
            raise TorchValueError(f"{name}: {CPU_ONLY} (got device {t.device} with a first tensor on "
                                  f"{first.device})")


def check_dtype(dtype):
    """A module's dtype: torch's default for None; TorchTypeError unless float32, float64, float16 or bfloat16."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in FLOATS:
        raise TorchTypeError(f"dtype: attnpp computes in {FLOAT_NAMES}, got {dtype}")
    return dtype


def to_numpy(tensor):
    """The NumPy array sharing the memory of a plain CPU tensor (detached), as ``tensor.detach().numpy()``, which
    also takes torch.bfloat16 (as an array of ``ml_dtypes.bfloat16``, which NumPy lacks) and tensors with the
    negative bit (resolved: a copy). None stays None. TorchTypeError for a tensor subclass, a functorch-wrapped
    tensor (vmap, grad) or another layout, TorchValueError off the CPU: their storage is never read."""
    if tensor is None:
        return None
    if not _plain_type(tensor) or tensor.layout != torch.strided \
            or torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        raise TorchTypeError(f"attnpp reads the memory of plain strided CPU tensors only, got "
                             f"{type(tensor).__qualname__} (layout {tensor.layout})")
    if not tensor.is_cpu:
        raise TorchValueError(f"{CPU_ONLY} (got device {tensor.device})")
    if tensor.requires_grad:  # (detach() makes a new tensor object: a few microseconds a call where it is not needed)
        tensor = tensor.detach()
    if tensor.is_neg() or tensor.is_conj():
        tensor = tensor.resolve_neg().resolve_conj()
    return bfloat16_tensor_as_ndarray(tensor) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def from_numpy(array):
    """The tensor sharing the memory of an ndarray, as ``torch.from_numpy``, which also takes arrays of
    ``ml_dtypes.bfloat16`` (as torch.bfloat16)."""
    if is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def draw_seed():
    """A dropout seed from torch's default generator, so that ``torch.manual_seed`` fixes it."""
    return int(torch.randint(0, 2**63 - 1, ()))


def additive_mask(mask, dtype, name):
    """A bool mask (True = masked out) or float mask of ``dtype`` as the float mask added to the scores."""
    check_tensor(mask, name, mask=True)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask, -math.inf)
    if mask.dtype != dtype:
        raise TorchTypeError(f"{name}: expected dtype torch.bool or {dtype} (the query's), got {mask.dtype}")
    return mask


# ----------------------------------------------------------------------------------- PyTorch's mask objects
def causal_bias_flags(attn_mask, L, S, is_causal):
    """``(is_causal, causal_alignment)`` of ``torch.nn.attention.bias.CausalBias`` ``attn_mask`` (its storage is
    never read): ``causal_upper_left`` is ``is_causal`` aligned top-left, ``causal_lower_right`` bottom-right
    (query i sees keys j <= i + S - L). None when ``attn_mask`` is not a CausalBias. TorchValueError for a bias
    made for another (L, S), or given with ``is_causal=True`` (PyTorch refuses that too)."""
    from torch.nn.attention.bias import CausalBias, CausalVariant
    if not isinstance(attn_mask, CausalBias):
        return None
    if is_causal:
        raise TorchValueError("attn_mask: a CausalBias must not be given with is_causal=True (as in PyTorch)")
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
        raise TorchValueError(f"attn_mask: a CausalBias for (L, S) = ({attn_mask.seq_len_q}, "
                              f"{attn_mask.seq_len_kv}), but the query and key give ({L}, {S})")
    if attn_mask.variant == CausalVariant.UPPER_LEFT:
        return True, "top_left"
    if attn_mask.variant == CausalVariant.LOWER_RIGHT:
        return True, "bottom_right"
    raise TorchValueError(f"attn_mask: unknown CausalBias variant {attn_mask.variant!r}")
