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


@pytest.mark.parametrize("where", ["example-report", "example-report-dp", "written"])
def test_page_one_is_five_plain_sentences_whose_numbers_are_scorecard_rows(where, request):
    folder = request.getfixturevalue("written") if where == "written" else EXAMPLE.parent / where
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
    assert title("fedavg_local_eps8") == f"{load('method', 'fedavg').title} local eps8"   # a DP setting's label


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


def _dp_model(bank_leaks: bool, weights_leak: bool):
    """A hand-made model: FedAvg without DP (its weights give back images), FedAvg and FedDG at a DP budget whose
    weights are covered (finite ε) and FedDG's amplitude bank outside DP (infinite ε)."""
    from fdg_audit.report.model import Cell, Model
    nan = float("nan")

    def cell(method, artifact, eps, value, adversary="server", setting=""):
        rid = f"r.{method}.reconstruction.{setting or 'all'}.{adversary}".replace("_", "-").replace(" ", "-").lower()
        return Cell(id=rid, group=("r", method, ""), harm="reconstruction", setting=setting, adversary=adversary,
                    metric="reid", unit="fraction", value=value, lo=value - 0.1, hi=min(1.0, value + 0.1), n=3,
                    baseline=0.2, b_lo=nan, b_hi=nan, baseline_kind="free guess", chance=0.01, reading="", control="",
                    attack="a", artifact=artifact, size=None, channel="", legible=None, comparison=None,
                    row={"epsilon": str(eps), "runs_clear": ""})
    cells = [cell("fedavg", "weights", "inf", 0.9),
             cell("fedavg_eps2", "weights", 1.9, 0.8 if weights_leak else 0.25),
             cell("feddg_eps2", "weights", 1.9, 0.22),
             cell("feddg_eps2", "amplitude_bank", "inf", 0.95 if bank_leaks else 0.21, "client",
                  "amplitude_bank outside DP")]
    return Model(res=None, cells=cells, comparisons=[], bytes={}, reference="fedavg")


def test_page_one_says_what_still_gives_back_images_under_dp():
    """Where runs use DP, page one names what still gives back images: a channel under DP first, else one outside
    every DP mechanism (its ε infinite), else it says none does and gives the highest cell; no sentence without DP.
    The cell without DP (FedAvg's 0.9) is never the one named."""
    from fdg_audit.report.pageone import under_dp
    s = under_dp(_dp_model(bank_leaks=True, weights_leak=False))
    assert s.startswith("Under DP, FedDG eps2's amplitude bank, outside DP, is still re-identified by a client at "
                        "0.95 [0.85, 1.00] against")
    assert "(3 runs, leak) [↗](#r.feddg-eps2.reconstruction.amplitude-bank-outside-dp.client)" in s
    assert s.endswith("while no channel under DP gives back images.")
    s = under_dp(_dp_model(bank_leaks=True, weights_leak=True))
    assert s.startswith("Under DP, FedAvg eps2's weights still give back images to the server, re-identified at 0.80")
    s = under_dp(_dp_model(bank_leaks=False, weights_leak=False))
    assert s.startswith("Under DP, no channel gives back images at any budget: the most is FedAvg eps2's weights, "
                        "re-identified by the server at 0.25"), s
    m = _dp_model(bank_leaks=True, weights_leak=True)
    m.cells = m.cells[:1]
    assert under_dp(m) is None


def test_page_one_says_what_the_accuracy_data_rule_out(monkeypatch):
    """Issue 48: the largest distinguishable accuracy difference leads and the others get the power statement (the
    widest interval as ±, with its row); with none distinguishable every difference is bounded the same way."""
    from fdg_audit.report import pageone as P
    from fdg_audit.report.model import Cell, Comparison, Model
    monkeypatch.setattr(P.T, "accuracy_table", lambda res: [])   # no NOT CONVERGED group
    nan = float("nan")

    def pair(ds, method, diff, half, call):
        cmp = Comparison(id=f"c.{ds}.{method}", dataset=ds, harm="accuracy", adversary="", setting="",
                         a=(ds, method, ""), b=(ds, "fedavg", ""), channel_a="", channel_b="", metric="acc",
                         diff=diff, lo=diff - half, hi=diff + half, n=20, p_holm=0.5, call=call, family=4)
        return cmp, Cell(id=f"{ds}.{method}.accuracy", group=(ds, method, ""), harm="accuracy", setting="",
                         adversary="", metric="acc", unit="fraction", value=0.7, lo=0.6, hi=0.8, n=20, baseline=nan,
                         b_lo=nan, b_hi=nan, baseline_kind="", chance=nan, reading="", control="", attack="",
                         artifact="", size=None, channel="", legible=None, comparison=cmp, row={})
    made = [pair("rotated", "csac", -0.036, 0.017, "distinguishable"), pair("rotated", "feddg", -0.008, 0.019,
            "not distinguishable"), pair("digits_dg", "feddg", 0.016, 0.023, "inconclusive")]
    m = Model(res=None, cells=[c for _, c in made], comparisons=[c for c, _ in made], bytes={}, reference="fedavg")
    assert P.accuracy(m) == (
        "CSAC minus FedAvg in held-out accuracy on rotated is -0.036 [-0.053, -0.019] (20 runs, distinguishable) "
        "[↗](#rotated.csac.accuracy), and the others lie within ±0.039 at 95%, the widest FedDG on digits dg (20 "
        "runs, inconclusive) [↗](#digits_dg.feddg.accuracy).")
    # two groups NOT CONVERGED on a data set the sentence shows: both the power statement and the groups fit
    late = [dict(key=(ds, meth, ""), converged=0, runs=20) for ds, meth in (("digits_dg", "feddg"), ("rotated", "csac"))]
    monkeypatch.setattr(P.T, "accuracy_table", lambda res: late)
    assert P.accuracy(m) == (
        "CSAC minus FedAvg in held-out accuracy on rotated is -0.036 [-0.053, -0.019] (20 runs, distinguishable) "
        "[↗](#rotated.csac.accuracy), and FedDG on digits dg, CSAC on rotated had NOT CONVERGED, and the others lie "
        "within ±0.039 at 95%, the widest FedDG on digits dg (20 runs, inconclusive) [↗](#digits_dg.feddg.accuracy).")
    monkeypatch.setattr(P.T, "accuracy_table", lambda res: [])
    m.comparisons = m.comparisons[1:]
    assert P.accuracy(m).startswith("No held-out accuracy difference to FedAvg is distinguishable, every one lies "
                                    "within ±0.039 at 95%, the widest being FedDG on digits dg at +0.016")
    # one run per method (a preview): no interval, no "±nan"; the sentence says the comparison is not testable
    from dataclasses import replace
    one = [replace(c, lo=nan, hi=nan, n=1, call="not testable") for c, _ in made]
    m.cells, m.comparisons = [replace(cell, n=1, comparison=c) for c, (_, cell) in zip(one, made)], one
    text = P.accuracy(m)
    assert "nan" not in text and text.startswith(
        "No held-out accuracy difference to FedAvg is testable (a test needs 3 paired runs), the largest being "
        "CSAC on rotated at -0.036 (1 run, not testable) [↗](#rotated.csac.accuracy)"), text


def test_bank_against_weights_at_one_run_says_untested_not_a_holm_family_of_none():
    """A preview (1 run): the bank-minus-weights difference has an interval over images but no test; page one says
    so instead of "no size's difference survives the Holm correction over 0 comparisons"; at 5 runs, an interval
    clear of zero that Holm does not keep is said as such, with the size of its harm's Holm family."""
    from dataclasses import replace
    from types import SimpleNamespace

    from fdg_audit.report import pageone as P
    from fdg_audit.report.model import Cell, Comparison, Model
    nan, g = float("nan"), ("rotated_small", "feddg", "")
    cmp = Comparison(id="c.bank", dataset=g[0], harm="reconstruction", adversary="server", setting="", a=g, b=g,
                     channel_a="amplitude_bank", channel_b="weights", metric="reid", diff=0.53, lo=0.03, hi=0.88, n=1,
                     p_holm=nan, call="not testable", family=0)
    cell = Cell(id="rs.feddg.16", group=g, harm="reconstruction", setting="clients of 16 images", adversary="server",
                metric="reid", unit="fraction", value=0.9, lo=0.8, hi=1.0, n=1, baseline=0.2, b_lo=nan, b_hi=nan,
                baseline_kind="", chance=0.01, reading="", control="", attack="", artifact="amplitude_bank", size=16,
                channel="amplitude_bank", legible=None, comparison=cmp, row={})
    m = Model(res=SimpleNamespace(groups=lambda: [g]), cells=[cell], comparisons=[cmp], bytes={}, reference="fedavg")
    text = P.bank_vs_weights(m)
    assert "untested: a test needs 3 paired runs" in text and "Holm" not in text, text
    five = replace(cmp, n=5, p_holm=0.3, call="inconclusive", family=1)   # compare.holm_per_harm's count
    acc = replace(five, id="c.acc", harm="accuracy", channel_a="", channel_b="")   # another harm: another family
    m.cells, m.comparisons = [replace(cell, n=5, comparison=five)], [five, acc, acc]
    assert "no size's difference survives the Holm correction over the 1 reconstruction comparisons" in \
        P.bank_vs_weights(m)
