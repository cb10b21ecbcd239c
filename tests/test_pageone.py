"""Page one (issue 46): at most five plain sentences, each number traceable to its scorecard row, one comparison one
p-value and one call in every view; on the committed example report of the main job and on a report written here."""
import csv
import re
import shutil
from pathlib import Path

import pytest

from pageone_check import LINK, disagreements, page_one, untraced

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example-report"


def plain(folder: Path) -> list[str]:
    """What is wrong with page one's form: more than five sentences, a sentence over 45 words, a code identifier
    (a token with an underscore), a semicolon, report.md before its appendix over 5,000 words."""
    md = (folder / "report.md").read_text()
    said, bad = page_one(md), []
    if not 1 <= len(said) <= 5:
        bad.append(f"{len(said)} sentences")
    for s in said:
        words = LINK.sub("", s).split()
        bad += [f"{len(words)} words: {s}"] if len(words) > 45 else []
        bad += [f"identifier: {w}" for w in words if "_" in w]
        bad += [f"semicolon: {s}"] if ";" in s else []
    front = md.split("\n## Appendix", 1)[0]
    if len(front.split()) > 5000:
        bad.append(f"report.md before its appendix: {len(front.split())} words")
    return bad


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A report of a hand-made folder: two methods, two targets, three seeds, a membership attack."""
    from test_report import fabricate

    from fdg_audit.report import write_report
    d = tmp_path_factory.mktemp("p1")
    root = fabricate(d / "r")
    write_report([root], d / "out")
    return d / "out"


@pytest.mark.parametrize("where", ["example", "written"])
def test_page_one_is_five_plain_sentences_whose_numbers_are_scorecard_rows(where, request):
    folder = EXAMPLE if where == "example" else request.getfixturevalue("written")
    assert plain(folder) == []
    assert untraced(folder) == []
    assert disagreements(folder) == []
    said = page_one((folder / "report.md").read_text())
    assert all(LINK.search(s) for s in said if re.search(r"\d\.\d", s))   # a sentence with a measurement links


def test_the_checks_fail_when_a_view_differs(tmp_path):
    """The same checks on a copy of the example whose scorecard.csv changed one linked number, and whose
    comparisons.csv changed one call: both are found."""
    shutil.copytree(EXAMPLE, tmp_path / "x")
    folder = tmp_path / "x"
    with open(folder / "scorecard.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    linked = LINK.findall(" ".join(page_one((folder / "report.md").read_text())))
    r = next(r for r in rows if r["id"] in linked and r["value"])
    for k, v in r.items():                 # every number of the row moves (its n stays), and its comparison goes
        if k not in ("n_runs", "diff_n", "n_items") and re.fullmatch(r"-?[\d.]+(e[+-]\d+)?", v or ""):
            r[k] = f"{1.5 * float(v) + 0.111:.6g}"
    r["comparison"] = ""
    with open(folder / "scorecard.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert any(x.startswith(r["id"]) for x in untraced(folder))
    with open(folder / "comparisons.csv", newline="") as f:
        comps = list(csv.DictReader(f))
    shown = {r["comparison"] for r in rows if r.get("comparison")}
    i = next(i for i, c in enumerate(comps) if c["id"] in shown)      # a comparison a scorecard row shows too
    comps[0], comps[i] = comps[i], comps[0]
    comps[0]["call"] = "borderline" if comps[0]["call"] != "borderline" else "inconclusive"
    with open(folder / "comparisons.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(comps[0]))
        w.writeheader()
        w.writerows(comps)
    assert any(x.startswith(comps[0]["id"]) for x in disagreements(folder))


def test_page_one_names_methods_as_their_papers_write_them():
    """Page one says "FedDG", never the registered key "feddg": each method's ``title``; a name read from a run
    folder that is not an installed plugin stays words and is never imported."""
    from fdg_audit.plugins import load
    from fdg_audit.report.formatting import title
    said = " ".join(page_one((EXAMPLE / "report.md").read_text()))
    names = {r["method"] for r in csv.DictReader(open(EXAMPLE / "scorecard.csv", newline=""))}
    for n in names:
        t = load("method", n).title
        assert t and t != n and not re.search(rf"(?<![\w/#.-]){n}(?![\w-])", LINK.sub("", said)), (n, said)
    assert any(load("method", n).title in said for n in names)
    assert title("os:system") == "os:system" and title("not_a_method") == "not a method"


@pytest.mark.parametrize("name", ["example-report", "membership-report"])
def test_the_answer_figures_note_describes_the_panels_it_has(name):
    """A report with a reconstruction cell explains the re-identification lines; one without (the membership
    companion runs none) says its figure is accuracy only, never lines that are not drawn."""
    from fdg_audit.report.pageone import ACCURACY_NOTE, FIGURE_NOTE
    folder = EXAMPLE.parent / name
    with open(folder / "scorecard.csv", newline="") as f:
        recon = any(r["harm"] == "reconstruction" for r in csv.DictReader(f))
    md = (folder / "report.md").read_text()
    assert (FIGURE_NOTE in md, ACCURACY_NOTE in md) == (recon, not recon)
