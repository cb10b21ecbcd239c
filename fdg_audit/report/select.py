"""Which attack output a scorecard cell reports (the lower half of the scorecard, shared with the comparisons between
methods in compare.py): the candidates of every cell, pooled over their victims (``_candidates``), the cross-fitted
choice among them (``selections``; fdg_audit.metrics.stats.crossfit), the settings a cell can have (main row, client
size, declared variants, artifacts outside DP) and the small helpers both modules use. The scorecard's columns are
documented in scorecard.py."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from .. import seeding
from ..vocab import ORACLE
from ..metrics import membership as MM
from ..metrics import stats as S
from ..metrics.registry import harm_of, info
from ..store.runfolder import load_items
from . import cells as C
from . import tables as T
from . import threat as TH
from .tables import client_size

def cut_diff(d: dict, metric: str) -> dict:
    """A difference (dict with lo, hi) with its interval cut to the range a difference of ``metric`` can take:
    ±(hi − lo) of the metric's range (accuracy: ±1); NaN stays NaN."""
    mi = None if metric == "target_acc" else info(metric)
    span = 1.0 if mi is None else mi.hi - mi.lo
    cut = lambda x: x if x != x else min(max(x, -span), span)  # noqa: E731
    return d | dict(lo=cut(d["lo"]), hi=cut(d["hi"]))


def reference_group(res: T.Results, g: tuple) -> tuple | None:
    """The group ``g``'s Δ compares with: the reference method's group of the same dataset and variant (else without
    variant), runs without DP first; None for the reference itself or when there is none."""
    if not res.reference:
        return None
    plugin = {T.gkey(r): (r.get("plugin", r.get("method")), bool(r.get("privacy"))) for r in res.ok}
    same = sorted((h for h in res.groups() if h[0] == g[0] and plugin[h][0] == res.reference),
                  key=lambda h: plugin[h][1])
    f = next((h for h in same if h[2] == g[2]), None) or next((h for h in same if not h[2]), None)
    return None if f == g else f


def role(adversary: str) -> str:
    return adversary if adversary in ("server", "eavesdropper") else "client"


def _candidates(res: T.Results, final: dict, side: dict) -> dict:
    """{(group, harm, role, setting): {run: [candidate]}} with candidate = dict(attack, artifact, output, metric,
    items, base, ok (control passed)). Oracle-prior outputs are left out (upper bounds, in the per-victim table);
    outputs an attack reports apart (``rows`` in attacks.json) form cells of their own setting, and so do artifacts
    sent outside every DP mechanism of a run that has some (setting "<artifact> outside DP"), so that a cell's ε is
    the one that holds for what it attacked, never the strongest of a covered and an uncovered artifact (``final``:
    ``tables.final_privacy``), and in a family whose clients have fixed sizes each size (``size_setting``).
    A candidate is one attack output (attack, artifact, variant, round) over every victim of the run (and size):
    its victims' items are pooled (``_pool``), so its value weighs every victim and a victim of one image can fall
    in either held-out half; membership pools through its victim-calibrated scores (``_victims_pooled``).
    ``side`` receives the reconstruction companions of every output (``cells.side_key``: aligned PSNR and success
    shares, each with its baseline), pooled the same way."""
    gof, runs = res.group_of(), {r["run"]: r for r in res.ok}
    out = defaultdict(lambda: defaultdict(list))
    for f in res.items:
        if f["run"] not in gof:
            continue
        outputs = defaultdict(list)
        key = lambda c: (gof[f["run"]], harm_of(c["metric"]), c["role"], c["setting"])  # noqa: E731
        for r in load_items(f["path"], f["root"]):
            desc = res.attacks.get(r["attack"], {})
            if r["metric"] in C.COMPANIONS:
                side[C.side_key(f["run"], r, r["metric"])] = (r["items"], r["base"])
            member = harm_of(r["metric"]) == "membership"
            if not info(r["metric"]).card or str(r.get("victim")) == "pooled" and not member \
                    or TH.prior(desc, r["output"] or "") == ORACLE:
                continue
            c = dict(attack=r["attack"], artifact=r["artifact"], output=r["output"] or "", metric=r["metric"],
                     items=r["items"], base=r["base"], ok=str(r.get("status", "ok")) in ("ok", ""),
                     role=role(str(r["adversary"])), round=r["round"], setting=TH.setting(desc, r["output"] or ""),
                     victim=str(r.get("victim")))
            n = None if member else client_size(runs[f["run"]], c["victim"])
            extra = (size_setting(n) if n is not None else "",
                     f"{c['artifact']} outside DP" if T.outside_dp(final, f["run"], c["role"], c["artifact"]) else "")
            c["setting"] = ", ".join(filter(None, (c["setting"],) + extra))
            if member:
                out[key(c)][f["run"]].append(c)
            else:
                outputs[tuple(c[k] for k in ("attack", "artifact", "output", "metric", "role", "round", "ok",
                                             "setting"))].append(c)
        for cs in outputs.values():
            c = _pool(cs, side, f["run"])
            out[key(c)][f["run"]].append(c)
    for k, runs_ in out.items():   # once every file of a run is read
        if k[1] == "membership":
            for run, cands in runs_.items():
                runs_[run] = _victims_pooled(cands)
    return out


def size_setting(n: int) -> str:
    """The setting of a cell of clients with ``n`` training images (families with fixed client sizes)."""
    return f"clients of {n} image" + "s" * (n != 1)


def size_of(setting: str) -> int | None:
    """The client size a setting names (``size_setting``'s inverse), None for any other setting."""
    head = setting.split(",")[0]
    return int(head.split()[2]) if head.startswith("clients of ") else None


def primary(setting: str) -> bool:
    """A setting every method of a family has and that methods are compared in: the harm's main row ("") or one
    client size's row."""
    return not setting or setting.startswith("clients of ") and "," not in setting


def channel_base(setting: str) -> str:
    """The setting a channel's cell belongs to (its setting without the channel)."""
    return ", ".join(setting.split(", ")[:-1]) if channel_of(setting) else setting


def stable_id(*parts: str) -> str:
    """A row's id from its key in words (lower case, dots between parts, hyphens inside them): the same cell has the
    same id in every report, whatever the order of its rows."""
    clean = lambda p: "-".join("".join(ch if ch.isalnum() else " " for ch in str(p).lower()).split())  # noqa: E731
    return ".".join(c for c in map(clean, parts) if c)


def per_channel(r: dict) -> bool:
    """Whether a scorecard row is one channel's cell of a method that sends several (``channel_setting``)."""
    return bool(channel_of(str(r.get("setting", ""))))


def _pool(cs: list, side: dict, run: str) -> dict:
    """One attack output's candidates of several victims as one (victims "|"-joined), their items, baselines and
    reconstruction companions concatenated and their CPU costs averaged (an estimate's items are its victims)."""
    if len(cs) == 1:
        return cs[0]
    cat = lambda parts: S.concat(parts) if all(isinstance(p, S.Items) for p in parts) else None  # noqa: E731
    c = dict(cs[0], items=cat([c["items"] for c in cs]), base=cat([c["base"] for c in cs]),
             victim="|".join(c["victim"] for c in cs))
    for metric in C.COMPANIONS:
        got = [side.get(C.side_key(run, v, metric)) for v in cs]
        if all(g is not None for g in got):
            side[C.side_key(run, c, metric)] = (cat([g[0] for g in got]), cat([g[1] for g in got]))
    cost = [side.get(C.side_key(run, v, "cpu_seconds")) for v in cs]
    if all(x is not None for x in cost):
        side[C.side_key(run, c, "cpu_seconds")] = float(np.mean(cost))
    return c


def _victims_pooled(cands: list) -> list:
    """Membership candidates of one run: where an output was also scored over every victim at once (victim
    "pooled"), that pooled candidate replaces its per-victim ones, its scores calibrated within each victim's model
    (``metrics.membership.calibrate`` keyed by ``cells.victims``; label-free), so a cell's pool
    spans victims and runs."""
    same = lambda c: (c["attack"], c["artifact"], c["output"], c["metric"], c["round"])  # noqa: E731
    pooled = {same(c) for c in cands if c["victim"] == "pooled"}
    out = []
    for c in cands:
        it = c["items"]
        if c["victim"] == "pooled" and it is not None and it.ids is not None:
            x = MM.calibrate(np.asarray(it.x, float), C.victims(it))
            out.append(dict(c, items=S.Items(it.kind, x, it.y, it.ids)))
        elif same(c) not in pooled:
            out.append(c)
    return out


def _constant_baseline(res: T.Results) -> dict:
    """{(run, attack, artifact, output, metric): baseline} from leakage.csv (constants such as chance)."""
    return {(r["run"], r["attack"], r["artifact"], r.get("output", ""), r["metric"]): r["baseline"]
            for r in res.leakage}


def _mode(values) -> str:
    """The distinct values, most frequent first, joined by "|"."""
    c = Counter(values)
    return "|".join(v for v, _ in c.most_common())


def _fmt(x) -> str:
    return "" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.6g}"


def _select(per_run: dict, const: dict) -> dict:
    """The cross-fitted choice of one cell (``stats.crossfit``): per run, its items as scored (each half by the
    candidate chosen on the other), the chosen candidates' own baselines on the same items (a constant where a
    candidate has no per-item baseline), the candidate chosen on half A (``chosen``: what the row names) and
    ``parts`` [(candidate, half)]. The choice is on the excess over each candidate's baseline when all have one
    per item (``_excess``), else on the values."""
    cands = {}
    for run, cs in per_run.items():
        seen = Counter()
        cands[run] = {}
        for c in [c for c in cs if c["ok"]] or cs:   # an output's key; victims apart only for membership
            k = (c["attack"], c["artifact"], c["output"], c["metric"], c["round"])
            cands[run][k + (seen[k],)] = c
            seen[k] += 1
    metric = next(c["metric"] for cs in cands.values() for c in cs.values())
    salts = {run: seeding.seed32(run, seeding.SCORE) for run in cands}
    ex = {run: {k: _excess(c) for k, c in cs.items()} for run, cs in cands.items()}
    every = all(ex[run][k] is not c["items"] for run, cs in cands.items() for k, c in cs.items())
    raw = {run: {k: c["items"] for k, c in cs.items()} for run, cs in cands.items()}
    choice, how = S.crossfit(ex if every else raw, info(metric).higher, salts)
    out = {}
    for run, ks in choice.items():
        parts = [(cands[run][k], h) for k, h in ks]
        items = S.merge([S.part(c["items"], salts[run], h) for c, h in parts])
        if all(isinstance(c["base"], S.Items) for c, _ in parts):
            base = S.merge([S.part(c["base"], salts[run], h) for c, h in parts])
        else:
            c = parts[0][0]
            base = const.get((run, c["attack"], c["artifact"], c["output"], c["metric"]), np.nan)
        out[run] = dict(items=items, base=base, chosen=parts[0][0], parts=parts, salt=salts[run], selection=how,
                        ok=all(c["ok"] for c, _ in parts))
    return out


def _excess(c: dict):
    """A candidate's per-item excess over its own per-item baseline (``items`` − ``base``, the same items), what the
    choice compares when every candidate has one: channels whose chances differ (a bank's 1/100, the matched chance
    of 4 dummies among 240 images) are compared by what they add to a free guess, not by their raw rates. Else its
    items as they are."""
    x, b = c["items"], c["base"]
    if not (isinstance(b, S.Items) and x.kind == b.kind == "mean" and len(x) == len(b) and x.ids is not None
            and b.ids is not None and np.array_equal(x.ids, b.ids)):
        return x
    return S.Items("mean", np.asarray(x.x, float) - np.asarray(b.x, float), ids=x.ids)


def channel_setting(setting: str, artifact: str) -> str:
    """The setting of one channel's cell of a method that sends several for a harm (``selections``)."""
    return ", ".join(filter(None, (setting, f"{artifact} only")))


def channel_of(setting: str) -> str:
    """The channel a setting names (``channel_setting``'s inverse), "" for a cell over every channel."""
    last = setting.split(", ")[-1]
    return last[:-len(" only")] if last.endswith(" only") else ""


def selections(res: T.Results) -> dict:
    """{(group, harm, role, setting): {run: the cross-fitted choice of ``_select``}}, computed once per Results (with
    ``res.cache["side"]``: the reconstruction companions and CPU costs by ``cells.side_key``). Where a method's
    candidates of a cell span several channels (artifacts; e.g. a bank and weights), each channel gets a cell
    of its own too (setting ``channel_setting``), chosen by the same cross-fitted rule among that channel's outputs, so
    channels are compared on the same runs and items (compare.py)."""
    if "chosen" not in res.cache:
        const, final, side = _constant_baseline(res), T.final_privacy(res), C.cpu_seconds(res.leakage)
        chosen = {}
        for key, per_run in _candidates(res, final, side).items():
            per_run = dict(sorted(per_run.items()))
            chosen[key] = _select(per_run, const)
            arts = sorted({c["artifact"] for cs in per_run.values() for c in cs})
            for a in arts if len(arts) > 1 and key[1] != "membership" else ():
                sub = {run: got for run, cs in per_run.items() if (got := [c for c in cs if c["artifact"] == a])}
                chosen[key[:3] + (channel_setting(key[3], a),)] = _select(sub, const)
        res.cache["chosen"], res.cache["side"] = chosen, side
    return res.cache["chosen"]


def accuracy_by_run(res: T.Results) -> dict:
    """{group: {(target, seed): held-out accuracy}} of the finished runs."""
    acc = defaultdict(dict)
    for r in res.ok:
        if r.get("target_acc") is not None:
            acc[T.gkey(r)][(r["target"], r["seed"])] = float(r["target_acc"])
    return acc
