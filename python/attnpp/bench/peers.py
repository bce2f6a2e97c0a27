"""The peers (``python -m attnpp.bench --against onnxruntime,openvino``): other CPU attention engines, timed forward
only (they have no backward) on the attention problem of a case, in turn with the case's attnpp and PyTorch calls,
after a check of their output against float64.

- ONNX Runtime (``onnxruntime``): the standard ONNX ``Attention`` operator (opset ONNX_OPSET, 23: its first) in a
  one-node model built in memory with onnx's helper API: query (B, Hq, L, D), key and value (B, Hk, S, D), its
  grouped heads as given (Hq a multiple of Hk), ``is_causal``, the default scale 1 / sqrt(D). One
  ``InferenceSession`` on the CPU execution provider with ``intra_op_num_threads`` set to the run's threads (and one
  inter-op thread), its threads not spinning after a call (``session.intra_op.allow_spinning`` 0): spinning, they
  took the cores from the engine timed next (on the loaded 2-core EPYC, attnpp's decoding step over 4,096 keys took
  21.5 ms right after ONNX Runtime's, 16 ms alone, 14-15 ms after a non-spinning ONNX Runtime); the rest as a user
  gets it. ONNX Runtime 1.23 brought this operator's CPU kernel in float32 and float16, not bfloat16 (the session
  cannot be built: the case says so). The kernel holds the weights of all heads, (B, Hq, L, S) in float32, at once:
  its call grew by 1.1 to 1.2 times their size at (1, 12, 4096, 64), (1, 32, 4096, 128) and (1, 16, 8192, 128), and
  the bench running it at (1, 32, 8192, 128) (8 GiB of weights) was killed for memory at 19 GiB. Twice the weights'
  size is counted: a problem where that exceeds half the memory available is skipped, saying so.
- OpenVINO (``openvino``): ``openvino.opset13.scaled_dot_product_attention`` in a model of static shapes, compiled
  for the CPU plugin with ``INFERENCE_NUM_THREADS`` set to the run's threads, the latency hint, and
  ``INFERENCE_PRECISION_HINT`` "f32" for float32 and float16 inputs, "bf16" for bfloat16: on a CPU with AVX512_BF16
  the plugin's default is bf16, which would round a float32 problem's products to bfloat16. The operator has no
  grouped heads: key and value are repeated to the query's heads beforehand (``np.repeat``, not timed), which the
  case's peer line says. Inputs and outputs are shared with the infer request, not copied.

The CPU level: ONNX Runtime picks its own (no variable caps it, ``--capability`` included); OpenVINO's CPU plugin
follows ``ONEDNN_MAX_CPU_ISA``, which ``--capability`` sets. Each engine's first call on a case is its warm-up; its
output, on up to CHECK_ROWS query rows spread from the first to the last, is compared with the attention computed in
float64 from the same (rounded) inputs: the error ``max |out - ref| / max(1, max |ref|)`` (the tests' measure,
docs/design.md) must stay within CHECK_TOLERANCE of the dtype, else the engine is not timed on that case and its
line gives the error.
"""
from __future__ import annotations

import functools
import importlib
import time
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from .case import PeerResult
from .machine import available_memory

ONNX_OPSET = 23
CHECK_ROWS = 64
# the project's float32 tolerance (docs/design.md), and four unit roundoffs of each half-precision dtype (the C++
# test's bound for bfloat16 under flash numerics)
CHECK_TOLERANCE = {"float32": 1e-5, "float16": 4 * 2.0 ** -11, "bfloat16": 4 * 2.0 ** -8}
MEMORY_SHARE = 0.5  # an engine whose predicted working memory exceeds this share of the available memory is skipped
INSTALL = 'pip install ".[bench-peers]" (onnx, onnxruntime, openvino)'


@dataclass
class Problem:
    """The attention forward a case's peers compute: query (B, Hq, L, D), key and value (B, Hk, S, D), NumPy arrays
    of one dtype (float32, float16 or ml_dtypes.bfloat16), Hq a multiple of Hk, the default scale; ``is_causal``
    only with L == S (where the top-left and bottom-right alignments agree)."""
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    is_causal: bool = False

    @property
    def dtype(self):
        return self.query.dtype.name


def reference_rows(problem, rows):
    """The problem's output on the query rows ``rows`` (B, Hq, len(rows), D) in float64, one key head at a time
    (its query heads together), from the problem's own arrays."""
    query, key, value = problem.query, problem.key, problem.value
    Hq, Hk, S, D = query.shape[1], key.shape[1], key.shape[2], query.shape[3]
    group = Hq // Hk
    q = query[:, :, rows].astype(np.float64) / np.sqrt(D)
    out = np.empty(q.shape)
    hidden = rows[:, None] < np.arange(S)[None, :] if problem.is_causal else None  # key j after query row i
    for h in range(Hk):
        scores = q[:, h * group:(h + 1) * group] @ key[:, h:h + 1].astype(np.float64).swapaxes(-1, -2)  # (B, g, r, S)
        if hidden is not None:
            scores[..., hidden] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        heads = slice(h * group, (h + 1) * group)
        out[:, heads] = (weights @ value[:, h:h + 1].astype(np.float64)) / weights.sum(-1, keepdims=True)
    return out


def check_reference(problem):
    """(rows, their reference_rows): up to CHECK_ROWS query rows spread evenly from the first to the last."""
    L = problem.query.shape[2]
    rows = np.unique(np.linspace(0, L - 1, min(L, CHECK_ROWS)).round().astype(np.int64))
    return rows, reference_rows(problem, rows)


def check_error(problem, output, reference=None):
    """(error, rows checked): ``output``'s error against ``reference`` (check_reference's, computed when None),
    relative to the reference's scale above 1."""
    rows, ref = check_reference(problem) if reference is None else reference
    got = np.asarray(output)[:, :, rows].astype(np.float64)
    return float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max())), len(rows)


def _onnxruntime_call(problem, threads):
    """ONNX Runtime's Attention on ``problem`` (see the module's documentation): (call returning the output, note)."""
    import onnxruntime
    from onnx import TensorProto, helper
    element = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
               "bfloat16": TensorProto.BFLOAT16}[problem.dtype]
    names, arrays = ("Q", "K", "V"), (problem.query, problem.key, problem.value)
    graph = helper.make_graph([helper.make_node("Attention", list(names), ["Y"], is_causal=int(problem.is_causal))],
                              "attention", [helper.make_tensor_value_info(n, element, a.shape) for n, a in
                                            zip(names, arrays)],
                              [helper.make_tensor_value_info("Y", element, problem.query.shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # see the module's documentation
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # e.g. NOT_IMPLEMENTED: no CPU kernel for this dtype
        first = _error_line(error).replace("[ONNXRuntimeError] : ", "")
        raise PeerUnavailable(f"no session for Attention (opset {ONNX_OPSET}) in {problem.dtype} on the CPU "
                              f"({first})") from error
    feed = dict(zip(names, arrays))
    return lambda: session.run(None, feed)[0], ""


def _onnxruntime_memory(problem):
    """Bytes ONNX Runtime's CPU Attention may hold beyond its inputs and output: twice the weights of all heads (see
    the module's documentation)."""
    B, Hq, L, _ = problem.query.shape
    return 2 * 4 * B * Hq * L * problem.key.shape[2], "twice the (B, Hq, L, S) attention weights in float32"


@functools.lru_cache(maxsize=None)
def _openvino_core():
    import openvino
    return openvino.Core()


def _openvino_call(problem, threads):
    """OpenVINO's scaled_dot_product_attention on ``problem`` (see the module's documentation): (call returning the
    output, note)."""
    import openvino
    import openvino.opset13 as ops
    element = {"float32": openvino.Type.f32, "float16": openvino.Type.f16,
               "bfloat16": openvino.Type.bf16}[problem.dtype]
    query, key, value = problem.query, problem.key, problem.value
    group, note = query.shape[1] // key.shape[1], ""
    if group > 1:
        key, value = (np.repeat(x, group, axis=1) for x in (key, value))
        note = (f"GQA: key and value repeated from {problem.key.shape[1]} to {query.shape[1]} heads beforehand, not "
                "timed (opset13's SDPA has no grouped heads)")
    params = [ops.parameter(list(x.shape), element, name=n) for n, x in zip("QKV", (query, key, value))]
    model = openvino.Model([ops.scaled_dot_product_attention(*params, causal=problem.is_causal)], params, "attention")
    try:
        compiled = _openvino_core().compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "bf16" if problem.dtype == "bfloat16" else "f32"})
    except RuntimeError as error:  # e.g. bfloat16 under ONEDNN_MAX_CPU_ISA=AVX2: no Softmax kernel for it
        raise PeerUnavailable(f"not compiled for the CPU in {problem.dtype} ({_error_line(error, last=True)})") \
            from error
    request = compiled.create_infer_request()
    if problem.dtype == "bfloat16":  # OpenVINO's Python API shows bfloat16 as float16: the bits, as uint16
        tensors = [openvino.Tensor(x.view(np.uint16), x.shape, element) for x in (query, key, value)]
        as_dtype = lambda out: out.view(np.uint16).view(ml_dtypes.bfloat16)
    else:
        tensors, as_dtype = [openvino.Tensor(x, shared_memory=True) for x in (query, key, value)], lambda out: out
    return lambda: as_dtype(request.infer(tensors, share_inputs=True, share_outputs=True)[0]), note


def _error_line(error, last=False):
    """The first (or last: OpenVINO's names the cause there) line of an engine's error message."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    return lines[-1 if last else 0].strip()


class PeerUnavailable(Exception):
    """An engine that cannot run a case (its message: why); the case's peer line says so."""


@dataclass(frozen=True)
class Engine:
    """A peer: its ``--against`` name, its title in the report, the modules it needs, ``call(problem, threads)`` ->
    (call returning the output, note), ``memory(problem)``, where what an engine holds beyond its inputs and
    output can be large: (bytes, what they hold), else None; and what sets its CPU level, for the header."""
    name: str
    title: str
    modules: tuple
    call: Callable
    memory: Callable = lambda problem: None
    level: str = ""


ENGINES = {engine.name: engine for engine in (
    Engine("onnxruntime", "ONNX Runtime", ("onnxruntime", "onnx"), _onnxruntime_call, _onnxruntime_memory,
           "its own CPU level: no variable caps it"),
    Engine("openvino", "OpenVINO", ("openvino",), _openvino_call, level="ONEDNN_MAX_CPU_ISA caps its CPU level"),
)}


class Peers:
    """The engines of a run (``--against``): those that import, with their versions, and a line for each that does
    not; ``prepare(problem)`` builds each engine's call on a case's problem, warms it up and checks it."""

    def __init__(self, names, threads):
        self.threads, self.engines, self.versions, self.missing = threads, [], {}, []
        for name in names:
            engine = ENGINES[name]
            try:
                module = [importlib.import_module(m) for m in engine.modules][0]
            except ImportError as error:  # (None in sys.modules included)
                self.missing.append(f"--against {name}: {engine.title} skipped, not importable here ({error}): "
                                    f"{INSTALL}")
                continue
            self.engines.append(engine)
            self.versions[engine.title] = module.__version__.split("-")[0]  # (OpenVINO's: 2026.4.1-22982-...)

    def header(self):
        """The report's line naming the engines and the CPU level each takes."""
        return "peers (--against; forward cases only, in the peers' table): " + ", ".join(
            f"{engine.title} {self.versions[engine.title]} ({engine.level})" for engine in self.engines)

    def prepare(self, problem):
        """{engine title: (call, seconds of its first call, PeerResult with the check's figures)} for the engines
        that pass the check on ``problem``, and {engine title: PeerResult(skipped=reason)} for the others."""
        ready, skipped = {}, {}
        available = available_memory()
        reference = None  # (computed once, at the first engine that runs)
        for engine in self.engines:
            need, what = engine.memory(problem) or (0, "")
            if available is not None and need > MEMORY_SHARE * available:
                skipped[engine.title] = PeerResult(skipped=(
                    f"not run: it would hold {what}, {need / 2 ** 30:.1f} GiB, more than {MEMORY_SHARE:.0%} of the "
                    f"{available / 2 ** 30:.1f} GiB available"))
                continue
            try:
                call, note = engine.call(problem, self.threads)
                first, output = _first_call(call)
            except PeerUnavailable as error:
                skipped[engine.title] = PeerResult(skipped=str(error))
                continue
            reference = reference or check_reference(problem)
            error, rows = check_error(problem, output, reference)
            tolerance = CHECK_TOLERANCE[problem.dtype]
            if not error <= tolerance:  # (NaN fails too)
                skipped[engine.title] = PeerResult(error=error, tolerance=tolerance, note=note, skipped=(
                    f"not timed: its output is off by {error:.2g} against float64 on {rows} rows, above "
                    f"{tolerance:.2g}"))
                continue
            ready[engine.title] = (call, first, PeerResult(error=error, tolerance=tolerance, note=note))
        return ready, skipped


def _first_call(call):
    """(seconds, output) of the first call of an engine: its warm-up, whose output is checked. A failure (whatever
    the engine raises) makes the engine unavailable on the case, with the error."""
    start = time.perf_counter()
    try:
        output = call()
    except Exception as error:
        raise PeerUnavailable(f"its first call failed: {type(error).__name__}: {error}") from error
    return time.perf_counter() - start, output
