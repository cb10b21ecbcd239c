"""Citations of the project's documents resolve inside the repository (issue 33 item 5)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)\s*§\s*(\d+(?:\.\d+)?)")


def _sources():
    for ext in ("py", "toml", "md"):
        for f in ROOT.rglob(f"*.{ext}"):
            rel = f.relative_to(ROOT)
            if rel.parts[0] not in (".git", ".venv", "runs", "build") and "example-report" not in str(rel) \
                    and not rel.parts[0].endswith(".egg-info") and f.name != Path(__file__).name:
                yield f


def _sections(doc: Path) -> set:
    return {m.group(1) for m in re.finditer(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", doc.read_text(), re.M)}


def test_every_section_citation_names_an_existing_section_of_a_document_in_the_repository():
    bad = []
    for f in _sources():
        for line_no, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for name, sec in CITE.findall(line):
                doc = (f.parent / name) if f.parent.name == "docs" and "/" not in name else ROOT / name
                if not doc.is_file() or sec not in _sections(doc):
                    bad.append(f"{f.relative_to(ROOT)}:{line_no}: {name} §{sec}")
    assert not bad, "citations of missing documents or sections:\n" + "\n".join(bad)


def test_the_citation_pattern_finds_bare_and_docs_citations():
    assert CITE.findall("see attacks.md §5.1 and docs/methods.md §2") == [("attacks.md", "5.1"),
                                                                       ("docs/methods.md", "2")]


def test_readme_fits_in_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_readme_answer_is_the_example_reports_page_one(monkeypatch):
    """README's answer is printed from the example report (`python -m fdg_audit answer docs/example-report`), so it
    cannot drift from the report it cites."""
    from fdg_audit.report.pageone import answer_md
    monkeypatch.chdir(ROOT)
    said = answer_md("docs/example-report")
    assert said.count("\n- ") >= 2 and said in (ROOT / "README.md").read_text()
