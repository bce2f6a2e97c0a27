"""The problems the case families share: one call of each side (attnpp, PyTorch) per case, on the same inputs and
weights: the attention kernel on random inputs, and a layer against its PyTorch twin."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as TF

import attnpp
from attnpp import functional as F, nn
from attnpp.torch import from_numpy

from .config import HALVES
from .measure import peak_growth_mib
from .peers import Problem


def forward_only(attnpp_call, torch_call):
    """(attnpp call, PyTorch call) of a forward-only case, each under its library's no_grad: attnpp's layers save
    no context for a backward that never comes (they would pile up, one per call: memory held and, at 1000, a
    RuntimeWarning), and PyTorch builds no graph."""
    def attnpp_run():
        with attnpp.no_grad():
            attnpp_call()

    def torch_run():
        with torch.no_grad():
            torch_call()
    return attnpp_run, torch_run


class FreshGradients:
    """A forward + backward call that frees the last call's gradients first (``release``: to None, as zero_grad
    does), so that every call allocates and fills fresh ones. Its memory is measured after that release: else the
    last call's gradients, alive when the resident set is taken and freed inside the call, would offset the new
    ones (PyTorch's fwd+bwd of (1,32,4096,128) grew 130 MiB instead of 324, less than its gradients and output)."""

    def __init__(self, run, release):
        self.run, self.release = run, release

    def __call__(self):
        self.release()
        return self.run()

    def peak_growth_mib(self):
        self.release()
        return peak_growth_mib(self)


def set_gradients_to_none(tensors):
    """A FreshGradients release for PyTorch leaves."""
    for t in tensors:
        t.grad = None


def torch_forward_backward(forward, leaves, grad_output):
    """One PyTorch forward and ``out.backward(grad_output)``, the leaves' gradients fresh (FreshGradients)."""
    return FreshGradients(lambda: forward().backward(grad_output), partial(set_gradients_to_none, leaves))


@dataclass
class Sides:
    """One attention problem on both sides, for attention_calls. ``inputs``: attnpp's query, key, value and output
    gradient (NumPy); ``torch_inputs``: PyTorch's (tensors), by default the same arrays (torch.from_numpy, no copy),
    else in PyTorch's own layout (the varlen case's padded batch), and ``unpad`` maps a PyTorch output or gradient
    to attnpp's layout (for the tests that check both sides compute the same). ``attnpp_forward(q, k, v)`` returns
    ``(output, logsumexp, seed)``, ``attnpp_backward(g, q, k, v, output, logsumexp)`` the gradients and
    ``torch_forward(q, k, v)`` PyTorch's output."""
    inputs: tuple
    attnpp_forward: Callable
    attnpp_backward: Callable
    torch_forward: Callable
    torch_inputs: Optional[tuple] = None
    unpad: Callable = lambda t: t

    def tensors(self):
        """PyTorch's inputs (q, k, v, g)."""
        return self.torch_inputs if self.torch_inputs is not None else tuple(map(from_numpy, self.inputs))


def random_inputs(shape, dtype=np.float32):
    """Query, key, value and the output's gradient: standard normal of ``shape`` and ``dtype`` (drawn in float32,
    then rounded), from one fixed seed."""
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(4))


def sdpa_sides(inputs, torch_forward=None, **options):
    """attnpp's scaled_dot_product_attention_forward and _backward with ``options`` on (B, H, L, D) ``inputs``,
    against ``torch_forward`` (default: torch's scaled_dot_product_attention with the same options)."""
    return Sides(inputs, partial(F.scaled_dot_product_attention_forward, **options),
                 partial(F.scaled_dot_product_attention_backward, **options),
                 torch_forward or partial(TF.scaled_dot_product_attention, **options))


def attention_calls(sides, backward):
    """(attnpp call, PyTorch call) of an attention problem: forward only (under no_grad), or forward + backward
    (attnpp's backward consumes its forward's output and log-sum-exp; PyTorch's autograd, ``out.backward(g)``)."""
    q, k, v, g = sides.inputs
    tq, tk, tv, tg = sides.tensors()
    if not backward:
        return forward_only(lambda: sides.attnpp_forward(q, k, v), lambda: sides.torch_forward(tq, tk, tv))

    def attnpp_call():
        out, lse, _ = sides.attnpp_forward(q, k, v)
        sides.attnpp_backward(g, q, k, v, out, lse)

    leaves = [t.requires_grad_() for t in (tq, tk, tv)]
    return attnpp_call, torch_forward_backward(lambda: sides.torch_forward(*leaves), leaves, tg)


def kernel_calls(shape, causal, backward, dtype=np.float32, bfloat16_numerics=None):
    """(attnpp call, PyTorch call) of the kernel on random (B, H, L, D) query, key and value of ``dtype``; attnpp's
    under ``attnpp.set_bfloat16_attention(bfloat16_numerics)`` when given."""
    attnpp_call, torch_call = attention_calls(sdpa_sides(random_inputs(shape, dtype), is_causal=causal), backward)
    if bfloat16_numerics is None:
        return attnpp_call, torch_call

    def call_with_numerics():
        before = attnpp.get_bfloat16_attention()
        attnpp.set_bfloat16_attention(bfloat16_numerics)
        try:
            attnpp_call()
        finally:
            attnpp.set_bfloat16_attention(before)
    return call_with_numerics, torch_call

def kernel_problem(shape, causal, dtype=np.float32):
    """The problem kernel_calls times, for the peers: the same random (B, H, L, D) query, key and value."""
    return Problem(*random_inputs(shape, dtype)[:3], is_causal=causal)


def layer_calls(layer, ref, x, backward, forward=None, ref_forward=None):
    """(attnpp call, PyTorch call) of a layer and its PyTorch twin (same weights) on the input x (B, L, E).

    ``forward(x)`` / ``ref_forward(tx)`` give the output (default: call the layer). Forward only: under each
    library's no_grad. Forward + backward: resets the parameters' gradients to None, as a training step's
    zero_grad does, then one forward whose saved context the one backward consumes (attnpp) or one autograd
    forward and ``out.backward`` (PyTorch); both also compute the input's gradient.
    """
    forward, ref_forward = forward or layer, ref_forward or ref
    tx = from_numpy(x)
    if not backward:
        return forward_only(lambda: forward(x), lambda: ref_forward(tx))
    with attnpp.no_grad():  # a forward for the output's shape only: no backward consumes it, so it saves nothing
        out_shape = forward(x).shape
    g = np.random.default_rng(1).standard_normal(out_shape, dtype=np.float32).astype(x.dtype)

    def attnpp_step():  # (after zero_grad: gradients to None, set_to_none=True as PyTorch's)
        forward(x)
        grads = layer.backward(g)  # consumes the context the forward just saved
        if isinstance(grads, tuple):  # MultiheadAttention: x was query, key and value; autograd sums the three
            grads[0] + grads[1] + grads[2]

    tx.requires_grad_()
    return FreshGradients(attnpp_step, layer.zero_grad), \
        torch_forward_backward(lambda: ref_forward(tx), [tx, *ref.parameters()], from_numpy(g))


def mha_calls(B, L, E, heads, need_weights, dtype="float32"):
    """MultiheadAttention forward + backward, self-attention (query = key = value = x), batch_first, in ``dtype``
    (float32 or a name of HALVES)."""
    np_dtype, torch_dtype = HALVES.get(dtype, (np.dtype(np.float32), torch.float32))
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, heads, batch_first=True, dtype=torch_dtype)
    layer = nn.MultiheadAttention(E, heads, batch_first=True, dtype=np_dtype)
    layer.load_state_dict(ref.state_dict())
    x = np.random.default_rng(0).standard_normal((B, L, E), dtype=np.float32).astype(np_dtype)
    return layer_calls(layer, ref, x, True, forward=lambda x: layer(x, x, x, need_weights=need_weights)[0],
                       ref_forward=lambda tx: ref(tx, tx, tx, need_weights=need_weights)[0])


def padded_causal_calls(B, L, E, heads, bridge):
    """Forward + backward of a causal self-attention layer over a padded batch (valid lengths L, 3L/4, L/2, L/4,
    ...: ``key_padding_mask`` True at the padding), attnpp's ``nn.Attention`` (``bridge`` False) or
    ``attnpp.torch.Attention`` (True), against ``torch.nn.MultiheadAttention`` with the causal (L, L) mask and the
    same padding mask. Both attnpp layers pass the padding beside the causal flag, so the kernel skips the blocks
    above the diagonal."""
    from attnpp import torch as attnpp_torch
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, heads, batch_first=True)
    lengths = [L - (L * (b % 4)) // 4 for b in range(B)]
    pad = np.arange(L)[None, :] >= np.array(lengths)[:, None]                  # (B, L), True = padding
    x = np.random.default_rng(0).standard_normal((B, L, E), dtype=np.float32)
    g = from_numpy(np.random.default_rng(1).standard_normal((B, L, E), dtype=np.float32))
    tx, tpad = from_numpy(x), torch.from_numpy(pad)
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
    ref_forward = lambda: ref(tx, tx, tx, key_padding_mask=tpad, attn_mask=causal, is_causal=True,
                              need_weights=False)[0]
    tx.requires_grad_()
    torch_call = torch_forward_backward(ref_forward, [tx, *ref.parameters()], g)
    if bridge:
        layer = attnpp_torch.Attention(E, heads, causal=True)
        ax = from_numpy(x.copy()).requires_grad_()
        return torch_forward_backward(lambda: layer(ax, key_padding_mask=tpad), [ax, *layer.parameters()], g), \
            torch_call
    layer = nn.Attention(E, heads, causal=True)
    g_np = g.numpy()

    def attnpp_step():
        layer(x, key_padding_mask=pad)
        layer.backward(g_np)
    return FreshGradients(attnpp_step, layer.zero_grad), torch_call
