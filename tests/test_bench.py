"""The benchmark's quick mode runs every case kind and prints a ratio for each (no timing is asserted)."""
import re
import subprocess
import sys

BENCH = [sys.executable, "-m", "attnpp.bench", "--quick"]
RATIO = re.compile(r"^\d+\.\d+ \[\d+\.\d+-\d+\.\d+\]$")  # median [first quartile-third quartile]


def run(*args):
    return subprocess.run(BENCH + list(args), capture_output=True, text=True, timeout=600)


def test_quick_run_prints_a_ratio_for_every_case():
    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    names = listed.stdout.splitlines()
    assert any(n.startswith("memory") for n in names) and any("training" in n for n in names)

    result = run()
    assert result.returncode == 0, result.stderr
    # table rows: cells separated by two or more spaces, the case name first, the ratio fourth
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines())}
    for name in names:
        assert name in rows, f"no row for {name!r} in:\n{result.stdout}"
        assert RATIO.match(rows[name][3]), f"no ratio in the row of {name!r}: {rows[name]}"
    assert re.search(r"attnpp temporaries -?\d+\.\d+ MiB|n/a", result.stdout)
