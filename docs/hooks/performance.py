"""mkdocs hook: renders the benchmark's results files (docs/results/*.json, written by ``python -m attnpp.bench
--json PATH``; their format: attnpp.bench.results) into the performance page, where it says ``{{ results }}``.
Nothing on that page is typed by hand: a new results file is a new section at the next build."""
import html
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
MARKER = "{{ results }}"
FORMAT = "attnpp-bench-results/1"


def fmt_time(seconds):
    """Three significant digits in µs, ms or s (as the bench's table)."""
    for unit, scale in (("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if seconds < 1000 * scale or unit == "s":
            v = seconds / scale
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}"


def cell(text):
    """A table cell: the pipe escaped."""
    return str(text).replace("|", "\\|")


def side_time(case, side):
    figures = case[side]
    return fmt_time(figures.get("total_s", figures["median_s"]))


def target(case):
    if case.get("target") is None:
        return ""
    met = case.get("target_met")
    verdict = "" if met is None else (" met" if met else " **not met**")
    return f">= {case['target']} (issue {case['issue']}){verdict}"


def ratio_cell(ratio):
    return f"{ratio['median']:.2f} [{ratio['iqr'][0]:.2f}-{ratio['iqr'][1]:.2f}]"


def peers_table(data):
    """The peers' table (``--against``): one row per case and engine, or [] (no peers in the run; files written
    before issue 37 have none)."""
    rows = []
    for case in data["cases"]:
        for title, peer in case.get("peers", {}).items():
            check = "" if peer.get("error") is None else f"{peer['error']:.1e} (tol {peer['tolerance']:.2g})"
            if "skipped" in peer:
                rows.append(f"| {cell(case['name'])} | {cell(title)} | skipped | | {check} | {cell(peer['skipped'])} |")
            else:
                rows.append(f"| {cell(case['name'])} | {cell(title)} | {fmt_time(peer['median_s'])} | "
                            f"{ratio_cell(peer['ratio'])} | {check} | {cell(peer.get('note') or '')} |")
    if not rows:
        return []
    versions = ", ".join(f"{k} {v}" for k, v in data["peers"]["versions"].items())
    return ["", f"Peers, forward only ({cell(versions)}): each checked against float64 first (its error and the "
            "tolerance), then timed in the same rounds; peer/attnpp above 1: attnpp faster.", "",
            "| case | peer | time | peer/attnpp [IQR] | float64 check | note |", "|---|---|---:|---:|---:|---|", *rows]


def render(data, name):
    """One results file as markdown: the machine, then the cases' table, the peers' table, the skipped cases and the
    cases' lines."""
    if data.get("format") != FORMAT:
        raise ValueError(f"docs/results/{name}: format {data.get('format')!r}, expected {FORMAT!r}")
    m, run = data["machine"], data["run"]
    load = m.get("other_processes_load")
    out = [f"## {m['cpu_model']}, {data['date'][:10]}", "",
           f"From `docs/results/{name}` (`{' '.join(data['command'])}`).", "",
           "| | |", "|---|---|",
           f"| CPU | {cell(m['cpu_model'])}, {m['logical_cpus']} logical CPUs |",
           f"| vector flags | {cell(' '.join(m['simd_flags']) or 'unknown')} |",
           f"| CPU level | attnpp {m['level']['attnpp']}, PyTorch {m['level']['torch']}"
           + (f" (forced: {cell(', '.join(f'{k}={v}' for k, v in m['forced'].items()))})" if m["forced"] else "")
           + " |",
           f"| threads | attnpp {m['threads']['attnpp']}, PyTorch {m['threads']['torch']} |",
           f"| versions | {cell(', '.join(f'{k} {v}' for k, v in m['versions'].items()))} |",
           f"| other processes | {'n/a' if load is None else f'{load:.0%}'} of the CPUs' time during the run |",
           f"| run | {run['repeats']} alternating pairs per case{', --quick sizes' if run['quick'] else ''} |"]
    if m.get("note"):
        out.append(f"| note | {cell(m['note'])} |")
    out += ["", "| case | attnpp | PyTorch | ratio [IQR] | attnpp GFLOP/s | % of GEMM | % of peak | attnpp MiB | "
            "PyTorch MiB | target |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for case in data["cases"]:
        if "skipped" in case:
            out.append(f"| {cell(case['name'])} | skipped | skipped | | | | | | | {target(case)} |")
            continue
        gflops = "" if case["attnpp_gflops"] is None else f"{case['attnpp_gflops']:.1f}"
        share, of_peak = ("" if case.get(k) is None else f"{case[k]:.0%}" for k in ("gemm_share", "peak_share"))
        memory = ["n/a" if case[s]["memory_mib"] is None else f"{case[s]['memory_mib']:.1f}" for s in ("attnpp", "torch")]
        out.append(f"| {cell(case['name'])} | {side_time(case, 'attnpp')} | {side_time(case, 'torch')} | "
                   f"{ratio_cell(case['ratio'])} | {gflops} | {share} | {of_peak} | {memory[0]} | {memory[1]} | "
                   f"{target(case)} |")
    out += peers_table(data)
    notes = [f"skipped {c['name']}: {c['skipped']}" for c in data["cases"] if "skipped" in c]
    notes += (data.get("peers") or {}).get("missing", [])
    notes += [c["line"] for c in data["cases"] if c.get("line")]
    sgemm = data["sgemm"]
    rates = ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in sgemm["gflops"].items())
    limits = sgemm.get("limits", {"float32": "PyTorch", "bfloat16": "PyTorch bfloat16"})
    notes.append(f"sgemm {sgemm['n']}^3 in the same run: {rates} ({sgemm['numpy_threads']}); % of GEMM: of "
                 f"{limits['float32']}'s float32 rate, bfloat16 cases of {limits['bfloat16']}'s")
    if data.get("peak"):  # (files since the multiply-add peak came: results.py)
        peak = data["peak"]
        notes.append(f"multiply-add peak at {peak['level']} on {peak['threads']} threads in the same run: "
                     f"{peak['gflops']:.1f} GFLOP/s; % of peak: of it")
        if peak.get("forward_products"):  # (files since the forward's products came)
            rates = ", ".join(f"D={D} {rate:.1f} GFLOP/s ({rate / peak['gflops']:.0%} of the peak)"
                              for D, rate in peak["forward_products"].items())
            notes.append(f"the forward's products alone on its blocks, no softmax: {rates}")
    out += [""] + [f"- {html.escape(line)}" for line in notes]
    return "\n".join(out)


def results_markdown(folder=RESULTS):
    """Every results file in ``folder``, newest first (by the date inside)."""
    files = [(json.loads(p.read_text()), p.name) for p in sorted(folder.glob("*.json"))]
    if not files:
        return "No results file is committed yet: `python -m attnpp.bench --json docs/results/NAME.json`."
    files.sort(key=lambda f: f[0]["date"], reverse=True)
    return "\n\n".join(render(data, name) for data, name in files)


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, results_markdown())
