"""The documentation site: ``mkdocs build --strict`` is clean, every public function and class of attnpp.functional,
attnpp.nn, attnpp.optim, attnpp.torch and attnpp.transformers has an entry in the API reference, and the built home
page and an API page render in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by
selenium): the title, a table of contents, a highlighted code block, no console error. .ci/run installs chromium and
the ``docs`` extra; without them the browser test is skipped, saying which is missing."""
import functools
import html
import http.server
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ("functional", "nn", "optim", "torch", "transformers")

pytest.importorskip("mkdocs", reason='mkdocs is not installed: pip install ".[docs]"')
pytest.importorskip("mkdocstrings", reason='mkdocstrings is not installed: pip install ".[docs]"')


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from this checkout (``mkdocs build --strict``) into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # (Material's banner about mkdocs 2)
    assert build.returncode == 0, build.stdout + build.stderr
    assert not re.search(r"^(WARNING|ERROR)", build.stderr, re.MULTILINE), build.stderr
    return out


def public_names(module):
    """A module's public names: its ``__all__``, else the functions and classes it defines."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items() if not n.startswith("_")
                 and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__]
    return [n for n in names if callable(getattr(module, n))]  # (functions and classes; constants need no page)


def page_text(html_text):
    """The text of an HTML page, tags dropped, entities and white space made plain."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", html_text)).split())


@pytest.mark.parametrize("name", API)
def test_every_public_function_has_an_api_entry_with_its_docstring(site, name):
    module = importlib.import_module(f"attnpp.{name}")
    page = (site / "api" / name / "index.html").read_text()
    for public in public_names(module):
        anchor = f'id="attnpp.{name}.{public}"'
        assert anchor in page, f"attnpp.{name}.{public} has no entry in api/{name}/"
        # the entry shows the docstring: its first words follow the anchor
        doc = inspect.getdoc(getattr(module, public))
        assert doc, f"attnpp.{name}.{public} has no docstring"
        first_words = " ".join(re.findall(r"\w+", doc.split("\n")[0])[:6])  # (of its summary line)
        start = page.index(anchor)
        end = page.find('class="doc doc-heading"', start + len(anchor) + 30)  # the next entry's heading
        entry = " ".join(re.findall(r"\w+", page_text(page[start:end if end > 0 else None])))
        assert first_words in entry, (public, first_words, entry[:300])


def test_performance_page_is_rendered_from_the_results_files(site):
    import json
    page = (site / "performance" / "index.html").read_text()
    assert "{{ results }}" not in page
    files = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert files, "no results file in docs/results/"
    for path in files:
        data = json.loads(path.read_text())
        assert f"docs/results/{path.name}" in page
        for case in data["cases"]:
            assert html.escape(case["name"], quote=False) in page, case["name"]


def browser_or_skip():
    """A headless Chromium driven by selenium through Debian's chromedriver; skipped if one is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed: apt-get install chromium "
                    "chromium-driver (.ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason='selenium is not installed: pip install ".[docs]"')
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the browser does not run under tools/sanitize.sh's preloaded sanitizer runtime (only Python's processes do)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    return webdriver.Chrome(service=Service(executable_path=driver, env=env), options=options)


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on the loopback (the search and its worker need http, not file:)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    driver = browser_or_skip()
    yield driver
    driver.quit()


@pytest.mark.parametrize("path, title, toc_entry, code", [
    ("/", "attnpp", "Where to go", "import"),
    ("/api/functional/", "attnpp.functional - attnpp", "scaled_dot_product_attention", "scaled_dot_product_attention"),
])
def test_page_renders_in_headless_chromium(served, browser, path, title, toc_entry, code):
    from selenium.webdriver.common.by import By
    browser.get(served + path)
    assert browser.title == title
    # the table of contents of the page (Material's secondary navigation) lists its sections
    toc = browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--secondary a.md-nav__link")
    assert any(toc_entry in a.get_attribute("textContent") for a in toc), [a.get_attribute("textContent") for a in toc]
    # a code block rendered by Pygments: highlighted tokens inside a <pre>, which the browser lays out
    blocks = browser.find_elements(By.CSS_SELECTOR, ".highlight pre code")
    assert blocks, "no code block"
    block = next(b for b in blocks if code in b.get_attribute("textContent"))
    assert block.find_elements(By.CSS_SELECTOR, "span[class]"), "the code block is not highlighted"
    assert block.size["height"] > 0 and block.size["width"] > 0
    # Material's stylesheet and script ran: the header is laid out, the search input exists
    assert browser.find_element(By.CSS_SELECTOR, "header.md-header").size["height"] > 0
    assert browser.find_elements(By.CSS_SELECTOR, "input.md-search__input")
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
