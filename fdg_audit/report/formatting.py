"""Text helpers of the report: numbers, cells with intervals, markdown and fixed-width tables."""
from __future__ import annotations

import math
import re
from functools import lru_cache

from ..metrics.registry import info

ARROW = {"up": "↑", "down": "↓", "peer": "↔"}


def num(x) -> float:
    """A CSV cell as a float; NaN for anything that is not a number (an empty cell, "not measurable")."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def digits(row: dict) -> int:
    """Decimals of a scorecard row's numbers: 1 for dB, else 3 (accuracy rows have no registry metric)."""
    return 1 if row.get("harm") != "accuracy" and info(row["metric"].split("|")[0]).unit == "dB" else 3


def fmt(s: dict, d: int = 3) -> str:
    if not s or s["n"] == 0:
        return "—"
    if s["mean"] == math.inf:   # an epsilon without noise: every run's is infinite, its std undefined
        return "∞"
    m = f"{s['mean']:.{d}f}"
    return m if s["n"] == 1 else f"{m} ± {s['std']:.{d}f}"


def fmt_metric(metric: str, s: dict) -> str:
    u = info(metric).unit
    return fmt(s, 1 if u == "dB" else 3) + (" dB" if u == "dB" and s["n"] else "")


def ci(r: dict, key: str = "", d: int | None = None) -> str:
    """"v [lo, hi]" of a scorecard row's value (key ""), baseline ("baseline") or difference to the reference
    ("diff_ref", with n and the Holm-adjusted call)."""
    pre = f"{key}_" if key else ""
    v, lo, hi = r[key or "value"], r[f"{pre}ci_low"], r[f"{pre}ci_high"]
    if v in ("", None):
        return "—"
    if v == "not measurable":
        return v
    d = digits(r) if d is None else d
    sign = "+" if key == "diff_ref" else ""
    f = lambda x: f"{num(x):{sign}.{d}f}"  # noqa: E731
    out = f(v) + ("" if lo in ("", None) or lo == hi or num(lo) != num(lo) else f" [{f(lo)}, {f(hi)}]")
    if key == "diff_ref" and r.get("diff_call"):
        out += f" (n = {r['diff_n']}, {r['diff_call']})"
    return out


def human_bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


# bidirectional-text controls (RTL marks, embeddings, isolates) and other invisible format characters
_HIDDEN = re.compile("[\u0000-\u001f\u007f-\u009f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")
_MD = re.compile(r"([\\`*<>|!])")
CELL_CHARS = 2000
LEGEND_CHARS = 80


def clean(s, limit: int = CELL_CHARS) -> str:
    """Text read from a run folder, made one visible line: line breaks and control / bidi characters become "␣"
    (so a label cannot reorder or split what follows it), and anything beyond ``limit`` characters is cut with
    "… (N characters)"."""
    s = _HIDDEN.sub("␣", str(s))
    return s if len(s) <= limit else s[:limit] + f"… ({len(s)} characters)"


def md_text(s, limit: int = CELL_CHARS) -> str:
    """``clean`` text with markdown's active characters backslash-escaped (HTML tags, emphasis, code, tables,
    images), so that report.md shows a label such as ``<script>`` as text."""
    return _MD.sub(r"\\\1", clean(s, limit))


def md_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; every cell is ``md_text`` (no markup inside cells)."""
    esc = md_text
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list]) -> str:
    """Fixed-width table; a cell may hold several lines (one row then spans several terminal lines)."""
    cells = [[str(c).split("\n") for c in r] for r in [headers] + rows]
    w = [max(len(line) for r in cells for line in r[i]) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        for k in range(max(len(c) for c in r)):
            out.append("  ".join((c[k] if k < len(c) else "").ljust(w[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            out.append("  ".join("-" * x for x in w))
    return "\n".join(out)


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_") or "x"


def gkey(r: dict) -> tuple:
    """A run's group: (dataset, method label, sweep variant)."""
    return (str(r.get("dataset", "")), str(r.get("method", "")), str(r.get("variant", "") or ""))


def words(x: str) -> str:
    """A name in words for prose: underscores and "|" to spaces."""
    return " ".join(str(x).replace("_", " ").replace("|", " ").split())


@lru_cache(maxsize=None)
def title(name: str) -> str:
    """A method's name as its paper writes it: the ``title`` of the registered method plugin ``name`` (a name read
    from a run folder is looked up among the installed plugins only, never imported as a path); a label made of a
    plugin's name, "_" and more (a DP setting's "fedavg_eps8") reads as that title and the rest in words; else
    ``words``."""
    from ..plugins import available, load
    t, plugins = "", available("method")
    head = max((p for p in plugins if name.startswith(p + "_")), key=len, default="")
    if name not in plugins and head:
        return " ".join((title(head) + " " + words(name[len(head):])).split())
    if name in plugins:
        try:
            t = getattr(load("method", name), "title", "")
        except Exception:   # a broken install still gets its report, with the registered name
            t = ""
    return t if isinstance(t, str) and re.fullmatch(r"[\w\- ]{1,40}", t) else words(name)


def method_words(g: tuple) -> str:
    """A group's method in words: its title (as its paper writes it) and its variant in words."""
    return " ".join((title(g[1]) + " " + words(g[2])).split())


def legend_label(label: str) -> str:
    """A figure's legend or tick label cut to LEGEND_CHARS per line (a folder's labels are data: a 100,000-character
    method label took matplotlib 45 s to draw in full)."""
    return "\n".join(x if len(x) <= LEGEND_CHARS else x[:LEGEND_CHARS - 1] + "…" for x in label.split("\n"))


def colors(res) -> dict:
    """{group: RGB}: one hue per method plugin (matplotlib's tab10, in the order plugins first appear: the reference
    method blue, the next orange, then green), the same in every figure; its other labels (DP settings) take darker
    and lighter shades of it."""
    import matplotlib
    tab10 = matplotlib.colormaps["tab10"]
    plugin = {gkey(r): r.get("plugin") or r["method"] for r in res.ok}
    hues = list(dict.fromkeys(plugin[g] for g in res.groups()))
    names = {h: list(dict.fromkeys(g[1] + g[2] for g in res.groups() if plugin[g] == h)) for h in hues}
    out = {}
    for g in res.groups():
        i, k = names[plugin[g]].index(g[1] + g[2]), len(names[plugin[g]])
        t = (i + 1) // 2 * 0.6 / max(1, (k + 1) // 2)   # 0 for the first label, then further from the hue
        base = tab10(hues.index(plugin[g]) % tab10.N)[:3]
        out[g] = tuple(b * (1 - t) if i % 2 else b + (1 - b) * t for b in base)   # odd: darker, even: lighter
    return out
