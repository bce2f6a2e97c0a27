"""The version is written once, in pyproject.toml: ``attnpp.__version__`` is the installed distribution's."""
import importlib.metadata
import pathlib

import pytest

import attnpp

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_version_is_the_installed_distributions():
    assert attnpp.__version__ == importlib.metadata.version("attnpp")


def test_version_is_pyprojects():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    if not PYPROJECT.exists():
        pytest.skip("tests run outside the source tree")
    with open(PYPROJECT, "rb") as f:
        assert attnpp.__version__ == tomllib.load(f)["project"]["version"]


def test_show_config_prints_the_version(capsys):
    attnpp.show_config()
    assert capsys.readouterr().out.startswith(f"attnpp {attnpp.__version__}\n")
