"""Bytes on the bus: the one table of encoded wire bytes per method (``bytes_table``), its JSON form for
summary.json (``bytes_summary``, written by the runner) and its report text.

Round 0 is the one-time set-up; "per round" is the mean over the training rounds 1..T of a run (T from the run's
``params.rounds``, else its last round on the bus); both per run, then averaged over the group's runs.
"""
from __future__ import annotations

from collections import defaultdict

from .formatting import ARROW, gkey, human_bytes, md_table, md_text


def direction(e: dict) -> str:
    if e["receiver"] == "server":
        return "up"
    if e["sender"] == "server":
        return "down"
    return "peer"


def bytes_table(envelopes, runs: list[dict]) -> dict:
    """{group: dict(runs, kinds={(kind, direction): dict(once, per_round, total)}, once, per_round, total,
    clients={client: sorted kinds it emitted})}, bytes per run averaged over the group's runs. ``envelopes``: dicts
    (run, round, sender, receiver, kind, wire_bytes); ``runs``: summary.json entries (envelopes of other runs are
    left out)."""
    gof = {r["run"]: gkey(r) for r in runs}
    envelopes = [e for e in envelopes if e["run"] in gof]
    last = defaultdict(int)
    for e in envelopes:
        last[e["run"]] = max(last[e["run"]], e["round"])
    rounds = {r["run"]: max(1, int((r.get("params") or {}).get("rounds") or 0) or last[r["run"]]) for r in runs}
    acc = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    members, clients = defaultdict(set), defaultdict(lambda: defaultdict(set))
    for e in envelopes:
        g = gof[e["run"]]
        members[g].add(e["run"])
        a = acc[g][(e["kind"], direction(e))]
        a[2] += e["wire_bytes"]
        a[0 if e["round"] == 0 else 1] += e["wire_bytes"] / (1 if e["round"] == 0 else rounds[e["run"]])
        if e["sender"] not in ("server", "public"):   # "public": the core's record of the server's public data
            clients[g][e["sender"]].add(e["kind"])
    out = {}
    for g in dict.fromkeys(gof.values()):
        n = len(members[g])
        if not n:
            continue
        order = sorted(acc[g], key=lambda k: (k[0], list(ARROW).index(k[1])))
        kinds = {k: dict(once=acc[g][k][0] / n, per_round=acc[g][k][1] / n, total=acc[g][k][2] / n) for k in order}
        out[g] = dict(runs=n, kinds=kinds, **{f: sum(k[f] for k in kinds.values())
                                              for f in ("once", "per_round", "total")},
                      clients={c: sorted(k) for c, k in sorted(clients[g].items())})
    return out


def bytes_summary(envelopes, runs: list[dict]) -> dict:
    """``bytes_table`` as summary.json's "bytes": {"<dataset>/<method><variant>": {runs, once, per_round, total,
    by_kind: {"<kind> <direction>": {once, per_round, total}}, kinds_from_clients}}."""
    return {f"{g[0]}/{g[1]}{g[2]}": dict(runs=b["runs"], once=b["once"], per_round=b["per_round"], total=b["total"],
                                         by_kind={f"{k} {d}": v for (k, d), v in b["kinds"].items()},
                                         kinds_from_clients=sorted({k for ks in b["clients"].values() for k in ks}))
            for g, b in bytes_table(envelopes, runs).items()}


def client_lines(clients: dict) -> list[str]:
    by = {}
    for c, kinds in clients.items():
        by.setdefault(tuple(kinds), []).append(c)
    return [f"{', '.join(cs)}: {', '.join(k)}" for k, cs in by.items()]


def same_bytes(res, by: dict) -> list[tuple[str, dict]]:
    """Groups with the same bytes profile (as printed) and the same client kinds, merged: [(labels, entry)]."""
    merged = {}
    for g, b in by.items():
        sig = (tuple((k, d, tuple(human_bytes(v[f]) for f in ("once", "per_round", "total")))
                     for (k, d), v in b["kinds"].items()), tuple((c, tuple(k)) for c, k in b["clients"].items()))
        merged.setdefault(sig, ([], b))[0].append(res.label(g))
    return [(", ".join(labels), b) for labels, b in merged.values()]


def bytes_lines(res, by: dict) -> list[str]:
    """The terminal's bytes block."""
    lines = []
    for label, b in same_bytes(res, by):
        lines.append(f"{label}  ({b['runs']} runs; per run: {human_bytes(b['total'])} total, "
                     f"{human_bytes(b['once'])} once at round 0, {human_bytes(b['per_round'])} per round)")
        for (kind, d), v in b["kinds"].items():
            lines.append(f"  {ARROW[d]} {kind:<16} per round {human_bytes(v['per_round']):>9}   once "
                         f"{human_bytes(v['once']):>9}   total {human_bytes(v['total']):>9}")
        lines += [f"  left client(s) {s}" for s in client_lines(b["clients"])]
    return lines


def bytes_md(res, by: dict, images: list[str]) -> list[str]:
    """report.md's Communication section (``images``: markdown image lines)."""
    if not by:
        return []
    md = ["## Communication", "",
          "Encoded bytes on the bus (messages.jsonl), per run, mean over the method's runs. Round 0 is the one-time "
          "set-up; \"per round\" is the mean over training rounds 1..T. ↑ client→server, ↓ server→client, "
          "↔ client→client.", ""]
    body = []
    for label, b in same_bytes(res, by):
        for (kind, d), v in b["kinds"].items():
            body.append([label, kind, ARROW[d], human_bytes(v["once"]), human_bytes(v["per_round"]),
                         human_bytes(v["total"])])
        body.append([label, "all (total)", "", human_bytes(b["once"]), human_bytes(b["per_round"]),
                     human_bytes(b["total"])])
    md += [md_table(["method", "artifact kind", "dir", "round 0 (once)", "per round", "total per run"], body), ""]
    md += ["Artifact kinds that left each client:", ""]
    md += [f"- {md_text(label, 200)}: " + md_text("; ".join(client_lines(b["clients"]) or ["none"]))
           for label, b in same_bytes(res, by)]
    return md + [""] + images + [""]
