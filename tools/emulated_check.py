#!/usr/bin/env python3
"""The installed attnpp on an emulated CPU, where it runs its baseline kernels:

    qemu-x86_64 -cpu Nehalem "$(python -c 'import sys; print(sys.executable)')" tools/emulated_check.py
    EMULATOR="qemu-aarch64 -L ROOT" qemu-aarch64 -L ROOT ROOT/usr/bin/python3.11 tools/emulated_check.py

an x86-64 without AVX (tools/cross_check.sh; the real interpreter: pyenv's `python` is a shell script that qemu
cannot run) and aarch64 (tools/wheel_aarch64.sh, the wheel installed for an aarch64 Python in ROOT). Checks that the
baseline level is picked, that the attention functions (in float64, float32, bfloat16 and float16) and
nn.MultiheadAttention (float64, float32) agree with a NumPy float64 reference written here (forward and analytic
backward, small sizes: everything runs emulated; the halves' software conversions included), and that forcing a
level the CPU lacks (ATTNPP_CPU_CAPABILITY=avx2) makes `import attnpp` fail with an ImportError.

Environment: EMULATOR, the emulator command for that child (default "qemu-x86_64 -cpu Nehalem"). It must be given
explicitly: qemu-user passes a guest's execve to the host, so a plain subprocess would run natively.
Exit status 0 when every check passes.
"""
import os
import shlex
import subprocess
import sys

import ml_dtypes
import numpy as np

import attnpp
import attnpp.functional as F

# relative to max(1, |ref|); the halves: two unit roundoffs of the dtype (their results are rounded once)
TOL = {np.float32: 1e-5, np.float64: 1e-12, ml_dtypes.bfloat16: 2 * 2.0 ** -8, np.float16: 2 * 2.0 ** -11}
passed, failures = 0, []


def report(name, ok, detail=""):
    global passed
    print(f"{'PASS' if ok else 'FAIL'} {name}{detail}")
    if ok:
        passed += 1
    else:
        failures.append(name)


def check(name, got, ref, dtype):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    err = np.where(np.isinf(ref) & (got == ref), 0.0, err)  # -inf logsumexp of fully masked rows
    worst = np.inf if got.shape != ref.shape or np.isnan(err).any() else float(err.max(initial=0.0))
    report(f"{name:<58}", worst <= TOL[dtype], f" max rel err {worst:.2e}")


# --------------------------------------------------------------------------------------------- NumPy reference
def ref_forward(q, k, v, add_mask, scale):
    """softmax(scale q k^T + add_mask) v in float64; fully masked rows give 0 and logsumexp -inf."""
    s = scale * q @ k.swapaxes(-1, -2) + add_mask
    m = s.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = m + np.log(np.exp(s - np.where(np.isinf(m), 0, m)).sum(axis=-1, keepdims=True))
        p = np.where(np.isinf(lse), 0.0, np.exp(s - lse))
    return p @ v, lse[..., 0], p


def ref_backward(dout, q, k, v, p, scale):
    """Gradients of ref_forward: out = p v, p = softmax(s), s = scale q k^T + mask."""
    dv = p.swapaxes(-1, -2) @ dout
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, dv


def causal_mask(L, S, alignment):
    offset = S - L if alignment == "bottom_right" else 0
    return np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + offset, 0.0, -np.inf)


# ------------------------------------------------------------------------------------------------------ checks
def check_sdpa(dtype, rng):
    B, H, L, S, D, Dv = 2, 3, 6, 9, 5, 4
    q, k, v = (rng.uniform(-1, 1, shape).astype(dtype) for shape in ((B, H, L, D), (B, H, S, D), (B, H, S, Dv)))
    dout = rng.uniform(-1, 1, (B, H, L, Dv)).astype(dtype)
    keep = rng.uniform(size=(B, 1, L, S)) > 0.3  # boolean attn_mask: True where a key takes part
    keep[0, 0, 2] = False  # a fully masked row: output 0
    cases = [("no mask", {}, 0.0), ("bool attn_mask", {"attn_mask": keep}, np.where(keep, 0.0, -np.inf))]
    for align in ("top_left", "bottom_right"):
        cases.append((f"causal {align}", {"is_causal": True, "causal_alignment": align}, causal_mask(L, S, align)))
    scale = 1 / np.sqrt(D)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for name, kwargs, add in cases:
        tag = f"sdpa {np.dtype(dtype).name} {name}"
        out, lse, _ = F.scaled_dot_product_attention_forward(q, k, v, **kwargs)
        ref_out, ref_lse, p = ref_forward(q64, k64, v64, add, scale)
        check(f"{tag} output", out, ref_out, dtype)
        check(f"{tag} logsumexp", lse, ref_lse, dtype)
        grads = F.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kwargs)
        refs = ref_backward(dout.astype(np.float64), q64, k64, v64, p, scale)
        for g_name, g, r in zip(("dq", "dk", "dv"), grads, refs):
            check(f"{tag} {g_name}", g, r, dtype)


def check_mha(dtype, rng):
    L, S, B, E, H = 5, 7, 2, 8, 2
    D = E // H
    mha = attnpp.nn.MultiheadAttention(E, H, dtype=dtype)  # inputs (L, B, E)
    for p in mha.parameters():  # random biases too (they start at 0)
        p.data[...] = rng.uniform(-0.5, 0.5, p.data.shape)
    xq, xk, xv = (rng.uniform(-1, 1, (T, B, E)).astype(dtype) for T in (L, S, S))
    hidden = rng.uniform(size=(L, S)) < 0.3  # MultiheadAttention's boolean attn_mask: True where NOT allowed
    hidden[1] = True  # a fully masked row
    dy = rng.uniform(-1, 1, (L, B, E)).astype(dtype)
    y, weights = mha(xq, xk, xv, attn_mask=hidden)
    dxq, dxk, dxv = mha.backward(dy)

    f64 = lambda a: np.asarray(a, np.float64)
    W, b = f64(mha.in_proj_weight.data), f64(mha.in_proj_bias.data)
    Wo, bo = f64(mha.out_proj.weight.data), f64(mha.out_proj.bias.data)
    xs = [f64(x) for x in (xq, xk, xv)]
    proj = [x @ W[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E] for i, x in enumerate(xs)]  # (T, B, E)
    heads = lambda t: t.reshape(t.shape[0], B, H, D).transpose(1, 2, 0, 3)  # (B, H, T, D)
    merge = lambda t: t.transpose(2, 0, 1, 3).reshape(t.shape[2], B, E)  # back to (T, B, E)
    scale = 1 / np.sqrt(D)
    o, _, p = ref_forward(*(heads(t) for t in proj), np.where(hidden, -np.inf, 0.0), scale)
    o = merge(o)
    ref_y = o @ Wo.T + bo
    # backward: y = o Wo^T + bo; o = attention(proj); proj_i = x_i W_i^T + b_i
    do = f64(dy) @ Wo
    d_heads = ref_backward(heads(do), *(heads(t) for t in proj), p, scale)
    d_proj = [merge(g) for g in d_heads]
    flat = lambda t: t.reshape(-1, t.shape[-1])
    tag = f"MultiheadAttention {np.dtype(dtype).name}"
    check(f"{tag} output", y, ref_y, dtype)
    check(f"{tag} weights (head mean)", weights, p.mean(axis=1), dtype)
    for name, g, x, i in zip(("grad query", "grad key", "grad value"), (dxq, dxk, dxv), xs, range(3)):
        check(f"{tag} {name}", g, d_proj[i] @ W[i * E:(i + 1) * E], dtype)
    check(f"{tag} in_proj_weight.grad", mha.in_proj_weight.grad,
          np.concatenate([flat(d).T @ flat(x) for d, x in zip(d_proj, xs)]), dtype)
    check(f"{tag} in_proj_bias.grad", mha.in_proj_bias.grad, np.concatenate([flat(d).sum(0) for d in d_proj]), dtype)
    check(f"{tag} out_proj.weight.grad", mha.out_proj.weight.grad, flat(f64(dy)).T @ flat(o), dtype)
    check(f"{tag} out_proj.bias.grad", mha.out_proj.bias.grad, flat(f64(dy)).sum(0), dtype)


def check_forced_level():
    """ATTNPP_CPU_CAPABILITY=avx2 on this CPU: `import attnpp` raises an ImportError that names the setting (an
    x86-64 without AVX2: that the CPU cannot run it; aarch64: that the build has no such level)."""
    qemu = shlex.split(os.environ.get("EMULATOR", "qemu-x86_64 -cpu Nehalem"))
    env = dict(os.environ, ATTNPP_CPU_CAPABILITY="avx2")
    child = subprocess.run(qemu + [sys.executable, "-c", "import attnpp"], env=env, capture_output=True, text=True)
    last = (child.stderr.strip().splitlines() or [""])[-1]
    ok = child.returncode != 0 and last.startswith("ImportError") and "ATTNPP_CPU_CAPABILITY=avx2" in last
    report("ATTNPP_CPU_CAPABILITY=avx2 import fails", ok, f" (exit {child.returncode}): {last}")


def main():
    print(f"attnpp {attnpp.__version__} from {attnpp.__file__}, numpy {np.__version__}")
    level = attnpp.cpu_capability()
    report("attnpp.cpu_capability() == 'default'", level == "default", f" (got {level!r})")
    rng = np.random.default_rng(0)
    for dtype in (np.float64, np.float32):
        check_sdpa(dtype, rng)
        check_mha(dtype, rng)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        check_sdpa(dtype, rng)
    check_forced_level()
    print(f"{passed} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
