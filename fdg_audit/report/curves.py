"""Reconstruction against the client's data size and per victim domain.

Size (issue 19, item 3): where a dataset gives its clients fixed
training-set sizes (``data.client_sizes``, e.g. [1, 4, 16, 64]), every reconstruction attack's per-victim rows of
leakage.csv are grouped by the victim's size. One point per (group, attack, output variant, size): the mean over the
attacked victims (one per run and source domain) of the reconstruction headline (the registry's card metric, the same
for every channel: ``HEADLINE``) and of PSNR, each with its 95% Student-t interval over those victims cut to the
metric's range, their number, and the same for the attack's own baseline. The output's prior and budget come from
attacks.json (report/threat.py); an oracle prior is an upper bound, flagged so, and drawn dashed.

Domain (``per_domain``): the same per-victim rows grouped by the victim's domain (a client "<domain>/<k>" belongs to
<domain>; a domain-level client is its own domain), every channel of a method in one table, so the bank's and the
weights' leak on each domain sit side by side.
"""
from __future__ import annotations

from collections import defaultdict

from ..vocab import ORACLE
from ..metrics import stats as S
from ..metrics.image import PSNR_CAP_DB
from ..metrics.registry import card_metrics, info
from . import tables as T
from .tables import client_size
from . import threat as TH
from .formatting import md_table, num

HEADLINE = card_metrics("reconstruction")[0]    # the reconstruction headline, whatever the channel (registry)
METRICS = {HEADLINE: min(info(HEADLINE).hi, PSNR_CAP_DB), "psnr": PSNR_CAP_DB}   # metric -> top of its range


def _ci(values, top: float) -> dict:
    m, lo, hi, n = S.t_interval(values)
    cut = lambda x: x if x != x else min(max(x, 0.0), top)  # noqa: E731
    return dict(mean=m, lo=cut(lo), hi=cut(hi), n=n)


def by_size(res: T.Results) -> list[dict]:
    """One row per (group, attack, output, client size, metric) of the runs whose clients have fixed sizes."""
    runs, gof = {r["run"]: r for r in res.ok}, res.group_of()
    by = defaultdict(list)
    for r in res.leakage:
        if r["metric"] in METRICS and r["run"] in gof and r.get("status") in ("ok", "") and r["victim"] != "pooled":
            n = client_size(runs[r["run"]], r["victim"])
            if n is not None:
                by[(gof[r["run"]], r["attack"], r.get("output") or "main", r["metric"], n)].append(r)
    out = []
    for (g, a, o, metric, n), rs in sorted(by.items(), key=lambda kv: (str(kv[0][:4]), kv[0][4])):
        desc = res.attacks.get(a, {})
        out.append(dict(key=g, attack=a, output=o, metric=metric, size=n, prior=TH.prior(desc, o),
                        artifact="|".join(dict.fromkeys(str(r.get("artifact", "")) for r in rs)),
                        budget=TH.budget(desc, o), oracle=TH.prior(desc, o) == ORACLE,
                        value=_ci([num(r["value"]) for r in rs], METRICS[metric]),
                        baseline=_ci([num(r["baseline"]) for r in rs], METRICS[metric])))
    return out


def _cell(s: dict, d: int) -> str:
    if not s["n"]:
        return "—"
    iv = "" if s["lo"] != s["lo"] else f" [{s['lo']:.{d}f}, {s['hi']:.{d}f}]"
    return f"{s['mean']:.{d}f}{iv}"


def curve_md(res: T.Results, rows: list[dict], files: list[str]) -> list[str]:
    """The report's section: one table per dataset family with fixed client sizes, and the figures."""
    if not rows:
        return []
    md = ["## Reconstruction against the client's data size", "",
          f"Per method, attack and prior: the reconstruction headline ({HEADLINE}, the same for every channel) and "
          "mean PSNR (dB) per client training-set size, mean [95% t-interval] over the attacked victims (n: "
          "one per run and "
          "source domain), each next to the attack's own baseline. Oracle priors are upper bounds, not findings.", ""]
    sizes = sorted({r["size"] for r in rows})
    cells = {(r["key"], r["attack"], r["output"], r["metric"], r["size"]): r for r in rows}
    for metric in METRICS:
        d = 1 if info(metric).unit == "dB" else 2
        body = []
        for key in dict.fromkeys((r["key"], r["attack"], r["output"]) for r in rows if r["metric"] == metric):
            first = next(cells[(*key, metric, n)] for n in sizes if (*key, metric, n) in cells)
            name = (f"{res.label(key[0])}, {key[1]}" + ("" if key[2] == "main" else f" ({key[2]})")
                    + (" — oracle: upper bound" if first["oracle"] else ""))
            got = [cells.get((*key, metric, n)) for n in sizes]
            body.append([name, first["prior"] or "—", first["budget"] or "—"]
                        + [_cell(c["value"], d) + f" (n = {c['value']['n']}; baseline {_cell(c['baseline'], d)})"
                           if c else "—" for c in got])
        md += [f"**{metric}**", "", md_table(["method, attack (variant)", "prior", "budget"]
                                             + [f"{n} images" for n in sizes], body), ""]
    return md + [f"![reconstruction against client data size](plots/{f})" for f in files] + [""]


def domain_of(victim: str) -> str:
    """The domain of a victim: "mnistm/2" -> "mnistm"; a domain-level client or an aggregate "a+b" as it is."""
    return victim if "+" in victim else victim.partition("/")[0]


def per_domain(res: T.Results) -> list[dict]:
    """One row per (group, attack, output, victim domain, metric): mean [95% t-interval] over the attacked victims
    of that domain (every run and client) of the headline and PSNR, with n, next to the baseline treated the same."""
    gof = res.group_of()
    by = defaultdict(list)
    for r in res.leakage:
        if r["metric"] in METRICS and r["run"] in gof and r.get("status") in ("ok", "") and r["victim"] != "pooled":
            by[(gof[r["run"]], r["attack"], r.get("output") or "main", domain_of(r["victim"]), r["metric"])].append(r)
    return [dict(key=g, attack=a, output=o, domain=d, metric=m, oracle=TH.prior(res.attacks.get(a, {}), o) == ORACLE,
                 value=_ci([num(r["value"]) for r in rs], METRICS[m]),
                 baseline=_ci([num(r["baseline"]) for r in rs], METRICS[m]))
            for (g, a, o, d, m), rs in by.items()]


def domain_md(res: T.Results, rows: list[dict]) -> list[str]:
    """The report's per-domain section: per group one table, a row per attack and variant (every channel), a
    column per victim domain holding the headline and PSNR, each with its baseline."""
    if not rows:
        return []
    md = ["## Reconstruction per victim domain", "",
          f"Per method, every reconstruction attack (every channel) and variant: {HEADLINE} and PSNR (dB) of the "
          "victims of each domain, mean [95% t-interval] over them (n: victims × runs), with the baseline of the "
          "same victims. Variants with the oracle prior are upper bounds, labelled so.", ""]
    cells = {(r["key"], r["attack"], r["output"], r["domain"], r["metric"]): r for r in rows}
    for g in dict.fromkeys(r["key"] for r in rows):
        doms = list(dict.fromkeys(r["domain"] for r in rows if r["key"] == g))
        body = []
        for a, o in dict.fromkeys((r["attack"], r["output"]) for r in rows if r["key"] == g):
            got = [[cells.get((g, a, o, d, m)) for m in METRICS] for d in doms]
            oracle = any(c and c["oracle"] for cs in got for c in cs)
            body.append([f"{a}: {o}" + (" (oracle: upper bound)" if oracle else "")]
                        + [" / ".join(_cell(c["value"], 1 if m == "psnr" else 2) if c else "—"
                                      for c, m in zip(cs, METRICS))
                           + (f" (n = {cs[0]['value']['n']})" if cs[0] else "") for cs in got])
            body.append([f"{a}: {o}, baseline"] + [" / ".join(_cell(c["baseline"], 1 if m == "psnr" else 2)
                                                               if c else "—" for c, m in zip(cs, METRICS))
                                                    for cs in got])
        md += [f"**{res.label(g)}** ({HEADLINE} / PSNR dB)", "", md_table(["attack: variant"] + doms, body), ""]
    return md


def smallest_point(curve: list[dict], g: tuple) -> dict | None:
    """A family with fixed client sizes: its reconstruction point at the smallest size, the strongest non-oracle
    output over every channel (what page one's matrix and the trade-off figure show); None without a size curve."""
    pts = [c for c in curve if c["key"] == g and c["metric"] == HEADLINE and not c["oracle"]]
    if not pts:
        return None
    n = min(c["size"] for c in pts)
    return max((c for c in pts if c["size"] == n), key=lambda c: c["value"]["mean"])
