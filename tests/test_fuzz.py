"""The fuzzer (tools/fuzz.py), short run: a few thousand calls over every call kind, the functions of attnpp._core
and the public API's (attnpp.functional, nn, optim, torch with autograd, transformers), valid ones against their
references and invalid ones required to raise a clear ValueError, TypeError or IndexError.

The calls run in a child process (tools/fuzz.py restarts it after a crash), so a segfault or abort fails this
test with the call's index and arguments instead of killing pytest. Under tools/sanitize.sh the child inherits
the sanitized core (PYTHONPATH, LD_PRELOAD), so out-of-bounds reads and undefined behaviour are caught too.

    ATTNPP_FUZZ_CALLS=20000 ATTNPP_FUZZ_SEED=7 python -m pytest tests/test_fuzz.py -s    a longer run
    python tools/fuzz.py --calls 100000 --seed 0                                         the full fuzzer
"""
import importlib.util
import json
import os
import subprocess
import sys

import attnpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "tools", "fuzz.py")
CALLS = int(os.environ.get("ATTNPP_FUZZ_CALLS", 2000))
SEED = int(os.environ.get("ATTNPP_FUZZ_SEED", 20251122))


def test_fuzz_binding(tmp_path):
    summary_path = tmp_path / "fuzz.json"
    env = dict(os.environ)
    # the child imports the attnpp this test imported (the source tree, an installed one, sanitize.sh's staging)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(attnpp.__file__)))
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, FUZZ, "--calls", str(CALLS), "--seed", str(SEED), "--json", str(summary_path),
           "--progress", "0", "--timeout", "120", "--workdir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-30000:])
    print(proc.stderr[-5000:], file=sys.stderr)
    assert summary_path.exists(), f"fuzz.py wrote no summary (exit {proc.returncode})"
    s = json.loads(summary_path.read_text())

    assert s["calls"] == CALLS
    # every function was called, and a good part of the calls were valid ones that ran the kernels
    spec = importlib.util.spec_from_file_location("attnpp_fuzz", FUZZ)
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    missing = sorted(set(fuzz.all_functions()) - set(s["per_function"]))
    assert not missing, f"functions never called: {missing}"
    assert s["valid_calls"] >= CALLS // 4
    assert s["outcomes"].get("ok", 0) >= CALLS // 3

    crashes = [f for f in s["findings"] if f["kind"] in ("crash", "hang")]
    unexpected = [f for f in s["findings"] if f["kind"] == "unexpected_exception"]
    lines = [f"[{f['kind']}] {f['function']}: {f['detail'][:200]} (x{f['count']}; repro: python tools/fuzz.py "
             f"--seed {SEED} --repro {f['first']})\n{f.get('description', '')}" for f in s["findings"]]
    assert not crashes, "crash(es):\n" + "\n".join(lines)
    assert not unexpected, "unexpected exception type(s):\n" + "\n".join(lines)
    # the other findings: an input modified, a write outside an output, a wrong or non-finite result of a
    # valid call, an exception from a valid call
    assert not s["findings"], "findings:\n" + "\n".join(lines)
    assert proc.returncode == 0, proc.stdout[-3000:]
