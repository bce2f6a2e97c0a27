"""python/attnpp/_core.pyi, the type stubs of the compiled module, against attnpp._core itself.

mypy's stubtest cannot check this module's signatures: pybind11 functions carry no __text_signature__, so
inspect.signature fails on them and stubtest only compares which names exist. Instead the signature pybind11 writes
as the first line of each function's __doc__ ("name(a: T, b: T = default) -> R") is parsed here and compared with
the stub's functions, read with ast (the stub is never imported): the same public names on both sides, and per
function the same parameter names, kinds and defaults, the same None-or-not return, and a docstring on both sides.
A new or renamed py::arg in cpp/bindings/module.cpp fails here until the stub follows (the stub is read from the source
tree, the module is the one imported: rebuild after changing the bindings).
"""
import ast
import inspect
import os

import numpy as np
import pytest

import attnpp
from attnpp import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = os.path.join(ROOT, "python", "attnpp", "_core.pyi")
P = inspect.Parameter


# ------------------------------------------------------------------------------------------ the compiled module
def split_top(s, sep=","):
    """``s`` split at ``sep`` outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, ""
    for c in s:
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += c
    parts.append(cur)
    return parts


def runtime_signature(name, fn):
    """(inspect.Signature, return annotation as pybind11 wrote it) from the first line of a pybind11 __doc__."""
    doc = fn.__doc__ or ""
    first = doc.splitlines()[0] if doc else ""
    assert "Overloaded function." not in doc, f"{name}: overloads are not handled by this test (nor by the stub)"
    assert first.startswith(name + "("), f"{name}: no pybind11 signature line in __doc__: {first!r}"
    head, sep, ret = first[len(name) + 1:].rpartition(") -> ")
    assert sep, f"{name}: no return annotation in {first!r}"
    params, kind = [], P.POSITIONAL_OR_KEYWORD
    for raw in (p.strip() for p in split_top(head) if p.strip()):
        if raw == "/":  # the parameters so far are positional-only (py::pos_only)
            params = [p.replace(kind=P.POSITIONAL_ONLY) for p in params]
            continue
        if raw == "*":  # the parameters after are keyword-only (py::kw_only)
            kind = P.KEYWORD_ONLY
            continue
        if raw.startswith("**"):
            params.append(P(raw[2:].partition(":")[0].strip(), P.VAR_KEYWORD))
            continue
        if raw.startswith("*"):
            params.append(P(raw[1:].partition(":")[0].strip(), P.VAR_POSITIONAL))
            kind = P.KEYWORD_ONLY
            continue
        decl, eq, default = _split_default(raw)
        pname = decl.partition(":")[0].strip()
        params.append(P(pname, kind, default=_literal(name, pname, default) if eq else P.empty))
    return inspect.Signature(params), ret.strip()


def _split_default(raw):
    """(declaration, has default, default text) of one pybind11 parameter ``name: type = default``."""
    parts = split_top(raw, "=")
    if len(parts) == 1:
        return raw, False, ""
    return parts[0].strip(), True, "=".join(parts[1:]).strip()


def _literal(fn, arg, text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pytest.fail(f"{fn}: the default of {arg} is not a literal ({text!r}); give py::arg_v a literal description")


def runtime_names():
    """Public names of attnpp._core, each mapped to "function", "class" or "other"."""
    out = {}
    for n in dir(_core):
        if n.startswith("_"):
            continue
        obj = getattr(_core, n)
        out[n] = "class" if isinstance(obj, type) else "function" if callable(obj) else "other"
    return out


# ------------------------------------------------------------------------------------------ the stub
def stub_tree():
    with open(STUB, encoding="utf-8") as f:
        return ast.parse(f.read(), STUB)


def stub_default(fn, node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        pytest.fail(f"stub {fn}: default {ast.unparse(node)!r} is not a literal; write the binding's default")


def stub_signature(fn):
    """inspect.Signature of a stub function (ast.FunctionDef): names, kinds, defaults (annotations left out)."""
    a = fn.args
    params = []
    positional = a.posonlyargs + a.args
    defaults = [P.empty] * (len(positional) - len(a.defaults)) + [stub_default(fn.name, d) for d in a.defaults]
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        params.append(P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD, default=d))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else stub_default(fn.name, d)))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def stub_names(body):
    """Public names defined by a stub body, each mapped to its ast node."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.AnnAssign):
            names = [node.target.id] if isinstance(node.target, ast.Name) else []
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        else:
            continue
        for n in names:
            if not n.startswith("_"):
                assert n not in out, f"stub: {n} defined twice (overloads are not expected)"
                out[n] = node
    return out


def kind_of(node):
    return "function" if isinstance(node, ast.FunctionDef) else "class" if isinstance(node, ast.ClassDef) else "other"


def signature_rows(sig):
    return [(p.name, p.kind.name, repr(p.default)) for p in sig.parameters.values()]  # repr: False is not 0


def returns_none(node):
    return isinstance(node.returns, ast.Constant) and node.returns.value is None


STUB_NAMES = stub_names(stub_tree().body)
RUNTIME_NAMES = runtime_names()


# ------------------------------------------------------------------------------------------ tests
def test_same_names_both_ways():
    missing_in_stub = sorted(set(RUNTIME_NAMES) - set(STUB_NAMES))
    missing_at_runtime = sorted(set(STUB_NAMES) - set(RUNTIME_NAMES))
    assert not missing_in_stub, f"attnpp._core has names the stub lacks: {missing_in_stub}"
    assert not missing_at_runtime, f"the stub has names attnpp._core lacks: {missing_at_runtime}"
    kinds = {n: (RUNTIME_NAMES[n], kind_of(STUB_NAMES[n])) for n in RUNTIME_NAMES}
    assert all(r == s for r, s in kinds.values()), {n: k for n, k in kinds.items() if k[0] != k[1]}


def _check_function(qualname, runtime_fn, node, drop_self=False, generated=False):
    sig, ret = runtime_signature(runtime_fn.__name__, runtime_fn)
    stub_sig = stub_signature(node)
    if drop_self:  # a method: pybind11 writes self with its type, the stub plainly
        assert list(sig.parameters)[:1] == ["self"] == list(stub_sig.parameters)[:1], qualname
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        stub_sig = stub_sig.replace(parameters=list(stub_sig.parameters.values())[1:])
    assert signature_rows(stub_sig) == signature_rows(sig), (
        f"{qualname}: the stub's parameters differ from the binding's\n  stub:    {stub_sig}\n  binding: {sig}")
    assert returns_none(node) == (ret == "None"), f"{qualname}: the binding returns {ret}, the stub " + (
        "None" if returns_none(node) else ast.unparse(node.returns) if node.returns else "nothing declared")
    doc = runtime_fn.__doc__.split("\n", 1)[1].strip() if "\n" in runtime_fn.__doc__ else ""
    assert doc or generated, f"{qualname}: no docstring in cpp/bindings/module.cpp (only pybind11's signature line)"
    assert ast.get_docstring(node), f"{qualname}: no docstring in the stub"


@pytest.mark.parametrize("name", sorted(n for n, k in RUNTIME_NAMES.items() if k == "function"))
def test_function_signature(name):
    node = STUB_NAMES.get(name)
    assert isinstance(node, ast.FunctionDef), f"{name}: not a function in the stub"
    _check_function(name, getattr(_core, name), node)


def test_class_methods():
    for name in sorted(n for n, k in RUNTIME_NAMES.items() if k == "class"):
        _check_class(name)


def _check_class(name):
    node = STUB_NAMES.get(name)
    assert isinstance(node, ast.ClassDef), f"{name}: not a class in the stub"
    cls = getattr(_core, name)
    runtime = {n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__init__")}
    stub = stub_names(node.body)
    stub.update({n.name: n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"})
    stub_methods = {n for n, v in stub.items() if isinstance(v, ast.FunctionDef)}
    assert runtime == stub_methods, f"{name}: methods {sorted(runtime)} at runtime, {sorted(stub_methods)} in stub"
    enum = hasattr(cls, "__members__")  # (py::enum_ writes its constructor itself, without a docstring)
    for m in sorted(runtime):
        _check_function(f"{name}.{m}", getattr(cls, m), stub[m], drop_self=True, generated=enum and m == "__init__")


def test_parser_reads_defaults_and_kinds():
    """The signature parser itself, on a function of the core with defaults."""
    sig, ret = runtime_signature("sdpa_weights", _core.sdpa_weights)
    assert ret == "None"
    assert list(sig.parameters)[-2:] == ["params", "average_heads"]
    assert sig.parameters["average_heads"].default is False and sig.parameters["params"].default is P.empty
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
    assert split_top("a: tuple[int, str] = (1, ','), b: int") == ["a: tuple[int, str] = (1, ',')", " b: int"]


def test_shipped_with_the_package():
    """PEP 561: the stub and the py.typed marker sit next to the attnpp that was imported (the installed one)."""
    pkg = os.path.dirname(os.path.abspath(attnpp.__file__))
    for f in ("_core.pyi", "py.typed"):
        assert os.path.isfile(os.path.join(pkg, f)), f"{f} is not in {pkg} (wheel.packages in pyproject.toml?)"


def test_keyword_calls_match_positional():
    """The names are usable: a call by keyword does what the positional call does."""
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    a, b = np.empty_like(x), np.empty_like(x)
    _core.dropout_forward(a, x, 0.5, 123)
    _core.dropout_forward(seed=123, p=0.5, input=x, out=b)
    np.testing.assert_array_equal(a, b)
    w = np.arange(12, dtype=np.float64).reshape(4, 3)
    y = np.empty((2, 4))
    _core.linear_forward(out=y, input=np.ones((2, 3)), weight=w, bias=None)
    np.testing.assert_array_equal(y, np.ones((2, 3)) @ w.T)
