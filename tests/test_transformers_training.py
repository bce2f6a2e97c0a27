"""attnpp.transformers' training step: the fused loss (``apply``) against the model without it.

Random-initialised small configurations of each architecture (tests/helpers.py), dropout off so that steps
compare. The bound of a float32 comparison is twice the unpatched model's own float32 error: twice the largest
difference between it and a float64 reference of the same weights (at least float32's epsilon of the largest
value: one loss's error can be 0 by chance), whose loss is computed in float64
(``float64_loss``: transformers' causal-LM loss computes from float32 logits even in a float64 model). gpt-oss's
experts run in no float64: 1e-4 of the largest value. Bounds are the model's over all its parameters' gradients
(a gradient that is exactly 0 is rounding noise in both).
"""
import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

import attnpp.transformers as AT
from helpers import HF_NAMES, HF_NO_FLOAT64, hf_bound, hf_config, hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
T = 16
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}


def float64_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                 **kwargs):
    """transformers' ForCausalLMLoss in the logits' dtype (it casts them to float32 first)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index,
                                             reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def models(name, config=None):
    """(plain, fused, reference or None): the model with attnpp's attention, the same with apply(), and the
    float64 one with float64_loss (None for gpt-oss)."""
    options = NO_DROPOUT.get(name, {})
    plain = hf_model(name, "attnpp", config=config, **options)
    fused = AT.apply(hf_model(name, "attnpp", weights=plain, config=config, **options))
    reference = None
    if name not in HF_NO_FLOAT64:
        reference = hf_model(name, "attnpp", torch.float64, weights=plain, config=config, **options)
        reference.loss_function = float64_loss
    return plain, fused, reference


def micro_batches(n, seed=3):
    """n micro-batches of (input_ids, labels), 2 rows of T tokens; labels ignored (-100) on a run of each row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 128, (2, T), generator=g)
        labels = ids.clone()
        labels[0, :4] = -100
        labels[1, 9:12] = -100
        out.append((ids, labels))
    return out


def flat_grads(model):
    return torch.cat([p.grad.double().flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])


def step(model, batches, **kwargs):
    """(losses, flat gradient) of one step accumulated over ``batches`` (num_items_in_batch the labelled tokens
    of them all, as Trainer passes it, when more than one)."""
    model.train()
    model.zero_grad()
    items = sum(int((labels[..., 1:] != -100).sum()) for _, labels in batches)
    losses = []
    for ids, labels in batches:
        extra = dict(num_items_in_batch=torch.tensor(items)) if len(batches) > 1 else {}
        loss = model(ids, labels=labels, **extra, **kwargs).loss
        loss.backward()
        losses.append(loss.detach().double())
    return torch.stack(losses), flat_grads(model)


def assert_within(got, plain, reference, what):
    limit = hf_bound(plain, reference)
    assert limit > 0, what
    err = (got - plain).abs().max().item()
    assert err <= limit, f"{what}: {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize("accumulate", [1, 2], ids=["step", "accumulated"])
@pytest.mark.parametrize("name", HF_NAMES)
def test_fused_step_equals_unpatched(name, accumulate):
    """The loss and every parameter's gradient of a training step with ignored labels, alone or accumulated over
    2 micro-batches (num_items_in_batch), with the fused loss (Gemma 2's soft-capped logits included); no logits
    returned; revert() gives the model's own forward back."""
    plain, fused, reference = models(name)
    batches = micro_batches(accumulate)
    want, got = step(plain, batches), step(fused, batches)
    ref = None if reference is None else step(reference, batches)
    assert_within(got[0], want[0], None if ref is None else ref[0], "loss")
    assert_within(got[1], want[1], None if ref is None else ref[1], "gradients")
    ids, labels = batches[0]
    assert fused.train()(ids, labels=labels).logits is None
    assert fused.eval()(ids, labels=labels).logits.shape == (2, T, 128)  # eval mode: the model's own forward
    AT.revert(fused)
    assert fused.train()(ids, labels=labels).logits.shape == (2, T, 128)


@pytest.mark.parametrize("name", HF_NAMES)
def test_trainer_steps_equal_unpatched(name, tmp_path):
    """Trainer, 3 optimizer steps of 2 accumulated micro-batches (SGD: the parameters move by the gradients): the
    parameters after them with the fused loss against the model's own."""
    plain, fused, reference = models(name)
    data = [dict(input_ids=ids[r], labels=labels[r]) for ids, labels in micro_batches(6, seed=5) for r in range(2)]
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, learning_rate=0.5, optim="sgd", report_to="none",
                                save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, logging_strategy="no")
    trained = []
    for model in (plain, fused) + (() if reference is None else (reference,)):
        tf.Trainer(model=model, args=args, train_dataset=data).train()
        trained.append(torch.cat([p.detach().double().flatten() for _, p in sorted(model.named_parameters())]))
    start = torch.cat([p.detach().double().flatten() for _, p in sorted(
        hf_model(name, "attnpp", **NO_DROPOUT.get(name, {})).named_parameters())])
    assert (trained[0] - start).abs().max() > 1e-3  # the steps moved the parameters
    assert_within(trained[1], trained[0], trained[2] if reference is not None else None, "parameters")


def test_no_logits_materialised():
    """The fused step allocates no (B, L, V) logits, nor their gradient: no tensor that any op of its forward and
    backward returns has the vocabulary as its last dimension but the output projection's weight and its
    gradient (measured with a dispatch mode that sees every op)."""
    V = 257  # (a size no other dimension of the model has)
    config = hf_config("llama")
    config.vocab_size = V
    model = AT.apply(hf_model("llama", "attnpp", config=config)).train()
    ids = torch.randint(1, V, (2, T))
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    shapes.append(tuple(t.shape))
            return out
    with Shapes():
        model(ids, labels=ids).loss.backward()
    assert shapes  # (the mode saw the step)
    wide = [s for s in shapes if s and s[-1] == V]
    assert wide == [] and not any(V in s[:-1] and s != (V, 64) for s in shapes), wide


def test_apply_refuses_what_it_cannot_do():
    with pytest.raises(TypeError, match="transformers model"):
        AT.apply(torch.nn.Linear(2, 2))
    cohere = tf.AutoModelForCausalLM.from_config(tf.CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                                 num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="CohereForCausalLM is not among"):  # (it scales its logits)
        AT.apply(cohere)
    model = hf_model("llama", "attnpp")
    assert AT.apply(AT.apply(model)) is model and AT.revert(AT.revert(model)) is model
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)


def test_from_config_loads_with_attnpp_and_the_fused_loss():
    model = AT.from_config(hf_config("llama"))
    assert model.config._attn_implementation == "attnpp" and "_attnpp_fused_loss" in vars(model)
    ids = torch.randint(1, 128, (1, T))
    assert model.train()(ids, labels=ids).logits is None
    assert "_attnpp_fused_loss" not in vars(AT.from_config(hf_config("llama"), fused_loss=False))
