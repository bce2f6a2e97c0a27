#!/usr/bin/env python3
"""Two builds of attnpp give the same results bit for bit: the OpenMP build and one without OpenMP (threads.cpp's
std::thread pool), or any two builds of the same CPU level.

    python tools/bitwise_builds.py save results.npz       with the one build (e.g. the installed OpenMP build)
    PYTHONPATH=<stage> python tools/bitwise_builds.py compare results.npz      with the other

The runs are tests/test_threads.py's (attention forward and backward with dropout, GQA and masks, the layers
with their parameter gradients, a Linear + cross-entropy + AdamW step, dropout) in float32 and float64, and the
attention in bfloat16 and float16, on 1 and 2 threads, at the CPU level both builds run (ATTNPP_CPU_CAPABILITY
or the best). `compare` checks every array of every run, on each thread count, against the saved build's on the
same count, byte for byte, and ends with "N passed, N failed"; its exit status is 1 on any difference.
"""
import argparse
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import attnpp  # noqa: E402
from test_threads import RUNS, _sdpa_run  # noqa: E402

THREADS = (1, 2)
# in bfloat16 and float16: the attention (the layers' runs make float parameters)
HALF_RUNS = {"sdpa": lambda x: _sdpa_run(x, x[:, :, ::-1], x[..., ::-1], is_causal=True, dropout_p=0.2, seed=5),
             "sdpa_gqa_mask": RUNS["sdpa_gqa_mask"]}


def results():
    """{"run/dtype/threads/i": the bytes of output i} of every run on every thread count."""
    out = {}
    cases = [(run, RUNS[run], dt) for run in RUNS for dt in (np.float32, np.float64)]
    cases += [(run, fn, dt) for run, fn in HALF_RUNS.items() for dt in (ml_dtypes.bfloat16, np.float16)]
    before = attnpp.get_num_threads()
    try:
        for run, fn, dt in cases:
            x = np.random.default_rng(0).standard_normal((2, 4, 160, 64)).astype(dt)
            for n in THREADS:
                attnpp.set_num_threads(n)
                for i, a in enumerate(fn(x)):
                    out[f"{run}/{np.dtype(dt).name}/{n}/{i}"] = np.frombuffer(np.ascontiguousarray(a).tobytes(),
                                                                              np.uint8)
    finally:
        attnpp.set_num_threads(before)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("save", "compare"))
    ap.add_argument("file")
    a = ap.parse_args(argv)
    config = attnpp.show_config(mode="dicts")
    print(f"attnpp {attnpp.__file__}: {config['compiler']}, {config['threading']}, level {config['cpu_capability']}")
    got = results()
    if a.action == "save":
        np.savez(a.file, level=config["cpu_capability"], threading=config["threading"],
                 **got)
        print(f"saved {len(got)} arrays to {a.file}")
        return 0
    saved = np.load(a.file)
    if str(saved["level"]) != config["cpu_capability"]:
        print(f"the saved results are of level {saved['level']}, this run's {config['cpu_capability']}: "
              f"set ATTNPP_CPU_CAPABILITY to the same")
        return 2
    print(f"against {a.file} ({saved['threading']})")
    passed = failed = 0
    for key, value in got.items():
        ok = key in saved.files and np.array_equal(value, saved[key])
        passed, failed = passed + ok, failed + (not ok)
        if not ok:
            print(f"FAIL {key}: differs from the saved build's")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
