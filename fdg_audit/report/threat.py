"""What a scorecard cell's attack assumes, read from attacks.json (what each attack said of itself; the report imports
no plugin): its words (``assumes``), its image prior, its budget, the capabilities of its threat model and the setting
of outputs reported in rows of their own. The vocabulary (priors, capabilities) is the attack contract's
(fdg_audit/api/attack.py): a capability is what the attack declares it knows (``knows``), what its auxiliary data
gives (public images -> public data, candidates, layout) and what its prior needs (layout, learned -> public data,
oracle -> the data set's generator).
"""
from __future__ import annotations

from ..api.attack import CAPABILITIES, IMPLIED

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
