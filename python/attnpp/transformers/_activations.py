"""``apply``'s lean activations: what a decoder layer's RMSNorms, projections and gated MLP keep for the backward.

A Hugging Face decoder layer keeps, for its backward, every intermediate its modules compute under autograd. In a
Llama layer at 4 x 1,024 tokens (hidden 768, MLP 2,048, float32) that is 232 MiB, of which the attention's query,
key, value and output are 32 MiB. Three kinds of module keep more than their gradients need:

- an RMSNorm, ``weight * x * rsqrt(mean(x**2) + eps)``, keeps its input and the normalised input (24 MiB). Run
  under ``torch.utils.checkpoint`` it keeps its input alone (12 MiB); its backward runs the module's forward again
  (a few elementwise ops) and then its own autograd graph, so its gradients are the model's, bit for bit.
- the projections that read a norm's output (q, k and v; the MLP's gate and up) keep that output (12 MiB, twice a
  layer). ``_LinearOfNorm`` keeps the norm's input instead, which the norm keeps anyway; the backward computes the
  output again from it, once for all the projections that read it (``_NormOutput``).
- the gated MLP, ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU), keeps gate(x), act(gate(x)), up(x) and their
  product (128 MiB). ``_GatedDown`` keeps gate(x) alone (32 MiB): up(x) too where x is not a norm's output, or
  where up is half of one projection with gate (Phi-3's gate_up_proj). Its backward computes up(x) again, from x
  computed again once for it and the gate projection, then act and the product, the down projection's two
  products, up's two, and the activation's own backward (``aten.silu_backward``, ``aten.gelu_backward``, the ops
  autograd calls). The one more product, up(x), is about a ninth of the MLP's.

That is 88 MiB a layer instead of 232. The forwards compute the same ops as the model's, so their outputs are
the same bit for bit; the projections' gradients differ from autograd's by the rounding of their products. A
module is patched on its instance (its ``forward``), never on its class, and ``restore`` undoes it. A patched
forward runs the module's own when no gradient is recorded (``torch.no_grad``, inference), a projection's own when
its input is not a norm's output (or was changed in place since), and an MLP's own when its down projection is no
longer a plain ``torch.nn.Linear`` or has hooks (a PEFT adapter put there after ``apply``); an MLP keeps up(x) when
its up projection is no longer one.

Method: Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training" (2024), whose RMSNorm and SwiGLU
keep their inputs only; Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), recomputation.
"""
import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

# The gated MLP classes of the architectures apply() is tested on (tests/test_transformers_training.py), all
# down(act(gate(x)) * up(x)): gate and up from gate_proj and up_proj, or halves of Phi-3's gate_up_proj.
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma2MLP", "Gemma3MLP", "Phi3MLP", "SmolLM3MLP",
              "Olmo2MLP", "Llama4TextMLP")


def _activation(module):
    """(act, its backward(grad, input, grad_input=out)) of an MLP's activation module, or None for one this does
    not know."""
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    name = type(act).__name__
    if name in ("SiLU", "SiLUActivation"):
        return F.silu, torch.ops.aten.silu_backward.grad_input
    if name == "GELUTanh" and isinstance(getattr(act, "act", None), functools.partial):  # (not its Python formula)
        return (functools.partial(F.gelu, approximate="tanh"),
                functools.partial(torch.ops.aten.gelu_backward.grad_input, approximate="tanh"))
    return None


class _NormOutput:
    """An RMSNorm's output as the backward of the projections that read it computes it again: the norm's forward,
    its input (which the norm keeps anyway), the output's version at the norm's return, and the output once
    computed, held while projections still to run their backward need it (a layer's q, k and v share one)."""

    def __init__(self, forward, x, version):
        self.forward, self.x, self.version = forward, x, version
        self.pending, self.value = 0, None

    def take(self, x, compute=True):
        """The output computed from the norm's input ``x`` (None with ``compute`` False), for one projection."""
        value = self.value
        if compute and value is None:
            value = self.value = self.forward(x)
        self.pending -= 1
        if self.pending <= 0:  # (the last one; a retained graph's second backward computes it again)
            self.value = None
        return value


class _LinearOfNorm(torch.autograd.Function):
    """``linear(x, weight, bias)`` of an RMSNorm's output x (``norm``: its ``_NormOutput``), keeping the norm's
    input instead of x."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, weight, bias, norm):
        norm.pending += 1
        ctx.norm, ctx.has_bias = norm, bias is not None
        ctx.save_for_backward(norm.x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        source, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        x = ctx.norm.take(source, compute=need[1])
        return _linear_grads(grad, x, weight, need[0], need[1], ctx.has_bias and need[2]) + (None,)


class _GatedDown(torch.autograd.Function):
    """``linear(act(gate) * up, weight, bias)``, keeping gate and up (not act(gate), nor the product). Or, given
    ``up_of`` = (x, up's weight, up's bias, x's ``_NormOutput``) in place of ``up``: up = linear(x, ...) computed
    here, and again in the backward from the norm's input, which the norm keeps anyway (x computed once for this
    and the gate projection's backward)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, gate, up, weight, bias, act, act_backward, *up_of):
        ctx.act, ctx.act_backward, ctx.has_bias = act, act_backward, bias is not None
        ctx.norm = up_of[3] if up_of else None
        if ctx.norm is not None:
            x, up_weight, up_bias, norm = up_of
            norm.pending += 1
            up = F.linear(x, up_weight, up_bias)
            ctx.save_for_backward(gate, norm.x, weight, up_weight, up_bias)
        else:
            ctx.save_for_backward(gate, up, weight)
        return F.linear(act(gate) * up, weight, bias)

    @staticmethod
    @once_differentiable
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        # In place where it can be: beyond the gradients it returns, the backward holds one gate-sized tensor at a
        # time (and up, when it computes it again; the last layer's comes while every layer's activations are kept).
        gate, up, weight, *up_params = ctx.saved_tensors
        need = ctx.needs_input_grad
        if ctx.norm is not None:  # (up holds the norm's input)
            x = ctx.norm.take(up)
            up = F.linear(x, *up_params)
            need_up = any(need[6:9])
        else:
            need_up = need[1]
        activated = ctx.act(gate)
        grad_weight = _rows(grad).T.mm(_rows(activated * up)) if need[2] else None
        grad_bias = _rows(grad).sum(0) if ctx.has_bias and need[3] else None
        grad_product = grad.matmul(weight)
        grad_up = activated.mul_(grad_product) if need_up else None
        grad_gate = ctx.act_backward(grad_product.mul_(up), gate, grad_input=grad_product) if need[0] else None
        if ctx.norm is None:
            return grad_gate, grad_up, grad_weight, grad_bias, None, None
        up_weight, up_bias = up_params
        return (grad_gate, None, grad_weight, grad_bias, None, None,
                *_linear_grads(grad_up, x, up_weight, need[6], need[7], up_bias is not None and need[8]), None)


def _rows(t):
    return t.flatten(0, -2)


def _linear_grads(grad, x, weight, need_input, need_weight, need_bias):
    """The gradients of ``linear(x, weight, bias)`` from its output's ``grad``: (input's, weight's, bias's), each
    None where not needed."""
    return (grad.matmul(weight) if need_input else None, _rows(grad).T.mm(_rows(x)) if need_weight else None,
            _rows(grad).sum(0) if need_bias else None)


def _norm_of(x):
    """The ``_NormOutput`` of ``x``, a patched norm's output unchanged since, or None."""
    norm = getattr(x, "_attnpp_norm", None)
    return norm if norm is not None and norm.version == x._version else None


def _plain(linear):
    """Whether ``linear`` is a plain ``torch.nn.Linear`` without hooks: one whose forward may be computed in its
    stead (not a module that adds to it, as a PEFT adapter)."""
    return type(linear) is torch.nn.Linear and not (linear._forward_hooks or linear._forward_pre_hooks)


def _mlp_forward(module, original, act, x):
    down = module.down_proj  # (its forward is not called: a module that adds to it, or a hook, must be called)
    if not torch.is_grad_enabled() or not _plain(down):
        return original(x)
    if hasattr(module, "gate_up_proj"):  # (Phi-3: up * act(gate), the same product)
        gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
        return _GatedDown.apply(gate, up, down.weight, down.bias, *act)
    gate, up_proj, norm = module.gate_proj(x), module.up_proj, _norm_of(x)
    if norm is None or not _plain(up_proj):
        return _GatedDown.apply(gate, up_proj(x), down.weight, down.bias, *act)
    return _GatedDown.apply(gate, None, down.weight, down.bias, *act, x, up_proj.weight, up_proj.bias, norm)


def _linear_forward(module, original, x):
    norm = _norm_of(x)
    if norm is None or not torch.is_grad_enabled():
        return original(x)  # (not a norm's output, or changed in place since)
    return _LinearOfNorm.apply(x, module.weight, module.bias, norm)


def _norm_forward(original, hidden_states):
    if not torch.is_grad_enabled():
        return original(hidden_states)
    out = checkpoint(original, hidden_states, use_reentrant=False, preserve_rng_state=False)
    out._attnpp_norm = _NormOutput(original, hidden_states, out._version)
    return out


def patch(model, rms_norm=True, gated_mlp=True):
    """Patches, on their instances, the model's RMSNorm modules (every module whose class name ends in ``RMSNorm``)
    and with them its ``torch.nn.Linear`` projections but the output projection (those that read a norm's output
    then keep the norm's input), and its gated MLPs (``GATED_MLPS``, with a SiLU or tanh-GELU activation).

    Returns:
        list of (module, its own instance ``forward`` or None): what ``restore`` puts back.
    """
    head = model.get_output_embeddings()
    patched = []
    for module in model.modules():
        name = type(module).__name__
        if rms_norm and name.endswith("RMSNorm"):
            forward = functools.partial(_norm_forward, module.forward)
        elif rms_norm and type(module) is torch.nn.Linear and module is not head:
            forward = functools.partial(_linear_forward, module, module.forward)
        elif gated_mlp and name in GATED_MLPS and (act := _activation(module)) is not None:
            forward = functools.partial(_mlp_forward, module, module.forward, act)
        else:
            continue
        patched.append((module, module.__dict__.get("forward")))
        module.forward = forward
    return patched


def restore(patched):
    """Undoes ``patch``: each module's ``forward`` as it was."""
    for module, forward in patched:
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward
