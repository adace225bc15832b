"""The HTML report in a real browser: headless Chromium opens the pages from disk, network off.

Pages of real runs (tests/html_cases.py): a forward log-domain failure, a divergence with
recoveries, a clean run with a (test-made) warning, and the built-in demo. For each: no request
leaves the page, nothing is logged as an error, the plots are drawn (SVG paths with non-empty
boxes, painted), the failing step and the highlighted origin line are visible, the Evidence section
shows its deciding numbers (label, value with its unit, meaning) with the raw dump folded, and the
plot legends say what happened (a loss, gradients or a recovery that went non-finite, an early
warning while every value was finite); the open time (navigation
start to the load event) and the file size are measured. A page whose strings carry script/img
payloads runs nothing and shows the text literally, with and without its Content-Security-Policy.

Screenshots, the pages, a print PDF and ``measurements.json`` go to ``$NANGUARD_TEST_ARTIFACTS``
(default: a pytest temporary folder). Needs the python ``playwright`` driver (test extra) and a
Chromium (Debian's ``chromium``; ``$NANGUARD_CHROMIUM`` names another). Without them the tests are
skipped, unless ``NANGUARD_REQUIRE_BROWSER=1`` (CI) makes that a failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from html_cases import LOG_DOMAIN_LINE, PAYLOADS, WARNING_STEP, payload_report, run_case
from nanguard.core.render.html import write_html

# The real runs of html_cases.run_case are cached per process: test_html.py and test_html_browser.py run on one
# pytest-xdist worker (--dist loadgroup), so each case runs once per session.
pytestmark = pytest.mark.xdist_group("html_cases")

CHROMIUM = next((p for p in [os.environ.get("NANGUARD_CHROMIUM")] + [shutil.which(n) for n in (
    "chromium", "chromium-browser", "google-chrome")] if p and os.access(p, os.X_OK)), None)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-default-apps", "--disable-extensions",
        "--host-resolver-rules=MAP * ~NOTFOUND"]  # no name resolves: nothing could leave even if asked
HAVE_PLAYWRIGHT = importlib.util.find_spec("playwright") is not None
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
MAX_BYTES = 1_000_000
MAX_OPEN_MS = 10_000  # generous: a loaded 2-core CI machine; typical is well under 1 s


def _missing() -> str:
    if not HAVE_PLAYWRIGHT:
        return "the python playwright driver is not installed (pip install -c constraints.txt -e '.[test]')"
    if not CHROMIUM:
        return "no Chromium found (apt-get install -y chromium, or set NANGUARD_CHROMIUM)"
    if not HAVE_MPL:
        return "matplotlib is not installed (pip install matplotlib)"
    return ""


@pytest.fixture(scope="module")
def browser():
    why = _missing()
    if why:
        if os.environ.get("NANGUARD_REQUIRE_BROWSER") == "1":
            pytest.fail(f"NANGUARD_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)  # fresh empty profile
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = Path(os.environ.get("NANGUARD_TEST_ARTIFACTS") or tmp_path_factory.mktemp("html_artifacts"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def measurements(artifacts):
    m: dict = {}
    yield m
    (artifacts / "measurements.json").write_text(json.dumps(m, indent=1))
    print("\nHTML report measurements:", json.dumps(m, indent=1), f"\nartifacts: {artifacts}")


class Opened:
    def __init__(self, page, ctx, url, requests, blocked, errors, dialogs, timing):
        self.page, self.ctx, self.url = page, ctx, url
        self.requests, self.blocked, self.errors, self.dialogs, self.timing = requests, blocked, errors, dialogs, timing


def open_page(browser, path: Path, width: int = 1200) -> Opened:
    ctx = browser.new_context(viewport={"width": width, "height": 900}, device_scale_factor=1)
    requests, blocked, errors, dialogs = [], [], [], []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()
    ctx.route("**/*", route)
    page = ctx.new_page()
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def dialog(d):
        dialogs.append(d.message)
        d.dismiss()
    page.on("dialog", dialog)
    url = path.resolve().as_uri()
    page.goto(url, wait_until="load")
    timing = page.evaluate("""() => { const n = performance.getEntriesByType('navigation')[0];
        return {load_ms: n.loadEventEnd - n.startTime, dom_ms: n.domContentLoadedEventEnd - n.startTime}; }""")
    return Opened(page, ctx, url, requests, blocked, errors, dialogs, timing)


def plot_boxes(page):
    """Per inline SVG: its size, its <path> count, the box of its first data line and whether that line
    is painted (a stroke, not hidden, not transparent)."""
    return page.evaluate("""() => Array.from(document.querySelectorAll('svg.plot')).map(s => {
        const r = s.getBoundingClientRect();
        const line = s.querySelector('[id^="ng-line-"] path');
        const lb = line ? line.getBoundingClientRect() : null;
        const cs = line ? getComputedStyle(line) : null;
        const painted = !!cs && cs.stroke !== 'none' && cs.visibility !== 'hidden' && cs.display !== 'none'
            && parseFloat(cs.opacity) > 0 && parseFloat(cs.strokeOpacity || '1') > 0;
        return {id: s.id, w: r.width, h: r.height, paths: s.querySelectorAll('path').length,
                line_w: lb ? lb.width : 0, line_h: lb ? lb.height : 0, painted};
    })""")


def legend_texts(page, key: str) -> list:
    """The legend entries of plot ``key`` (matplotlib writes them as <text> in its legend group)."""
    return page.evaluate("""(key) => Array.from(document.querySelectorAll(
        `#plot-${key} g[id^="legend"] text`)).map(t => t.textContent.trim()).filter(t => t)""", key)


def check_evidence(page):
    """The Evidence section a person reads: the deciding numbers with label, value (with its unit) and
    meaning, visible; the raw dump folded in a closed <details> whose content shows only when opened."""
    rows = page.evaluate("""() => Array.from(document.querySelectorAll('#evidence-deciding tbody tr')).map(r => ({
        key: r.dataset.key, label: r.querySelector('th').textContent.trim(),
        value: r.querySelector('td.value').textContent.trim(),
        meaning: r.querySelector('td.meaning').textContent.trim()}))""")
    assert rows, "no deciding numbers in the Evidence section"
    for r in rows:
        assert r["label"] and r["value"] and len(r["meaning"]) > 10, r
    assert visible(page, "#evidence-deciding")
    if page.locator("#evidence-all").count():
        assert page.evaluate("() => document.querySelector('#evidence-all').open") is False
        shown = "() => document.querySelector('#evidence-all table').checkVisibility({opacityProperty: true, " \
                "visibilityProperty: true, contentVisibilityAuto: true})"
        assert page.evaluate(shown) is False  # folded away (a closed <details> renders no content)
        page.click("#evidence-all > summary")
        assert page.evaluate(shown) is True and visible(page, "#evidence-all table")
        page.click("#evidence-all > summary")
        page.evaluate("() => window.scrollTo(0, 0)")  # visible() reads boxes from the top of the page
    return rows


def box(page, selector):
    return page.evaluate("""(sel) => { const el = document.querySelector(sel); if (!el) return null;
        const r = el.getBoundingClientRect(); return {w: r.width, h: r.height, x: r.x, y: r.y}; }""", selector)


def check_common(o: Opened, path: Path, name: str, artifacts: Path, measurements: dict, n_plots: int):
    page = o.page
    assert o.requests == [o.url], f"requests besides the page itself: {o.requests}"
    assert o.blocked == [] and o.errors == [] and o.dialogs == []
    size = path.stat().st_size
    assert size < MAX_BYTES
    assert 0 < o.timing["load_ms"] < MAX_OPEN_MS
    plots = plot_boxes(page)
    assert len(plots) == n_plots, plots
    for p in plots:
        assert p["w"] > 200 and p["h"] > 80 and p["paths"] > 5, p
        assert p["line_w"] > 0 or p["line_h"] > 0, f"{p['id']}: its data line is not drawn"
        assert p["painted"], f"{p['id']}: its data line is not painted"
    page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)
    page.screenshot(path=str(artifacts / f"{name}_top.png"))
    shutil.copy(path, artifacts / f"{name}.html")
    measurements[name] = {"bytes": size, "open_ms": round(o.timing["load_ms"], 1),
                          "dom_content_loaded_ms": round(o.timing["dom_ms"], 1), "plots": len(plots)}


def visible(page, selector) -> bool:
    """Laid out with a non-empty box (a vertical line's box has width 0: playwright's is_visible says
    no to it), not hidden by CSS, and inside the page."""
    return page.evaluate("""(sel) => { const el = document.querySelector(sel); if (!el) return false;
        const r = el.getBoundingClientRect(), cs = getComputedStyle(el);
        const W = document.documentElement.scrollWidth, H = document.documentElement.scrollHeight;
        return (r.width > 0 || r.height > 0) && cs.visibility !== 'hidden' && cs.display !== 'none'
            && parseFloat(cs.opacity) > 0 && r.right > 0 && r.bottom > 0 && r.left < W && r.top < H; }""",
                         selector)


# --------------------------------------------------------------------------- the real runs

def test_forward_log_domain_page(browser, tmp_path, artifacts, measurements):
    rep, script = run_case("log_domain", tmp_path)
    step = rep["events"][0]["step"]
    path = Path(write_html(rep, str(tmp_path / "log_domain.html")))
    o = open_page(browser, path)
    try:
        check_common(o, path, "log_domain", artifacts, measurements, n_plots=5)
        page = o.page
        assert page.inner_text("#failing-step") == str(step) and visible(page, "#failing-step")
        assert page.inner_text("#status") == "NONFINITE"  # CSS upper-cases the status badge
        # the failing step's line is drawn on the loss plot, at the right of the last recorded step
        line = box(page, f"#ng-failure-line-loss-{step} path")
        data = box(page, "#ng-line-loss-0 path")
        assert line and line["h"] > 20 and line["x"] >= data["x"] + data["w"] - 2
        # the origin line is highlighted: visible, the script's line, a coloured background
        assert visible(page, "#origin-line")
        src = Path(script).read_text().splitlines()[LOG_DOMAIN_LINE - 1]
        assert page.inner_text("#origin-line").strip() == f"{LOG_DOMAIN_LINE}{src}".strip()
        bg = page.evaluate("() => getComputedStyle(document.querySelector('#origin-line')).backgroundColor")
        assert bg not in ("rgba(0, 0, 0, 0)", "transparent")
        assert page.inner_text("#origin-module") == "head"
        # a forward failure: the loss itself went non-finite, and the legend says so
        assert f"loss non-finite at step {step}" in legend_texts(page, "loss")
        rows = check_evidence(page)
        labels = {r["label"]: r["value"] for r in rows}
        assert "origin op in float64" in labels and "log inputs at 0" in labels, labels
        assert labels["log inputs at 0"].endswith("elements"), labels  # the unit is said
        # print: the plots go two per row and stay drawn; a PDF as an artifact
        page.emulate_media(media="print")
        cols = page.evaluate("() => getComputedStyle(document.querySelector('.plots')).gridTemplateColumns")
        assert len(cols.split()) == 2
        assert all(p["w"] > 100 for p in plot_boxes(page))
        page.pdf(path=str(artifacts / "log_domain.pdf"), format="A4", print_background=True)
    finally:
        o.ctx.close()


def test_divergence_with_recovery_page(browser, tmp_path, artifacts, measurements):
    rep, _ = run_case("lr_recovered", tmp_path)
    ev = rep["events"][0]
    path = Path(write_html(rep, str(tmp_path / "lr_recovered.html")))
    o = open_page(browser, path)
    try:
        check_common(o, path, "lr_recovered", artifacts, measurements, n_plots=5)
        page = o.page
        assert page.inner_text("#failing-step") == str(ev["step"])
        assert visible(page, f"#ng-failure-line-loss-{ev['step']} path")
        assert visible(page, "#ng-recovery-marks-loss use")
        assert visible(page, "#ng-nonfinite-loss-0-inf use")
        assert page.get_attribute("figure[data-key=loss]", "data-scale") == "log"
        events = page.inner_text("#events")
        assert "rollback+lr_backoff+skip_step" in events and "lr_before" in events
        legend = " | ".join(legend_texts(page, "loss"))
        assert "recovered at step" in legend and "loss = +inf" in legend, legend
        rows = check_evidence(page)
        assert any(r["value"].startswith("×") for r in rows), rows  # a growth factor, with its unit
        assert visible(page, "#origin-line")
    finally:
        o.ctx.close()


def test_clean_run_with_warning_page(browser, tmp_path, artifacts, measurements):
    rep, _ = run_case("clean_warning", tmp_path)
    path = Path(write_html(rep, str(tmp_path / "clean_warning.html")))
    o = open_page(browser, path)
    try:
        check_common(o, path, "clean_warning", artifacts, measurements, n_plots=5)
        page = o.page
        assert page.inner_text("#status") == "CLEAN"
        assert visible(page, f"#ng-warning-line-loss-{WARNING_STEP} path")
        assert visible(page, "#ng-warning-marks-loss use")
        assert page.locator("#origin").count() == 0
        assert "grad_norm_spike" in page.inner_text("#events")
        # an early warning: every value was finite, and no legend or title says otherwise
        legend = legend_texts(page, "loss")
        assert f"early warning at step {WARNING_STEP} (all finite)" in legend, legend
        assert not any("non-finite" in t for k in ("loss", "grad_norm") for t in legend_texts(page, k))
        h1 = page.inner_text("h1").lower()  # titled as what happened: no non-finite value, a warning
        assert "no non-finite value, 1 warning" in h1 and "at step" not in h1, h1
    finally:
        o.ctx.close()


def test_demo_page(browser, tmp_path, artifacts, measurements):
    """``nanguard demo --report``: the page a first-time user sees (its size and open time)."""
    rep_path = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "nanguard", "demo", "--report", str(rep_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    html_path = tmp_path / "demo.html"
    assert subprocess.run([sys.executable, "-m", "nanguard", "report", str(rep_path), "-o", str(html_path)],
                          capture_output=True, text=True, timeout=300).returncode == 0
    o = open_page(browser, html_path)
    try:
        check_common(o, html_path, "demo", artifacts, measurements, n_plots=5)
        rep = json.loads(rep_path.read_text())
        step = rep["events"][0]["step"]
        assert o.page.inner_text("#failing-step") == str(step)
        assert visible(o.page, "#origin-line")
        # a backward failure with a finite loss: the loss legend names the gradients, never the loss
        legend = legend_texts(o.page, "loss")
        assert f"gradients non-finite at step {step}" in legend and not any("loss non-finite" in t for t in legend)
        rows = {r["label"]: r["value"] for r in check_evidence(o.page)}
        assert rows.get("+inf outputs", "").endswith("elements") and "inputs of the root at 0" in rows, rows
        # the why text follows the op's own output (+inf: x/0), not a fixed 0/0
        assert "x/0 = +inf" in o.page.inner_text("#summary") and "0/0" not in o.page.inner_text("#summary")
    finally:
        o.ctx.close()


# --------------------------------------------------------------------------- safety

@pytest.mark.parametrize("csp", [True, False], ids=["with-csp", "escaping-alone"])
def test_payloads_do_not_run_and_show_literally(browser, tmp_path, artifacts, csp):
    path = Path(write_html(payload_report(tmp_path), str(tmp_path / "payloads.html")))
    if not csp:  # prove the escaping, not the policy, keeps the payloads inert
        text = path.read_text()
        text, n = re.subn(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", text)
        assert n == 1
        path.write_text(text)
    o = open_page(browser, path)
    try:
        page = o.page
        assert o.dialogs == [] and o.requests == [o.url] and o.blocked == []
        assert page.evaluate("() => window.__ng_pwned") is None
        n = page.evaluate("() => document.querySelectorAll('script, img, iframe, object, embed, marquee, xmp, "
                          "svg:not(.plot) , [onerror], [onload]').length")
        assert n == 0
        assert page.inner_text("#origin-module") == PAYLOADS["module"]
        assert PAYLOADS["summary"] in page.inner_text("#summary")
        assert PAYLOADS["source"] in page.inner_text("#origin-line")
        assert PAYLOADS["fix"].replace("`", "") in page.inner_text("#fixes")
        if csp:
            page.screenshot(path=str(artifacts / "payloads_top.png"))
    finally:
        o.ctx.close()


def test_the_harness_sees_requests(browser, tmp_path):
    """The no-request checks above can fail: a page that asks for remote files is seen and blocked."""
    path = tmp_path / "remote.html"
    path.write_text('<!DOCTYPE html><html><head><link rel="stylesheet" href="http://nanguard.invalid/a.css">'
                    '</head><body><img src="https://nanguard.invalid/b.png"></body></html>')
    o = open_page(browser, path)
    try:
        assert len(o.requests) == 3 and sorted(o.blocked) == ["http://nanguard.invalid/a.css",
                                                              "https://nanguard.invalid/b.png"]
    finally:
        o.ctx.close()
