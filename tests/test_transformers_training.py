"""attnpp.transformers' training step: the fused loss (``apply``) against the model without it, packed sequences
and chunked attention through the varlen kernel against each sequence alone and the dense mask, and a 2-process
DistributedDataParallel step with both against one process.

Random-initialised small configurations of each architecture (tests/helpers.py), dropout off so that steps
compare. The bound of a float32 comparison is twice the unpatched model's own float32 error: twice the largest
difference between it and a float64 reference of the same weights (at least float32's epsilon of the largest
value: one loss's error can be 0 by chance), whose loss is computed in float64
(``float64_loss``: transformers' causal-LM loss computes from float32 logits even in a float64 model). gpt-oss's
experts run in no float64: 1e-4 of the largest value. Bounds are the model's over all its parameters' gradients
(a gradient that is exactly 0 is rounding noise in both).
"""
import datetime
import os
import socket

import pytest
import torch
import transformers as tf
from transformers import AttentionInterface
from torch.utils._python_dispatch import TorchDispatchMode

import attnpp.torch
import attnpp.transformers as AT
from helpers import HF_NAMES, HF_NO_FLOAT64, hf_bound, hf_config, hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
T = 16


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
    plain = hf_model(name, "attnpp", config=config)
    fused = AT.apply(hf_model(name, "attnpp", weights=plain, config=config))
    reference = None
    if name not in HF_NO_FLOAT64:
        reference = hf_model(name, "attnpp", torch.float64, weights=plain, config=config)
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
def test_fused_step_in_bfloat16(name):
    """bfloat16, a step with ignored labels. Every parameter's gradient with attnpp's attention and the fused loss,
    against float64 (float32 for gpt-oss) of the same weights, within 1.5 times the error of the model with
    transformers' eager attention and its own loss in bfloat16 (at least bfloat16's epsilon of the largest
    gradient). The loss: float64's cross-entropy of the model's own bfloat16 last hidden states through its
    bfloat16 lm_head (soft-capped where the model caps its logits), within twice PyTorch's float32 error on the
    same logits. (Against the float64 model, a loss's error is that of the bfloat16 hidden states, one number of
    either sign, larger or smaller than eager's by chance: no measure of the fused loss.)"""
    eager = hf_model(name, "eager", torch.bfloat16)
    fused = AT.apply(hf_model(name, "attnpp", torch.bfloat16, weights=eager))
    reference = hf_model(name, "eager", torch.float32 if name in HF_NO_FLOAT64 else torch.float64, weights=eager)
    reference.loss_function = float64_loss
    batches = micro_batches(1)
    ref, want, got = step(reference, batches), step(eager, batches), step(fused, batches)
    limit = max(1.5 * (want[1] - ref[1]).abs().max().item(),
                torch.finfo(torch.bfloat16).eps * ref[1].abs().max().item())
    err = (got[1] - ref[1]).abs().max().item()
    assert err <= limit, f"gradients: {err:.3g} > {limit:.3g} (1.5 x eager's bfloat16 error)"

    ids, labels = batches[0]
    with torch.no_grad():
        hidden = fused.base_model(ids).last_hidden_state
    cap = getattr(fused.config, "final_logit_softcapping", None)

    def loss_in(dtype):
        logits = hidden.to(dtype) @ fused.get_output_embeddings().weight.to(dtype).T
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return float64_loss(logits, labels, logits.shape[-1]).double()
    assert_within(got[0], loss_in(torch.float64), loss_in(torch.float32), "loss")


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
        hf_model(name, "attnpp").named_parameters())])
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
    assert not any("forward" in vars(module) for module in model.modules())  # (the norms' and MLPs' too)


def test_from_config_loads_with_attnpp_and_the_fused_loss():
    model = AT.from_config(hf_config("llama"))
    assert model.config._attn_implementation == "attnpp" and "_attnpp_fused_loss" in vars(model)
    ids = torch.randint(1, 128, (1, T))
    assert model.train()(ids, labels=ids).logits is None
    assert "_attnpp_fused_loss" not in vars(AT.from_config(hf_config("llama"), fused_loss=False))


# ------------------------------------------------------------------------------------------ lean activations
def saved_bytes(model, **kwargs):
    """The bytes of the activations a training forward keeps for the backward: the distinct storages of the
    tensors autograd saves (torch.autograd.graph.saved_tensors_hooks), not the parameters'."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t
    ids, labels = micro_batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.train()(ids, labels=labels, **kwargs).loss
    loss.backward()
    return sum(kept.values())


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_lean_activations_keep_less_of_the_mlp_and_norms(name):
    """apply()'s RMSNorms keep their input alone (not also the normalised input and each row's rsqrt:
    B*L*(hidden + 1) fewer floats each), and the projections that read a norm's output (q, k and v; the MLP's gate
    and up) keep the norm's input instead, which the norm keeps anyway (B*L*hidden fewer floats, twice a layer);
    its gated MLPs keep gate(x) alone, not act(gate(x)), the product, nor up(x), computed again from the norm's input
    (3*B*L*intermediate fewer floats). Phi-3's gate and up are halves of one projection, both kept. Measured as the
    bytes autograd keeps, against the fused loss alone."""
    config = hf_config(name)
    loss_only = AT.apply(hf_model(name, "attnpp"), rms_norm=False, gated_mlp=False)
    lean = AT.apply(hf_model(name, "attnpp"))
    tokens, layers = 2 * T, config.num_hidden_layers
    norms = 2 * layers + 1  # (each layer's two, and the last hidden states')
    mlp = 2 if name == "phi3" else 3
    fewer = 4 * tokens * (norms * (config.hidden_size + 1) + layers * (2 * config.hidden_size
                                                                       + mlp * config.intermediate_size))
    assert saved_bytes(loss_only) - saved_bytes(lean) == fewer


def test_lean_activations_with_a_retained_graph_and_frozen_projections():
    """Two backward passes through one retained graph (the norms' outputs computed again for each), with the
    attention's projections frozen (their weights' gradients not asked for): the loss and gradients of the model
    without apply()."""
    plain, fused, reference = models("llama")
    ids, labels = micro_batches(1)[0]
    grads = []
    for model in (plain, fused, reference):
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")))
        model.train()
        loss = model(ids, labels=labels).loss
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(flat_grads(model))
    assert_within(grads[1], grads[0], grads[2], "gradients")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lean_activations_with_checkpointing_and_an_adapter(reentrant):
    """apply() under transformers' activation checkpointing (the layers recomputed around the recomputed norms;
    reentrant: the first forward without autograd, the patches only in the recomputation), and after the MLPs' down
    or up projections are replaced by a LoRA-like module (a Linear plus a low-rank term, as a PEFT adapter is; the
    MLP then runs its own forward, or keeps up's output): the loss and gradients of the model without apply()."""
    plain, fused, reference = models("llama")
    batches = micro_batches(1)
    want, ref = step(plain, batches), step(reference, batches)
    for model in (plain, fused, reference):
        model.activation_checkpointing_enable(dict(use_reentrant=reentrant))
    for got in (step(plain, batches), step(fused, batches)):
        assert_within(got[0], want[0], ref[0], "loss")
        assert_within(got[1], want[1], ref[1], "gradients")

    class Adapter(torch.nn.Linear):
        def __init__(self, linear):
            super().__init__(linear.in_features, linear.out_features, bias=False)
            self.load_state_dict(linear.state_dict())
            self.low_rank = torch.nn.Sequential(torch.nn.Linear(linear.in_features, 2, bias=False),
                                                torch.nn.Linear(2, linear.out_features, bias=False))

        def forward(self, x):
            return super().forward(x) + self.low_rank(x)
    for model in (plain, fused, reference):
        model.activation_checkpointing_disable()
        torch.manual_seed(1)
        for i, layer in enumerate(model.model.layers):  # (on the down projection, then on up: its input kept)
            name = "up_proj" if i % 2 else "down_proj"
            setattr(layer.mlp, name, Adapter(getattr(layer.mlp, name)).to(layer.mlp.gate_proj.weight.dtype))
    want, ref, got = step(plain, batches), step(reference, batches), step(fused, batches)
    assert_within(got[0], want[0], ref[0], "loss")
    assert_within(got[1], want[1], ref[1], "gradients")


# ------------------------------------------------------------------------------------- packed sequences
ROWS = [[5, 7, 4], [9, 7]]  # the lengths of the sequences packed into each row of T tokens


def packed_batch(rows=ROWS, seed=7):
    """(input_ids, position_ids, labels) of rows of T tokens packed with sequences of the given lengths, as
    DataCollatorWithFlattening makes them (positions restarting at 0, the label of each sequence's first token
    -100), and the sequences as (row, start, stop)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (len(rows), T), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in lengths])[None] for lengths in rows])
    labels = ids.masked_fill(pos == 0, -100)
    spans = []
    for r, lengths in enumerate(rows):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        spans += [(r, a, a + n) for a, n in zip(starts, lengths)]
    return ids, pos, labels, spans


def packed_and_alone(model, fused=False):
    """(logits or None, flat gradient) of the packed rows, and of each sequence run alone (the logits
    concatenated in the packed order, the gradients summed; each loss the sum over its tokens divided by the
    labelled tokens of the whole batch, so that both are the same loss)."""
    ids, pos, labels, spans = packed_batch()
    items = torch.tensor(int((labels[:, 1:] != -100).sum()))
    model.train()
    model.zero_grad()
    out = model(ids, position_ids=pos, labels=labels, num_items_in_batch=items, use_cache=False)
    out.loss.backward()
    packed = (None if out.logits is None else out.logits.detach().double().reshape(-1, 128), flat_grads(model))
    model.zero_grad()
    logits = []
    for r, a, b in spans:
        out = model(ids[r:r + 1, a:b], labels=labels[r:r + 1, a:b], num_items_in_batch=items, use_cache=False)
        out.loss.backward()
        logits.append(None if out.logits is None else out.logits.detach().double()[0])
    return packed, (None if fused else torch.cat(logits), flat_grads(model))


# gpt-oss builds its masks without the position ids (transformers 5.24): with any attention, it never sees packed
# rows as packed
PACKED_NAMES = [name for name in HF_NAMES if name != "gpt_oss"]


@pytest.mark.parametrize("name", PACKED_NAMES)
def test_packed_rows_equal_each_sequence_alone(name):
    """Packed rows (position ids restarting, no attention_mask) run through the varlen kernel: their logits and
    every parameter's gradient equal each sequence's alone (with the window, soft-capping, sinks and GQA of
    each architecture), and so do the fused loss's gradients on them."""
    plain, fused, reference = models(name)
    (logits, grads), (logits_alone, grads_alone) = packed_and_alone(plain)
    ref = None if reference is None else packed_and_alone(reference)[1]
    assert_within(logits, logits_alone, None if ref is None else ref[0], "logits")
    assert_within(grads, grads_alone, None if ref is None else ref[1], "gradients")
    (_, fused_grads), _ = packed_and_alone(fused, fused=True)
    assert_within(fused_grads, grads_alone, None if ref is None else ref[1], "fused loss's gradients")


def test_packed_rows_build_no_square_mask(monkeypatch):
    """A packed batch of L = 48 tokens per row, forward and backward: every layer runs the varlen operator, the
    dense mask builder is never called, and no op returns a tensor with two dimensions of size L (measured with
    a dispatch mode that sees every op of the step, the backward's included)."""
    L = 48  # (a size no other dimension of the model has)
    config = hf_config("gemma2")  # (sliding windows and soft-capping)
    config.max_position_embeddings = L
    model = AT.apply(hf_model("gemma2", "attnpp", config=config)).train()
    ids = torch.randint(1, 128, (2, L))
    pos = torch.cat([torch.arange(20), torch.arange(28)]).expand(2, L)
    calls = []
    varlen = attnpp.torch.scaled_dot_product_attention_varlen
    monkeypatch.setattr(attnpp.torch, "scaled_dot_product_attention_varlen",
                        lambda *a, **k: calls.append(a[3].tolist()) or varlen(*a, **k))

    def refuse(*args, **kwargs):
        raise AssertionError("a dense mask was built")
    monkeypatch.setattr("attnpp.transformers._attention.sdpa_mask", refuse)
    square = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and list(t.shape).count(L) >= 2:
                    square.append((str(func), tuple(t.shape)))
            return out
    with Shapes():
        model(ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100), use_cache=False).loss.backward()
    assert calls == [[0, 20, 48, 68, 96]] * config.num_hidden_layers
    assert square == []


# ---------------------------------------------------------------------------------------- chunked attention
def llama4(impl, dtype=torch.float32, weights=None):
    """A small Llama 4 text model whose first three layers attend in chunks of 5 tokens (the fourth: full)."""
    config = tf.Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 attention_chunk_size=5, max_position_embeddings=128, moe_layers=[])
    return hf_model("llama", impl, dtype, weights, config=config)


@pytest.mark.parametrize("batch", ["plain", "packed", "left_padded"])
def test_chunked_attention_equals_the_dense_mask(batch):
    """Llama 4's chunked attention through the varlen kernel (each chunk a block; with packed rows, chunks
    restarting with each sequence; with left padding, after it): the logits and every parameter's gradient equal
    eager's with transformers' dense mask (the real tokens'), within twice eager's float32 error."""
    ids, pos, labels, _ = packed_batch()
    kw = dict(use_cache=False)
    if batch == "packed":
        kw["position_ids"] = pos
    elif batch == "left_padded":
        mask = torch.ones(2, T, dtype=torch.long)
        mask[0, :3] = 0
        kw["attention_mask"] = mask
        # (no padding position predicts a label: what a padded query computes, seeing no key, is each
        # implementation's own; nothing else depends on it)
        labels = ids.masked_fill((mask == 0) | (mask.roll(1, 1) == 0), -100)
    real = kw["attention_mask"].bool() if "attention_mask" in kw else torch.ones(2, T, dtype=torch.bool)
    blocks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        blocks.append(getattr(attention_mask, "cu_seqlens", None) is not None)
        return AT.attention_forward(module, query, key, value, attention_mask, **kwargs)
    attnpp_model = llama4("attnpp")
    runs = {}
    for impl, model in (("attnpp", attnpp_model), ("eager", llama4("eager", weights=attnpp_model)),
                        ("reference", llama4("eager", torch.float64, weights=attnpp_model))):
        model.train()
        if impl == "reference":
            model.loss_function = float64_loss
        AttentionInterface.register(AT.NAME, spy)
        try:
            out = model(ids, labels=labels, **kw)
        finally:
            AT.register()
        out.loss.backward()
        runs[impl] = (out.logits.detach().double()[real], flat_grads(model))
    # the three chunked layers run as blocks (and the full-attention one too on packed rows)
    assert blocks == [True, True, True, batch == "packed"]
    assert_within(runs["attnpp"][0], runs["eager"][0], runs["reference"][0], "logits")
    assert_within(runs["attnpp"][1], runs["eager"][1], runs["reference"][1], "gradients")


# --------------------------------------------------------------------------------------------------- DDP
def _ddp_rank(rank, world, port, out_dir):
    """One rank of the 2-process step: the fused loss on its packed row, gradients averaged by DDP (gloo). It
    ends with os._exit once both ranks are done (freeing a DDP Reducer at the function's return can deadlock:
    tests/test_transformers.py's DDP test says how)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    model = AT.apply(hf_model("llama", "attnpp", torch.float64)).train()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, pos, labels, _ = packed_batch(DDP_ROWS)
    ddp(ids[rank:rank + 1], position_ids=pos[rank:rank + 1], labels=labels[rank:rank + 1],
        use_cache=False).loss.backward()
    if rank == 0:
        torch.save({n: p.grad for n, p in model.named_parameters()}, out_dir / "ddp.pt")
    torch.distributed.barrier()
    os._exit(0)


DDP_ROWS = [[5, 11], [9, 7]]  # (as many labelled tokens in each row: the mean of the ranks' means is the batch's)


def test_ddp_step_with_fused_loss_and_packing_equals_one_process(tmp_path):
    """A 2-process DistributedDataParallel step (gloo, loopback), each rank a packed row, with the fused loss:
    the gradients of one process on both rows (float64)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_ddp_rank, args=(2, port, tmp_path), nprocs=2, join=True)
    got = torch.load(tmp_path / "ddp.pt")
    model = AT.apply(hf_model("llama", "attnpp", torch.float64)).train()
    ids, pos, labels, _ = packed_batch(DDP_ROWS)
    model(ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-10, atol=1e-13), n
