"""The fused linear + cross-entropy inside a causal LM's training forward: ``apply(model)`` and ``revert(model)``.

``apply`` changes three things on the model instance, nothing on its class: the model's ``forward``, its output
projection's ``forward`` and its ``loss_function``. A training forward with labels (``model.training``, ``labels``
or ``shift_labels`` given) then runs the model as it is written, with its output projection handing the last
hidden states over instead of computing the (B, L, V) logits, and the model's own call of ``loss_function``
computing the loss from them with ``attnpp.torch``'s fused ``linear_cross_entropy`` (its gradients computed in
the same pass over chunks of rows). Everything the model does after the projection (Gemma 2's soft-capping on the
logits is the fused loss's ``softcap``; gpt-oss adds its router's auxiliary loss to the loss) stays the model's.
Any other forward (eval mode, no labels, generation) is the model's own, logits included. ``apply`` also patches
the model's RMSNorms, the projections that read them and its gated MLPs on their instances, so that they keep less
for the backward (``_activations``).
"""
import functools
import inspect

import torch
import transformers

from ..torch.functional import linear_cross_entropy_float
from . import _activations
from ._attention import NAME

# The causal LM classes tested with the fused loss (tests/test_transformers_training.py): their forward computes
# the logits as lm_head(last hidden states), soft-capped by config.final_logit_softcapping where they have it, and
# the loss as loss_function(logits, labels, vocab_size, **kwargs); another class may scale its logits otherwise.
TESTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
          "Gemma3ForCausalLM", "GptOssForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel", "SmolLM3ForCausalLM",
          "Olmo2ForCausalLM", "Llama4ForCausalLM")
_STATE = "_attnpp_fused_loss"  # the model's attribute holding what apply() changed


class _FusedLoss:
    """What ``apply`` installed on one model: the originals it wraps, and the hidden states of the forward running
    (handed over by the output projection, read by the loss function)."""

    def __init__(self, model, head):
        self.model, self.head = model, head
        self.forward, self.head_forward = model.__dict__.get("forward"), head.__dict__.get("forward")
        self.own_loss = model.__dict__.get("_loss_function")
        self.loss_function = model.loss_function  # (the model's: its loss_type's from transformers' mapping)
        parameters = list(inspect.signature(model.forward).parameters)
        self.labels_at = parameters.index("labels") if "labels" in parameters else None
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.hidden = None
        self.capturing = False
        self.modules = []  # (module, its own forward): the norms, projections and MLPs patched (_activations.patch)

    def fused(self, args, kwargs):
        """Whether this call of the model's forward is a training forward with labels."""
        if not self.model.training:
            return False
        labels = kwargs.get("labels")
        if labels is None and self.labels_at is not None and len(args) > self.labels_at:
            labels = args[self.labels_at]
        return labels is not None or kwargs.get("shift_labels") is not None

    def model_forward(self, original, *args, **kwargs):
        if not self.fused(args, kwargs):
            return original(*args, **kwargs)
        self.capturing, self.hidden = True, None
        try:
            out = original(*args, **kwargs)
        finally:
            self.capturing, self.hidden = False, None
        if isinstance(out, tuple):  # (return_dict=False: loss, logits, ...)
            return out[:1] + out[2:]
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})

    def head_forward_of(self, original, hidden_states):
        if not self.capturing:
            return original(hidden_states)
        self.hidden = hidden_states
        return hidden_states.new_empty(hidden_states.shape[:-1] + (0,))  # what the model computes on: nothing

    def loss(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
             **kwargs):
        """transformers' ``ForCausalLMLoss`` (the labels shifted left by one, ``ignore_index`` padding the last;
        ``num_items_in_batch``: the sum over the micro-batch divided by it) from the hidden states, fused."""
        if not self.capturing:  # (a model's own call outside a training forward with labels)
            return self.loss_function(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                      ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        hidden = self.hidden
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.to(hidden.device)
        if target.shape != hidden.shape[:-1]:
            raise ValueError(f"attnpp.transformers.apply: the labels {tuple(target.shape)} do not match the hidden "
                             f"states the model projects {tuple(hidden.shape[:-1])} (logits_to_keep cuts them?)")
        loss = linear_cross_entropy_float(hidden, self.head.weight, target, self.head.bias, ignore_index=ignore_index,
                                          reduction="mean" if num_items_in_batch is None else "sum",
                                          softcap=self.softcap)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def _restore(obj, name, value):
    if value is None:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = value


def apply(model, *, rms_norm=True, gated_mlp=True):
    """Makes a causal LM's training forward compute its loss with attnpp's fused linear + cross-entropy, from the
    last hidden states, without the (B, L, V) logits (nor their gradient), and its RMSNorms, the projections that
    read them and its gated MLPs keep less for the backward. Undone by ``revert``.

    A forward in training mode (``model.train()``, as ``Trainer`` runs it) with ``labels`` (or ``shift_labels``)
    returns the loss (the model's ``loss_function``'s: labels shifted left, ``ignore_index``,
    ``num_items_in_batch`` for gradient accumulation, which ``Trainer`` passes; logits soft-capped by the
    config's ``final_logit_softcapping``, Gemma 2's and 3's; gpt-oss's router loss added by the model), and no
    logits (``logits`` None: as Liger Kernel's). Any other forward (eval mode, no labels, ``generate``) is the
    model's, with its logits. The loss is float32 for a half-precision model, as transformers' is. Works with any
    ``attn_implementation``, ``Trainer``, gradient accumulation, gradient checkpointing and
    ``DistributedDataParallel``.

    The RMSNorms keep their input alone and recompute the rest in the backward (``torch.utils.checkpoint``); the
    projections that read a norm's output keep the norm's input instead; the gated MLPs (SwiGLU, GeGLU) keep gate(x)
    alone and compute up(x) again in the backward (``attnpp.transformers._activations``): a Llama layer keeps 38% of
    what it kept, for one more product of the MLP's nine. The
    forward's outputs are the model's bit for bit; gradients are the model's up to the rounding of the projections'
    products.

    Args:
        model (transformers.PreTrainedModel): a causal LM of one of the classes in ``TESTED`` (or a subclass),
            whose output projection (``get_output_embeddings()``) is a ``torch.nn.Linear``.
        rms_norm (bool): recompute the RMSNorms (every module whose class name ends in ``RMSNorm``) in the
            backward, and their outputs for the ``torch.nn.Linear`` projections that read them. Default: True.
        gated_mlp (bool): the gated MLPs of the tested classes (with a SiLU or tanh-GELU activation) keep gate(x)
            alone (and up(x) where x is not a patched norm's output, or gate and up are one projection). Default:
            True.

    Returns:
        The model itself (changed in place: its ``forward``, its output projection's ``forward``, its
        ``loss_function``, and the patched modules' ``forward``; applying it twice changes nothing).

    Raises:
        TypeError: not a transformers model; ValueError: a class not tested with the fused loss (it may scale
            its logits after the projection), or an output projection that is not a ``torch.nn.Linear``.

    Method: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024); Liger Kernel's
    ``apply_liger_kernel_to_*`` (Hsu et al., 2024), which patches the forward the same way on GPUs.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"attnpp.transformers.apply: expected a transformers model, got {type(model).__name__}")
    if _STATE in model.__dict__:
        return model
    if not any(cls.__name__ in TESTED for cls in type(model).__mro__):
        raise ValueError(f"attnpp.transformers.apply: {type(model).__name__} is not among the causal LMs tested "
                         f"with the fused loss ({', '.join(TESTED)}): its forward may change its logits after the "
                         f"output projection, which the fused loss would not see")
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"attnpp.transformers.apply: {type(model).__name__}'s output projection is a "
                         f"{type(head).__name__}, not a torch.nn.Linear (the fused loss reads its weight and bias)")
    state = _FusedLoss(model, head)
    model.__dict__[_STATE] = state
    state.modules = _activations.patch(model, rms_norm=rms_norm, gated_mlp=gated_mlp)
    model.forward = functools.wraps(model.forward)(functools.partial(state.model_forward, model.forward))
    head.forward = functools.partial(state.head_forward_of, head.forward)
    model.loss_function = state.loss
    return model


def revert(model):
    """Undoes ``apply``: the model's forward, its output projection's, its loss function and its modules' as
    they were.

    Args:
        model (transformers.PreTrainedModel): a model ``apply`` changed (another is returned unchanged).

    Returns:
        The model itself.
    """
    state = model.__dict__.pop(_STATE, None)
    if state is not None:
        _restore(model, "forward", state.forward)
        _restore(state.head, "forward", state.head_forward)
        _restore(model, "_loss_function", state.own_loss)
        _activations.restore(state.modules)
    return model


def _load(load, *args, fused_loss=True, **kwargs):
    kwargs.setdefault("attn_implementation", NAME)
    model = load(*args, **kwargs)
    return apply(model) if fused_loss else model


def from_pretrained(pretrained_model_name_or_path, *args, fused_loss=True, **kwargs):
    """``transformers.AutoModelForCausalLM.from_pretrained`` with ``attn_implementation="attnpp"`` (unless given)
    and, with ``fused_loss``, ``apply`` on the model: the equivalent at load time.

    Args:
        pretrained_model_name_or_path, args, kwargs: ``from_pretrained``'s.
        fused_loss (bool): apply the fused loss. Default: True.

    Returns:
        The model.

    Raises:
        ValueError: as ``apply`` (a class not tested with the fused loss), and ``from_pretrained``'s errors.
    """
    return _load(transformers.AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path, *args,
                 fused_loss=fused_loss, **kwargs)


def from_config(config, *args, fused_loss=True, **kwargs):
    """``transformers.AutoModelForCausalLM.from_config`` (random weights) with ``attn_implementation="attnpp"``
    (unless given) and, with ``fused_loss``, ``apply`` on the model.

    Args:
        config (transformers.PretrainedConfig), args, kwargs: ``from_config``'s.
        fused_loss (bool): apply the fused loss. Default: True.

    Returns:
        The model.

    Raises:
        ValueError: as ``apply`` (a class not tested with the fused loss), and ``from_config``'s errors.
    """
    return _load(transformers.AutoModelForCausalLM.from_config, config, *args, fused_loss=fused_loss, **kwargs)
