"""report.html: the report as one self-contained file (issue 33, item 4), rendered from report.md's lines.

Page one (everything before the second ``## `` heading) is shown open, the trade-off figure at most 42% of the
window high so the answer and the figure share the first screen; every later ``## `` section is a collapsed
``<details>`` whose id is the heading's anchor (as GitHub makes it), opened when a link or the address points to it.
Images from ``plots/`` are embedded as base64 data URIs and nothing is fetched from the network (no external script,
style, font or image). Tables sort by a click on a column header (a few lines of inline JavaScript; numbers by value,
text alphabetically). Every piece of text is HTML-escaped; report.md's own markup is a small subset (headings,
bullets, tables, image lines, ``**bold**``, ``code``, in-page links and links to the report's own files
(scorecard.csv, comparisons.csv: a relative name, no ``..``), backslash escapes), so text that came from a
run folder (escaped there by ``formatting.md_text``) can never become markup here.
"""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from ..store.ledger import atomic_write
from ..store.safe import read_in

_INLINE = re.compile(r"\\(.)|\*\*(.+?)\*\*|`([^`]*)`|\[([^\]\\]+)\]\((#[-\w.]+|[\w-]+(?:/[\w-]+)*\.(?:csv|md|json|png))\)")
_IMAGE = re.compile(r"!\[([^\]]*)\]\((plots/[^)\s]+)\)")

STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1240px;padding:8px 16px;color:#111}
h1{font-size:20px;margin:4px 0}h2{font-size:17px;display:inline}h3{font-size:15px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}td,th{border:1px solid #ccc;padding:2px 5px;
vertical-align:top}th{background:#eee;cursor:pointer}td.leak{background:#fdd;font-weight:bold}
tr:target{outline:2px solid #c60}#page-one img{max-height:42vh;max-width:49%}
img{max-width:100%}details{border-top:1px solid #ccc;padding:4px 0}summary{cursor:pointer}
#page-one ul{margin:4px 0;padding-left:18px}"""

SCRIPT = """document.querySelectorAll('th').forEach(function(th){th.title='sort';th.onclick=function(){
var t=th.closest('table'),b=t.tBodies[0],i=th.cellIndex,up=th.dataset.up!=='1';th.dataset.up=up?'1':'0';
var v=function(r){var s=r.cells[i]?r.cells[i].textContent:'',n=parseFloat(s.replace('\\u2212','-'));
return isNaN(n)?s:n;};Array.from(b.rows).sort(function(x,y){var p=v(x),q=v(y);
var c=(typeof p==='number'&&typeof q==='number')?p-q:String(p).localeCompare(String(q));return up?c:-c;})
.forEach(function(r){b.appendChild(r);});};});
function openHash(){var e=location.hash&&document.getElementById(decodeURIComponent(location.hash.slice(1)));
var d=e&&e.closest('details');if(d){d.open=true;e.scrollIntoView();}}
window.addEventListener('hashchange',openHash);openHash();"""


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def inline(text: str) -> str:
    """HTML of one line of report.md's inline markup; everything else is escaped text."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        esc, bold, code, label, href = m.groups()
        out.append(html.escape(esc) if esc is not None else f"<b>{inline(bold)}</b>" if bold is not None else
                   f"<code>{html.escape(code)}</code>" if code is not None else
                   f'<a href="{html.escape(href)}">{inline(label)}</a>')
        pos = m.end()
    return "".join(out) + html.escape(text[pos:])


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row (a backslash escapes the next character, so ``\\|`` is no border)."""
    cells, cur, i, s = [], [], 0, line.strip()[1:]
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            cur.append(s[i:i + 2])
            i += 2
            continue
        if s[i] == "|":
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(s[i])
        i += 1
    return cells


def _image(alt: str, src: str, root: Path) -> str:
    raw = read_in(root, root / src) if src and not Path(src).is_absolute() and ".." not in Path(src).parts else None
    if raw is None:
        return f"<p>[missing figure: {html.escape(src)}]</p>"
    data = base64.b64encode(raw).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(rows: list[str]) -> str:
    """A table; under a first column headed "row" each row's id is its first cell (page one links there), and a
    cell that reads "leak" is set off."""
    head, body = _cells(rows[0]), [_cells(r) for r in rows[2:]]
    th = "".join(f"<th>{inline(c)}</th>" for c in head)
    rid = lambda r: f' id="{html.escape(r[0])}"' if head[:1] == ["row"] and r else ""  # noqa: E731
    td = lambda c: '<td class="leak">' if c == "leak" else "<td>"  # noqa: E731
    tr = "".join(f"<tr{rid(r)}>" + "".join(f"{td(c)}{inline(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{tr}</tbody></table>"


def blocks(lines: list[str], root: Path) -> list[str]:
    """HTML of a run of markdown lines without ``## `` headings."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append(_table(lines[i:j]))
            i = j
            continue
        if line.startswith("- "):
            j = i
            while j < len(lines) and lines[j].startswith("- "):
                j += 1
            out.append("<ul>" + "".join(f"<li>{inline(x[2:])}</li>" for x in lines[i:j]) + "</ul>")
            i = j
            continue
        imgs = _IMAGE.findall(line)
        if imgs and not _IMAGE.sub("", line).strip():
            out.append("<p>" + " ".join(_image(a, s, root) for a, s in imgs) + "</p>")
        elif line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")), 6)
            title = line[level:].strip()
            out.append(f'<h{level} id="{anchor(title)}">{inline(title)}</h{level}>')
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
        i += 1
    return out


def render(md: list[str], root: Path) -> str:
    """The whole page: page one open, every later ``## `` section collapsed."""
    lines = "\n".join(md).split("\n")
    starts = [i for i, x in enumerate(lines) if x.startswith("## ")]
    cut = starts[1] if len(starts) > 1 else len(lines)
    title = next((x[2:] for x in lines if x.startswith("# ")), "fdg_audit report")
    body = ['<section id="page-one">'] + blocks(lines[:cut], root) + ["</section>"]
    for k, s in enumerate(starts[1:], 1):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        head = lines[s][3:].strip()
        body += [f'<details id="{anchor(head)}"><summary><h2>{inline(head)}</h2></summary>']
        body += blocks(lines[s + 1:end], root) + ["</details>"]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
            f"<title>{inline(title)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(body)
            + f"\n<script>{SCRIPT}</script></body></html>\n")


def write_html(md: list[str], out: Path) -> Path:
    """Write ``out/report.html`` from report.md's lines (images read from ``out/plots``)."""
    path = Path(out) / "report.html"
    atomic_write(path, render(md, Path(out)), Path(out))
    return path
