"""Making a call in the child process and classifying its outcome."""
import json
import os
import re
import resource
import sys
import traceback
import warnings

import numpy as np

from .values import ALLOWED, Arr, ROOT, materialize, walk_arrs
from .api import ApiCall, execute_api
from .mutations import generate


# ------------------------------------------------------------------------------------------ execution
class Observed(Exception):
    """A finding made inside an invoker (not an exception of the call)."""


PARAM_SLOTS = ("masks", "scale", "causal", "dropout_p", "seed")  # an sdpa call's fields of _core.AttentionParams


def sdpa_params(core, names, values):
    """The _core.AttentionParams of an sdpa call's parameter slots (masks as AttentionMasks, an int causal as
    Causal(int)); a mutated value raises here, where the binding's conversion of the arguments would."""
    fields = dict(zip(names, values))
    masks = fields.pop("masks", [])
    if type(masks) is list:
        masks = [core.AttentionMask(*m) if type(m) in (tuple, list) else m for m in masks]
    if type(fields.get("causal")) is int:
        fields["causal"] = core.Causal(fields["causal"])
    params = core.AttentionParams()
    params.masks = masks
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def invoke(core, call, args):
    fn = call.fn
    if fn.startswith("sdpa_"):  # the parameter slots, wherever mutations left them, as one AttentionParams
        names = [s.name for s in call.slots if not s.omit]
        i = names.index("masks") if "masks" in names else len(args)
        k = i + sum(1 for n in names[i:i + len(PARAM_SLOTS)] if n in PARAM_SLOTS)
        args = args[:i] + [sdpa_params(core, names[i:k], args[i:k])] + args[k:]
    if fn == "set_num_threads":
        old = core.get_num_threads()
        try:
            core.set_num_threads(*args)
            n = core.get_num_threads()
            if args and isinstance(args[0], int) and n != args[0]:
                call.observed.append(("wrong_result", f"get_num_threads() = {n} after set_num_threads({args[0]})"))
            x = np.ones((1 << 17) + 3, np.float32)  # a kernel large enough to run on the threads
            o = np.empty_like(x)
            core.dropout_forward(o, x, 0.25, 7)
            if not np.isfinite(o).all():
                call.observed.append(("nonfinite", "dropout_forward after set_num_threads"))
        finally:
            core.set_num_threads(old)
        return None
    if fn == "get_num_threads":
        n = core.get_num_threads(*args)
        if not (isinstance(n, int) and n >= 1):
            call.observed.append(("wrong_result", f"get_num_threads() = {n!r}"))
        return n
    if fn == "empty":
        res = core.empty(*args)
        if isinstance(res, np.ndarray) and res.size:
            if res.dtype.hasobject:
                _ = res.copy()  # what any use of the array does: reference its elements
            else:
                res.reshape(-1).view(np.uint8).fill(7) if res.dtype.itemsize and res.flags.c_contiguous else None
        if call.valid and (tuple(res.shape) != tuple(args[0]) or res.dtype != args[1]):
            call.observed.append(("wrong_result", f"empty: got {res.shape} {res.dtype}"))
        del res
        return None
    return getattr(core, fn)(*args)


def classify(exc):
    if exc is None:
        return "ok"
    for t in ALLOWED:
        if isinstance(exc, t):
            return t.__name__
    return "UNEXPECTED:" + type(exc).__name__


def execute(core, call):
    """Make the call; returns (outcome, findings, notes), each finding (kind, detail)."""
    if isinstance(call, ApiCall):
        return execute_api(call)
    call.observed = []
    arrs, seen = [], set()
    for s in call.slots:
        for a in walk_arrs(s.value):
            if id(a) not in seen:
                seen.add(id(a))
                arrs.append(a)
    snaps = [(a, a.base.copy()) for a in arrs if a.base is not None]
    # (a "listed" slot is one entry of a list argument: the optimizers take a list of parameters)
    args = [[materialize(s.value)] if s.spec.get("listed") else materialize(s.value) for s in call.slots
            if not s.omit]
    exc = result = None
    try:
        result = invoke(core, call, args)
    except Exception as e:
        exc = e
    outcome = classify(exc)
    call.message = "" if exc is None else f"{type(exc).__name__}: {exc}"
    findings, notes = [], []
    if outcome.startswith("UNEXPECTED"):
        findings.append(("unexpected_exception", f"{type(exc).__name__}: {str(exc)[:300]}"))
    for a, snap in snaps:
        changed = a.base != snap
        if not changed.any():
            continue
        if a.role == "in" and not call.aliased:
            findings.append(("input_modified", f"{a.describe()[:200]}: {int(changed.sum())} byte(s) changed"))
        elif a.role == "out":
            outside = changed & ~a.covered()
            if outside.any():
                findings.append(("write_outside_output", f"{a.describe()[:200]}: {int(outside.sum())} byte(s)"))
            if exc is not None and not isinstance(exc, MemoryError) and not call.aliased:
                findings.append(("output_modified_on_error", f"{type(exc).__name__}: {a.describe()[:200]}"))
    findings += call.observed
    if call.valid:
        if exc is not None:
            findings.append(("valid_call_raised", f"{type(exc).__name__}: {str(exc)[:300]}"))
        else:
            for kind, check in call.checks:
                try:
                    msg = check(result)
                except Exception as e:  # a bug of the fuzzer's own reference code
                    msg, kind = f"{type(e).__name__}: {e}", "fuzzer_error"
                if msg:
                    findings.append((kind, msg))
    if exc is None:
        unaligned = [a for a in arrs if a.base is not None and a.unaligned and a.view.size and a.view.ndim]
        if unaligned:
            notes.append(("accepted_unaligned", f"{call.fn}: an unaligned array was accepted"))
        for s in call.slots:  # an optional array given as a list etc. is converted by the binding to a temporary
            if s.kind == "optarr" and s.value is not None and not isinstance(s.value, (Arr, np.ndarray)):
                findings.append(("non_array_accepted",
                                 f"{s.name} = {type(s.value).__name__} accepted: the binding converts it to a "
                                 f"temporary array (freed before the kernel {'writes' if s.spec.get('role') == 'out' else 'reads'} it?)"))
    return outcome, findings, notes


# -------------------------------------------------------------------------------------------- child
def import_core():
    try:
        from attnpp import _core
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        from attnpp import _core
    return _core


def child_main(a):
    if a.mem_limit_gb > 0:
        lim = int(a.mem_limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    core = import_core()
    functions = a.functions.split(",")
    fd = os.open(a.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    warnings.simplefilter("ignore")
    np.seterr(all="ignore")

    def out(line):
        os.write(fd, (line + "\n").encode())

    for i in range(a.start, a.stop):
        try:
            call = generate(a.seed, i, functions, a.no_huge)
        except Exception as e:
            out(f"S {i} ?")
            out("F " + json.dumps([i, "?", "fuzzer_error", f"generate: {type(e).__name__}: {e}"]))
            out(f"R {i} ? fuzzer_error 0")
            continue
        out(f"S {i} {call.fn}")
        try:
            outcome, findings, notes = execute(core, call)
        except Exception as e:
            outcome, findings, notes = "fuzzer_error", [("fuzzer_error", traceback.format_exc()[-600:])], []
        for kind, detail in findings:
            out("F " + json.dumps([i, call.fn, kind, detail]))
        for kind, detail in notes:
            out("N " + json.dumps([i, call.fn, kind, detail]))
        msg = re.sub(r"\s+", " ", re.sub(r"-?\d+", "#", getattr(call, "message", "")))[:100]
        out(f"R {i} {call.fn} {outcome} {int(call.valid)} {msg}")
    os.close(fd)
