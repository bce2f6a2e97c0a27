"""tools/lint_commits.py, the commit-message rule .ci/run enforces: a subject of at most 72 characters, a blank
line, a body."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("lint_commits", Path(__file__).resolve().parent.parent / "tools" /
                                              "lint_commits.py")
lint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint)


def test_a_good_message_has_no_fault():
    assert lint.faults("Make the bench a package\n\nIt imported itself back through _bench_ring.\n") == []
    assert lint.faults("x" * 72 + "\n\nwhy\n") == []


def test_each_fault_is_named():
    assert lint.faults("x" * 73 + "\n\nwhy\n") == ["subject of 73 characters (at most 72)"]
    assert lint.faults("Subject\nno blank line\nthe body\n") == ["no blank line after the subject"]
    assert lint.faults("Subject only\n") == ["no body (say why)"]
    assert lint.faults("Subject\n\n   \n") == ["no body (say why)"]
    assert lint.faults("\n\nbody\n") == ["empty subject"]


def test_the_commits_since_lint_since_are_found():
    since = (Path(lint.ROOT) / ".ci" / "lint-since").read_text().strip()
    found = lint.commits(since)
    assert all(len(sha) == 40 and message for sha, message in found)
