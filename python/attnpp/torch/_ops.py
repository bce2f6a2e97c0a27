"""attnpp's operations as PyTorch operators (``torch.library.custom_op``, namespace ``attnpp``).

Each operator's CPU kernel is attnpp's C++ (``attnpp.functional``) on NumPy views of the tensors (``to_numpy``:
no copy, never a subclass's storage); its fake kernel gives the outputs' shapes and dtypes only, so meta and
fake tensors propagate shapes and ``torch.compile(fullgraph=True)`` and ``torch.export`` trace through attnpp;
the backward is an operator of its own, called by the forward's registered autograd formula; a vmap rule folds
the vmapped dimension into the batch dimensions where the kernel takes it (attention, linear's input, rotary)
and otherwise runs the operator once per vmapped entry.

Operators (tensors and plain scalars only; options as ints, floats, bools and strings; a dropout seed as an
int; an empty (0,) tensor stands for a gradient not computed):

- ``attnpp::sdpa_forward`` -> (output (B..., Hq, L, Dv), logsumexp (B..., Hq, L)), ``attnpp::sdpa_backward``
  -> (grad_query, grad_key, grad_value, grad_sinks (Hq,) or (0,)), ``attnpp::sdpa_weights`` -> (B..., Hq, L, S).
- ``attnpp::sdpa_varlen_forward`` -> (output (Tq, Hq, Dv), logsumexp (Hq, Tq)), ``attnpp::sdpa_varlen_backward``
  -> (grad_query, grad_key, grad_value, grad_sinks (Hq,) or (0,)): packed sequences (cu_seqlens_q, cu_seqlens_k).
- ``attnpp::linear`` -> (*, Fout), ``attnpp::linear_backward`` -> (grad_input, grad_weight, grad_bias).
- ``attnpp::linear_cross_entropy_forward`` -> (loss, logsumexp, grad_input, grad_weight, grad_bias), the loss
  and logsumexp in the compute dtype (float32 for half precision), the gradients computed in the forward for the
  scalar reductions when ``compute_grads``;
  ``attnpp::linear_cross_entropy_backward`` -> (grad_input, grad_weight, grad_bias).
- ``attnpp::rotary_embedding`` and ``attnpp::rotary_embedding_backward``: RoPE of (B..., H, T, D) heads at
  positions ``position_offset`` .. ``position_offset + T - 1``, tables of ``rotary_dim`` and ``base``.

Arguments and errors: those of the ``attnpp.functional`` function of the same name; ValueError and TypeError are
raised as ``TorchValueError`` and ``TorchTypeError`` (also RuntimeErrors, as PyTorch's).
"""
import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import functional as AF
from ..functional.fused_loss import _forward_unrounded
from ..functional.rotary import cached_rotary_tables
from ._convert import from_numpy, to_numpy, torch_errors

_HALVES = (torch.float16, torch.bfloat16)


def _acc(dtype):
    """The dtype of a log-sum-exp for inputs of ``dtype``: float32 for half precision."""
    return torch.float32 if dtype in _HALVES else dtype


def _none(like):
    """The empty (0,) tensor that stands for a gradient not computed."""
    return like.new_empty((0,))


def _new(like):
    """A fake output of ``like``'s shape and dtype, contiguous as the CPU kernels' outputs (not empty_like, which
    keeps a view's strides)."""
    return like.new_empty(like.shape)


def _window(window):
    return None if window is None else tuple(window)


def _loop_rule(op):
    """A vmap rule running ``op`` once per vmapped entry and stacking the outputs (dim 0)."""
    def rule(info, in_dims, *args):
        outs = [op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
                for i in range(info.batch_size)]
        if isinstance(outs[0], tuple):
            return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
        return torch.stack(outs), 0
    return rule


def _lift(x, dim, ndim, size=None):
    """``x`` (vmapped at ``dim``, or None if not) as (size or 1, 1..., *x's own shape), ``ndim`` dims after the
    first (a view); expanded to ``size`` entries along the first when given."""
    if x is None:
        return None
    x = x.unsqueeze(0) if dim is None else x.movedim(dim, 0)
    pad = ndim - (x.dim() - 1)
    if pad > 0:
        x = x[(slice(None),) + (None,) * pad]
    return x if size is None or x.shape[0] == size else x.expand(size, *x.shape[1:])


def _own_ndim(x, dim):
    return x.dim() - (dim is not None)


def _differentiable(op, backward, setup_context, eager_setup_context=None):
    """``op`` with its autograd formula (``backward``, ``setup_context``, registered on it): a function calling
    ``op`` itself while torch.compile or torch.export traces (their autograd uses the registered formula), else
    the same formula as a ``torch.autograd.Function`` that torch.func composes with (in torch 2.13 a custom op's
    registered formula fails under torch.func's transforms, "must override the setup_context staticmethod":
    pytorch/pytorch#168393); vmap over it reaches the operators' own vmap rules (``generate_vmap_rule``).
    ``eager_setup_context``: the Function's own, where it may keep tensors on ctx that a traced graph could not."""
    op.register_autograd(backward, setup_context=setup_context)
    return _traced_or(op, type(f"{op._name}_function", (torch.autograd.Function,), dict(
        forward=staticmethod(lambda *args: op(*args)),
        setup_context=staticmethod(eager_setup_context or setup_context),
        backward=staticmethod(backward), generate_vmap_rule=True)))


def _backward_of(op):
    """A backward operator, called by an autograd formula: ``op`` itself while torch.compile or torch.export
    traces, else a ``torch.autograd.Function`` (torch.func's grad records the backward for higher orders, where
    a custom op's default autograd fails as above) whose own backward raises: attnpp has no double backward."""
    def refuse(ctx, *grads):
        raise RuntimeError(f"{op._name}: attnpp's backward is not differentiable (no double backward)")
    return _traced_or(op, type(f"{op._name}_function", (torch.autograd.Function,), dict(
        forward=staticmethod(lambda *args: op(*args)), setup_context=staticmethod(lambda ctx, inputs, output: None),
        backward=staticmethod(refuse), generate_vmap_rule=True)))


def _traced_or(op, function):
    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else function.apply(*args)
    return call


# -------------------------------------------------------------------------------------------- attention
def _attention_rows(query, key, value, enable_gqa):
    """The shape of an attention call's rows: (B..., Hq, L), or (L,) unbatched, as ``functional``'s checks
    compute it."""
    lead = lambda x: tuple(x.shape[:-2]) if x.dim() >= 3 else (1,)
    if query.dim() == 2 and key.dim() == 2 and value.dim() == 2:
        return (query.shape[-2],)
    if enable_gqa:
        batch, Hq = torch.broadcast_shapes(lead(query)[:-1], lead(key)[:-1], lead(value)[:-1]), lead(query)[-1]
    else:
        full = torch.broadcast_shapes(lead(query), lead(key), lead(value))
        batch, Hq = full[:-1], full[-1]
    return tuple(batch) + (Hq, query.shape[-2])


@torch.library.custom_op("attnpp::sdpa_forward", mutates_args=(), device_types="cpu")
@torch_errors
def sdpa_forward(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], sinks: Optional[Tensor],
                 alibi_slopes: Optional[Tensor], key_padding_mask: Optional[Tensor], dropout_p: float,
                 is_causal: bool, scale: Optional[float], enable_gqa: bool, seed: Optional[int],
                 causal_alignment: str, window: Optional[List[int]], softcap: Optional[float]) -> Tuple[Tensor, Tensor]:
    output, lse, _ = AF.scaled_dot_product_attention_forward(
        *map(to_numpy, (query, key, value, attn_mask)), dropout_p, is_causal, scale, enable_gqa, seed=seed,
        causal_alignment=causal_alignment, window=_window(window), alibi_slopes=to_numpy(alibi_slopes),
        softcap=softcap, sinks=to_numpy(sinks), key_padding_mask=to_numpy(key_padding_mask))
    return from_numpy(output), from_numpy(lse)


@sdpa_forward.register_fake
def _(query, key, value, attn_mask, sinks, alibi_slopes, key_padding_mask, dropout_p, is_causal, scale,
      enable_gqa, seed, causal_alignment, window, softcap):
    rows = _attention_rows(query, key, value, enable_gqa)
    return (query.new_empty(rows + (value.shape[-1],)), query.new_empty(rows, dtype=_acc(query.dtype)))


@torch.library.custom_op("attnpp::sdpa_backward", mutates_args=(), device_types="cpu")
@torch_errors
def sdpa_backward(grad_output: Tensor, query: Tensor, key: Tensor, value: Tensor, output: Tensor, logsumexp: Tensor,
                  attn_mask: Optional[Tensor], sinks: Optional[Tensor], alibi_slopes: Optional[Tensor],
                  key_padding_mask: Optional[Tensor], dropout_p: float, is_causal: bool, scale: Optional[float],
                  enable_gqa: bool, seed: Optional[int], causal_alignment: str, window: Optional[List[int]],
                  softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = AF.scaled_dot_product_attention_backward(
        *map(to_numpy, (grad_output, query, key, value, output, logsumexp, attn_mask)), dropout_p, is_causal,
        scale, enable_gqa, seed=seed, causal_alignment=causal_alignment, window=_window(window),
        alibi_slopes=to_numpy(alibi_slopes), softcap=softcap, sinks=to_numpy(sinks),
        key_padding_mask=to_numpy(key_padding_mask))
    return (*map(from_numpy, grads[:3]), from_numpy(grads[3]) if len(grads) > 3 else _none(query))


@sdpa_backward.register_fake
def _(grad_output, query, key, value, output, logsumexp, attn_mask, sinks, *options):
    return (_new(query), _new(key), _new(value),
            _none(query) if sinks is None else _new(sinks))


def _sdpa_setup_context(ctx, inputs, output):
    # (both attention operators, sdpa's and varlen's: their 7 tensor arguments first, then the options)
    ctx.save_for_backward(*inputs[:7], *output)
    ctx.options = inputs[7:]


def _sdpa_backward_formula(ctx, grad_output, _grad_lse):
    query, key, value, attn_mask, sinks, alibi_slopes, key_padding_mask, output, lse = ctx.saved_tensors
    grads = _apply_sdpa_backward(grad_output, query, key, value, output, lse, attn_mask, sinks, alibi_slopes,
                                key_padding_mask, *ctx.options)
    return (*grads[:3], None, None if sinks is None else grads[3]) + (None,) * (2 + len(ctx.options))


apply_sdpa = _differentiable(sdpa_forward, _sdpa_backward_formula, _sdpa_setup_context)


def _must_loop(sinks, sinks_dim, alibi_slopes, alibi_dim, dropout_p):
    """True when the vmapped attention runs entry by entry: sinks or ALiBi slopes vmapped, slopes per batch
    entry, or dropout (the same seed gives each vmapped entry the same mask, as a loop does)."""
    return dropout_p > 0 or (sinks is not None and sinks_dim is not None) or \
        (alibi_slopes is not None and (alibi_dim is not None or alibi_slopes.dim() > 1))


def _sdpa_forward_vmap(info, in_dims, query, key, value, attn_mask, sinks, alibi_slopes, key_padding_mask,
                       *options):
    if _must_loop(sinks, in_dims[4], alibi_slopes, in_dims[5], options[0]):
        return _loop_rule(sdpa_forward)(info, in_dims, query, key, value, attn_mask, sinks, alibi_slopes,
                                        key_padding_mask, *options)
    N = info.batch_size
    own = max(_own_ndim(x, d) for x, d in zip((query, key, value), in_dims))
    r = max(own, 3)
    q, k, v = (_lift(x, d, r, N) for x, d in zip((query, key, value), in_dims))
    output, lse = sdpa_forward(q, k, v, _lift(attn_mask, in_dims[3], r), sinks, alibi_slopes,
                               _lift(key_padding_mask, in_dims[6], r - 2), *options)
    if own == 2:  # unbatched (L, D) entries: the head dimension added here goes
        output, lse = output.squeeze(1), lse.squeeze(1)
    return (output, lse), (0, 0)


sdpa_forward.register_vmap(_sdpa_forward_vmap)


def _sdpa_backward_vmap(info, in_dims, grad_output, query, key, value, output, logsumexp, attn_mask, sinks,
                        alibi_slopes, key_padding_mask, *options):
    args = (grad_output, query, key, value, output, logsumexp, attn_mask, sinks, alibi_slopes, key_padding_mask)
    if sinks is not None or _must_loop(sinks, in_dims[7], alibi_slopes, in_dims[8], options[0]):
        return _loop_rule(sdpa_backward)(info, in_dims, *args, *options)
    N = info.batch_size
    r = max(3, *(_own_ndim(x, d) for x, d in zip((query, key, value), in_dims[1:4])))
    lifted = [_lift(x, d, n, N) for x, d, n in zip(args[:6], in_dims[:6], (r, r, r, r, r, r - 1))]
    grads = sdpa_backward(*lifted, _lift(attn_mask, in_dims[6], r), sinks, alibi_slopes,
                          _lift(key_padding_mask, in_dims[9], r - 2), *options)
    own_shape = lambda x, d: x.shape if d is None else x.shape[:d] + x.shape[d + 1:]
    grads = [g.reshape((N,) + own_shape(x, d)) for g, x, d in zip(grads[:3], args[1:4], in_dims[1:4])]
    return (*grads, _none(query).expand(N, 0)), (0, 0, 0, 0)


sdpa_backward.register_vmap(_sdpa_backward_vmap)
_apply_sdpa_backward = _backward_of(sdpa_backward)


@torch.library.custom_op("attnpp::sdpa_weights", mutates_args=(), device_types="cpu")
@torch_errors
def sdpa_weights(query: Tensor, key: Tensor, attn_mask: Optional[Tensor], sinks: Optional[Tensor],
                 alibi_slopes: Optional[Tensor], key_padding_mask: Optional[Tensor], logsumexp: Optional[Tensor],
                 dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool, seed: Optional[int],
                 causal_alignment: str, window: Optional[List[int]], softcap: Optional[float]) -> Tensor:
    return from_numpy(AF.scaled_dot_product_attention_weights(
        *map(to_numpy, (query, key, attn_mask)), dropout_p, is_causal, scale, enable_gqa, seed=seed,
        causal_alignment=causal_alignment, logsumexp=to_numpy(logsumexp), window=_window(window),
        alibi_slopes=to_numpy(alibi_slopes), softcap=softcap, sinks=to_numpy(sinks),
        key_padding_mask=to_numpy(key_padding_mask)))


@sdpa_weights.register_fake
def _(query, key, attn_mask, sinks, alibi_slopes, key_padding_mask, logsumexp, dropout_p, is_causal, scale,
      enable_gqa, *options):
    return query.new_empty(_attention_rows(query, key, key, enable_gqa) + (key.shape[-2],))


sdpa_weights.register_vmap(_loop_rule(sdpa_weights))


# ---------------------------------------------------------------------------------------------- varlen
@torch.library.custom_op("attnpp::sdpa_varlen_forward", mutates_args=(), device_types="cpu")
@torch_errors
def sdpa_varlen_forward(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        sinks: Optional[Tensor], alibi_slopes: Optional[Tensor], dropout_p: float, is_causal: bool,
                        scale: Optional[float], seed: Optional[int], causal_alignment: str,
                        window: Optional[List[int]], softcap: Optional[float]) -> Tuple[Tensor, Tensor]:
    output, lse, _ = AF.scaled_dot_product_attention_varlen_forward(
        *map(to_numpy, (query, key, value, cu_seqlens_q, cu_seqlens_k)), dropout_p, is_causal, scale, seed=seed,
        causal_alignment=causal_alignment, window=_window(window), alibi_slopes=to_numpy(alibi_slopes),
        softcap=softcap, sinks=to_numpy(sinks))
    return from_numpy(output), from_numpy(lse)


@sdpa_varlen_forward.register_fake
def _(query, key, value, cu_seqlens_q, cu_seqlens_k, *options):
    return (query.new_empty(query.shape[:2] + value.shape[2:]),
            query.new_empty((query.shape[1], query.shape[0]), dtype=_acc(query.dtype)))


@torch.library.custom_op("attnpp::sdpa_varlen_backward", mutates_args=(), device_types="cpu")
@torch_errors
def sdpa_varlen_backward(grad_output: Tensor, query: Tensor, key: Tensor, value: Tensor, output: Tensor,
                         logsumexp: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, sinks: Optional[Tensor],
                         alibi_slopes: Optional[Tensor], dropout_p: float, is_causal: bool, scale: Optional[float],
                         seed: Optional[int], causal_alignment: str, window: Optional[List[int]],
                         softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = AF.scaled_dot_product_attention_varlen_backward(
        *map(to_numpy, (grad_output, query, key, value, output, logsumexp, cu_seqlens_q, cu_seqlens_k)), dropout_p,
        is_causal, scale, seed=seed, causal_alignment=causal_alignment, window=_window(window),
        alibi_slopes=to_numpy(alibi_slopes), softcap=softcap, sinks=to_numpy(sinks))
    return (*map(from_numpy, grads[:3]), from_numpy(grads[3]) if len(grads) > 3 else _none(query))


@sdpa_varlen_backward.register_fake
def _(grad_output, query, key, value, output, logsumexp, cu_seqlens_q, cu_seqlens_k, sinks, *options):
    return _new(query), _new(key), _new(value), _none(query) if sinks is None else _new(sinks)


def _varlen_backward_formula(ctx, grad_output, _grad_lse):
    query, key, value, cu_q, cu_k, sinks, alibi_slopes, output, lse = ctx.saved_tensors
    grads = _apply_sdpa_varlen_backward(grad_output, query, key, value, output, lse, cu_q, cu_k, sinks,
                                        alibi_slopes, *ctx.options)
    return (*grads[:3], None, None, None if sinks is None else grads[3]) + (None,) * (1 + len(ctx.options))


apply_sdpa_varlen = _differentiable(sdpa_varlen_forward, _varlen_backward_formula, _sdpa_setup_context)
sdpa_varlen_forward.register_vmap(_loop_rule(sdpa_varlen_forward))
sdpa_varlen_backward.register_vmap(_loop_rule(sdpa_varlen_backward))
_apply_sdpa_varlen_backward = _backward_of(sdpa_varlen_backward)


# ----------------------------------------------------------------------------------------------- linear
@torch.library.custom_op("attnpp::linear", mutates_args=(), device_types="cpu")
@torch_errors
def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return from_numpy(AF.linear(to_numpy(input), to_numpy(weight), to_numpy(bias)))


@linear.register_fake
def _(input, weight, bias):
    return input.new_empty(input.shape[:-1] + (weight.shape[0],))


@torch.library.custom_op("attnpp::linear_backward", mutates_args=(), device_types="cpu")
@torch_errors
def linear_backward(grad_output: Tensor, input: Tensor, weight: Tensor, need_input: bool,
                    need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    # linear_backward accumulates into these (the weight's is computed even when not needed)
    grad_weight = torch.zeros(weight.shape, dtype=weight.dtype)
    grad_bias = torch.zeros(weight.shape[:1], dtype=weight.dtype) if need_bias else _none(weight)
    grad_input = AF.linear_backward(to_numpy(grad_output), to_numpy(input), to_numpy(weight), to_numpy(grad_weight),
                                    to_numpy(grad_bias) if need_bias else None, need_input_grad=need_input)
    return (_none(input) if grad_input is None else from_numpy(grad_input)), grad_weight, grad_bias


@linear_backward.register_fake
def _(grad_output, input, weight, need_input, need_bias):
    return (_new(input) if need_input else _none(input), _new(weight),
            weight.new_empty(weight.shape[:1]) if need_bias else _none(weight))


def _linear_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_backward_formula(ctx, grad_output):
    input, weight, bias = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad
    grad_input, grad_weight, grad_bias = _apply_linear_backward(grad_output, input, weight, need_input,
                                                               bias is not None and need_bias)
    return (grad_input if need_input else None, grad_weight if need_weight else None,
            grad_bias if bias is not None and need_bias else None)


apply_linear = _differentiable(linear, _linear_backward_formula, _linear_setup_context)


def _linear_vmap(info, in_dims, input, weight, bias):
    if in_dims[1] is not None or in_dims[2] is not None:
        return _loop_rule(linear)(info, in_dims, input, weight, bias)
    return linear(input.movedim(in_dims[0], 0), weight, bias), 0


linear.register_vmap(_linear_vmap)
linear_backward.register_vmap(_loop_rule(linear_backward))
_apply_linear_backward = _backward_of(linear_backward)


# --------------------------------------------------------------------------------- linear + cross-entropy
@torch.library.custom_op("attnpp::linear_cross_entropy_forward", mutates_args=(), device_types="cpu")
@torch_errors
def linear_cross_entropy_forward(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                                 ignore_index: int, reduction: str, label_smoothing: float, softcap: float,
                                 compute_grads: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = _forward_unrounded(*map(to_numpy, (input, weight, target, bias)), ignore_index, reduction, label_smoothing,
                             softcap, compute_grads)
    grads = [_none(input) if g is None else from_numpy(g) for g in (out.grads or (None,) * 3)]
    return (from_numpy(out.loss), from_numpy(out.logsumexp), *grads)


@linear_cross_entropy_forward.register_fake
def _(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, compute_grads):
    grads = compute_grads and reduction != "none"
    return (input.new_empty(target.shape if reduction == "none" else (), dtype=_acc(input.dtype)),
            input.new_empty(target.shape, dtype=_acc(input.dtype)),
            _new(input) if grads else _none(input), _new(weight) if grads else _none(input),
            _new(bias) if grads and bias is not None else _none(input))


@torch.library.custom_op("attnpp::linear_cross_entropy_backward", mutates_args=(), device_types="cpu")
@torch_errors
def linear_cross_entropy_backward(grad_output: Tensor, input: Tensor, weight: Tensor, target: Tensor,
                                  logsumexp: Tensor, bias: Optional[Tensor], ignore_index: int, reduction: str,
                                  label_smoothing: float, softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    grads = AF.linear_cross_entropy_backward(*map(to_numpy, (grad_output, input, weight, target, logsumexp, bias)),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing, softcap=softcap)
    return tuple(_none(input) if g is None else from_numpy(g) for g in grads)


@linear_cross_entropy_backward.register_fake
def _(grad_output, input, weight, target, logsumexp, bias, *options):
    return _new(input), _new(weight), _none(input) if bias is None else _new(bias)


def _lce_setup_context(ctx, inputs, output, hold=False):
    input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, compute_grads = inputs
    ctx.options = (ignore_index, reduction, label_smoothing, softcap)
    grads = list(output[2:]) if compute_grads and reduction != "none" else []
    # hold (eager): the forward's gradients are held by ctx alone, not saved, so that the backward, their last
    # user, scales them in place and hands them on; saved, they stay referenced through the backward, and the
    # weight's (V, H) gradient is there twice at the step's peak (once more as its product with the loss's
    # gradient). A traced graph takes saved tensors only.
    ctx.held = [g.detach() for g in grads] if hold else None
    if hold:  # (the other outputs' gradients, undefined, stay None: materialised, the weight's zeros (V, H))
        ctx.set_materialize_grads(False)
    ctx.save_for_backward(input, weight, target, bias, output[1], *([] if hold else grads))


def _lce_backward_formula(ctx, grad_loss, *_):
    if grad_loss is None:  # (eager, its output gradients not materialised: none reached the loss)
        ctx.held = None
        return (None,) * 9
    input, weight, target, bias, lse, *grads = ctx.saved_tensors
    grad_loss = grad_loss.to(input.dtype)  # (the loss is float32 for half precision; its gradient in the input's)
    if ctx.held:  # the forward's gradients (those of a loss of gradient 1), scaled; a retained graph's next
        grads, ctx.held = [g.mul_(grad_loss) for g in ctx.held], None  # backward computes them anew
    elif grads:
        grads = [g * grad_loss for g in grads]
    else:
        grads = _apply_linear_cross_entropy_backward(grad_loss, input, weight, target, lse, bias, *ctx.options)
    need = ctx.needs_input_grad
    return (grads[0] if need[0] else None, grads[1] if need[1] else None, None,
            grads[2] if bias is not None and need[3] else None, None, None, None, None, None)


apply_linear_cross_entropy = _differentiable(linear_cross_entropy_forward, _lce_backward_formula,
                                             _lce_setup_context, functools.partial(_lce_setup_context, hold=True))
linear_cross_entropy_forward.register_vmap(_loop_rule(linear_cross_entropy_forward))
linear_cross_entropy_backward.register_vmap(_loop_rule(linear_cross_entropy_backward))
_apply_linear_cross_entropy_backward = _backward_of(linear_cross_entropy_backward)


# ------------------------------------------------------------------------------------------------ rotary
def _rotary(function, x, rotary_dim, base, interleaved, position_offset):
    x_np = to_numpy(x)
    cos, sin = cached_rotary_tables(position_offset + x.shape[-2], rotary_dim, base, x_np.dtype)
    return from_numpy(function(x_np, cos, sin, interleaved=interleaved, position_offset=position_offset))


@torch.library.custom_op("attnpp::rotary_embedding", mutates_args=(), device_types="cpu")
@torch_errors
def rotary_embedding(input: Tensor, rotary_dim: int, base: float, interleaved: bool,
                     position_offset: int) -> Tensor:
    return _rotary(AF.rotary_embedding, input, rotary_dim, base, interleaved, position_offset)


@torch.library.custom_op("attnpp::rotary_embedding_backward", mutates_args=(), device_types="cpu")
@torch_errors
def rotary_embedding_backward(grad_output: Tensor, rotary_dim: int, base: float, interleaved: bool,
                              position_offset: int) -> Tensor:
    return _rotary(AF.rotary_embedding_backward, grad_output, rotary_dim, base, interleaved, position_offset)


@rotary_embedding.register_fake
def _(input, *options):
    return _new(input)


@rotary_embedding_backward.register_fake
def _(grad_output, *options):
    return _new(grad_output)


def _rotary_setup_context(ctx, inputs, output):
    ctx.options = inputs[1:]


def _rotary_backward_formula(ctx, grad_output):
    return (_apply_rotary_backward(grad_output, *ctx.options),) + (None,) * len(ctx.options)


apply_rotary = _differentiable(rotary_embedding, _rotary_backward_formula, _rotary_setup_context)


def _rotary_vmap_of(op):
    """Rotary's vmap rule: the vmapped dimension as one more leading batch dimension (an entry (T, D) as heads
    of (N, T, D))."""
    def rule(info, in_dims, x, *options):
        return op(x.movedim(in_dims[0], 0), *options), 0
    return rule


rotary_embedding.register_vmap(_rotary_vmap_of(rotary_embedding))
rotary_embedding_backward.register_vmap(_rotary_vmap_of(rotary_embedding_backward))
_apply_rotary_backward = _backward_of(rotary_embedding_backward)
