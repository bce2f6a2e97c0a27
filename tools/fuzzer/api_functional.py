"""The call kinds of attnpp.functional, each against PyTorch in float64 (attnpp.testing.reference: the attention
from its definitions, every variant of it)."""
import numpy as np
import torch

import attnpp
import attnpp.functional as F
from attnpp.testing import reference, rotary_reference, variant_scores

from . import api
from .api import all_close, checked, close, f64, kind, randn, tensor
from .values import F32, chance, pick

TF = torch.nn.functional


def compute(dt):
    """The dtype of the log-sum-exp, slopes and sinks: float32 for the halves."""
    return F32 if dt in (api.BF16, api.F16) else dt


# ------------------------------------------------------------------------------------------------- attention
def attention_problem(rng, dt, masks=True):
    """Query, key, value (N, H, L, D) and the keyword arguments of one attention call, and those of its
    reference (attnpp.testing.reference), in float64 from the same rounded arrays."""
    N, Hk, g = int(rng.integers(1, 3)), int(rng.integers(1, 3)), pick(rng, [1, 1, 2])
    Hq, L, S, D = Hk * g, int(rng.integers(1, 7)), int(rng.integers(1, 7)), pick(rng, [1, 2, 4, 8])
    Dv = pick(rng, [D, D, 3])
    q, k, v = randn(rng, (N, Hq, L, D), dt), randn(rng, (N, Hk, S, D), dt), randn(rng, (N, Hk, S, Dv), dt)
    kw, ref = {}, {}
    if g > 1:
        kw["enable_gqa"] = True
    if chance(rng, 0.3):
        kw["scale"] = ref["scale"] = float(rng.uniform(0.1, 2.0))
    hidden = np.zeros((N, Hq, L, S), bool)
    extra = np.zeros((N, Hq, L, S))
    if masks and chance(rng, 0.3):
        shape = pick(rng, [(L, S), (N, 1, L, S), (S,), (N, Hq, L, S)])
        if chance(rng, 0.5):
            m = rng.random(shape) < 0.7
            hidden |= ~np.broadcast_to(m, hidden.shape)
        else:
            m = randn(rng, shape, dt)
            extra += f64(np.broadcast_to(m, extra.shape))
        kw["attn_mask"] = m
    elif chance(rng, 0.3):
        kw["is_causal"] = ref["is_causal"] = True
        if chance(rng, 0.4):
            kw["causal_alignment"] = ref["causal_alignment"] = "bottom_right"
    if masks and chance(rng, 0.2):
        if chance(rng, 0.5):
            kpm = rng.random((N, S)) < 0.3
            hidden |= kpm[:, None, None, :]
        else:
            kpm = randn(rng, (N, S), dt)
            extra += f64(kpm)[:, None, None, :]
        kw["key_padding_mask"] = kpm
    if chance(rng, 0.2):
        kw["window"] = ref["window"] = (int(rng.integers(-1, 4)), int(rng.integers(-1, 4)))
    if chance(rng, 0.15):
        kw["alibi_slopes"] = randn(rng, (Hq,), compute(dt)) ** 2
        ref["alibi_slopes"] = tensor(kw["alibi_slopes"])
    if chance(rng, 0.15):
        kw["softcap"] = ref["softcap"] = float(rng.uniform(0.5, 5.0))
    if chance(rng, 0.15):
        kw["sinks"] = randn(rng, (Hq,), dt)
        ref["sinks"] = tensor(kw["sinks"], True)
    if hidden.any() or extra.any():
        ref["attn_mask"] = tensor(np.where(hidden, -np.inf, extra))
    return (q, k, v), kw, ref


def attention_bad(call, q, k, v, group="call"):
    """Shapes that do not agree: a query of another width, keys of another length than the values."""
    N, Hq, L, D = q.shape
    call.bad += [(group, "query", np.zeros((N, Hq, L, D + 1), q.dtype), ValueError, "query of another D"),
                 (group, "value", np.zeros(v.shape[:2] + (v.shape[2] + 1, v.shape[3]), v.dtype), ValueError,
                  "value of another S"),
                 (group, "query", np.zeros((D,), q.dtype), ValueError, "query 1-D")]


def dropout_keep(rng, kw, ref, shape):
    if chance(rng, 0.15):
        kw["dropout_p"] = ref["dropout_p"] = 0.25
        kw["seed"] = int(rng.integers(0, 2 ** 63))
        ref["keep"] = tensor(F.dropout_mask(shape, 0.25, kw["seed"]))


def flash_kernel(q, k, v, ref, g=None):
    """[output] and with ``g`` [the gradients of (output * g).sum() for query, key, value], as float64 arrays, from
    PyTorch's CPU flash kernel in bfloat16 on the call ``ref`` (reference's arguments), the kernel whose numerics
    attnpp's default takes for a bfloat16 call with D = Dv and no dropout (docs/design.md): the variants as the
    float mask they are (attnpp.testing.variant_scores of zero scores), the sinks as one more key of zeros whose
    mask is the sink's logit, the heads repeated for GQA. None where the kernel cannot take the call as it is: a
    soft cap (no mask expresses it), a bias that bfloat16 does not hold exactly (ALiBi's), or a row that sees
    nothing (the kernel's output there is not attnpp's 0)."""
    N, Hq, L, _ = q.shape
    S = k.shape[2]
    if "softcap" in ref or "keep" in ref:
        return None
    kw = {n: ref[n] for n in ("attn_mask", "is_causal", "causal_alignment", "window", "alibi_slopes") if n in ref}
    bias = variant_scores(torch.zeros(N, Hq, L, S, dtype=torch.float64), **kw)
    tq, tk, tv = (tensor(a, g is not None, torch.bfloat16) for a in (q, k, v))
    keys, values = (t.repeat_interleave(Hq // t.shape[1], dim=1) for t in (tk, tv))
    if "sinks" in ref:
        sink = ref["sinks"].detach().to(torch.float64)[None, :, None, None].expand(N, Hq, L, 1)
        bias = torch.cat([bias, sink], dim=-1)
        keys, values = (torch.cat([t, t.new_zeros(N, Hq, 1, t.shape[-1])], dim=2) for t in (keys, values))
    if torch.isinf(bias).all(dim=-1).any() or not torch.equal(bias.to(torch.bfloat16).to(torch.float64), bias):
        return None  # (a bias that bfloat16 does not hold exactly, ALiBi's, would change the problem)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = TF.scaled_dot_product_attention(tq, keys, values, attn_mask=bias.to(torch.bfloat16),
                                              scale=ref.get("scale", 1 / np.sqrt(q.shape[-1])))
    results = [out]
    if g is not None:
        (out * tensor(g, dtype=torch.bfloat16)).sum().backward()
        results += [tq.grad, tk.grad, tv.grad]
    return [r.detach().to(torch.float64).numpy() for r in results]


def attention_reference(q, k, v, ref, g=None, weights=False):
    """reference(torch dtype) -> [output] (the weights instead with ``weights``: the attention of an identity
    value), and with ``g`` the gradients of (output * g).sum() for query, key, value (and sinks): attnpp.testing's
    reference computed in that dtype from the arrays' values, as float64 arrays. In bfloat16, for a call that takes
    the flash numerics (D = Dv, no dropout, under attnpp's default), the results of PyTorch's flash kernel where it
    takes the call (flash_kernel; the sinks' gradient, which it does not give, from the reference)."""
    def compute_in(dtype):
        if (dtype == torch.bfloat16 and not weights and q.shape[-1] == v.shape[-1]
                and attnpp.get_bfloat16_attention() != "float32"):
            flash = flash_kernel(q, k, v, ref, g)
            if flash is not None:
                return flash + (compute_math(dtype)[4:] if g is not None and "sinks" in ref else [])
        return compute_math(dtype)

    def compute_math(dtype):
        kw = {n: t.detach().to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for n, t in ref.items()}
        grad = g is not None
        if "sinks" in kw:
            kw["sinks"].requires_grad_(grad)
        tq, tk, tv = (tensor(a, grad, dtype) for a in (q, k, v))
        if weights:
            S = k.shape[2]
            tv = torch.eye(S, dtype=dtype).expand(k.shape[:2] + (S, S))
        out, _ = reference(tq, tk, tv, **kw)
        results = [out]
        if grad:
            (out * tensor(g, dtype=dtype)).sum().backward()
            results += [tq.grad, tk.grad, tv.grad] + ([kw["sinks"].grad] if "sinks" in kw else [])
        return [r.detach().to(torch.float64).numpy() for r in results]
    return compute_in


@kind("functional.scaled_dot_product_attention", 3)
def _sdpa(rng, call):
    dt = api.dtype_of(rng)
    (q, k, v), kw, ref = attention_problem(rng, dt)
    dropout_keep(rng, kw, ref, q.shape[:3] + (k.shape[2],))
    call.add("call", "functional.scaled_dot_product_attention", ("query", "key", "value"), query=q, key=k, value=v,
             **kw)
    call.body = lambda kw: F.scaled_dot_product_attention(**kw["call"])
    call.check(checked(["output"], lambda r: [r], attention_reference(q, k, v, ref), dt))
    attention_bad(call, q, k, v)


@kind("functional.scaled_dot_product_attention_backward", 3)
def _sdpa_backward(rng, call):
    dt = api.dtype_of(rng)
    (q, k, v), kw, ref = attention_problem(rng, dt)
    dropout_keep(rng, kw, ref, q.shape[:3] + (k.shape[2],))
    fwd = F.scaled_dot_product_attention_forward(q, k, v, **kw)
    g = randn(rng, fwd.output.shape, dt)
    call.add("call", "functional.scaled_dot_product_attention_backward", ("grad_output", "query", "key", "value"),
             grad_output=g, query=q, key=k, value=v, output=fwd.output, logsumexp=fwd.logsumexp, **kw)
    names = ["dq", "dk", "dv"] + (["dsinks"] if "sinks" in ref else [])
    call.body = lambda kw: F.scaled_dot_product_attention_backward(**kw["call"])
    call.check(checked(names, lambda r: list(r), lambda dtype: attention_reference(q, k, v, ref, g)(dtype)[1:], dt))
    attention_bad(call, q, k, v)
    N, Hq, L, _ = q.shape
    call.bad.append(("call", "logsumexp", np.zeros((N, Hq, L + 1), compute(dt)), ValueError, "logsumexp of L + 1"))


@kind("functional.scaled_dot_product_attention_weights")
def _sdpa_weights(rng, call):
    dt = api.dtype_of(rng)
    (q, k, v), kw, ref = attention_problem(rng, dt)
    call.add("call", "functional.scaled_dot_product_attention_weights", ("query", "key"), query=q, key=k, **kw)
    call.body = lambda kw: F.scaled_dot_product_attention_weights(**kw["call"])
    call.check(checked(["weights"], lambda r: [r], attention_reference(q, k, v, ref, weights=True), dt))
    call.bad.append(("call", "key", np.zeros(k.shape[:3] + (k.shape[3] + 1,), dt), ValueError, "key of another D"))


def packed(rng, dt, B):
    """Varlen sequences: lengths, cumulative offsets, and the packed (T, H, D) arrays' makers."""
    Lq = [int(rng.integers(0, 5)) for _ in range(B)]
    Lk = [int(rng.integers(1, 6)) for _ in range(B)]
    cu = lambda ls: np.concatenate([[0], np.cumsum(ls)]).astype(pick(rng, [np.int64, np.int32]))  # noqa: E731
    return Lq, Lk, cu(Lq), cu(Lk)


def varlen_problem(rng, dt):
    B, Hk, g, D = int(rng.integers(1, 4)), int(rng.integers(1, 3)), pick(rng, [1, 2]), pick(rng, [1, 2, 4])
    Hq, Dv = Hk * g, pick(rng, [D, 3])
    Lq, Lk, cuq, cuk = packed(rng, dt, B)
    q, k, v = randn(rng, (cuq[-1], Hq, D), dt), randn(rng, (cuk[-1], Hk, D), dt), randn(rng, (cuk[-1], Hk, Dv), dt)
    kw, ref = {}, {}
    if chance(rng, 0.4):
        kw["is_causal"] = ref["is_causal"] = True
        if chance(rng, 0.5):
            kw["causal_alignment"] = ref["causal_alignment"] = "bottom_right"
    if chance(rng, 0.2):
        kw["window"] = ref["window"] = (int(rng.integers(-1, 3)), int(rng.integers(-1, 3)))
    if chance(rng, 0.2):
        kw["softcap"] = ref["softcap"] = float(rng.uniform(0.5, 4.0))
    if chance(rng, 0.2):
        kw["sinks"] = randn(rng, (Hq,), dt)
    if chance(rng, 0.2):
        kw["alibi_slopes"] = randn(rng, (Hq,), compute(dt)) ** 2
    return (q, k, v, cuq, cuk, Lq, Lk), kw, ref


def varlen_reference(q, k, v, cuq, cuk, Lq, Lk, kw, ref, g=None):
    """reference(torch dtype) -> [packed output] (or, with ``g``, the gradients of (output * g).sum() for query, key,
    value and sinks): each sequence by attnpp.testing's reference on its own, in that dtype, as float64 arrays."""
    def compute_in(dtype):
        grad = g is not None
        tq, tk, tv = (tensor(a, grad, dtype) for a in (q, k, v))
        sinks = tensor(kw["sinks"], grad, dtype) if "sinks" in kw else None
        extra = dict(ref, sinks=sinks)
        if "alibi_slopes" in kw:
            extra["alibi_slopes"] = tensor(kw["alibi_slopes"], dtype=dtype)
        outs = []
        for b in range(len(Lq)):
            qs = tq[cuq[b]:cuq[b + 1]].transpose(0, 1)[None]
            ks, vs = (t[cuk[b]:cuk[b + 1]].transpose(0, 1)[None] for t in (tk, tv))
            outs.append(reference(qs, ks, vs, **extra)[0][0].transpose(0, 1))
        out = torch.cat(outs) if outs else torch.zeros(0, q.shape[1], v.shape[2], dtype=dtype)
        if not grad:
            return [out.detach().to(torch.float64).numpy()]
        (out * tensor(g, dtype=dtype)).sum().backward()
        grads = [tq.grad, tk.grad, tv.grad] + ([sinks.grad] if sinks is not None else [])
        return [t.to(torch.float64).numpy() if t is not None else np.zeros(a.shape)
                for t, a in zip(grads, (q, k, v, kw.get("sinks")))]
    return compute_in


def varlen_bad(call, q, cuq):
    bad_cu = cuq.copy()
    if len(bad_cu) > 2:
        bad_cu[1], bad_cu[2] = bad_cu[2] + 1, bad_cu[1]  # decreasing
    else:
        bad_cu[-1] += 1  # past Tq
    call.bad += [("call", "cu_seqlens_q", bad_cu, ValueError, "cu_seqlens_q not running from 0 to Tq"),
                 ("call", "cu_seqlens_q", cuq.astype(np.float64), TypeError, "cu_seqlens_q of float64"),
                 ("call", "query", np.zeros(q.shape[:2] + (q.shape[2] + 1,), q.dtype), ValueError,
                  "query of another D")]


@kind("functional.scaled_dot_product_attention_varlen", 2)
def _varlen(rng, call):
    dt = api.dtype_of(rng)
    (q, k, v, cuq, cuk, Lq, Lk), kw, ref = varlen_problem(rng, dt)
    call.add("call", "functional.scaled_dot_product_attention_varlen", ("query", "key", "value"), query=q, key=k,
             value=v, cu_seqlens_q=cuq, cu_seqlens_k=cuk, **kw)
    call.body = lambda kw: F.scaled_dot_product_attention_varlen(**kw["call"])
    call.check(checked(["output"], lambda r: [r], varlen_reference(q, k, v, cuq, cuk, Lq, Lk, kw, ref), dt))
    varlen_bad(call, q, cuq)


@kind("functional.scaled_dot_product_attention_varlen_backward", 2)
def _varlen_backward(rng, call):
    dt = api.dtype_of(rng)
    (q, k, v, cuq, cuk, Lq, Lk), kw, ref = varlen_problem(rng, dt)
    fwd = F.scaled_dot_product_attention_varlen_forward(q, k, v, cuq, cuk, **kw)
    g = randn(rng, fwd.output.shape, dt)
    call.add("call", "functional.scaled_dot_product_attention_varlen_backward", ("grad_output", "query", "key"),
             grad_output=g, query=q, key=k, value=v, output=fwd.output, logsumexp=fwd.logsumexp, cu_seqlens_q=cuq,
             cu_seqlens_k=cuk, **kw)
    names = ["dq", "dk", "dv"] + (["dsinks"] if "sinks" in kw else [])
    call.body = lambda kw: F.scaled_dot_product_attention_varlen_backward(**kw["call"])
    call.check(checked(names, lambda r: list(r), varlen_reference(q, k, v, cuq, cuk, Lq, Lk, kw, ref, g), dt))
    varlen_bad(call, q, cuq)


@kind("functional.scaled_dot_product_attention_with_kvcache", 2)
def _kvcache(rng, call):
    dt = api.dtype_of(rng)
    B, Hk, g, D, Smax = int(rng.integers(1, 3)), int(rng.integers(1, 3)), pick(rng, [1, 2]), pick(rng, [2, 4]), 8
    Hq, L = Hk * g, int(rng.integers(1, 4))
    new = chance(rng, 0.6)
    lens = rng.integers(0 if new else 1, Smax - L + 1, B)
    q = randn(rng, (B, Hq, L, D), dt)
    kc, vc = randn(rng, (B, Hk, Smax, D), dt), randn(rng, (B, Hk, Smax, D), dt)
    kw = dict(query=q, key_cache=kc.copy(), value_cache=vc.copy(), cache_seqlens=lens.astype(np.int64))
    if new:
        kw["key"], kw["value"] = randn(rng, (B, Hk, L, D), dt), randn(rng, (B, Hk, L, D), dt)
    ref = {}
    if chance(rng, 0.3):
        kw["is_causal"] = False
    ref["is_causal"], ref["causal_alignment"] = kw.get("is_causal", True), "bottom_right"
    if chance(rng, 0.2):
        kw["softcap"] = ref["softcap"] = float(rng.uniform(0.5, 4.0))
    if chance(rng, 0.2):
        kw["window"] = ref["window"] = (int(rng.integers(-1, 3)), int(rng.integers(-1, 3)))
    call.add("call", "functional.scaled_dot_product_attention_with_kvcache", ("query",),
             written=("key_cache", "value_cache"), **kw)
    def kv_reference(dtype):  # each sequence over its cached keys and the new ones
        outs = []
        for b in range(B):
            keys, values = kc[b, :, :lens[b]], vc[b, :, :lens[b]]
            if new:
                keys = np.concatenate([keys, kw["key"][b]], axis=1)
                values = np.concatenate([values, kw["value"][b]], axis=1)
            outs += attention_reference(q[b:b + 1], keys[None], values[None], ref)(dtype)
        return [np.concatenate(outs)]
    output = checked(["output"], lambda r: [r], kv_reference, dt)

    def check(r):
        msg = output(r)
        if msg or not new:
            return msg
        for b in range(B):  # the new keys appended at cache_seqlens[b]
            got = call.kw["call"]["key_cache"][b, :, lens[b]:lens[b] + L]
            if not np.array_equal(f64(got), f64(kw["key"][b])):
                return f"key_cache[{b}]: the new keys were not written at cache_seqlens"
        return None
    call.body = lambda kw: F.scaled_dot_product_attention_with_kvcache(**kw["call"])
    call.check(check)
    bad_lens = lens.copy()
    bad_lens[0] = Smax + 1
    call.bad += [("call", "cache_seqlens", bad_lens, ValueError, "cache_seqlens beyond the cache"),
                 ("call", "query", np.zeros((B, Hq, L, D + 1), dt), ValueError, "query of another D")]


# ------------------------------------------------------------------------------------- linear, dropout, embedding
@kind("functional.linear", 1.5)
def _linear(rng, call):
    dt = api.dtype_of(rng)
    fin, fout = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    x, w = randn(rng, api.api_lead(rng) + (fin,), dt), randn(rng, (fout, fin), dt)
    b = randn(rng, (fout,), dt) if chance(rng, 0.6) else None
    call.add("call", None, ("input", "weight"), input=x, weight=w, bias=b)
    ref = TF.linear(tensor(x), tensor(w), None if b is None else tensor(b)).numpy()
    call.body = lambda kw: F.linear(**kw["call"])
    call.check(lambda r: close("output", r, ref, dt))
    call.bad.append(("call", "weight", np.zeros((fout, fin + 1), dt), ValueError, "weight of another Fin"))


@kind("functional.linear_backward", 1.5)
def _linear_backward(rng, call):
    dt = api.dtype_of(rng)
    fin, fout = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    x, w = randn(rng, api.api_lead(rng) + (fin,), dt), randn(rng, (fout, fin), dt)
    g = randn(rng, x.shape[:-1] + (fout,), dt)
    gw, gb = randn(rng, (fout, fin), dt), randn(rng, (fout,), dt) if chance(rng, 0.6) else None
    kw = call.add("call", "functional.linear_backward", ("grad_output", "input", "weight"),
                  written=("grad_weight", "grad_bias"), grad_output=g, input=x, weight=w, grad_weight=gw.copy(), grad_bias=None if gb is None else gb.copy())
    tx, tw = tensor(x, True), tensor(w, True)
    tb = tensor(np.zeros(fout), True)
    (TF.linear(tx, tw, tb) * tensor(g)).sum().backward()
    dw, db = f64(gw) + tw.grad.numpy(), None if gb is None else f64(gb) + tb.grad.numpy()

    def check(r):
        return (close("grad_input", r, tx.grad.numpy(), dt) or close("grad_weight", kw["grad_weight"], dw, dt)
                or (gb is not None and close("grad_bias", kw["grad_bias"], db, dt)) or None)
    call.body = lambda kw: F.linear_backward(**kw["call"])
    call.check(check)
    call.bad.append(("call", "grad_output", np.zeros(x.shape[:-1] + (fout + 1,), dt), ValueError,
                     "grad_output of another Fout"))


@kind("functional.dropout")
def _dropout(rng, call):
    dt = api.dtype_of(rng)
    x, p, seed = randn(rng, api.api_lead(rng) + (int(rng.integers(1, 40)),), dt), pick(rng, [0.0, 0.1, 0.5, 0.9]), \
        int(rng.integers(0, 2 ** 63))
    call.add("call", "functional.dropout", ("input",), input=x, p=p, seed=seed)
    # the reference: the mask that dropout_mask gives for the seed (itself checked by functional.dropout_mask)
    keep = F.dropout_mask(x.shape, p, seed)
    ref = np.where(keep, f64(x) / (1 - p), 0.0)
    call.body = lambda kw: F.dropout(**kw["call"])
    call.check(lambda r: close("output", r, ref, dt))


@kind("functional.dropout_backward")
def _dropout_backward(rng, call):
    dt = api.dtype_of(rng)
    g, p, seed = randn(rng, api.api_lead(rng) + (int(rng.integers(1, 40)),), dt), pick(rng, [0.1, 0.5]), \
        int(rng.integers(0, 2 ** 63))
    call.add("call", "functional.dropout_backward", ("grad_output",), grad_output=g, p=p, seed=seed)
    ref = np.where(F.dropout_mask(g.shape, p, seed), f64(g) / (1 - p), 0.0)
    call.body = lambda kw: F.dropout_backward(**kw["call"])
    call.check(lambda r: close("grad_input", r, ref, dt))


@kind("functional.dropout_mask")
def _dropout_mask(rng, call):
    from .calls import keep_ref
    shape, p, seed = api.api_lead(rng) + (int(rng.integers(1, 50)),), pick(rng, [0.0, 0.2, 0.5, 0.99]), \
        int(rng.integers(0, 2 ** 63)) * 2 + int(rng.integers(0, 2))
    call.add("call", "functional.dropout_mask", shape=shape, p=p, seed=seed)
    ref = keep_ref(seed, int(np.prod(shape)), p).reshape(shape)  # the hash from its definition (tools/fuzzer/calls.py)
    call.body = lambda kw: F.dropout_mask(**kw["call"])
    call.check(lambda r: None if np.array_equal(r, ref) else "the mask differs from the hash's definition")


@kind("functional.embedding")
def _embedding(rng, call):
    dt = api.dtype_of(rng)
    V, E = int(rng.integers(1, 10)), int(rng.integers(1, 6))
    idx = rng.integers(0, V, api.api_lead(rng) + (int(rng.integers(1, 5)),)).astype(pick(rng, [np.int64, np.int32]))
    w = randn(rng, (V, E), dt)
    call.add("call", None, ("weight",), input=idx, weight=w)
    ref = TF.embedding(torch.tensor(idx.astype(np.int64)), tensor(w)).numpy()
    call.body = lambda kw: F.embedding(**kw["call"])
    call.check(lambda r: close("output", r, ref, dt, 0.0))
    call.bad.append(("call", "input", idx.astype(np.float32), TypeError, "input of float32"))
    if idx.size:
        bad = idx.copy()
        bad.reshape(-1)[0] = pick(rng, [V, -1])
        call.bad.append(("call", "input", bad, IndexError, "an index out of [0, V)"))


@kind("functional.embedding_backward")
def _embedding_backward(rng, call):
    dt = api.dtype_of(rng)
    V, E = int(rng.integers(1, 10)), int(rng.integers(1, 6))
    idx = rng.integers(0, V, api.api_lead(rng) + (int(rng.integers(1, 5)),))
    g, gw = randn(rng, idx.shape + (E,), dt), randn(rng, (V, E), dt)
    kw = call.add("call", None, ("grad_output",), written=("grad_weight",), grad_output=g, input=idx,
                  grad_weight=gw.copy())
    tw = tensor(np.zeros((V, E)), True)
    (TF.embedding(torch.tensor(idx), tw) * tensor(g)).sum().backward()
    ref = f64(gw) + tw.grad.numpy()
    call.body = lambda kw: F.embedding_backward(**kw["call"])
    call.check(lambda r: close("grad_weight", kw["grad_weight"], ref, dt))
    if idx.size:
        bad = idx.copy()
        bad.reshape(-1)[0] = V
        call.bad.append(("call", "input", bad, IndexError, "an index out of [0, V)"))


# ------------------------------------------------------------------------------------------- losses
def targets(rng, N, C, ignore):
    t = rng.integers(0, C, N)
    if chance(rng, 0.3):
        t[rng.random(N) < 0.3] = ignore
    return t.astype(pick(rng, [np.int64, np.int32]))


def loss_problem(rng, dt):
    N, C = int(rng.integers(1, 7)), int(rng.integers(1, 9))
    ignore = pick(rng, [-100, 0, 1])
    kw = dict(input=randn(rng, (N, C), dt, 2.0), target=targets(rng, N, C, ignore),
              reduction=pick(rng, ["mean", "sum", "none"]))
    if ignore != -100 or chance(rng, 0.3):
        kw["ignore_index"] = ignore
    return kw


def loss_reference(kw, g=None):
    """reference(torch dtype) -> [loss] (and with ``g`` the input's gradient of (loss * g).sum()): PyTorch's
    cross_entropy in that dtype."""
    def compute_in(dtype):
        x = tensor(kw["input"], True, dtype)
        loss = TF.cross_entropy(x, torch.tensor(kw["target"].astype(np.int64)),
                                ignore_index=kw.get("ignore_index", -100), reduction=kw["reduction"])
        results = [loss]
        if g is not None:
            (loss * tensor(g, dtype=dtype)).sum().backward()
            results.append(x.grad)
        return [t.detach().to(torch.float64).numpy() for t in results]
    return compute_in


def loss_bad(call, kw, C):
    bad = kw["target"].copy()
    bad[0] = C if kw.get("ignore_index", -100) != C else C + 1
    call.bad += [("call", "target", bad, IndexError, "a target out of [0, C)"),
                 ("call", "target", kw["target"].astype(np.float32), TypeError, "target of float32")]


@kind("functional.cross_entropy")
def _cross_entropy(rng, call):
    dt = api.dtype_of(rng)
    kw = call.add("call", "functional.cross_entropy", ("input",), **loss_problem(rng, dt))
    call.body = lambda kw: F.cross_entropy(**kw["call"])
    call.check(checked(["loss"], lambda r: [r], loss_reference(kw), dt))
    loss_bad(call, kw, kw["input"].shape[1])


@kind("functional.cross_entropy_backward")
def _cross_entropy_backward(rng, call):
    dt = api.dtype_of(rng)
    kw = loss_problem(rng, dt)
    loss, stats = F.cross_entropy_forward(**kw)
    g = randn(rng, loss.shape, dt)
    reference_in = loss_reference(dict(kw), g)
    kw = call.add("call", "functional.cross_entropy_backward", ("grad_output", "input"), grad_output=g, stats=stats,
                  **kw)
    call.body = lambda kw: F.cross_entropy_backward(**kw["call"])
    call.check(checked(["grad_input"], lambda r: [r], lambda dtype: reference_in(dtype)[1:], dt))
    loss_bad(call, kw, kw["input"].shape[1])


def fused_problem(rng, dt):
    N, E, V = int(rng.integers(1, 7)), int(rng.integers(1, 6)), int(rng.integers(1, 12))
    ignore = pick(rng, [-100, 0])
    kw = dict(input=randn(rng, (N, E), dt), weight=randn(rng, (V, E), dt), target=targets(rng, N, V, ignore),
              reduction=pick(rng, ["mean", "sum", "none"]))
    if chance(rng, 0.5):
        kw["bias"] = randn(rng, (V,), dt)
    if ignore != -100:
        kw["ignore_index"] = ignore
    if chance(rng, 0.3):
        kw["label_smoothing"] = pick(rng, [0.1, 0.5, 1.0])
    return kw


def fused_reference(kw, g=None):
    """reference(torch dtype) -> [loss] (and with ``g`` the gradients of (loss * g).sum() for input, weight and
    bias): PyTorch's linear then cross_entropy, in that dtype."""
    def compute_in(dtype):
        tx, tw = tensor(kw["input"], True, dtype), tensor(kw["weight"], True, dtype)
        tb = tensor(kw["bias"], True, dtype) if kw.get("bias") is not None else None
        loss = TF.cross_entropy(TF.linear(tx, tw, tb), torch.tensor(kw["target"].astype(np.int64)),
                                ignore_index=kw.get("ignore_index", -100), reduction=kw["reduction"],
                                label_smoothing=kw.get("label_smoothing", 0.0))
        results = [loss]
        if g is not None:
            (loss * tensor(g, dtype=dtype)).sum().backward()
            results += [tx.grad, tw.grad] + ([tb.grad] if tb is not None else [])
        return [t.detach().to(torch.float64).numpy() for t in results]
    return compute_in


def fused_bad(call, kw):
    V, E = kw["weight"].shape
    bad = kw["target"].copy()
    bad[0] = V
    call.bad += [("call", "target", bad, IndexError, "a target out of [0, V)"),
                 ("call", "weight", np.zeros((V, E + 1), kw["input"].dtype), ValueError, "weight of another E")]


@kind("functional.linear_cross_entropy", 1.5)
def _fused(rng, call):
    dt = api.dtype_of(rng)
    kw = call.add("call", "functional.linear_cross_entropy", ("input", "weight"), **fused_problem(rng, dt))
    call.body = lambda kw: F.linear_cross_entropy(**kw["call"])
    call.check(checked(["loss"], lambda r: [r], fused_reference(dict(kw)), dt))
    fused_bad(call, kw)


@kind("functional.linear_cross_entropy_backward", 1.5)
def _fused_backward(rng, call):
    dt = api.dtype_of(rng)
    kw = fused_problem(rng, dt)
    fwd = F.linear_cross_entropy_forward(**kw, compute_grads=False)
    g = randn(rng, fwd.loss.shape, dt)
    reference_in = fused_reference(dict(kw), g)
    names = ["grad_input", "grad_weight"] + (["grad_bias"] if kw.get("bias") is not None else [])
    kw = call.add("call", "functional.linear_cross_entropy_backward", ("grad_output", "input", "weight"),
                  grad_output=g, logsumexp=fwd.logsumexp, **kw)
    call.body = lambda kw: F.linear_cross_entropy_backward(**kw["call"])
    call.check(checked(names, lambda r: [a for a in r if a is not None], lambda d: reference_in(d)[1:], dt))
    fused_bad(call, kw)


# ------------------------------------------------------------------------------------------------- rotary
def rotary_problem(rng, dt):
    N, H, L, D = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 6)), pick(rng, [2, 4, 6, 8])
    R = pick(rng, [r for r in range(2, D + 1, 2)])
    offsets = int(rng.integers(0, 4)) if chance(rng, 0.6) else rng.integers(0, 4, N)
    P = L + int(np.max(offsets)) + int(rng.integers(0, 3))
    cos, sin = F.rotary_tables(P, R, base=float(pick(rng, [10000.0, 100.0])), dtype=dt)
    kw = dict(cos=cos, sin=sin, position_offset=offsets)
    if chance(rng, 0.4):
        kw["interleaved"] = True
    return (N, H, L, D, R, P), kw


def rotary_ref(x, kw, R):
    """rotary_reference per sequence at its positions, from the tables' angles (their rounded cos and sin)."""
    cos, sin = f64(kw["cos"]), f64(kw["sin"])
    out = np.empty_like(f64(x))
    offsets = np.broadcast_to(kw["position_offset"], x.shape[:1])
    for n in range(x.shape[0]):
        pos = offsets[n] + np.arange(x.shape[2])
        c, s = cos[pos], sin[pos]
        out[n] = rotate(f64(x[n]), c, s, R, kw.get("interleaved", False))
    return out


def rotate(x, c, s, R, interleaved):
    rot, rest = x[..., :R], x[..., R:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = np.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :R // 2], rot[..., R // 2:]
        rot = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    return np.concatenate([rot, rest], axis=-1)


@kind("functional.rotary_embedding")
def _rotary(rng, call):
    dt = api.dtype_of(rng)
    (N, H, L, D, R, P), kw = rotary_problem(rng, dt)
    x = randn(rng, (N, H, L, D), dt)
    call.add("call", "functional.rotary_embedding", ("input", "cos"), input=x, **kw)
    ref = rotary_ref(x, kw, R)
    call.body = lambda kw: F.rotary_embedding(**kw["call"])
    call.check(lambda r: close("output", r, ref, dt))
    call.bad += [("call", "position_offset", P, ValueError, "position_offset past the tables"),
                 ("call", "sin", kw["sin"][:, :-1] if R > 2 else kw["sin"][:0], ValueError, "sin of another shape")]


@kind("functional.rotary_embedding_backward")
def _rotary_backward(rng, call):
    dt = api.dtype_of(rng)
    (N, H, L, D, R, P), kw = rotary_problem(rng, dt)
    g = randn(rng, (N, H, L, D), dt)
    call.add("call", "functional.rotary_embedding_backward", ("grad_output", "cos"), grad_output=g, **kw)
    # the rotation's transpose: by the opposite angles
    ref = rotary_ref(g, dict(kw, sin=-f64(kw["sin"])), R)
    call.body = lambda kw: F.rotary_embedding_backward(**kw["call"])
    call.check(lambda r: close("grad_input", r, ref, dt))
    call.bad.append(("call", "position_offset", -1, ValueError, "position_offset=-1"))


@kind("functional.rotary_tables", 0.5)
def _rotary_tables(rng, call):
    dt = api.dtype_of(rng)
    P, R, base = int(rng.integers(0, 20)), pick(rng, [2, 4, 8]), pick(rng, [10000.0, 500.0, 2.5])
    call.add("call", "functional.rotary_tables", max_positions=P, rotary_dim=R, base=base, dtype=dt)
    # the tables from rotary_reference: (cos, sin) are what rotating (1, 0) pairs gives
    rot = rotary_reference(torch.cat([torch.ones(P, R // 2), torch.zeros(P, R // 2)], -1).double(), np.arange(P),
                           R, base).numpy() if P else np.zeros((0, R))
    call.body = lambda kw: F.rotary_tables(**kw["call"])
    call.check(all_close([("cos", lambda r: r[0], rot[:, :R // 2]), ("sin", lambda r: r[1], rot[:, R // 2:])], dt))
    call.bad += [("call", "rotary_dim", 3, ValueError, "rotary_dim odd"), ("call", "base", 0.0, ValueError, "base=0")]


@kind("functional.get_alibi_slopes", 0.3)
def _alibi(rng, call):
    dt = pick(rng, [F32, np.dtype(np.float64)])
    H = int(rng.integers(1, 40))
    call.add("call", "functional.get_alibi_slopes", num_heads=H, dtype=dt)

    def slopes(n):  # the paper's: 2^(-8/n * i) for a power of two n; else interleaved from the next power
        p = 2 ** int(np.floor(np.log2(n)))
        s = [2 ** (-8 / p * (i + 1)) for i in range(p)]
        if p < n:
            s += [2 ** (-8 / (2 * p) * (i + 1)) for i in range(2 * p)][0::2][:n - p]
        return np.array(s)
    call.body = lambda kw: F.get_alibi_slopes(**kw["call"])
    call.check(lambda r: close("slopes", r, slopes(H), dt))
