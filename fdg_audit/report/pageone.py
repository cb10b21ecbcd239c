"""Page one (issue 33, item 1): the answer in at most 25 lines, generated from the numbers only, opening report.md
and report.html and closing the terminal output.

* One sentence per data set family, at most five (``family_sentence``): which channel of which method gives back
  images, by the reconstruction headline (the same for every channel) with its 95% interval against chance; where the
  family's clients have fixed sizes, the sizes whose interval clears the baseline's, per channel (size curve); the
  other harms measured above baseline (cells whose whole interval clears their baseline's, ``verdict.clears``), with
  their channel and adversary; the leakage differences between methods whatever the channel and the held-out
  accuracy per method, with every difference between two methods and its call (paired by seed, Holm); bytes sent
  per run.
* The method x harm matrix (``matrix``): per family and method, each harm's main cell (the strongest attack over
  every channel; of the adversaries' cells the one that clears its baseline by most, the server's on a tie): value
  vs baseline, the call ("LEAK" when it clears its baseline), the channel (artifact) that carries it and Δ to the
  reference method over channels; held-out accuracy with its Δ and call; MB sent per run.
* A method whose accuracy row is NOT CONVERGED (``tables.not_converged``) says so beside its accuracy, in the
  sentence and in the matrix.
"""
from __future__ import annotations

from ..metrics.registry import HARMS, info
from .curves import HEADLINE, smallest_point
from .formatting import ci, human_bytes, md_table, md_text, num, text_table
from .select import primary, size_of
from . import tables as T
from .verdict import clears

MAX_LINES = 25


def _main(card: list[dict], ds: str, method: str, variant: str, harm: str) -> dict | None:
    rows = [r for r in card if (r["dataset"], r["method"], r["variant"], r["harm"]) == (ds, method, variant, harm)
            and primary(r.get("setting", ""))]
    rows.sort(key=lambda r: (not clears(r), -_margin(r), r["adversary"] != "server"))
    return rows[0] if rows else None


def _margin(r: dict) -> float:
    """How far a cell's value lies beyond its baseline, in the direction of more leakage (0 when unknown)."""
    if r["harm"] == "accuracy":
        return 0.0
    m = num(r["value"]) - num(r["baseline"])
    m = m if info(r["metric"].split("|")[0]).higher else -m
    return m if m == m else 0.0


def _label(r: dict) -> str:
    return "held-out accuracy" if r["harm"] == "accuracy" else info(r["metric"].split("|")[0]).label


def _vs_ref(comps: list[dict], g: tuple, harm: str, adversary: str) -> dict | None:
    """The comparison of group ``g`` with the reference method (``compare.between`` puts the reference second)."""
    return next((c for c in comps if c["ga"] == g and c["harm"] == harm and c["adversary"] == adversary
                 and c.get("ref")), None)


def _delta(c: dict | None, d: int) -> str:
    if not c:
        return ""
    iv = "" if c["lo"] != c["lo"] else f" [{c['lo']:+.{d}f}, {c['hi']:+.{d}f}]"
    return f"Δ {c['gb'][1]}{c['gb'][2]} {c['diff']:+.{d}f}{iv} {c['call']}"


def _cell(r: dict | None, comps: list[dict], g: tuple) -> str:
    if r is None:
        return "—"
    if r["value"] == "not measurable":
        return "not measurable (control failed)"
    call = "LEAK" if clears(r) else (r.get("reading") or "interval reaches baseline").split(":")[0]
    d = 1 if info(r["metric"].split("|")[0]).unit == "dB" else 3
    dl = _delta(_vs_ref(comps, g, r["harm"], r["adversary"]), d)
    who = ", ".join(filter(None, (r["adversary"] if r["adversary"] != "server" else "", r.get("setting", ""))))
    return f"{num(r['value']):.{d}f} vs {num(r['baseline']):.{d}f} {call} via {r['artifact']}" \
        + (f" ({who})" if who else "") + (f"; {dl}" if dl else "")


def _acc(r: dict | None, comps: list[dict], g: tuple, late: set) -> str:
    if r is None:
        return "—"
    dl = _delta(_vs_ref(comps, g, "accuracy", ""), 3)
    return ci(r, d=3) + " NOT CONVERGED" * (g in late) + (f"; {dl}" if dl else "")


def _not_converged(res) -> set:
    """The groups (dataset, method, variant) whose accuracy row is NOT CONVERGED (``tables.not_converged``)."""
    return {r["key"] for r in T.accuracy_table(res) if T.not_converged(r)}


def _smallest(curve: list[dict], g: tuple) -> str:
    """A reconstruction cell of a family with fixed client sizes (``curves.smallest_point``): value vs baseline, the
    call and the channel ("" without a size curve)."""
    c = smallest_point(curve, g)
    if c is None:
        return ""
    n, call = c["size"], "LEAK" if _above(c) else "interval reaches baseline"
    return f"{_iv(c['value'])} vs {c['baseline']['mean']:.2f} {call} at {n} image{'s' * (n > 1)} via {c['artifact']}"


def matrix(res, card: list[dict], comps: list[dict], by: dict, curve: list[dict] = ()
           ) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the method x harm matrix (module doc); ``curve``: the size-curve points, whose smallest
    client size gives the reconstruction cell of a family with fixed client sizes."""
    harms = [h for h in HARMS if h != "none" and any(r["harm"] == h and primary(r.get("setting", "")) for r in card)]
    many = len(res.groups()) != len({g[0] for g in res.groups()}) and len({g[0] for g in res.groups()}) > 1
    rows, late = [], _not_converged(res)
    for g in res.groups():
        mine = [_main(card, *g, h) for h in harms]
        if not any(mine) and not _main(card, *g, "accuracy"):
            continue
        mb = human_bytes(by[g]["total"]) if g in by else "—"
        cells = [(_smallest(curve, g) if h == "reconstruction" else "") or _cell(r, comps, g)
                 for h, r in zip(harms, mine)]
        rows.append(([g[0]] if many else []) + [g[1] + g[2]] + cells
                    + [_acc(_main(card, *g, "accuracy"), comps, g, late), mb])
    return (["family"] if many else []) + ["method"] + harms + ["held-out accuracy [95% CI]", "sent per run"], rows


def _join(parts: list[str], empty: str = "none") -> str:
    return "; ".join(parts) if parts else empty


def _iv(v: dict, d: int = 2) -> str:
    """"m [lo, hi]" of a size-curve or domain statistic."""
    return f"{v['mean']:.{d}f}" + ("" if v["lo"] != v["lo"] else f" [{v['lo']:.{d}f}, {v['hi']:.{d}f}]")


def _above(c: dict) -> bool:
    """A size-curve point whose interval clears its baseline's (its mean where the baseline has no interval)."""
    b = c["baseline"]
    return c["value"]["lo"] > (b["hi"] if b["hi"] == b["hi"] else b["mean"])


def _recon(res, card: list[dict], curve: list[dict], g: tuple) -> str:
    """What one method's channels give back: with fixed client sizes, per channel the sizes whose headline clears
    its baseline, with the smallest size's number; else the scorecard cell when it clears."""
    pts = [c for c in curve if c["key"] == g and c["metric"] == HEADLINE and not c["oracle"]]
    if pts:
        out = []
        for art in dict.fromkeys(c["artifact"] for c in pts):
            best = {}
            for c in pts:   # per size, the channel's strongest attack output
                if c["artifact"] == art and (c["size"] not in best or c["value"]["mean"] > best[c["size"]]["value"]["mean"]):
                    best[c["size"]] = c
            up = [best[n] for n in sorted(best) if _above(best[n])]
            if up:
                out.append(f"{art} at {', '.join(str(c['size']) for c in up)} of {', '.join(map(str, sorted(best)))} "
                           f"images ({_iv(up[0]['value'])} at {up[0]['size']})")
        return f"{g[1]}{g[2]}: " + ("; ".join(out) if out else "none above chance")
    r = _main(card, *g, "reconstruction")
    if r is None:
        return ""
    return f"{g[1]}{g[2]}: " + (f"{r['artifact']} {ci(r, d=2)}" if clears(r) else "none above chance")


def _chance(card: list[dict], curve: list[dict], fam: str) -> str:
    b = [num(r["baseline"]) for r in card if r["dataset"] == fam and r["harm"] == "reconstruction"
         and primary(r.get("setting", ""))] + [c["baseline"]["mean"] for c in curve if c["key"][0] == fam
                                      and c["metric"] == HEADLINE]
    b = sorted({f"{x:.2f}" for x in b if x == x})
    return "-".join(b[::len(b) - 1] if len(b) > 1 else b) or "—"


def _others(card: list[dict], fam: str) -> str:
    """The other harms measured above baseline in a family: method harm via channel (adversary; the client sizes
    where it clears, with fixed client sizes)."""
    out = {}
    for r in card:
        if r["dataset"] == fam and r["harm"] not in ("reconstruction", "accuracy") and clears(r) \
                and primary(r.get("setting", "")):
            k = f"{r['method']}{r['variant']} {r['harm']} via {r['artifact']} ({r['adversary']}"
            out.setdefault(k, []).append(size_of(r.get("setting", "")))
    sizes = lambda n: f"; clients of {', '.join(map(str, sorted(n)))} image" + "s" * (n != [1]) + ")"  # noqa: E731
    return _join([k + (sizes(n) if None not in n else ")") for k, n in out.items()])


def _accuracy(res, card: list[dict], comps: list[dict], fam: str) -> str:
    acc = [r for r in card if r["dataset"] == fam and r["harm"] == "accuracy" and not r.get("setting")]
    calls = [c for c in comps if c["harm"] == "accuracy" and c["ga"][0] == fam]
    diff = _join([f"{c['ga'][1]} − {c['gb'][1]} {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] {c['call']}"
                  for c in calls], "no paired runs to compare")
    late = _not_converged(res)
    return ", ".join(f"{r['method']}{r['variant']} {ci(r, d=3)}"
                     + " NOT CONVERGED" * ((fam, r["method"], r["variant"]) in late) for r in acc) + f" ({diff})"


def _between(comps: list[dict], fam: str) -> str:
    """Leakage differences between methods whatever the channel (``compare.between``: per harm, adversary and, with
    fixed client sizes, size), distinguishable or borderline."""
    out = [f"{c['a']} − {c['b']} {c['harm']} ({', '.join(filter(None, (c['adversary'], c['setting'])))}; "
           f"{c['channel_a']} vs {c['channel_b']}) {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] {c['call']}"
           for c in comps
           if c["harm"] != "accuracy" and c["ga"][0] == fam and c["call"] in ("distinguishable", "borderline")]
    return _join(out, "none distinguishable or borderline")


def family_sentence(res, card, comps, curve, by, fam: str) -> str:
    """One family's answer (module doc)."""
    gs = [g for g in res.groups() if g[0] == fam]
    rec = [x for x in (_recon(res, card, curve, g) for g in gs) if x]
    mb = ", ".join(f"{g[1]}{g[2]} {human_bytes(by[g]['total'])}" for g in gs if g in by)
    recon = f"images given back ({HEADLINE}, chance {_chance(card, curve, fam)}): {_join(rec)}; " if rec else \
        "no reconstruction attack ran; "
    return (f"{fam}: {recon}other leaks: {_others(card, fam)}; leakage between methods whatever the channel (paired by seed, Holm): "
            f"{_between(comps, fam)}; held-out accuracy {_accuracy(res, card, comps, fam)}"
            + (f"; sent per run: {mb}." if mb else "."))


def sentences(res, card, comps, curve, by) -> list[str]:
    """One sentence per data set family, at most five (module doc), each built from the numbers."""
    return [family_sentence(res, card, comps, curve, by, f) for f in dict.fromkeys(g[0] for g in res.groups())][:5]


def page_one_md(res, card, comps, curve, by, figures: list[str]) -> list[str]:
    """report.md's first section (``figures``: the trade-off PNG names), at most MAX_LINES lines with the title."""
    head, rows = matrix(res, card, comps, by, curve)
    md = ["## The answer"] + [f"- {md_text(s)}" for s in sentences(res, card, comps, curve, by)] + [""]
    if figures:
        md += [" ".join(f"![trade-off figure: held-out accuracy against leakage](plots/{f})" for f in figures), ""]
    if rows:
        md += [md_table(head, rows), ""]
    links = ["Details below: [scorecard](#privacy-scorecard), [between methods](#between-methods-whatever-the-"
             "channel), [attacks](#attacks-and-their-threat-models), [accuracy](#held-out-accuracy), "
             "[leakage](#leakage).", ""]
    lines = "\n".join(md + links).count("\n") + 1
    return md + links if lines + 2 <= MAX_LINES else md   # + 2: the report's title and its blank


def page_one_text(res, card, comps, curve, by, figures: list[str]) -> str:
    """The same page one for the terminal."""
    head, rows = matrix(res, card, comps, by, curve)
    out = ["", "THE ANSWER (report.md, page one)"] + [f"- {s}" for s in sentences(res, card, comps, curve, by)]
    if rows:
        out += [text_table(head, rows)]
    out += [f"trade-off figure: plots/{f}" for f in figures]
    return "\n".join(out)
