"""Commit-message lint: every commit after the one named in .ci/lint-since (the last commit before issue 36, which
set the rule) has a subject of at most 72 characters, a blank line, and a body that says why. Merge commits are
not checked (their messages are git's). Run by .ci/run; by hand: ``python tools/lint_commits.py [REV]`` (REV:
the newest commit to check, default HEAD). Exit status 1 and one line per fault if any commit breaks the rule."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBJECT_MAX = 72


def faults(message):
    """What is wrong with one commit message (an empty list if nothing)."""
    lines = message.rstrip("\n").split("\n")
    found = []
    if not lines[0].strip():
        found.append("empty subject")
    if len(lines[0]) > SUBJECT_MAX:
        found.append(f"subject of {len(lines[0])} characters (at most {SUBJECT_MAX})")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line after the subject")
    if not any(line.strip() for line in lines[2:]):
        found.append("no body (say why)")
    return found


def commits(since, until="HEAD"):
    """(hash, message) of every non-merge commit in since..until, oldest first."""
    out = subprocess.run(["git", "log", "--reverse", "--no-merges", "--format=%H%x00%B%x1e", f"{since}..{until}"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [tuple(record.strip("\n").split("\x00", 1)) for record in out.split("\x1e") if record.strip()]


def main(argv):
    since = (ROOT / ".ci" / "lint-since").read_text().strip()
    if subprocess.run(["git", "cat-file", "-e", f"{since}^{{commit}}"], cwd=ROOT).returncode != 0:
        sys.exit(f"lint_commits: {since} (.ci/lint-since) is not in this clone's history (a shallow clone?)")
    checked, bad = 0, 0
    for sha, message in commits(since, argv[0] if argv else "HEAD"):
        checked += 1
        for fault in faults(message):
            bad += 1
            print(f"{sha[:12]} {message.splitlines()[0][:60]!r}: {fault}")
    print(f"lint_commits: {checked} commits after {since[:12]} checked, {bad} faults")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
