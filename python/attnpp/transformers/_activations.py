"""``apply``'s lean activations: what a decoder layer's RMSNorms and gated MLP keep for the backward.

A Hugging Face decoder layer keeps, for its backward, every intermediate its modules compute under autograd. In a
Llama layer at 4 x 1,024 tokens (hidden 768, MLP 2,048, float32) that is 232 MiB, and two modules keep more than
their gradients need:

- an RMSNorm, ``weight * x * rsqrt(mean(x**2) + eps)``, keeps its input and the normalised input (24 MiB). Run
  under ``torch.utils.checkpoint`` it keeps its input alone (12 MiB), and the backward runs the module's forward
  again (a few elementwise ops) and then its own autograd graph: the gradients are the model's own, bit for bit.
- the gated MLP, ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU), keeps gate(x), act(gate(x)), up(x) and their
  product (128 MiB). ``_GatedDown`` keeps gate(x) and up(x) (64 MiB). Its backward computes act and the product
  again, then the down projection's two products and the activation's own backward (``aten.silu_backward``,
  ``aten.gelu_backward``, the ops autograd calls).

The forwards compute the same ops as the model's, so their outputs are the same bit for bit. A module is patched
on its instance (its ``forward``), never on its class, and ``restore`` undoes it. The patched forward runs the
module's own when no gradient is recorded (``torch.no_grad``, inference), and the MLP's own when its down
projection is no longer a plain ``torch.nn.Linear`` (a PEFT adapter put there after ``apply``).

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


class _GatedDown(torch.autograd.Function):
    """``linear(act(gate) * up, weight, bias)``, keeping gate and up (not act(gate), nor the product)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, gate, up, weight, bias, act, act_backward):
        ctx.act, ctx.act_backward, ctx.has_bias = act, act_backward, bias is not None
        ctx.save_for_backward(gate, up, weight)
        return F.linear(act(gate) * up, weight, bias)

    @staticmethod
    @once_differentiable
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        # In place where it can be: beyond the two gradients it returns, the backward holds one gate-sized tensor
        # at a time (the last layer's comes while every layer's activations are still kept).
        gate, up, weight = ctx.saved_tensors
        activated = ctx.act(gate)
        grad_weight = grad_bias = grad_gate = grad_up = None
        if ctx.needs_input_grad[2]:
            grad_weight = grad.flatten(0, -2).T.mm((activated * up).flatten(0, -2))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.flatten(0, -2).sum(0)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_product = grad.matmul(weight)
            if ctx.needs_input_grad[1]:
                grad_up = activated.mul_(grad_product)
            if ctx.needs_input_grad[0]:
                grad_gate = ctx.act_backward(grad_product.mul_(up), gate, grad_input=grad_product)
        return grad_gate, grad_up, grad_weight, grad_bias, None, None


def _mlp_forward(module, original, act, x):
    down = module.down_proj
    if not torch.is_grad_enabled() or type(down) is not torch.nn.Linear:
        return original(x)
    if hasattr(module, "gate_up_proj"):  # (Phi-3: up * act(gate), the same product)
        gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = module.gate_proj(x), module.up_proj(x)
    return _GatedDown.apply(gate, up, down.weight, down.bias, *act)


def _norm_forward(original, hidden_states):
    if not torch.is_grad_enabled():
        return original(hidden_states)
    return checkpoint(original, hidden_states, use_reentrant=False, preserve_rng_state=False)


def patch(model, rms_norm=True, gated_mlp=True):
    """Patches the model's RMSNorm modules (every module whose class name ends in ``RMSNorm``) and gated MLPs
    (``GATED_MLPS``, with a SiLU or tanh-GELU activation) on their instances.

    Returns:
        list of (module, its own instance ``forward`` or None): what ``restore`` puts back.
    """
    patched = []
    for module in model.modules():
        name = type(module).__name__
        if rms_norm and name.endswith("RMSNorm"):
            forward = functools.partial(_norm_forward, module.forward)
        elif gated_mlp and name in GATED_MLPS and _activation(module) is not None:
            forward = functools.partial(_mlp_forward, module, module.forward, _activation(module))
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
