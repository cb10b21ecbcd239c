"""The results model (issue 46): built once from the run folders, read by every view (page one, the scorecard and
comparisons.csv, report.md's sections, the HTML, the answer figure and ``python -m fdg_audit answer``).

* ``Cell``: one row of scorecard.csv, typed: its stable ``id`` (family, method, harm, setting, adversary in words:
  the same cell has the same id in every report), value with its 95% interval and n (runs: held-out target x seed),
  its unit, its baseline with its interval and which baseline it is (``baseline_kind``: the strongest guess an
  attacker has for free where the attack names one, else "trivial"; accuracy: "chance") and the metric's chance,
  legibility where the scorer gives it, the reading (``state``: "leak", "no leak above baseline", "not measurable",
  "not resolvable", "vacuous", "sent in the clear"), the attack and channel chosen (one cross-fitted rule,
  report/select.py), and
  ``comparison``: the one comparison whose Δ the row shows.
* ``Comparison``: one row of comparisons.csv (between two methods whatever the channel, or between two channels of
  one method), with its one Holm-adjusted p-value and one call. A cell shows the comparison in which it is A and
  whose B is the reference method (its channel comparison for a channel's own cell), and nowhere another.
* ``Model``: cells, comparisons, bytes per run per group, the families and the rule that picks a method's answer
  cell at a setting (``main``: of the adversaries' cells the one that clears its baseline by most, the server's on
  a tie). Filling the model is the only place new cells, baselines or runs need code; the views read what is there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..metrics.registry import info
from . import compare as CMP
from . import scorecard as SC
from . import select as SEL
from . import tables as T
from .formatting import num
from .traffic import bytes_table

WHOLE = 10 ** 9   # the size of a whole-domain client on the answer figure's axis (after every fixed size)


@dataclass(frozen=True)
class Comparison:
    id: str
    dataset: str
    harm: str
    adversary: str
    setting: str
    a: tuple          # group (dataset, method, variant)
    b: tuple
    channel_a: str
    channel_b: str
    metric: str
    diff: float
    lo: float
    hi: float
    n: int
    p_holm: float
    call: str
    family: int       # the size of its Holm family: the testable comparisons of its harm (report/compare.py)

    @property
    def within(self) -> bool:
        """Two channels of one method (the same runs and items), not two methods."""
        return self.a == self.b

    @property
    def firm(self) -> bool:
        return self.call in ("distinguishable", "not distinguishable")


@dataclass(frozen=True)
class Cell:
    id: str
    group: tuple                 # (dataset, method, variant)
    harm: str
    setting: str
    adversary: str
    metric: str
    unit: str
    value: float
    lo: float
    hi: float
    n: int
    baseline: float
    b_lo: float
    b_hi: float
    baseline_kind: str
    chance: float
    reading: str
    control: str
    attack: str
    artifact: str
    size: int | None             # a client size (fixed-size families), None for whole-domain clients
    channel: str                 # "" for the cell over every channel the method sends
    legible: tuple | None        # (value, lo, hi, baseline) where the scorer measures legibility
    comparison: Comparison | None
    row: dict = field(repr=False, compare=False)

    @property
    def method(self) -> str:
        return self.group[1] + self.group[2]

    @property
    def measurable(self) -> bool:
        return self.value == self.value and self.control != "failed"

    @property
    def clears(self) -> bool:
        """The whole 95% interval beyond the baseline's (above it; below for an error metric): a leak."""
        if self.harm == "accuracy" or self.reading or not self.measurable:
            return False
        blo, bhi = (self.baseline, self.baseline) if self.b_lo != self.b_lo else (self.b_lo, self.b_hi)
        return self.lo > bhi if info(self.metric).higher else self.hi < blo

    @property
    def gives_back(self) -> bool:
        """Images given back (page one's words): the cell ``clears`` its baseline and, where the scorer measures
        legibility, the low end of its legibility interval lies above the free guess's legibility (a hit a person
        would not recognise is linkable, not given back)."""
        return self.clears and (self.legible is None or not self.legible[1] <= self.legible[3])

    @property
    def margin(self) -> float:
        if self.harm == "accuracy":
            return 0.0
        m = self.value - self.baseline
        m = m if info(self.metric).higher else -m
        return m if m == m else 0.0

    @property
    def rank(self) -> tuple:
        """The order in which a method's cells answer for it (``Model.main``, the answer figure): the one that clears
        its baseline by most first, the server's on a tie."""
        return (not self.clears, -self.margin, self.adversary != "server")

    @property
    def state(self) -> str:
        if not self.measurable:
            return "not measurable"
        if self.reading.startswith("not resolvable"):
            return "not resolvable"
        if self.reading.startswith("vacuous"):
            return "vacuous"
        if self.reading.startswith("sent in the clear"):
            return "sent in the clear"
        return "leak" if self.clears else "no leak above baseline"


@dataclass
class Model:
    res: T.Results
    cells: list[Cell]
    comparisons: list[Comparison]
    bytes: dict                  # group -> mean bytes on the bus per run
    reference: str

    def groups(self, ds: str | None = None) -> list[tuple]:
        return [g for g in self.res.groups() if ds is None or g[0] == ds]

    def families(self) -> list[str]:
        return list(dict.fromkeys(g[0] for g in self.res.groups()))

    def kind(self, ds: str) -> str:
        """The data-set family a data set draws from (e.g. rotated for rotated_small), from its runs' data config."""
        return next((str((r.get("data") or {}).get("family") or ds) for r in self.res.ok if r.get("dataset") == ds),
                    ds)

    def sized(self, ds: str) -> bool:
        return any(c.size is not None for c in self.cells if c.group[0] == ds)

    def find(self, g: tuple, harm: str, setting: str = "", adversary: str | None = None) -> list[Cell]:
        return [c for c in self.cells if c.group == g and c.harm == harm and c.setting == setting
                and (adversary is None or c.adversary == adversary)]

    def main(self, g: tuple, harm: str, setting: str = "") -> Cell | None:
        """A method's answer cell of a harm at a setting: over every channel (the cross-fitted choice), of the
        adversaries' cells the one that clears its baseline by most, the server's on a tie."""
        return min(self.find(g, harm, setting), key=lambda c: c.rank, default=None)

    def channels(self, g: tuple, harm: str = "reconstruction") -> list[str]:
        """The channels of a method measured for a harm at any setting of the family kind, by any adversary (answer
        figure)."""
        kin = [h for h in self.groups() if self.kind(h[0]) == self.kind(g[0]) and h[1:] == g[1:]]
        return sorted({c.artifact.split("|")[0] for c in self.cells if c.group in kin and c.harm == harm
                       and c.measurable})

    def channel_cell(self, g: tuple, setting: str, channel: str) -> Cell | None:
        """A method's cell of one channel at a setting: its own channel cell, or its cell over every channel when
        that chose the channel (page one and the answer figure)."""
        own = self.main(g, "reconstruction", ", ".join(filter(None, (setting, f"{channel} only"))))
        if own:
            return own
        c = self.main(g, "reconstruction", setting)
        return c if c and c.artifact == channel else None

    def cell(self, row_id: str) -> Cell:
        return next(c for c in self.cells if c.id == row_id)

    def rows(self) -> list[dict]:
        """scorecard.csv's rows."""
        return [c.row for c in self.cells]


def _comparison(c: dict) -> Comparison:
    return Comparison(id=c["id"], dataset=c["dataset"], harm=c["harm"], adversary=c["adversary"],
                      setting=c["setting"], a=c["ga"], b=c["gb"], channel_a=c.get("channel_a", ""),
                      channel_b=c.get("channel_b", ""), metric=c["metric"], diff=float(c["diff"]), lo=float(c["lo"]),
                      hi=float(c["hi"]), n=int(c["n"]), p_holm=float(c["p_holm"]), call=c["call"],
                      family=int(c.get("family_size", 0)))


def _own(r: dict, comps: list[Comparison], ref_of, card: dict) -> Comparison | None:
    """The comparison a scorecard row shows: it is A, and B is the reference method's cell at the same harm,
    adversary and setting (a channel's cell: its method's other channel). None for a cell with a reading (below its
    baseline, vacuous, not resolvable: the legend's rule) and between cells of different priors."""
    g = (r["dataset"], r["method"], r["variant"])
    ch = SEL.channel_of(r["setting"])
    ref = card.get((ref_of(g), r["harm"], r["setting"], r["adversary"]))
    below = r.get("reading") and not r["reading"].startswith("not resolvable")   # below its baseline, vacuous
    if (below and r["harm"] != "accuracy") or (ref and ref.get("prior") != r.get("prior") and not ch):
        return None
    for c in comps:
        if c.a != g or (c.harm, c.adversary) != (r["harm"], r["adversary"]):
            continue
        if ch and c.within and c.channel_a == ch and c.setting == SEL.channel_base(r["setting"]):
            return c
        if not ch and not c.within and c.b == ref_of(g) and c.setting == r["setting"]:
            return c
    return None


def build(res: T.Results) -> Model:
    """The model of ``res`` (module doc); computed once per Results."""
    if "model" in res.cache:
        return res.cache["model"]
    card = SC.scorecard(res)
    comps = [_comparison(c) for c in CMP.between(res, card)]
    by = {g: b["total"] for g, b in bytes_table(res.envelopes, res.ok).items()}
    f = SEL._fmt
    cells = []
    key = {((r["dataset"], r["method"], r["variant"]), r["harm"], r["setting"], r["adversary"]): r for r in card}
    for r in card:
        g = (r["dataset"], r["method"], r["variant"])
        c = _own(r, comps, lambda g: SEL.reference_group(res, g), key)
        r = {k: v for k, v in r.items() if not k.startswith("_")}
        r["id"] = SEL.stable_id(r["dataset"], r["method"] + r["variant"], r["harm"], r["setting"], r["adversary"])
        r["bytes"] = f(float(by[g])) if g in by else ""
        ref = g if g[1] == res.reference else SEL.reference_group(res, g)
        r["bytes_vs_ref"] = f"{100 * by[g] / by[ref]:.1f}" if g in by and by.get(ref) else ""
        if c is not None:
            r |= dict(comparison=c.id, reference=res.label(c.b) + (f" {c.channel_b}" if c.within else ""),
                      diff_ref=f(c.diff), diff_ref_ci_low=f(c.lo), diff_ref_ci_high=f(c.hi), diff_n=c.n,
                      diff_p_holm=f(c.p_holm), diff_call=c.call)
        metric = r["metric"].split("|")[0]
        leg = tuple(num(r.get(k)) for k in ("legible", "legible_ci_low", "legible_ci_high", "baseline_legible"))
        cells.append(Cell(
            id=r["id"], group=g, harm=r["harm"], setting=r["setting"], adversary=r["adversary"], metric=metric,
            unit=r.get("unit") or "", value=num(r["value"]), lo=num(r["ci_low"]), hi=num(r["ci_high"]),
            n=int(num(r["n_runs"])) if r["n_runs"] != "" else 0, baseline=num(r["baseline"]),
            b_lo=num(r["baseline_ci_low"]), b_hi=num(r["baseline_ci_high"]),
            baseline_kind=r.get("baseline_kind") or "trivial", chance=num(r.get("chance")),
            reading=r.get("reading") or "", control=r.get("control") or "", attack=r.get("attack") or "",
            artifact=r.get("artifact") or "", size=SEL.size_of(r["setting"]), channel=SEL.channel_of(r["setting"]),
            legible=leg if leg[0] == leg[0] else None, comparison=c, row=r))
    res.cache["model"] = Model(res=res, cells=cells, comparisons=comps, bytes=by, reference=res.reference or "")
    return res.cache["model"]
