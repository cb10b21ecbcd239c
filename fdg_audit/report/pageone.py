"""Page one (issue 46, item 2): at most five plain sentences generated from the results model (report/model.py), in
this order, each with one number, its 95% interval, its baseline or chance and n (runs), and a link to its
scorecard row id:

1. ``bank_vs_weights``: does one channel of a method (e.g. a bank) give back more than its other (its weights), and
   at which client sizes (the channel comparisons: the same runs and items, paired); where only one channel was
   attacked on whole-domain clients, that cell.
2. ``weights_reach``: what the channel every method sends (the reference method's: the weights) gives back, up to
   which client size, and from which size no method's does (``Cell.gives_back``: clears its baseline and, where the
   scorer measures legibility, is legible beyond the free guess).
3. ``under_dp``: where runs use DP, what still gives back images at the smallest budget: a channel under DP, else
   one outside every DP mechanism of the run (its ε is infinite), at the smallest budget where one does, else the
   highest cell, which then gives back none.
4. ``membership``: the strongest membership cell, by TPR at 1% FPR against its chance, AUC beside it, its adversary
   and channel named, and the strongest cell on any other channel beside it.
5. ``accuracy``: a resolved held-out accuracy difference, or what the data rule out (the widest interval).
6. ``traffic``: bytes sent per run as a percentage of the reference method's.

No code identifiers (words only: underscores become spaces), no semicolons, effect size and interval first, the
call word after. ``sentences`` returns them; ``page_one_md`` and ``page_one_text`` place them.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from ..errors import UserError
from . import tables as T
from .formatting import human_bytes, md_text, method_words, num
from .formatting import words as _words
from .model import WHOLE, Cell, Model

MAX_WORDS = 45


def words(x: str) -> str:
    """A name in words, escaped: a label from a run folder never becomes markup on page one."""
    return md_text(_words(x), 60)


def mw(g: tuple) -> str:
    """A group's method as its paper writes it, escaped (formatting.method_words)."""
    return md_text(method_words(g), 60)


def link(c: Cell) -> str:
    return f"[↗](#{c.id})"


def iv(v: float, lo: float, hi: float, d: int = 2, sign: bool = False) -> str:
    f = (lambda x: f"{x:+.{d}f}") if sign else (lambda x: f"{x:.{d}f}")
    return f(v) + ("" if lo != lo else f" [{f(lo)}, {f(hi)}]")


def runs(c: Cell) -> str:
    """"5 runs"; "5 runs, 4 above baseline" where the cell's claim did not hold in every run (scorecard runs_clear)."""
    k, _, n = str(c.row.get("runs_clear") or "").partition("/")
    held = f", {k} above baseline" if k and 0 < int(k) < int(n) else ""
    return f"{c.n} run" + "s" * (c.n != 1) + held


def size_words(c: Cell) -> str:
    return "whole-domain clients" if c.size is None else f"clients of {c.size} image" + "s" * (c.size != 1)


def _fit(parts: list[str]) -> str:
    """The sentence of the leading parts that fit MAX_WORDS (the first always), closed by a full stop."""
    out = parts[0]
    for p in parts[1:]:
        if len((out + p).split()) <= MAX_WORDS:
            out += p
    out = out.rstrip(" ,") + "."
    return out[:1].upper() + out[1:]


def _at(m: Model, cmp) -> Cell | None:
    """The cell that shows comparison ``cmp`` (its A cell)."""
    return next((c for c in m.cells if c.comparison is cmp), None)


def bank_vs_weights(m: Model) -> str | None:
    within = [c for c in m.comparisons if c.within and c.harm == "reconstruction" and _at(m, c)]
    if not within:
        return None
    g = max(dict.fromkeys(c.a for c in within), key=lambda g: sum(c.a == g for c in within))
    mine = [c for c in within if c.a == g]
    a, b = words(mine[0].channel_a), words(mine[0].channel_b)
    cells = {c.id: _at(m, c) for c in mine}
    sizes = lambda cs: ", ".join(sorted({size_words(cells[c.id]).replace("clients of ", "")  # noqa: E731
                                         for c in cs if cells[c.id]}, key=_size_key))
    more = [c for c in mine if c.lo > 0 and c.call == "distinguishable"]
    less = [c for c in mine if c.hi < 0 and c.call == "distinguishable"]
    head = max(more or less or mine, key=lambda c: (abs(c.diff), -(cells[c.id].size or WHOLE)))
    at = cells[head.id]
    say = "more than" if head.diff > 0 else "less than"
    parts = [f"{mw(g)}'s {a} minus its {b} is {iv(head.diff, head.lo, head.hi, sign=True)} in "
             f"re-identification at {size_words(at)} on {words(g[0])} ({runs(at)}, {head.call}) {link(at)}"]
    if more:
        parts.append(f", so it gives back more at {sizes(more)}")
    if less:
        parts.append(f", less at {sizes(less)}")
    if not more and not less and head.call == "not testable":
        parts.append(", untested: a test needs 3 paired runs")
    elif not more and not less and (head.lo > 0 or head.hi < 0):
        parts.append(f", an interval clear of zero, but no size's difference survives the Holm correction over "
                     f"the {head.family} {head.harm} comparisons")
    elif not more and not less:
        parts.append(f", so neither channel is shown to give back {say} the other at any client size")
    whole = [c for h in m.groups() if h[1:] == g[1:] and not m.sized(h[0])
             for c in [m.main(h, "reconstruction")] if c and c.channel == "" and "|" not in c.artifact]
    if whole:
        w = max(whole, key=lambda c: c.value)
        parts.append(f", and on whole-domain clients only its {words(w.artifact)} was attacked, at "
                     f"{iv(w.value, w.lo, w.hi)} against {w.baseline:.2f} {link(w)}")
    return _fit(parts)


def _size_key(s: str) -> tuple:
    return (0, int(s.split()[0])) if s[0].isdigit() else (1, 0)


def weights_reach(m: Model) -> str | None:
    """Sentence 2. Families that reach the same largest leaking size are all named (in the report's order), the
    numbers are of the strongest cell among them."""
    ref = [g for g in m.groups() if g[1] == m.reference and m.sized(g[0])]
    chans = [c.artifact for g in ref for c in [m.main(g, "reconstruction", s) for s in _settings(m, g)] if c]
    if not chans:
        return None
    w = max(dict.fromkeys(chans), key=chans.count)
    reach = {}
    for ds in dict.fromkeys(g[0] for g in ref):
        for s in _settings(m, next(g for g in ref if g[0] == ds)):
            cs = [c for g in m.groups(ds) if (c := m.channel_cell(g, s, w))]
            reach.setdefault(ds, []).append((cs[0].size if cs else None, [c for c in cs if c.gives_back], cs))
    top = {ds: max((n for n, ok, _ in pts if ok and n), default=0) for ds, pts in reach.items()}
    best = max(top.values())
    if not best:
        c = max((c for pts in reach.values() for p in pts if p[0] for c in p[2]), key=lambda c: c.value)
        return _fit([f"No method gives back images through its {words(w)} at any client size: the highest is "
                     f"{iv(c.value, c.lo, c.hi)} against {c.baseline:.2f} on {words(c.group[0])} ({runs(c)}) "
                     f"{link(c)}"])
    tied = [ds for ds in reach if top[ds] == best]
    c = max((c for ds in tied for p in reach[ds] if p[0] == best for c in p[1]), key=lambda c: c.value)
    what = ("legible in " + iv(*c.legible[:3]) + f" of images against {c.legible[3]:.2f}") if c.legible else \
        f"re-identified at {iv(c.value, c.lo, c.hi)} against {_kind(c)} {c.baseline:.2f}"
    where = f" on {words(c.group[0])}" if len(tied) > 1 else ""
    parts = [f"The {words(w)} give back images up to {size_words(c)} on {' and '.join(map(words, tied))}, where "
             f"{mw(c.group)}'s{where} are {what} ({runs(c)}) {link(c)}"]
    after = [p for p in reach[c.group[0]] if p[0] and p[0] > best and not p[1] and p[2]]
    if after:
        s = min(after, key=lambda p: p[0])
        x = max(s[2], key=lambda c: c.legible[0] if c.legible else c.value)
        best = (f"legible in {iv(*x.legible[:3])} against {x.legible[3]:.2f}" if x.legible else
                f"re-identified at {iv(x.value, x.lo, x.hi)} against {x.baseline:.2f}")
        parts.append(f", and from {s[0]} images on none is, the most being {mw(x.group)}'s, {best} {link(x)}")
    return _fit(parts)


def _kind(c: Cell) -> str:
    return "a free guess of" if c.baseline_kind not in ("", "trivial") else "a baseline of"


def _settings(m: Model, g: tuple) -> list[str]:
    return sorted({c.setting for c in m.cells if c.group == g and c.harm == "reconstruction" and c.size is not None
                   and c.channel == ""}, key=lambda s: int(s.split()[2]))


def _by(c: Cell) -> str:
    return "the server" if c.adversary == "server" else f"a {words(c.adversary)}"


def under_dp(m: Model) -> str | None:
    """Sentence 3 (module doc). A cell's ε is scorecard.csv's: the one that holds for what it attacked, against its
    adversary (infinite for a channel outside DP); a method setting's budget is the smallest finite ε of its cells,
    named by its label (page one prints no ε: each number is its linked row's)."""
    eps = {c.id: num(c.row.get("epsilon")) for c in m.cells}
    budget = {}
    for c in m.cells:
        if eps[c.id] < float("inf"):
            budget[c.group] = min(budget.get(c.group, float("inf")), eps[c.id])
    rec = [c for c in m.cells if c.group in budget and c.harm == "reconstruction" and c.measurable]
    if not rec:
        return None
    inside = [c for c in rec if eps[c.id] < float("inf")]
    back_in = [c for c in inside if c.gives_back]
    back_out = [c for c in rec if eps[c.id] == float("inf") and c.gives_back]
    key = lambda c: (budget[c.group], -c.value)  # noqa: E731
    if back_in:
        c = min(back_in, key=key)
        verb = "give" if words(c.artifact).endswith("s") else "gives"   # weights give, a bank gives
        return _fit([f"Under DP, {mw(c.group)}'s {words(c.artifact)} still {verb} back images to "
                     f"{_by(c)}, re-identified at {iv(c.value, c.lo, c.hi)} against {_kind(c)} {c.baseline:.2f} "
                     f"on {words(c.group[0])} ({runs(c)}, {c.state}) {link(c)}"])
    if back_out:
        c = min(back_out, key=key)
        parts = [f"Under DP, {mw(c.group)}'s {words(c.artifact)}, outside "
                 f"DP, is still re-identified by {_by(c)} at {iv(c.value, c.lo, c.hi)} "
                 f"against {_kind(c)} {c.baseline:.2f} on {words(c.group[0])} ({runs(c)}, {c.state}) {link(c)}"]
        if inside:
            parts.append(", while no channel under DP gives back images")
        return _fit(parts)
    c = max(rec, key=lambda c: c.margin)
    return _fit([f"Under DP, no channel gives back images at any budget: the most is "
                 f"{mw(c.group)}'s {words(c.artifact)}, re-identified by {_by(c)} at {iv(c.value, c.lo, c.hi)} against "
                 f"{_kind(c)} {c.baseline:.2f} ({runs(c)}, {c.state}) {link(c)}"])


def membership(m: Model) -> str | None:
    every = [c for c in m.cells if c.harm == "membership" and c.setting == "" and c.measurable]
    cs = [c for c in every if c.state in ("leak", "no leak above baseline")] or every   # a readable cell first
    if not cs:
        return ("No membership attack ran in this job, so membership is not attacked here, which is not the same "
                "as no leak.")
    tpr = lambda c: c.row.get("tpr@0.01fpr")  # noqa: E731
    with_tpr = [c for c in cs if tpr(c) not in ("", None)]
    if not with_tpr:
        c = max(cs, key=lambda c: c.value)
        return _fit([f"Membership AUC is at most {iv(c.value, c.lo, c.hi, d=3)} against {c.baseline:.3f} for "
                     f"{mw(c.group)} on {words(c.group[0])} ({runs(c)}, {c.state}) {link(c)}",
                     ", and the pools are too small to read a true-positive rate at 1% false positives"])
    c = max(with_tpr, key=lambda c: (float(tpr(c)), c.adversary == "server"))   # the server's on a tie
    by = _by(c)
    what = words(c.artifact) or "messages"
    other = [d for d in with_tpr if d.artifact != c.artifact]
    auc = "" if other else f", AUC {iv(c.value, c.lo, c.hi, d=3)} against {c.baseline:.3f}"   # the row has it
    parts = [f"Membership inference by {by} on {mw(c.group)}'s {what} finds {_tpr(c)} of members at 1% "
             f"false positives (chance: 1%) on {words(c.group[0])}{auc} ({runs(c)}, {c.state}) {link(c)}"]
    if other:
        o = max(other, key=lambda d: float(tpr(d)))
        parts.append(f", and on the {words(o.artifact)} at most {_tpr(o)} ({runs(o)}, {mw(o.group)} on "
                     f"{words(o.group[0])}) {link(o)}")
    return _fit(parts)


def _tpr(c: Cell) -> str:
    r = c.row
    return iv(float(r["tpr@0.01fpr"]), num(r["tpr@0.01fpr_ci_low"]), num(r["tpr@0.01fpr_ci_high"]), d=3)


def accuracy(m: Model) -> str | None:
    """The largest distinguishable accuracy difference to the reference method on the whole-domain data sets, and
    what the data rule out for the others (the widest interval, as ±: the power statement, kept short so that it
    fits beside the NOT CONVERGED groups)."""
    comps = [c for c in m.comparisons if c.harm == "accuracy" and c.b[1] == m.reference]
    main = [c for c in comps if not m.sized(c.dataset)] or comps
    if not main:
        return None
    firm = [c for c in main if c.call == "distinguishable"]
    rest = [c for c in main if c.call not in ("distinguishable", "not testable") and c.lo == c.lo]
    parts = []
    if firm:
        c = max(firm, key=lambda c: abs(c.diff))
        at = _at(m, c)
        parts.append(f"{mw(c.a)} minus {mw(c.b)} in held-out accuracy on {words(c.dataset)} is "
                     f"{iv(c.diff, c.lo, c.hi, 3, True)} ({runs(at)}, {c.call}) {link(at)}")
    if rest:
        c = max(rest, key=lambda c: max(abs(c.lo), abs(c.hi)))
        at = _at(m, c)
        bound = f"within ±{max(abs(c.lo), abs(c.hi)):.3f} at 95%"
        parts.append(f", and the others lie {bound}, the widest {mw(c.a)} on {words(c.dataset)} ({runs(at)}, "
                     f"{c.call}) {link(at)}" if firm else
                     f"No held-out accuracy difference to {mw(('', m.reference, ''))} is distinguishable, every one "
                     f"lies {bound}, the widest being {mw(c.a)} on {words(c.dataset)} at "
                     f"{iv(c.diff, c.lo, c.hi, 3, True)} ({runs(at)}, {c.call}) {link(at)}")
    if not parts:   # fewer than 3 paired runs (a preview): not testable
        c = max(main, key=lambda c: abs(c.diff))
        at = _at(m, c)
        parts.append(f"No held-out accuracy difference to {mw(('', m.reference, ''))} is testable (a test needs 3 "
                     f"paired runs), the largest being {mw(c.a)} on {words(c.dataset)} at "
                     f"{iv(c.diff, c.lo, c.hi, 3, True)} ({runs(at)}, {c.call}) {link(at)}")
    return _late(m, parts, {c.dataset for c in main})


def _late(m: Model, parts: list[str], shown: set) -> str:
    """``_fit(parts)``, with the methods whose accuracy is NOT CONVERGED (tables.not_converged) named next to the
    lead when one is on a data set the sentence ``shown``, else last."""
    late = [r["key"] for r in T.accuracy_table(m.res) if T.not_converged(r)]
    if late:
        parts.insert(1 if {g[0] for g in late} & shown else len(parts),
                     ", and " + ", ".join(f"{mw(g)} on {words(g[0])}" for g in late) + " had NOT CONVERGED")
    return _fit(parts)


def traffic(m: Model) -> str | None:
    """The method that sends most against the reference method, on the whole-domain families (bytes and the
    percentage are both scorecard.csv columns of the two accuracy rows linked)."""
    pct = []
    for g in m.groups():
        ref = next((h for h in m.groups(g[0]) if h[1] == m.reference), None)
        acc, racc = m.main(g, "accuracy"), ref and m.main(ref, "accuracy")
        if ref and ref != g and acc and racc and acc.row.get("bytes_vs_ref") and not m.sized(g[0]):
            pct.append((float(acc.row["bytes_vs_ref"]), g, acc, racc))
    if not pct:
        return None
    p, g, acc, racc = max(pct, key=lambda t: t[0])
    return _fit([f"{mw(('', m.reference, ''))} sends {human_bytes(m.bytes[racc.group])} per run on {words(g[0])} "
                 f"({runs(racc)}) {link(racc)}, and {mw(g)} sends {human_bytes(m.bytes[g])}, "
                 f"{p:.0f}% of that ({runs(acc)}) {link(acc)}"])


def sentences(m: Model) -> list[str]:
    """Page one's sentences (module doc), at most five."""
    return [s for s in (bank_vs_weights(m), weights_reach(m), under_dp(m), membership(m), accuracy(m), traffic(m))
            if s][:5]


FIGURE_NOTE = ("How to read it: each line is one method (colour) and one channel (line style), its re-identification "
               "against the client's size, methods side by side at each size, with 95% intervals over runs (one run: "
               "over its images), the grey band is chance or the free guess, a cross marks a channel not attacked at "
               "that size, the right panel is held-out accuracy with its chance line.")
ACCURACY_NOTE = ("How to read it: held-out accuracy per family and method, the mean over runs with its 95% interval, "
                 "the dotted line is chance. No reconstruction attack ran, so there is no re-identification panel.")


def page_one_md(m: Model, figure: str | None, strips: list[str]) -> list[str]:
    """report.md's first section: the sentences, the answer figure with how to read it, the truth / reconstruction
    strips and a table of contents of what follows."""
    md = ["## The answer", ""] + [" ".join(sentences(m)), ""]
    if figure:
        md += [f"![answer figure: re-identification against client size, and held-out accuracy](plots/{figure})", "",
               FIGURE_NOTE if any(c.harm == "reconstruction" for c in m.cells) else ACCURACY_NOTE, ""]
    if strips:
        md += [" ".join(f"![truth and reconstruction, {words(s.split('.')[0])}](plots/{s})" for s in strips), "",
               "Top row: the victim's images, bottom row: the reconstruction, one strip per channel.", ""]
    return md


def answer_md(folder: str) -> str:
    """Page one's sentences of a written report, one bullet each, links pointing into ``folder/report.md``."""
    path = Path(folder) / "report.md"
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    if "## The answer" not in text:
        raise UserError(f"{path} is not a report with a page one: give the folder `fdg_audit report` wrote")
    body = text.split("## The answer", 1)[1].split("\n\n", 2)[1]
    said = re.split(r"(?<=\.)\s+(?=[A-Z])", body.strip())
    rel = Path(folder).as_posix().rstrip("/")
    return "\n".join("- " + s.replace("](#", f"]({rel}/report.md#") for s in said)


def page_one_text(m: Model, figure: str | None) -> str:
    """The same page one for the terminal, wrapped at 100 columns, links as row ids."""
    out = ["", "THE ANSWER (report.md, page one)"]
    for s in sentences(m):
        s = re.sub(r"\[↗\]\(#([^)]+)\)", r"[row \1]", s)
        out += textwrap.wrap(s, 100)
    if figure:
        out.append(f"answer figure: plots/{figure}")
    return "\n".join(out)
