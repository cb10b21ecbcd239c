"""What a scorecard cell's attack assumes, read from attacks.json (what each attack said of itself; the report imports
no plugin): its words (``assumes``), its image prior, its budget, the capabilities of its threat model and the setting
of outputs reported in rows of their own. The vocabulary (priors, capabilities) is the attack contract's
(fdg_audit/api/attack.py): a capability is what the attack declares it knows (``knows``), what its auxiliary data
gives (public images -> public data, candidates, layout) and what its prior needs (layout, learned -> public data,
oracle -> the data set's generator).
"""
from __future__ import annotations

from ..vocab import CAPABILITIES, IMPLIED

AUX_WORDS = {"public": "public target-domain images", "domain_samples": "public samples of each source domain",
             "candidates": "a pool of the victim's members and non-members",
             "layout": "the dataset's public image layout"}


def _key(output: str) -> str:
    return "" if output == "main" else output or ""


def _of(table: dict, output: str):
    """The entry of an output variant in a {variant | "*": value} declaration (None when absent)."""
    k = _key(output)
    return table[k] if k in table else table.get("*")


def assumes(desc: dict, output: str) -> str:
    """What an attack's chosen output assumes, in words: its auxiliary data (the core's vocabulary) and its output
    variant's own words, from the attack's entry in attacks.json (``desc``; {} when absent: nothing is said)."""
    if not desc:
        return ""
    words = [AUX_WORDS[a] for a in desc.get("aux", ()) if a in AUX_WORDS] or ["no auxiliary data"]
    outs = desc.get("outputs", {})
    words += [outs[o] for o in dict.fromkeys(_key(p) for p in output.split("/")) if outs.get(o)]
    return "; ".join(words)


def prior(desc: dict, output: str) -> str:
    """The output's image prior as the attack declared it ("" when it declared none)."""
    return str(_of(desc.get("priors") or {}, output) or "")


def budget(desc: dict, output: str) -> str:
    """"<iterations>x<restarts>" of the output ("" when the attack declared no budget)."""
    b = _of(desc.get("budget") or {}, output)
    return f"{b[0]}x{b[1]}" if b else ""


def capabilities(desc: dict, output: str) -> str:
    """The capabilities of the output's threat model, in the contract's order, joined by "+" ("" without attacks.json);
    "none beyond the artifact" when the attack uses nothing else."""
    if not desc:
        return ""
    have = set(desc.get("knows") or ()) | {IMPLIED[a] for a in desc.get("aux", ()) if a in IMPLIED}
    have |= {IMPLIED[p]} if (p := prior(desc, output)) in IMPLIED else set()
    return "+".join(c for c in CAPABILITIES if c in have) or "none beyond the artifact"


def setting(desc: dict, output: str) -> str:
    """The setting of an output the attack reports in a scorecard row of its own ("" = the harm's main row)."""
    return str((desc.get("rows") or {}).get(_key(output), ""))


def legend_md(res) -> list[str]:
    """One legend table of the attacks behind the scorecard: each attack's threat model, stated once per output
    variant (instead of on every row), and what every reconstruction row states: alignment, baseline kind, plateau
    criterion (leakage.csv columns), CPU seconds and iterations per victim (its ``cpu_seconds`` / ``iterations`` rows,
    mean over them)."""
    from .formatting import md_table, md_text
    used = list(dict.fromkeys([r["attack"] for r in res.leakage] + [f["attack"] for f in res.items]))
    left = [md_text(f"Left out by the scenario (its [[attacks]] exclude): {', '.join(res.left_out)}.", 2000), ""] \
        if res.left_out else []
    if res.see_also:
        left += [f"- See also: {md_text(x, 2000)}" for x in res.see_also] + [""]
    if not used:
        return ["## Attacks and their threat models", ""] + left if left else []
    mode = lambda rs, k: " | ".join(dict.fromkeys(str(r[k]) for r in rs if r.get(k) not in (None, ""))) or "—"  # noqa
    avg = lambda v, d: f"{sum(v) / len(v):.{d}f} (n = {len(v)})" if v else "—"  # noqa: E731
    body = []
    for a in used:
        desc = res.attacks.get(a, {})
        for o in ["main"] + [k for k in desc.get("outputs", {}) if k]:
            rs = [r for r in res.leakage if r["attack"] == a and (r.get("output") or "main") == o]
            cost = {m: [r["value"] for r in rs if r["metric"] == m and r["value"] == r["value"]]
                    for m in ("cpu_seconds", "iterations")}
            body.append([a, o, mode(rs, "adversary"), mode(rs, "artifact"), prior(desc, o) or "—",
                         budget(desc, o) or "—", capabilities(desc, o) or "—", assumes(desc, o) or "—",
                         mode(rs, "alignment"), mode(rs, "baseline_kind"), mode(rs, "plateau"),
                         avg(cost["cpu_seconds"], 2), avg(cost["iterations"], 0)])
    return ["## Attacks and their threat models", "",
            "One line per attack and output variant (attacks.json and leakage.csv): what it reads (adversary, "
            "channel), its image prior (oracle: an upper bound, never a headline), budget (iterations x restarts), "
            "what the attacker knows and assumes; for reconstructions how images are matched (alignment), "
            "which trivial "
            "baseline it is scored against, when it stops (plateau criterion) and its mean CPU seconds and iterations "
            "per victim.", "",
            md_table(["attack", "variant", "adversary", "channel", "prior", "budget", "knows", "assumes", "alignment",
                      "baseline", "plateau", "CPU s / victim", "iterations / victim"], body), ""] + left
