"""report.html in a real browser: a report built from a tiny run folder, rendered by headless Debian chromium at
1280 x 800, shows page one's answer sentences and the answer figure on its first screen; it has a table of contents,
and every in-page link (contents, page one's row links) reaches an element of the page; the file is self-contained
(images as data URIs, nothing fetched); text from a run folder is escaped in report.md and report.html."""
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from fdg_audit.report import model as M
from fdg_audit.report import tables as T
from fdg_audit.report import write_report
from fdg_audit.report.pageone import sentences

from conftest import tiny_scenario

TINY = tiny_scenario(name="tiny_html", report=None, seeds=[0, 1], methods=[dict(name="fedavg"), dict(name="feddg")],
                     attacks=[dict(name="mia_loss", max_victims=1)])   # report: the default (written)

W, H = 1280, 800
# a measuring probe appended to a copy of the page: writes where page one's parts are into the DOM
PROBE = """<script>var r=function(e){var b=e.getBoundingClientRect();return [b.left,b.top,b.width,b.height];};
document.documentElement.dataset.layout=JSON.stringify({items:Array.from(document.querySelectorAll('#page-one li'))
.map(r),said:Array.from(document.querySelectorAll('#page-one p')).map(function(p){return [p.textContent].concat(r(p));}),
figure:r(document.querySelector('#page-one img')),view:[innerWidth,innerHeight],
links:Array.from(document.querySelectorAll('a[href^="#"]')).map(function(a){var h=decodeURIComponent(a.getAttribute('href').slice(1));
return [h,!!document.getElementById(h)];})});</script>"""


def chromium(tmp_path, page, *args) -> str:
    exe = shutil.which("chromium")
    if not exe:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it): report.html is not tested in a browser")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={W},{H}", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True).stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import public_split
    from fdg_audit.runner import run_scenario
    d = tmp_path_factory.mktemp("html")
    (d / "tiny.toml").write_text(public_split(TINY))
    return run_scenario(str(d / "tiny.toml"), [], out=str(d / "runs"), quiet=True)


def test_the_first_screen_holds_the_answer_and_the_answer_figure_and_every_link_works(tiny, tmp_path):
    page = tiny / "report.html"
    src = page.read_text()
    # self-contained: every image a data URI, links only to the page itself or to the report's own files
    assert re.findall(r"<img [^>]*src=\"data:image/png;base64,", src)
    assert not re.search(r"src=\"(?!data:)", src) and "http://" not in src and "https://" not in src
    assert set(re.findall(r'href="(?!#)([^"]+)"', src)) <= {"scorecard.csv", "comparisons.csv"}
    assert all((tiny / f).is_file() for f in set(re.findall(r'href="(?!#)([^"]+)"', src)))
    md = (tiny / "report.md").read_text()
    assert md.splitlines()[2].startswith("Contents: ") and "## The answer" in md
    said = sentences(M.build(T.load([tiny])))
    assert 1 <= len(said) <= 5
    probe = tmp_path / "probe.html"
    probe.write_text(src.replace("</body>", PROBE + "</body>"))
    dom = chromium(tmp_path, probe, "--dump-dom")
    import html
    lay = json.loads(html.unescape(re.search(r'data-layout="([^"]+)"', dom).group(1)))
    view = lay["view"][1]        # --dump-dom lays out below the window's height: stricter still
    assert lay["view"][0] == W and view <= H
    text = re.sub(r"\s+", " ", " ".join(p[0] for p in lay["said"]))
    for s in said:               # every sentence is on page one, inside the first screen
        plain = re.sub(r"\s+", " ", re.sub(r"\[↗\]\(#[^)]+\)", "↗", s))
        assert plain in text, plain
        box = next(p for p in lay["said"] if plain in re.sub(r"\s+", " ", p[0]))
        assert 0 <= box[2] and box[2] + box[4] <= view
    x, y, w, h = lay["figure"]
    assert 0 <= y and y + h <= view and w >= 300 and h >= 200  # the answer figure, whole, on the first screen
    links = dict(lay["links"])
    assert len(links) >= 3 and all(links.values()), [k for k, ok in links.items() if not ok]
    assert any(k.count(".") >= 2 for k in links)             # page one's links to scorecard rows
    shot = tmp_path / "first.png"
    chromium(tmp_path, page, f"--screenshot={shot}")
    img = np.asarray(Image.open(shot).convert("L"), float)
    assert img.shape == (H, W)
    inside = img[int(y) + 2:int(y + h) - 2, int(x) + 2:int(x + w) - 2]
    assert (inside < 200).mean() > 0.02                          # the figure is painted there, not blank


def test_folder_text_is_escaped_and_truncated_in_report_md_and_html(tmp_path):
    from test_report import fabricate
    # 2,500 characters: past the 2,000 a cell keeps, so "L" * 2001 below finds any place that cuts later or never
    # (100,000 cost 45 s in the answer figure, whose legend draws the label in full)
    evil = "<script>alert(1)</script>\u200f|*b*\nnext" + "L" * 2_500
    root = fabricate(tmp_path / "r", methods=(("fedavg", "", {}), (evil, "", {})), extra=False)
    out = tmp_path / "out"
    md = write_report([root], out).read_text()
    page = (out / "report.html").read_text()
    assert "<script>alert" not in md and "\\<script\\>alert(1)\\</script\\>" in md
    assert "\u200f" not in md and "\u200f" not in page and "L" * 2001 not in md and "L" * 2001 not in page
    for line in md.splitlines():
        if line.startswith("|"):
            assert line.endswith("|")                             # no label broke a table row
    assert page.count("<script>") == 1 and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "characters)" in page                                  # the 2,500-character label is cut, and says so
