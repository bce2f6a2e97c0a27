#!/usr/bin/env python3
"""Fuzzer of attnpp._core, the pybind11 binding: random, mostly near-valid arguments for every exported function.

    python tools/fuzz.py --calls 100000 --seed 0 [--functions sdpa_forward,sdpa_backward] [--json out.json]
    python tools/fuzz.py --seed 0 --describe 1234      the arguments of call 1234 (no call is made)
    python tools/fuzz.py --seed 0 --repro 1234         make call 1234 in this process (a crash crashes here)

Every call is generated from (seed, index) alone (a numpy Generator seeded with [seed, index]): first a
consistent, valid argument set, then 0, 1 or 2 mutations (a shape, a dtype, a layout, a flag, a value, a mask's
offsets or strides, an index out of range, a non-array where an array goes, ...). The calls run in a child
process; the parent watches it, so that a crash (signal, abort, std::terminate) or a hang is reported with the
call's index, function and arguments, and the run goes on from the next call in a new child.

Outcome of a call: it returns, or raises TypeError, ValueError, IndexError, MemoryError or OverflowError. Findings
(exit status 1): a crash or hang; any other exception type; an input array modified; a byte written outside an
output array (outputs sit in canary-filled buffers); an output written by a call that raised; for a valid call,
an exception, a non-finite result from finite inputs, or a result that differs from a NumPy reference (inputs
sit in NaN-filled buffers, so a read past their end tends to show up as NaN); a list accepted where an optional
array goes (the binding's conversion to a temporary array). Notes (no failure): behaviour worth knowing, not
unsafe on x86 by itself (an unaligned array accepted: undefined behaviour that UBSan reports).

Under AddressSanitizer (tools/sanitize.sh preloads it; the children inherit it) the children get no address-space
limit, and without ASAN_OPTIONS=allocator_may_return_null=1 only huge sizes whose byte count overflows are tried.
The summary (--json) has the outcome counts per function, the findings with their first call's arguments, and the
error messages seen (digits as #), which show which of the binding's checks the run reached.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (the package tools/fuzzer, also when loaded by path)

from fuzzer.api import all_functions, expand  # noqa: E402
from fuzzer.execution import child_main  # noqa: E402
from fuzzer.parent import parent_main, repro_main  # noqa: E402
from fuzzer.values import FUNCTIONS  # noqa: E402

# The package, by concern: values.py (edge values, padded arrays), calls.py (a call's slots, the NumPy
# references), generators.py (valid arguments per function), mutations.py (the mutations, and generate),
# execution.py (a call in the child, its outcome), parent.py (the children, the summary, --describe and --repro).


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10000, help="number of calls (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="index of the first call")
    ap.add_argument("--functions", default="all",
                    help="comma-separated names of attnpp._core's functions (" + ", ".join(sorted(FUNCTIONS)) +
                         ") and of the public API's call kinds (tools/fuzzer/api_*.py; --list prints them), or "
                         "the groups binding, api and all (default)")
    ap.add_argument("--list", action="store_true", help="print every call kind and exit")
    ap.add_argument("--json", help="write the summary (counts, findings) to this file")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds without progress before a hang is declared")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="address-space limit of the child (default 8; none under AddressSanitizer)")
    ap.add_argument("--no-huge", action="store_true",
                    help="only huge sizes that overflow (default under ASan without allocator_may_return_null=1)")
    ap.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines (0: none)")
    ap.add_argument("--workdir", help="directory for the children's logs (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the children's logs")
    ap.add_argument("--describe", type=int, help="print the arguments of this call and exit")
    ap.add_argument("--repro", type=int, help="make this call in this process and report")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(f"{name}  (frequency {w})" for name, w in sorted(all_functions().items())))
        print(f"{len(all_functions())} call kinds: {len(FUNCTIONS)} of attnpp._core, {len(all_functions()) - len(FUNCTIONS)} "
              f"of the public API")
        return 0
    a.functions = ",".join(expand(a.functions))
    if a.child:
        if a.mem_limit_gb is None:
            a.mem_limit_gb = 0
        return child_main(a)
    if a.describe is not None or a.repro is not None:
        return repro_main(a)
    return parent_main(a)


if __name__ == "__main__":
    sys.exit(main())
