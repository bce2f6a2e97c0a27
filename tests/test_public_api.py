"""The house's promises about its layout: every public name importable from where it was before the modules were
split by operation (issue 36), no module in python/attnpp over 600 lines, and no import circle between them.

``PUBLIC`` is the list of public names taken from ``main`` before the split (``__all__`` and ``dir()`` of each
module, less the modules and helpers a module merely imports), plus the private names other modules of attnpp
import from ``attnpp.functional``. The names that README.md and the stubs ``_core.pyi`` mention are read from the
files themselves.
"""
import ast
import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "python", "attnpp")
MAX_LINES = 600

_FUNCTIONAL_ALL = [
    "dropout", "dropout_backward", "embedding", "embedding_backward", "cross_entropy", "cross_entropy_forward",
    "cross_entropy_backward", "linear_cross_entropy", "linear_cross_entropy_forward", "linear_cross_entropy_backward",
    "LinearCrossEntropyForward", "scaled_dot_product_attention", "scaled_dot_product_attention_forward",
    "AttentionForward", "scaled_dot_product_attention_backward", "scaled_dot_product_attention_weights",
    "scaled_dot_product_attention_varlen", "scaled_dot_product_attention_varlen_forward",
    "scaled_dot_product_attention_varlen_backward", "scaled_dot_product_attention_with_kvcache", "get_alibi_slopes",
    "dropout_mask", "linear", "linear_backward", "rotary_embedding", "rotary_embedding_backward", "rotary_tables"]

PUBLIC = {
    "attnpp": ["functional", "nn", "optim", "manual_seed", "get_rng_state", "set_rng_state", "no_grad", "enable_grad",
               "is_grad_enabled", "set_num_threads", "get_num_threads", "empty_cache", "cpu_capability",
               "show_config", "set_bfloat16_attention", "get_bfloat16_attention"],
    "attnpp.functional": _FUNCTIONAL_ALL + [
        # used by attnpp.nn, attnpp.torch, attnpp.transformers, bench.py and the tests
        "score_scale", "causal_mode", "attention_params", "mask_arg", "additive_mask", "last_dim_contiguous",
        "_plain_forward", "_empty", "_zeros", "_POOLED_BYTES", "_BFLOAT16_NUMERICS"],
    "attnpp.nn": ["Parameter", "Module", "locked", "Linear", "Embedding", "Dropout", "CrossEntropyLoss",
                  "LinearCrossEntropyLoss", "MultiheadAttention", "Attention", "KVCache"],
    "attnpp.nn.attention": ["Attention", "attention_config", "attention_config_of", "rotary_tables", "variant_args"],
    "attnpp.nn.module": ["IncompatibleKeys", "Module", "PENDING_CONTEXTS_WARNING", "locked", "to_numpy"],
    "attnpp.nn.multihead_attention": ["MultiheadAttention"],
    "attnpp.nn.linear": ["Linear"],
    "attnpp.nn.embedding": ["Embedding"],
    "attnpp.nn.dropout": ["Dropout"],
    "attnpp.nn.loss": ["CrossEntropyLoss", "LinearCrossEntropyLoss"],
    "attnpp.nn.kv_cache": ["KVCache"],
    "attnpp.nn.parameter": ["Parameter"],
    "attnpp.optim": ["Optimizer", "SGD", "AdamW"],
    "attnpp.grad_mode": ["no_grad", "enable_grad", "is_grad_enabled"],
    "attnpp.testing": ["to_tensor", "ReplayDropout", "variant_scores", "reference", "rotary_reference",
                       "attention_layer_reference", "Article000CausalSelfAttention", "Article000MultiheadAttention",
                       "Article001HelloWorldModel", "Article002SelfAttention", "Article002MultiHeadAttentionWrapper",
                       "Article003SingleHeadAttention", "Article003CausalAttention", "Article003CausalCrossAttention",
                       "Article004MultiHeadAttention"],
    "attnpp.torch": ["scaled_dot_product_attention", "linear", "linear_cross_entropy", "Linear", "MultiheadAttention",
                     "Attention", "from_numpy", "to_numpy"],
    "attnpp.torch.distributed": ["ring_attention", "shard_sequence", "gather_sequence", "LAYOUTS", "PIECE_BYTES"],
    "attnpp.transformers": ["register", "attention_forward", "attention_mask", "KeyLayout", "NAME"],
}
NEEDS = {"attnpp.testing": "torch", "attnpp.torch": "torch", "attnpp.torch.distributed": "torch",
         "attnpp.transformers": "transformers"}


def _import(module):
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    return importlib.import_module(module)


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_imports_from_where_it_did(module):
    mod = _import(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"
    for name in getattr(mod, "__all__", ()):  # and each name a module lists
        assert hasattr(mod, name), f"{module}.__all__ lists {name}, which it does not define"


def test_functional_all_unchanged():
    import attnpp.functional as AF
    assert sorted(AF.__all__) == sorted(_FUNCTIONAL_ALL)


def _resolve(dotted):
    """The object a dotted name ``attnpp.x.y`` names, importing modules on the way; AttributeError if none."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


def test_the_names_readme_mentions_resolve():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    names = sorted(set(re.findall(r"\battnpp(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text)))
    assert names, "README.md mentions no attnpp names"
    unresolved = []
    for name in names:
        module = ".".join(name.split(".")[:2])
        if any(module == m or module.startswith(m + ".") for m in NEEDS):
            pytest.importorskip(NEEDS[next(m for m in NEEDS if module.startswith(m))])
        try:
            _resolve(name)
        except (AttributeError, ImportError):
            unresolved.append(name)
    assert not unresolved, f"README.md names {unresolved}, which do not import"


def test_the_stubs_names_exist_in_the_core():
    import attnpp
    tree = ast.parse(open(os.path.join(PACKAGE, "_core.pyi"), encoding="utf-8").read())
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert names
    assert [n for n in names if not hasattr(attnpp._core, n)] == []


# ------------------------------------------------------------------------------------------------- the layout
def _modules():
    """{dotted module name: path} of every Python file of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_600_lines(module):
    lines = sum(1 for _ in open(MODULES[module], encoding="utf-8"))
    assert lines <= MAX_LINES, f"{MODULES[module]}: {lines} lines (at most {MAX_LINES})"


def _module_level_imports(module, path):
    """The attnpp modules that ``module`` imports when it is imported (statements outside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # (a function's imports run when it is called, not at import)
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "attnpp")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                                    ([base] if base else []))
                if base.split(".")[0] != "attnpp":
                    continue
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])
    visit(tree.body)
    # a package is always imported before its modules: an edge to one's own package is no circle
    return {m for m in found if m in MODULES and not module.startswith(m + ".") and m != module}


def test_no_import_circle():
    graph = {m: _module_level_imports(m, p) for m, p in MODULES.items()}
    state, path, circles = {}, [], []

    def walk(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                walk(n)
        path.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert not circles, f"import circles: {circles}"
