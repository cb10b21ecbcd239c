"""Page one (issue 33, item 1): the answer in at most 25 lines, generated from the numbers only, opening report.md
and report.html and closing the terminal output.

* At most five sentences (``sentences``), each over every dataset family: which channel of which method leaks what
  (cells whose whole 95% interval clears their baseline's, ``verdict.clears``); up to which client size the
  reconstruction headline clears its baseline (where the family has fixed client sizes); which differences between
  methods, whatever the channel, are distinguishable or borderline (``compare.between``); the same for held-out
  accuracy; bytes sent per run.
* The method x harm matrix (``matrix``): per family and method, each harm's main cell (the strongest attack over
  every channel; of the adversaries' cells the one that clears its baseline by most, the server's on a tie): value
  vs baseline, the call
  ("leak" when it clears its baseline), the channel (artifact) that carries it and Δ to the reference method over
  channels; held-out accuracy with its Δ and call; MB sent per run.
"""
from __future__ import annotations

from ..metrics.registry import HARMS, info
from .curves import HEADLINE
from .formatting import ci, clean, human_bytes, md_table, md_text, num, text_table
from .verdict import clears

MAX_LINES = 25


def _main(card: list[dict], ds: str, method: str, variant: str, harm: str) -> dict | None:
    rows = [r for r in card if (r["dataset"], r["method"], r["variant"], r["harm"]) == (ds, method, variant, harm)
            and not r.get("setting")]
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
    return f"Δ {clean(c['b'], 40)} {c['diff']:+.{d}f}{iv} {c['call']}"


def _cell(r: dict | None, comps: list[dict], g: tuple) -> str:
    if r is None:
        return "—"
    if r["value"] == "not measurable":
        return "not measurable (control failed)"
    call = "LEAK" if clears(r) else (r.get("reading") or "interval reaches baseline").split(":")[0]
    d = 1 if info(r["metric"].split("|")[0]).unit == "dB" else 3
    dl = _delta(_vs_ref(comps, g, r["harm"], r["adversary"]), d)
    return f"{num(r['value']):.{d}f} vs {num(r['baseline']):.{d}f} {call} via {r['artifact']}" \
        + (f" ({r['adversary']})" if r["adversary"] != "server" else "") + (f"; {dl}" if dl else "")


def _acc(r: dict | None, comps: list[dict], g: tuple) -> str:
    if r is None:
        return "—"
    dl = _delta(_vs_ref(comps, g, "accuracy", ""), 3)
    return ci(r, d=3) + (f"; {dl}" if dl else "")


def matrix(res, card: list[dict], comps: list[dict], by: dict) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the method x harm matrix (module doc)."""
    harms = [h for h in HARMS if h != "none" and any(r["harm"] == h and not r.get("setting") for r in card)]
    many = len(res.groups()) != len({g[0] for g in res.groups()}) and len({g[0] for g in res.groups()}) > 1
    rows = []
    for g in res.groups():
        mine = [_main(card, *g, h) for h in harms]
        if not any(mine) and not _main(card, *g, "accuracy"):
            continue
        mb = human_bytes(by[g]["total"]) if g in by else "—"
        rows.append(([g[0]] if many else []) + [g[1] + g[2]] + [_cell(r, comps, g) for r in mine]
                    + [_acc(_main(card, *g, "accuracy"), comps, g), mb])
    return (["family"] if many else []) + ["method"] + harms + ["held-out accuracy [95% CI]", "sent per run"], rows


def _join(parts: list[str], empty: str = "none") -> str:
    return "; ".join(parts) if parts else empty


def _leaks(res, card: list[dict]) -> str:
    out = []
    for r in card:
        if clears(r) and not r.get("setting"):
            out.append(f"{clean(res.label((r['dataset'], r['method'], r['variant'])), 60)}'s {r['artifact']} "
                       f"({r['harm']}, {r['adversary']}): {_label(r)} {ci(r)} vs baseline {ci(r, 'baseline')}")
    return "Leaks measured above baseline (whole 95% interval beyond it): " + _join(out, "none at these budgets") + "."


def _sizes(res, curve: list[dict]) -> str:
    """Up to which client size each channel's reconstruction headline clears its baseline (size-curve rows)."""
    out = []
    head = {HEADLINE}
    for key in dict.fromkeys((r["key"], r["attack"], r["output"]) for r in curve if r["metric"] in head
                             and not r["oracle"]):
        rs = sorted((r for r in curve if (r["key"], r["attack"], r["output"]) == key and r["metric"] in head),
                    key=lambda r: r["size"])
        up = [str(r["size"]) for r in rs if r["value"]["lo"] > r["baseline"]["hi"]
              or r["value"]["lo"] > r["baseline"]["mean"] and r["baseline"]["hi"] != r["baseline"]["hi"]]
        out.append(f"{clean(res.label(key[0]), 60)}'s {rs[0]['artifact']} ({key[1]}) at "
                   f"{', '.join(up) if up else 'none'} of {', '.join(str(r['size']) for r in rs)} images")
    return (f"Reconstruction against client data size, the sizes whose {HEADLINE} interval clears its baseline's: "
            + _join(out) + ".") if out else ""


def _diffs(comps: list[dict], accuracy: bool) -> str:
    mine = [c for c in comps if (c["harm"] == "accuracy") == accuracy]
    if not mine:
        return ""
    say = lambda c: (f"{clean(c['a'], 60)} − {clean(c['b'], 60)}" + ("" if accuracy else  # noqa: E731
                     f" {c['harm']} ({c['adversary']}; {c['channel_a']} vs {c['channel_b']})")
                     + f" {c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}], p {c['p_holm']:.2g}")
    parts = [f"{call}: " + "; ".join(say(c) for c in mine if c["call"] == call)
             for call in ("distinguishable", "borderline") if any(c["call"] == call for c in mine)]
    rest = sum(c["call"] not in ("distinguishable", "borderline") for c in mine)
    what = "Held-out accuracy between methods" if accuracy else "Leakage between methods, whatever the channel"
    return (f"{what} (paired by seed, Holm-adjusted p; borderline = 0.01 to 0.1, not a firm claim): "
            + "; ".join(parts + [f"{rest} other pair(s) not distinguishable or not testable"]) + ".")


def _bytes(res, by: dict) -> str:
    if not by:
        return ""
    return "Bytes sent per run: " + ", ".join(f"{clean(res.label(g), 60)} {human_bytes(by[g]['total'])}"
                                              for g in res.groups() if g in by) + "."


def sentences(res, card, comps, curve, by) -> list[str]:
    """At most five sentences (module doc), each built from the numbers."""
    out = [_leaks(res, card), _sizes(res, curve), _diffs(comps, False), _diffs(comps, True), _bytes(res, by)]
    return [s for s in out if s][:5]


def page_one_md(res, card, comps, curve, by, figures: list[str]) -> list[str]:
    """report.md's first section (``figures``: the trade-off PNG names), at most MAX_LINES lines with the title."""
    head, rows = matrix(res, card, comps, by)
    md = ["## The answer", ""] + [f"- {md_text(s)}" for s in sentences(res, card, comps, curve, by)] + [""]
    if figures:
        md += [" ".join(f"![trade-off figure: held-out accuracy against leakage](plots/{f})" for f in figures), ""]
    if rows:
        md += [md_table(head, rows), ""]
    links = ["Details below: [scorecard](#privacy-scorecard), [between methods](#between-methods-whatever-the-"
             "channel), [attacks](#attacks-and-their-threat-models), [accuracy](#held-out-accuracy), "
             "[leakage](#leakage).", ""]
    return md + links if len(md) + len(links) + 2 <= MAX_LINES else md   # + 2: the report's title and its blank


def page_one_text(res, card, comps, curve, by, figures: list[str]) -> str:
    """The same page one for the terminal."""
    head, rows = matrix(res, card, comps, by)
    out = ["", "THE ANSWER (report.md, page one)"] + [f"- {s}" for s in sentences(res, card, comps, curve, by)]
    if rows:
        out += [text_table(head, rows)]
    out += [f"trade-off figure: plots/{f}" for f in figures]
    return "\n".join(out)
