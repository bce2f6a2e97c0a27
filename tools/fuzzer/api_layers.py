"""The call kinds of attnpp.nn (layers, forward and backward), attnpp.optim, attnpp.torch (autograd) and
attnpp.transformers, each against PyTorch in float64 (torch.nn's layers and optimizers holding the same weights,
attnpp.testing's references)."""
import numpy as np
import torch

import attnpp
import attnpp.functional as F
import attnpp.torch as AT
from attnpp import nn
from attnpp.testing import attention_layer_reference, reference

from . import api
from .api import all_close, checked, close, f64, kind, randn, tensor
from .api_functional import (attention_problem, attention_reference, fused_problem, fused_reference, loss_problem,
                             loss_reference)
from .values import F32, F64, chance, pick


def randomize(rng, layer, std=0.5):
    for p in layer.parameters():
        p.data[...] = randn(rng, p.shape, p.data.dtype, std)
    return layer


def param_pairs(layer, P):
    """(name, the parameter's grad, the reference's) of every parameter of a layer, against {name: leaf}."""
    return [(f"grad {n}", lambda r, p=p: p.grad, P[n].grad.numpy()) for n, p in layer.named_parameters()]


def wrong_width(call, group, name, a):
    call.bad.append((group, name, np.zeros(a.shape[:-1] + (a.shape[-1] + 1,), a.dtype), ValueError,
                     f"{name} of another width"))


# ------------------------------------------------------------------------------------------------- nn layers
@kind("nn.Linear")
def _linear(rng, call):
    dt = api.dtype_of(rng)
    fin, fout, bias = int(rng.integers(1, 8)), int(rng.integers(1, 8)), chance(rng, 0.7)
    init = call.add("init", "nn.Linear", in_features=fin, out_features=fout, bias=bias, dtype=dt)
    layer = randomize(rng, nn.Linear(**init))
    x = randn(rng, api.api_lead(rng) + (fin,), dt)
    call.add("call", None, ("input",), input=x)
    P = {n: tensor(p.data, True) for n, p in layer.named_parameters()}
    tx = tensor(x, True)
    out = torch.nn.functional.linear(tx, P["weight"], P.get("bias"))
    g = randn(rng, out.shape, dt)
    (out * tensor(g)).sum().backward()

    def body(kw):
        lay = nn.Linear(**kw["init"])
        lay.load_state_dict(layer.state_dict())
        y = lay(**kw["call"])
        return y, lay.backward(g), lay
    call.body = body
    params = all_close([(n, lambda res, n=n: dict(res[2].named_parameters())[n].grad, P[n].grad.numpy())
                        for n in P], dt)
    call.check(lambda r: close("output", r[0], out.detach().numpy(), dt)
               or close("grad_input", r[1], tx.grad.numpy(), dt) or params(r))
    wrong_width(call, "call", "input", x)


@kind("nn.Embedding")
def _embedding(rng, call):
    dt = api.dtype_of(rng)
    V, E = int(rng.integers(1, 9)), int(rng.integers(1, 6))
    init = call.add("init", "nn.Embedding", num_embeddings=V, embedding_dim=E, dtype=dt)
    layer = randomize(rng, nn.Embedding(**init))
    idx = rng.integers(0, V, api.api_lead(rng) + (int(rng.integers(1, 4)),))
    call.add("call", None, input=idx)
    tw = tensor(layer.weight.data, True)
    out = torch.nn.functional.embedding(torch.tensor(idx), tw)
    g = randn(rng, out.shape, dt)
    (out * tensor(g)).sum().backward()

    def body(kw):
        lay = nn.Embedding(**kw["init"])
        lay.load_state_dict(layer.state_dict())
        y = lay(**kw["call"])
        lay.backward(g)
        return y, lay.weight.grad
    call.body = body
    call.check(all_close([("output", lambda r: r[0], out.detach().numpy()), ("grad weight", lambda r: r[1],
                                                                            tw.grad.numpy())], dt))
    if idx.size:
        bad = idx.copy()
        bad.reshape(-1)[0] = V
        call.bad.append(("call", "input", bad, IndexError, "an index out of [0, V)"))


@kind("nn.Dropout", 0.7)
def _dropout(rng, call):
    dt = api.dtype_of(rng)
    p, seed = pick(rng, [0.0, 0.3, 0.6]), int(rng.integers(0, 2 ** 62))
    call.add("init", "nn.Dropout", p=p)
    x = randn(rng, api.api_lead(rng) + (int(rng.integers(1, 20)),), dt)
    call.add("call", None, ("input",), input=x, seed=seed)
    keep = F.dropout_mask(x.shape, p, seed)
    g = randn(rng, x.shape, dt)

    def body(kw):
        lay = nn.Dropout(**kw["init"])
        return lay(**kw["call"]), lay.backward(g)
    call.body = body
    call.check(all_close([("output", lambda r: r[0], np.where(keep, f64(x) / (1 - p), 0)),
                          ("grad_input", lambda r: r[1], np.where(keep, f64(g) / (1 - p), 0))], dt))


@kind("nn.CrossEntropyLoss")
def _ce(rng, call):
    dt = api.dtype_of(rng)
    kw = loss_problem(rng, dt)
    init = call.add("init", "nn.CrossEntropyLoss", reduction=kw.pop("reduction"))
    if "ignore_index" in kw:
        init["ignore_index"] = kw.pop("ignore_index")
    call.add("call", None, ("input",), **kw)
    reference_in = loss_reference(dict(kw, **init))
    g = randn(rng, reference_in(torch.float64)[0].shape, dt)
    reference_in = loss_reference(dict(kw, **init), g)

    def body(kw):
        loss = nn.CrossEntropyLoss(**kw["init"])
        return [loss(**kw["call"]), loss.backward(g if g.ndim else g[()])]
    call.body = body
    call.check(checked(["loss", "grad_input"], lambda r: r, reference_in, dt))


@kind("nn.LinearCrossEntropyLoss")
def _fused(rng, call):
    dt = api.dtype_of(rng)
    kw = fused_problem(rng, dt)
    init = call.add("init", "nn.LinearCrossEntropyLoss", reduction=kw.pop("reduction"),
                    **{n: kw.pop(n) for n in ("ignore_index", "label_smoothing") if n in kw})
    call.add("call", None, ("input", "weight"), **kw)
    full = dict(kw, **init)
    g = randn(rng, fused_reference(full)(torch.float64)[0].shape, dt)
    names = ["loss", "grad_input", "grad_weight"] + (["grad_bias"] if kw.get("bias") is not None else [])

    def body(kw):
        loss = nn.LinearCrossEntropyLoss(**kw["init"])
        return [loss(**kw["call"])] + [a for a in loss.backward(g if g.ndim else g[()]) if a is not None]
    call.body = body
    call.check(checked(names, lambda r: r, fused_reference(full, g), dt))


@kind("nn.MultiheadAttention", 1.5)
def _mha(rng, call):
    dt = pick(rng, [F32, F64])
    H = int(rng.integers(1, 3))
    E = H * pick(rng, [1, 2, 3])
    opts = dict(bias=chance(rng, 0.7), add_bias_kv=chance(rng, 0.3), add_zero_attn=chance(rng, 0.3),
                batch_first=chance(rng, 0.5))
    if chance(rng, 0.3):
        opts.update(kdim=int(rng.integers(1, 5)), vdim=int(rng.integers(1, 5)))
    init = call.add("init", "nn.MultiheadAttention", embed_dim=E, num_heads=H, dtype=dt, **opts)
    layer = randomize(rng, nn.MultiheadAttention(**init))
    B, L, S = int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    lead = lambda T: (B, T) if opts["batch_first"] else (T, B)  # noqa: E731
    q = randn(rng, lead(L) + (E,), dt)
    k, v = randn(rng, lead(S) + (layer.kdim,), dt), randn(rng, lead(S) + (layer.vdim,), dt)
    kw = dict(need_weights=chance(rng, 0.5))
    if chance(rng, 0.3):
        kpm = rng.random((B, S)) < 0.3
        kpm[:, 0] = False  # (a row that sees no key: PyTorch's layer gives NaN, attnpp 0)
        kw["key_padding_mask"] = kpm
    if chance(rng, 0.3):
        m = rng.random((L, S)) < 0.3
        m[:, 0] = False
        kw["attn_mask"] = m  # (torch.nn.MultiheadAttention's bool attn_mask: True masks out)
    if kw["need_weights"] and chance(rng, 0.5):
        kw["average_attn_weights"] = False
    call.add("call", None, ("query", "key", "value"), query=q, key=k, value=v, **kw)
    g = randn(rng, q.shape, dt)
    params = [n for n, _ in layer.named_parameters()]

    def reference_in(dtype):  # torch.nn.MultiheadAttention holding the same weights, in dtype
        ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **opts)
        ref.load_state_dict({n: tensor(v, dtype=dtype) for n, v in layer.state_dict().items()})
        tq, tk, tv = (tensor(a, True, dtype) for a in (q, k, v))
        ty, tw = ref(tq, tk, tv, **{n: torch.tensor(m) if isinstance(m, np.ndarray) else m for n, m in kw.items()})
        (ty * tensor(g, dtype=dtype)).sum().backward()
        P = dict(ref.named_parameters())
        out = [ty] + ([tw] if tw is not None else []) + [tq.grad, tk.grad, tv.grad] + [P[n].grad for n in params]
        return [t.detach().to(torch.float64).numpy() for t in out]

    def body(kw):
        lay = nn.MultiheadAttention(**kw["init"])
        lay.load_state_dict(layer.state_dict())
        y, w = lay(**kw["call"])
        grads = list(lay.backward(g))
        return [y] + ([w] if w is not None else []) + grads + [dict(lay.named_parameters())[n].grad for n in params]
    names = ["output"] + (["weights"] if kw["need_weights"] else []) + ["grad_query", "grad_key", "grad_value"] + \
        [f"grad {n}" for n in params]
    call.body = body
    call.check(checked(names, lambda r: r, reference_in, dt))
    wrong_width(call, "call", "query", q)


def attention_layer(rng, dt, decoding=False):
    H = int(rng.integers(1, 3))
    E = H * pick(rng, [2, 4])
    opts = dict(causal=decoding or chance(rng, 0.4))
    if chance(rng, 0.25):
        opts["window"] = (int(rng.integers(0, 3)), 0 if decoding else int(rng.integers(-1, 3)))
    if chance(rng, 0.2):
        opts["alibi"] = True
    if chance(rng, 0.2):
        opts["softcap"] = float(rng.uniform(0.5, 4.0))
    if chance(rng, 0.2):
        opts["sinks"] = True
    if chance(rng, 0.3):
        opts["rotary"] = True
        opts["rotary_interleaved"] = chance(rng, 0.5)
    if not decoding and chance(rng, 0.3):
        opts["kv_dim"] = int(rng.integers(1, 6))
    return dict(embed_dim=E, num_heads=H, dtype=dt, **opts)


@kind("nn.Attention", 1.5)
def _attention(rng, call):
    dt = pick(rng, [F32, F64])
    init = call.add("init", "nn.Attention", **attention_layer(rng, dt))
    layer = randomize(rng, nn.Attention(**init))
    B, L, S = int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
    x = randn(rng, (B, L, layer.embed_dim), dt)
    context = randn(rng, (B, S, layer.kv_dim), dt) if "kv_dim" in init else None
    kw = dict(x=x, context=context, need_weights=chance(rng, 0.4))
    if chance(rng, 0.3):
        kw["key_padding_mask"] = rng.random((B, S if context is not None else L)) < 0.3
    call.add("call", None, ("x",), **kw)
    g = randn(rng, (B, L, layer.out_dim), dt)
    params = [n for n, _ in layer.named_parameters()]
    reference_in = layer_reference(layer, x, context, kw.get("key_padding_mask"), g, kw["need_weights"], params)

    def body(kw):
        lay = nn.Attention(**kw["init"])
        lay.load_state_dict(layer.state_dict())
        r = lay(**kw["call"])
        y, w = r if kw["call"]["need_weights"] else (r, None)
        grads = lay.backward(g)
        grads = list(grads) if context is not None else [grads]
        return [y] + ([w] if w is not None else []) + grads + [dict(lay.named_parameters())[n].grad for n in params]
    names = ["output"] + (["weights"] if kw["need_weights"] else []) + ["grad x"] + \
        (["grad context"] if context is not None else []) + [f"grad {n}" for n in params]
    call.body = body
    call.check(checked(names, lambda r: r, reference_in, dt))
    wrong_width(call, "call", "x", x)


def layer_reference(layer, x, context, kpm, g, need_weights, params):
    """reference(torch dtype) -> [output, (weights), grad x, (grad context), the parameters' gradients]: the layer's
    math (attnpp.testing.attention_layer_reference, which reads attnpp.nn.Attention and attnpp.torch.Attention
    alike) in that dtype, from the gradient ``g`` of the output."""
    def compute_in(dtype):
        tx = tensor(x, True, dtype)
        tc = tx if context is None else tensor(context, True, dtype)
        out, w, P = attention_layer_reference(layer, tx, tc, kpm, dtype=dtype)
        (out * tensor(g, dtype=dtype)).sum().backward()
        res = [out] + ([w] if need_weights else []) + [tx.grad] + ([tc.grad] if context is not None else []) + \
            [P[n].grad for n in params]
        return [t.detach().to(torch.float64).numpy() for t in res]
    return compute_in


@kind("nn.KVCache")
def _kv_cache(rng, call):
    dt = pick(rng, [F32, F64])
    layer = randomize(rng, nn.Attention(**attention_layer(rng, dt, decoding=True))).eval()
    B, T = int(rng.integers(1, 3)), int(rng.integers(1, 7))
    prompt = int(rng.integers(0, T + 1))
    H = layer.num_heads
    call.add("init", "nn.KVCache", batch_size=B, num_heads=H, max_length=T + int(rng.integers(0, 3)),
             head_dim=layer.qk_dim // H, v_head_dim=layer.v_dim // H, dtype=dt)
    x = randn(rng, (B, T, layer.embed_dim), dt)
    call.add("call", None, ("x",), x=x)
    def reference_in(dtype):  # the full forward over the whole sequence
        tx = tensor(x, dtype=dtype)
        return [attention_layer_reference(layer, tx, tx, None, dtype=dtype)[0].detach().to(torch.float64).numpy()]
    output = checked(["decoded output"], lambda r: [r[0]], reference_in, dt)

    def body(kw):
        cache, x = nn.KVCache(**kw["init"]), kw["call"]["x"]
        with attnpp.no_grad():
            if not isinstance(x, np.ndarray):  # (a mutated x goes to the layer as it is)
                return layer(x, kv_cache=cache)
            outs = [layer(x[:, :prompt], kv_cache=cache)] if prompt else []
            outs += [layer(x[:, t:t + 1], kv_cache=cache) for t in range(prompt, x.shape[1])]
        return np.concatenate(outs, axis=1), cache
    call.body = body
    call.check(lambda r: output(r)
               or (None if list(r[1].lengths) == [T] * B else f"cache lengths {list(r[1].lengths)}, expected {T}"))
    wrong_width(call, "call", "x", x)


# ------------------------------------------------------------------------------------------------ optimizers
def optimizer_kind(name, ours, theirs, hyper):
    @kind(f"optim.{name}")
    def gen(rng, call):
        dt = pick(rng, [F32, F64])
        init = call.add("init", f"optim.{name}", **hyper(rng))
        shapes = [(int(rng.integers(1, 5)), int(rng.integers(1, 4))), (int(rng.integers(1, 6)),)]
        start = [randn(rng, s, dt) for s in shapes]
        grads = [[randn(rng, s, dt) for s in shapes] for _ in range(int(rng.integers(1, 4)))]
        tp = [torch.nn.Parameter(tensor(a)) for a in start]
        topt = theirs(tp, **{k: v for k, v in init.items() if k != "master_weights"})
        for step in grads:
            for p, g in zip(tp, step):
                p.grad = tensor(g)
            topt.step()

        def body(kw):
            params = [nn.Parameter(a.copy()) for a in start]
            opt = ours(params, **kw["init"])
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = g.copy()
                opt.step()
            return [p.data for p in params]
        call.body = body
        call.check(all_close([(f"parameter {i}", lambda r, i=i: r[i], p.detach().numpy()) for i, p in enumerate(tp)],
                             dt))


optimizer_kind("SGD", attnpp.optim.SGD, torch.optim.SGD,
               lambda rng: dict(lr=pick(rng, [0.1, 0.01]), momentum=pick(rng, [0.0, 0.9]),
                                dampening=pick(rng, [0.0, 0.1]), weight_decay=pick(rng, [0.0, 0.01]),
                                nesterov=False))
optimizer_kind("AdamW", attnpp.optim.AdamW, torch.optim.AdamW,
               lambda rng: dict(lr=pick(rng, [0.1, 0.001]), betas=(0.9, pick(rng, [0.999, 0.95])),
                                eps=pick(rng, [1e-8, 1e-6]), weight_decay=pick(rng, [0.0, 0.01])))


# ------------------------------------------------------------------------------------- attnpp.torch (autograd)
TORCH_DTYPE = {F32: torch.float32, F64: torch.float64}


def torch_tensor(a, grad=True):
    """A leaf tensor of the array's dtype (bfloat16 through float32: exact)."""
    if a.dtype == api.BF16:
        t = torch.tensor(a.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t.requires_grad_(grad)


def as_numpy(t):
    """A tensor's values as an array (bfloat16 through float32: exact)."""
    if t is None:
        return None
    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def torch_bad(call, names, tensors):
    for n, t in zip(names, tensors):
        call.bad += [("call", n, t.detach().to(torch.int32), TypeError, f"{n} of int32"),
                     ("call", n, t.detach().numpy() if t.dtype != torch.bfloat16 else "x", TypeError,
                      f"{n} as an ndarray")]


@kind("torch.scaled_dot_product_attention", 3)
def _torch_sdpa(rng, call):
    dt = api.dtype_of(rng)
    (q, k, v), kw, ref = attention_problem(rng, dt)
    kw = {n: (torch.tensor(m) if m.dtype != api.BF16 else torch_tensor(m, False)) if isinstance(m, np.ndarray) else m
          for n, m in kw.items()}
    if "sinks" in kw:
        kw["sinks"].requires_grad_()
    tq, tk, tv = (torch_tensor(a) for a in (q, k, v))
    call.add("call", "functional.scaled_dot_product_attention", query=tq, key=tk, value=tv, **kw)
    g = randn(rng, q.shape[:3] + v.shape[3:], dt)

    def body(kw):
        for t in (tq, tk, tv):
            t.grad = None
        o = AT.scaled_dot_product_attention(**kw["call"])
        o.backward(torch_tensor(g, False).to(o.dtype))
        return o, tq.grad, tk.grad, tv.grad
    call.body = body
    call.check(checked(["output", "dq", "dk", "dv"], lambda r: [as_numpy(t) for t in r],
                       lambda dtype: attention_reference(q, k, v, ref)(dtype) + attention_reference(
                           q, k, v, ref, g)(dtype)[1:4], dt))
    torch_bad(call, ("query", "key"), (tq, tk))


@kind("torch.linear")
def _torch_linear(rng, call):
    dt = api.dtype_of(rng)
    fin, fout = int(rng.integers(1, 8)), int(rng.integers(1, 8))
    x, w, b = randn(rng, api.api_lead(rng) + (fin,), dt), randn(rng, (fout, fin), dt), randn(rng, (fout,), dt)
    tx, tw, tb = torch_tensor(x), torch_tensor(w), torch_tensor(b) if chance(rng, 0.6) else None
    call.add("call", None, input=tx, weight=tw, bias=tb)
    rx, rw, rb = tensor(x, True), tensor(w, True), None if tb is None else tensor(b, True)
    out = torch.nn.functional.linear(rx, rw, rb)
    g = randn(rng, out.shape, dt)
    (out * tensor(g)).sum().backward()

    def body(kw):
        o = AT.linear(**kw["call"])
        o.backward(torch_tensor(g, False))
        return [as_numpy(t) for t in (o, tx.grad, tw.grad)]
    call.body = body
    call.check(all_close([("output", lambda r: r[0], out.detach().numpy()), ("dx", lambda r: r[1], rx.grad.numpy()),
                          ("dw", lambda r: r[2], rw.grad.numpy())], dt))
    torch_bad(call, ("input",), (tx,))


@kind("torch.linear_cross_entropy", 1.5)
def _torch_fused(rng, call):
    dt = api.dtype_of(rng)
    kw = fused_problem(rng, dt)
    tens = {n: torch_tensor(kw[n]) for n in ("input", "weight", "bias") if n in kw}
    call.add("call", "functional.linear_cross_entropy",
             **dict(kw, **tens, target=torch.tensor(kw["target"].astype(np.int64))))
    g = randn(rng, fused_reference(kw)(torch.float64)[0].shape, dt)

    def body(kw):
        for t in tens.values():
            t.grad = None
        o = AT.linear_cross_entropy(**kw["call"])
        o.backward(torch_tensor(g, False).to(o.dtype))
        return [as_numpy(t) for t in (o, tens["input"].grad, tens["weight"].grad)]
    call.body = body
    call.check(checked(["loss", "dx", "dw"], lambda r: r, lambda d: fused_reference(kw, g)(d)[:3], dt))
    torch_bad(call, ("input",), (tens["input"],))


def torch_module_kind(name, make_ours, make_reference, inputs):
    """A module of attnpp.torch against PyTorch (``make_reference(module, args, dtype, g)``: [output, the inputs'
    gradients, the parameters'] computed in dtype, [output] alone without g): the output and every gradient."""
    @kind(f"torch.{name}")
    def gen(rng, call):
        dt = pick(rng, [F32, F64])
        init, ours_init = make_ours(rng, dt)
        call.add("init", **init)  # (no invalid constructor: Linear and MultiheadAttention take torch.nn's)
        module = ours_init()
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.tensor(randn(rng, tuple(p.shape), dt, 0.5)))
        args = inputs(rng, module, dt)
        call.add("call", None, **{n: torch_tensor(a) for n, a in args.items()})
        g = randn(rng, make_reference(module, args, torch.float64, None)[0].shape, dt)
        params = [n for n, _ in module.named_parameters()]

        def body(kw):
            m = type(module)(**{k: v for k, v in kw["init"].items()})
            m.load_state_dict(module.state_dict())
            ins = kw["call"]
            for t in ins.values():
                if isinstance(t, torch.Tensor):
                    t.grad = None
            o = m(**ins)
            o = o[0] if isinstance(o, tuple) else o
            o.backward(torch.tensor(g))
            grads = dict(m.named_parameters())
            return [as_numpy(t) for t in [o] + [ins[n].grad for n in args] + [grads[n].grad for n in params]]
        names = ["output"] + [f"grad {n}" for n in args] + [f"grad {n}" for n in params]
        call.body = body
        call.check(checked(names, lambda r: r, lambda dtype: make_reference(module, args, dtype, g), dt))
        first = next(iter(args))
        wrong_width(call, "call", first, args[first])
        call.bad[-1] = call.bad[-1][:2] + (torch.from_numpy(call.bad[-1][2]),) + call.bad[-1][3:]


def _module_results(out, inputs, params, g, dtype):
    """[output] alone without g; else also the gradients of (out * g).sum() for the inputs and the parameters."""
    results = [out]
    if g is not None:
        (out * tensor(g, dtype=dtype)).sum().backward()
        results += [t.grad for t in inputs] + [p.grad for p in params]
    return [t.detach().to(torch.float64).numpy() for t in results]


def _linear_module(rng, dt):
    init = dict(in_features=int(rng.integers(1, 8)), out_features=int(rng.integers(1, 8)), bias=chance(rng, 0.7),
                dtype=TORCH_DTYPE[dt])
    return init, lambda: AT.Linear(**init)


def _linear_reference(m, args, dtype, g):
    ref = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=dtype)
    ref.load_state_dict({n: tensor(p, dtype=dtype) for n, p in m.state_dict().items()})
    x = tensor(args["input"], True, dtype)
    return _module_results(ref(x), [x], [p for _, p in ref.named_parameters()], g, dtype)


def _mha_module(rng, dt):
    H = int(rng.integers(1, 3))
    init = dict(embed_dim=H * pick(rng, [1, 2]), num_heads=H, bias=chance(rng, 0.7), add_bias_kv=chance(rng, 0.3),
                batch_first=True, dtype=TORCH_DTYPE[dt])
    return init, lambda: AT.MultiheadAttention(**init)


def _mha_reference(m, args, dtype, g):
    ref = torch.nn.MultiheadAttention(m.embed_dim, m.num_heads, bias=m.in_proj_bias is not None,
                                      add_bias_kv=m.bias_k is not None, batch_first=True, dtype=dtype)
    ref.load_state_dict({n: tensor(p, dtype=dtype) for n, p in m.state_dict().items()})
    ts = {n: tensor(a, True, dtype) for n, a in args.items()}
    return _module_results(ref(**ts)[0], list(ts.values()), [p for _, p in ref.named_parameters()], g, dtype)


def _mha_inputs(rng, m, dt):
    B, L, S = int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    return dict(query=randn(rng, (B, L, m.embed_dim), dt), key=randn(rng, (B, S, m.embed_dim), dt),
                value=randn(rng, (B, S, m.embed_dim), dt))


def _attention_module(rng, dt):
    init = attention_layer(rng, dt)
    init.pop("kv_dim", None)
    init["dtype"] = TORCH_DTYPE[dt]
    return init, lambda: AT.Attention(**init)


def _attention_reference(m, args, dtype, g):
    """attention_layer_reference reads the torch module as it reads attnpp.nn.Attention (the same attributes and
    parameter names)."""
    x = tensor(args["x"], True, dtype)
    out, _, P = attention_layer_reference(m, x, x, None, dtype=dtype)
    return _module_results(out, [x], [P[n] for n, _ in m.named_parameters()], g, dtype)


torch_module_kind("Linear", _linear_module, _linear_reference,
                  lambda rng, m, dt: dict(input=randn(rng, api.api_lead(rng) + (m.in_features,), dt)))
torch_module_kind("MultiheadAttention", _mha_module, _mha_reference, _mha_inputs)
torch_module_kind("Attention", _attention_module, _attention_reference,
                  lambda rng, m, dt: dict(x=randn(rng, (int(rng.integers(1, 3)), int(rng.integers(1, 5)),
                                                       m.embed_dim), dt)))


# ------------------------------------------------------------------------------------------------- transformers
def _transformers():
    import attnpp.transformers as ATR
    from transformers import masking_utils as mu
    return ATR, mu


class _Layer(torch.nn.Module):
    is_causal = True


@kind("transformers.attention_mask", 1.5)
def _hf_mask(rng, call):
    """The mask function's result (a KeyLayout, or a dense mask), run by the attention function, against the
    attention under transformers' own dense mask (sdpa_mask)."""
    ATR, mu = _transformers()
    dt = pick(rng, [F32, F64])
    B, L, Hk = int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 3))
    past = int(rng.integers(0, 4))
    S = past + L + int(rng.integers(0, 2))  # (a static cache's unused end)
    pattern = pick(rng, ["causal", "bidirectional", "window"])
    fn = {"causal": mu.causal_mask_function, "bidirectional": mu.bidirectional_mask_function,
          "window": mu.sliding_window_causal_mask_function(int(rng.integers(1, 4)))}[pattern]
    pad = None
    if chance(rng, 0.4):
        pad = torch.ones(B, S, dtype=torch.long)
        pad[0, :int(rng.integers(0, S))] = 0  # left padding
    kw = dict(batch_size=B, q_length=L, kv_length=S, q_offset=past, kv_offset=0, mask_function=fn,
              attention_mask=pad)
    call.add("call", None, **kw)
    dense = mu.sdpa_mask(B, L, S, past, 0, fn, pad, allow_is_causal_skip=False,
                         allow_is_bidirectional_skip=False).to(torch.bool)
    g = pick(rng, [1, 2])
    q, k, v = randn(rng, (B, Hk * g, L, 4), dt), randn(rng, (B, Hk, S, 4), dt), randn(rng, (B, Hk, S, 4), dt)
    out, _ = reference(tensor(q), tensor(k), tensor(v), attn_mask=torch.where(dense, 0.0, -torch.inf).double())
    expected = out.transpose(1, 2).numpy()

    def body(kw):
        mask = ATR.attention_mask(**kw["call"])
        return ATR.attention_forward(_Layer(), *(torch.from_numpy(a) for a in (q, k, v)), mask)[0]
    call.body = body
    call.check(lambda r: close("output", r.numpy(), expected, dt))
    # (no invalid variant: transformers makes these arguments, a model's user never does)


@kind("transformers.attention_forward", 1.5)
def _hf_forward(rng, call):
    ATR, _ = _transformers()
    dt = api.dtype_of(rng)
    B, Hk, g, L, S, D = (int(rng.integers(1, 3)), int(rng.integers(1, 3)), pick(rng, [1, 2]),
                         int(rng.integers(1, 5)), int(rng.integers(1, 6)), pick(rng, [2, 4]))
    q, k, v = randn(rng, (B, Hk * g, L, D), dt), randn(rng, (B, Hk, S, D), dt), randn(rng, (B, Hk, S, D), dt)
    kw, ref = {}, {}
    mask = None
    if chance(rng, 0.5):
        dense = rng.random((B, 1, L, S)) < 0.8
        mask = torch.tensor(dense)
        ref["attn_mask"] = tensor(np.where(dense, 0.0, -np.inf))
    else:
        ref["is_causal"] = L > 1
        if L > 1 and L != S:
            ref["causal_alignment"] = "top_left"
    if chance(rng, 0.3):
        kw["softcap"] = ref["softcap"] = float(rng.uniform(1.0, 5.0))
    if chance(rng, 0.3):
        kw["scaling"] = ref["scale"] = float(rng.uniform(0.2, 1.0))
    sinks = None
    if chance(rng, 0.3):
        s = randn(rng, (Hk * g,), dt)
        sinks, ref["sinks"] = torch_tensor(s), tensor(s)
        kw["s_aux"] = sinks
    tq, tk, tv = (torch_tensor(a) for a in (q, k, v))
    call.add("call", None, query=tq, key=tk, value=tv, attention_mask=mask, **kw)
    gr = randn(rng, (B, L, Hk * g, D), dt)  # (the output's layout: (B, L, Hq, Dv))
    transposed = lambda a: np.ascontiguousarray(np.swapaxes(a, 1, 2))  # noqa: E731

    def body(kw):
        for t in (tq, tk, tv) + ((sinks,) if sinks is not None else ()):
            t.grad = None
        o = ATR.attention_forward(_Layer(), **kw["call"])[0]
        o.backward(torch_tensor(gr, False).to(o.dtype))
        grads = [t.grad for t in (tq, tk, tv)] + ([sinks.grad] if sinks is not None else [])
        return [as_numpy(t) for t in [o] + grads]
    def reference_in(dtype):  # the output transposed to (B, L, Hq, Dv), and the gradients
        out = attention_reference(q, k, v, ref)(dtype)[0]
        return [transposed(out)] + attention_reference(q, k, v, ref, transposed(gr))(dtype)[1:]
    names = ["output", "dq", "dk", "dv"] + (["d s_aux"] if sinks is not None else [])
    call.body = body
    call.check(checked(names, lambda r: r, reference_in, dt))
    call.bad.append(("call", "query", torch_tensor(q, False).to(torch.int32), TypeError, "query of int32"))
