"""The parent process: runs the children, restarts them after a crash or hang, and summarises."""
import collections
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from .api import all_functions
from .values import FUZZ_SCRIPT
from .mutations import generate
from .execution import execute, import_core


# ------------------------------------------------------------------------------------------- parent
FAILING = {"crash", "hang", "unexpected_exception", "input_modified", "write_outside_output", "non_array_accepted",
           "output_modified_on_error", "valid_call_raised", "nonfinite", "wrong_result", "fuzzer_error",
           "exit_error", "invalid_accepted", "wrong_exception", "unclear_error"}


def detect_asan():
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        return True
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def group_key(kind, fn, detail):
    d = re.sub(r"0x[0-9a-f]+|\d+", "#", detail)
    return (kind, fn, d[:90])


def describe_call(seed, index, functions, no_huge):
    try:
        return generate(seed, index, functions, no_huge).describe()
    except Exception as e:
        return f"(could not regenerate call {index}: {type(e).__name__}: {e})"


def parent_main(a):
    functions = a.functions.split(",")
    known = all_functions()
    unknown = [f for f in functions if f not in known]
    if unknown:
        sys.exit(f"fuzz.py: unknown function(s) {unknown}; known: binding, api, all, {sorted(known)}")
    asan = detect_asan()
    no_huge = a.no_huge or (asan and "allocator_may_return_null=1" not in os.environ.get("ASAN_OPTIONS", ""))
    mem = a.mem_limit_gb if a.mem_limit_gb is not None else (0 if asan else 8)
    workdir = a.workdir or tempfile.mkdtemp(prefix="attnpp-fuzz.")
    os.makedirs(workdir, exist_ok=True)
    if mem:  # the parent regenerates calls to describe them: the same limit as the children
        lim = int(mem * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    t0 = time.time()
    per_fn = collections.defaultdict(collections.Counter)
    outcomes = collections.Counter()
    messages = collections.Counter()
    valid_calls = 0
    groups = collections.OrderedDict()
    done, nxt, children, crashes = 0, a.start, 0, 0
    last_report = t0
    stop = a.start + a.calls

    def add(kind, index, fn, detail, extra=None):
        key = group_key(kind, fn, detail)
        g = groups.get(key)
        if g is None:
            g = groups[key] = dict(kind=kind, function=fn, detail=detail, count=0, indices=[], first=index,
                                   failing=kind in FAILING)
            if extra:
                g.update(extra)
        g["count"] += 1
        if len(g["indices"]) < 8:
            g["indices"].append(index)

    print(f"fuzz.py: seed {a.seed}, calls [{a.start}, {stop}), functions: {len(functions)}, asan: {asan}, "
          f"no_huge: {no_huge}, memory limit: {mem or 'none'} GiB, logs in {workdir}", flush=True)
    while nxt < stop:
        log = os.path.join(workdir, f"child{children}.log")
        errp = os.path.join(workdir, f"child{children}.err")
        cmd = [sys.executable, FUZZ_SCRIPT, "--child", "--seed", str(a.seed), "--start", str(nxt),
               "--stop", str(stop), "--functions", ",".join(functions), "--log", log,
               "--mem-limit-gb", str(mem)] + (["--no-huge"] if no_huge else [])
        open(log, "w").close()
        with open(errp, "wb") as ef:
            proc = subprocess.Popen(cmd, stdout=ef, stderr=ef, env=os.environ.copy())
        children += 1
        pos, buf, started, finished = 0, b"", None, None
        last_progress = time.time()
        rc = None
        hung = False

        def consume():
            nonlocal pos, buf, started, finished, last_progress, done, valid_calls
            with open(log, "rb") as f:
                f.seek(pos)
                data = f.read()
            if not data:
                return
            pos += len(data)
            buf += data
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                tag, rest = line[:1], line[2:]
                if tag == "S":
                    started = (int(rest.split()[0]), rest.split()[1])
                elif tag == "R":
                    i, fn, outcome, valid, *msg = rest.split(" ", 4)
                    if msg and msg[0]:
                        messages[f"{fn} | {msg[0]}"] += 1
                    finished = int(i)
                    per_fn[fn][outcome] += 1
                    outcomes[outcome] += 1
                    valid_calls += int(valid)
                    done += 1
                elif tag in "FN":
                    i, fn, kind, detail = json.loads(rest)
                    add(kind, i, fn, detail)
            last_progress = time.time()

        while True:
            rc = proc.poll()
            consume()
            if rc is not None:
                break
            if time.time() - last_progress > a.timeout:
                hung = True
                proc.kill()
                proc.wait()
                rc = proc.returncode
                consume()
                break
            now = time.time()
            if a.progress and now - last_report >= a.progress:
                last_report = now
                nf = sum(g["count"] for g in groups.values() if g["failing"])
                print(f"fuzz.py: {done} calls, {now - t0:.0f} s, {done / (now - t0):.0f} calls/s, crashes {crashes}, "
                      f"findings {nf}", flush=True)
            time.sleep(0.05)
        with open(errp, "rb") as f:
            err_tail = f.read()[-3000:].decode(errors="replace")
        if started is not None and (finished is None or finished < started[0]):
            i, fn = started
            kind = "hang" if hung else "crash"
            crashes += kind == "crash"
            why = f"no progress for {a.timeout} s" if hung else \
                (f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
            add(kind, i, fn, why, dict(stderr_tail=err_tail[-1500:],
                                       description=describe_call(a.seed, i, functions, no_huge)))
            print(f"fuzz.py: {kind.upper()} at call {i} ({fn}): {why}", flush=True)
            outcomes[kind] += 1
            per_fn[fn][kind] += 1
            done += 1
            nxt = i + 1
        elif rc != 0 and started is None:  # the child died before its first call: nothing to skip
            add("exit_error", nxt, "-", f"child exited with {rc} before its first call",
                dict(stderr_tail=err_tail[-1500:]))
            print(f"fuzz.py: the child exited with {rc} before its first call:\n{err_tail[-1500:]}", flush=True)
            break
        elif rc != 0:
            i = finished if finished is not None else nxt
            add("exit_error", i, "-", f"child exited with {rc} after call {i}", dict(stderr_tail=err_tail[-1500:]))
            nxt = (finished + 1) if finished is not None else nxt + 1
        else:
            nxt = stop
            if not a.keep:
                for p in (log, errp):
                    os.remove(p)
    elapsed = time.time() - t0
    for g in groups.values():
        if g["failing"] and "description" not in g:
            g["description"] = describe_call(a.seed, g["first"], functions, no_huge)
    findings = [g for g in groups.values() if g["failing"]]
    notes = [g for g in groups.values() if not g["failing"]]
    summary = dict(seed=a.seed, start=a.start, calls=done, valid_calls=valid_calls, seconds=round(elapsed, 1),
                   children=children, crashes=crashes, outcomes=dict(outcomes),
                   per_function={k: dict(v) for k, v in sorted(per_fn.items())},
                   findings=findings, notes=notes, asan=asan, no_huge=no_huge, workdir=workdir,
                   messages=dict(sorted(messages.items())))
    print_summary(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if not a.keep and not findings:
        try:
            os.rmdir(workdir)
        except OSError:
            pass
    return 1 if findings else 0


def print_summary(s):
    print(f"\nfuzz.py: {s['calls']} calls ({s['valid_calls']} valid before mutation) in {s['seconds']} s, "
          f"{s['children']} child process(es), {s['crashes']} crash(es)")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items(), key=lambda kv: -kv[1])))
    cols = sorted({o for v in s["per_function"].values() for o in v})
    w = max(len(f) for f in s["per_function"]) if s["per_function"] else 8
    print(f"{'function':<{w}} " + " ".join(f"{c[:14]:>14}" for c in cols))
    for fn, v in s["per_function"].items():
        print(f"{fn:<{w}} " + " ".join(f"{v.get(c, 0):>14}" for c in cols))
    for title, items in (("FINDINGS", s["findings"]), ("notes", s["notes"])):
        if not items:
            continue
        print(f"\n{title} ({len(items)} distinct):")
        for g in items:
            print(f"- [{g['kind']}] {g['function']}: {g['detail'][:300]}  (x{g['count']}, calls {g['indices']})")
            if g.get("failing"):
                print(f"    repro: python tools/fuzz.py --seed {s['seed']} --repro {g['first']}")
                for line in g.get("description", "").splitlines():
                    print("    " + line[:400])
                if g.get("stderr_tail"):
                    print("    stderr: " + g["stderr_tail"].strip()[-600:].replace("\n", "\n    stderr: "))
    if not s["findings"]:
        print("\nno findings")


def repro_main(a):
    functions = a.functions.split(",")
    call = generate(a.seed, a.repro if a.repro is not None else a.describe, functions, a.no_huge)
    print(call.describe(), flush=True)
    if a.repro is None:
        return 0
    core = import_core()
    np.seterr(all="ignore")
    outcome, findings, notes = execute(core, call)
    print(f"outcome: {outcome}")
    for kind, detail in findings + notes:
        print(f"[{kind}] {detail}")
    return 1 if any(k in FAILING for k, _ in findings) else 0
