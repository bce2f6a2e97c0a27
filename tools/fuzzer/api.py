"""The public API's calls: attnpp.functional, attnpp.nn, attnpp.optim, attnpp.torch (with autograd) and
attnpp.transformers, each a call kind of its own ("functional.linear", "nn.Attention", "torch.Linear", ...).

A call is generated from (seed, index) as the binding's are: a valid call in a dtype drawn from float32, float64,
bfloat16 and float16, its PyTorch reference (float64, from the same rounded inputs), then, for about 40% of the
calls, one argument made invalid: a refused value of the argument's kind (``attnpp._checks.ARGUMENTS``, which
also drives tests/test_bad_input.py), an array of an integer or another float dtype, a string in place of an
array, or a kind's own bad shapes and indices. Findings: a valid call that raises, or whose result differs from the
reference beyond the tolerance (docs/design.md's 1e-10 in float64 and 1e-5 in float32; 8 units of roundoff in
the halves, 2^-8 bfloat16 and 2^-11 float16, relative to max(1, |reference|)); an invalid call that returns, raises
another exception than the kind's (ValueError, TypeError or IndexError), or whose message does not name the
argument; an input array modified by a call.
"""
import numpy as np

from .values import F32, F64, chance, pick

BF16 = F16 = None  # set by _setup() (ml_dtypes, torch and attnpp are imported in the child only)
KINDS = {}  # name: (generator, weight)
ALLOWED_INVALID = (ValueError, TypeError, IndexError)


def kind(name, weight=1.0):
    def register(gen):
        KINDS[name] = (gen, weight)
        return gen
    return register


def _setup():
    """The imports the kinds need (in the process that makes or describes the calls)."""
    global BF16, F16
    if BF16 is None:
        import ml_dtypes
        import torch
        BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
        # the references' tensors are tiny: torch's threads would only wait at barriers for one another (on a busy
        # machine tens of milliseconds per call, most of the run)
        torch.set_num_threads(1)
        from . import api_functional, api_layers  # noqa: F401 (they register their kinds)


class ApiCall:
    """One call of a public function or layer: its argument groups (``"call"``, and ``"init"`` for a layer's
    constructor or an optimizer's), the body that makes the call from them, the checks of a valid call's result."""

    def __init__(self, index, fn):
        self.index, self.fn = index, fn
        self.kw = {}        # group -> {argument: value}
        self.kinds = {}     # group -> the key of ARGUMENTS that describes the group's scalars
        self.arrays = {}    # group -> the float arrays that dtype and non-array mutations may replace
        self.written = set()  # arguments the call writes into (gradients accumulated, parameters updated)
        self.bad = []       # (group, argument, value, exception, what): the kind's own invalid arguments
        self.body = None    # body(kw) -> result
        self.checks = []    # check(result) -> None, or a message
        self.mutations = []
        self.expected, self.argument = None, ()  # an invalid call: the exception it must raise, the names it may name
        self.message = ""

    @property
    def valid(self):
        return not self.mutations

    def add(self, group, kinds=None, arrays=(), written=(), **kw):
        self.kw[group] = kw
        if kinds:
            self.kinds[group] = kinds
        self.arrays[group] = list(arrays)
        self.written.update(written)
        return kw

    def check(self, fn):
        self.checks.append(fn)

    def describe(self):
        state = "valid" if self.valid else "invalid: " + "; ".join(self.mutations)
        lines = [f"call {self.index}: {self.fn}  ({state})"]
        for group, kw in self.kw.items():
            for name, value in kw.items():
                lines.append(f"  {group}.{name} = {_describe(value)}")
        return "\n".join(lines)


def _describe(v):
    if isinstance(v, np.ndarray):
        s = f"ndarray(shape={v.shape}, dtype={v.dtype}"
        if v.size <= 8 and v.dtype.kind in "biuf":
            s += f", {v.astype(np.float64).ravel().tolist() if v.dtype.kind == 'f' else v.ravel().tolist()}"
        return s + ")"
    if type(v).__module__.startswith("torch"):
        return f"tensor(shape={tuple(getattr(v, 'shape', ()))}, dtype={getattr(v, 'dtype', '?')})"
    r = repr(v)
    return r if len(r) <= 160 else r[:160] + "..."


# ------------------------------------------------------------------------------------------ values and checks
def dtype_of(rng, halves=True):
    r = rng.random()
    return F64 if r < 0.35 else F32 if r < 0.7 or not halves else BF16 if r < 0.85 else F16


def api_lead(rng):
    """Leading dimensions (*) of a layer's input: none to two, rarely empty."""
    return tuple(int(rng.integers(0 if chance(rng, 0.05) else 1, 4)) for _ in range(int(rng.integers(0, 3))))


def randn(rng, shape, dt, scale=1.0):
    return np.asarray(rng.standard_normal(shape) * scale).astype(dt)


def f64(a):
    return np.asarray(a).astype(np.float64)


def tolerance(dt):
    dt = np.dtype(dt)
    return {F64: 1e-10, F32: 1e-5}.get(dt) or 8 * (2.0 ** -8 if dt == BF16 else 2.0 ** -11)


def rel_err(ours, ref):
    """max |ours - ref| / max(1, max |ref|) (tests/helpers.py's max_rel_err); inf for another shape, a NaN or an
    infinity where the reference has none."""
    ours, ref = f64(ours), f64(ref)
    if ours.shape != ref.shape:
        return np.inf
    if ours.size == 0:
        return 0.0
    if (np.isnan(ours) != np.isnan(ref)).any() or (np.isinf(ours) != np.isinf(ref)).any():
        return np.inf
    fin = np.isfinite(ref)
    if not fin.any():
        return 0.0 if np.array_equal(ours, ref, equal_nan=True) else np.inf
    scale = max(1.0, float(np.abs(ref[fin]).max()))
    return float(np.abs(ours[fin] - ref[fin]).max() / scale)


def close(name, ours, ref, dt, tol=None):
    """None, or the message of a result that differs from its reference."""
    err = rel_err(ours, ref)
    tol = tolerance(dt) if tol is None else tol
    if ours is None or err > tol:
        shape = getattr(ours, "shape", None)
        return f"{name}: relative error {err:.3g} > {tol:g} against the PyTorch reference (shape {shape})"
    return None


def all_close(pairs, dt):
    """A check of several (name, ours(result), reference) at once."""
    def check(result):
        for name, ours, ref in pairs:
            msg = close(name, ours(result), ref, dt)
            if msg:
                return msg
        return None
    return check


def tensor(a, grad=False, dtype=None):
    """A torch tensor of an array's values (of any float dtype; exact) in the torch ``dtype`` (default float64),
    requiring grad if asked."""
    import torch
    t = torch.tensor(f64(a), dtype=torch.float64)
    return (t if dtype is None else t.to(dtype)).requires_grad_(grad)


def torch_dtype(dt):
    import torch
    return {F64: torch.float64, F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}[np.dtype(dt)]


def checked(names, ours, reference, dt):
    """A check of the results ``ours(result)`` (a list of arrays) against ``reference(torch dtype)`` (the same list
    computed by PyTorch in that dtype): each within tolerance(dt) of the float64 reference; where beyond that,
    within a multiple of the error of the reference computed in dt itself, PyTorch's own error there (docs/
    design.md's rules: 1.5 times in the halves; 4 times in float32, as the property tests, where cancellation
    makes PyTorch's own error larger than 1e-5)."""
    import torch
    ref = reference(torch.float64)

    def check(result):
        got = ours(result)
        errors = [rel_err(a, b) for a, b in zip(got, ref)]
        bad = [i for i, e in enumerate(errors) if e > tolerance(dt)]
        if bad and dt != F64:
            own = reference(torch_dtype(dt))
            factor = 4.0 if dt == F32 else 1.5
            bad = [i for i in bad if errors[i] > factor * rel_err(own[i], ref[i])]
        if not bad:
            return None
        i = bad[0]
        return (f"{names[i]}: relative error {errors[i]:.3g} > {tolerance(dt):g} against the PyTorch reference "
                f"(shape {np.shape(got[i])})")
    return check


# ---------------------------------------------------------------------------------------------- mutations
def mutate(rng, call):
    """One argument of a valid call made invalid (call.expected, call.argument say what the call must raise)."""
    from attnpp._checks import ARGUMENTS
    options = []
    for group, key in call.kinds.items():
        for name, k in ARGUMENTS[key].items():
            for value, exc in k.refuses:
                options.append((group, name, value, exc, f"{name}={value!r}"))
    for group, names in call.arrays.items():
        for name in names:
            a = call.kw[group].get(name)
            if not isinstance(a, np.ndarray):
                continue
            other = pick(rng, [d for d in (F32, F64, BF16, F16) if d != a.dtype])
            # (a dtype unlike the others': the message may name any of them, whichever is checked against which)
            others = tuple(n for n in names if isinstance(call.kw[group].get(n), np.ndarray))
            options += [(group, name, a.astype(np.int32), TypeError, f"{name} of int32"),
                        (group, name, "x", TypeError, f"{name}='x'")]
            if len(others) > 1:
                options.append((group, others, a.astype(other), TypeError, f"{name} of {other} (the others "
                                                                           f"{a.dtype})"))
    options += call.bad
    if not options:
        return False
    group, names, value, exc, what = options[int(rng.integers(len(options)))]
    names = (names,) if isinstance(names, str) else names
    call.kw[group][names[0] if len(names) == 1 else what.split(" ")[0]] = value
    call.mutations.append(what)
    call.expected, call.argument = exc, names
    return True


def all_functions():
    """{name: relative frequency} of every call kind: the binding's functions and the public API's kinds."""
    from .values import FUNCTIONS
    _setup()
    return dict(FUNCTIONS, **{name: weight for name, (_, weight) in KINDS.items()})


def expand(names):
    """A --functions list with its groups expanded: "binding" (attnpp._core's functions), "api" (the public
    API's kinds), "all"."""
    from .values import FUNCTIONS
    known = all_functions()
    groups = {"binding": sorted(FUNCTIONS), "api": sorted(KINDS), "all": sorted(known)}
    out = []
    for n in names.split(","):
        out += groups.get(n, [n])
    return out


def generate_api(seed, index, fn):
    _setup()
    rng = np.random.default_rng([seed, index, 1])
    call = ApiCall(index, fn)
    KINDS[fn][0](rng, call)
    if chance(rng, 0.4):
        mutate(rng, call)
    return call


# ---------------------------------------------------------------------------------------------- execution
def _arrays(value):
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)


def execute_api(call):
    """Make the call; returns (outcome, findings, notes) as execution.execute does."""
    inputs = [a for kw in call.kw.values() for n, v in kw.items() if n not in call.written for a in _arrays(v)]
    snaps = [(a, a.tobytes()) for a in inputs]
    exc = result = None
    try:
        result = call.body(call.kw)
    except Exception as e:  # noqa: BLE001 (classified below)
        exc = e
    outcome = "ok" if exc is None else type(exc).__name__
    call.message = "" if exc is None else f"{type(exc).__name__}: {exc}"
    findings = []
    for a, snap in snaps:
        if a.tobytes() != snap:
            findings.append(("input_modified", f"an input array {a.shape} {a.dtype} was changed by the call"))
    if call.valid:
        if exc is not None:
            findings.append(("valid_call_raised", call.message[:300]))
        else:
            for check in call.checks:
                try:
                    msg = check(result)
                except Exception as e:  # noqa: BLE001 (a bug of the fuzzer's reference)
                    findings.append(("fuzzer_error", f"reference: {type(e).__name__}: {e}"[:300]))
                    break
                if msg:
                    findings.append(("wrong_result", msg[:300]))
                    break
    elif exc is None:
        findings.append(("invalid_accepted", f"{call.mutations[0]}: the call returned"))
    elif not isinstance(exc, ALLOWED_INVALID):
        findings.append(("unexpected_exception", f"{call.mutations[0]}: {call.message[:300]}"))
    elif not isinstance(exc, call.expected):
        findings.append(("wrong_exception", f"{call.mutations[0]}: expected {call.expected.__name__}, got "
                                            f"{call.message[:300]}"))
    elif not any(name in str(exc) for name in call.argument):
        findings.append(("unclear_error", f"{call.mutations[0]}: the message does not name "
                                          f"{' or '.join(call.argument)}: {call.message[:300]}"))
    return outcome, findings, []
