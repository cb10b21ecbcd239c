"""The plugins' import surface: methods/ and attacks/ import fdg_audit only through fdg_audit.api (and its modules),
and every registered attack describes its outputs in words (the report's threat-model column reads them)."""
import ast
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def core_imports(path: Path) -> list[str]:
    """"line: module" of every import of fdg_audit outside fdg_audit.api in a file (module level and in functions)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from fdg_audit import metrics" imports fdg_audit.metrics: judge the modules it names
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "fdg_audit" else [node.module]
        else:
            continue
        bad += [f"{node.lineno}: {n}" for n in names
                if n.split(".")[0] == "fdg_audit" and n != "fdg_audit.api" and not n.startswith("fdg_audit.api.")]
    return bad


def offenders(check, *folders: str) -> dict:
    """{file: what ``check`` finds in it} for the Python files below ``folders`` (of the repository)."""
    files = [f for d in folders for f in sorted((ROOT / d).rglob("*.py"))]
    assert files
    return {str(f.relative_to(ROOT)): b for f in files if (b := check(f))}


@pytest.mark.parametrize("folder", ["attacks", "methods"])
def test_plugins_import_only_the_api(folder):
    bad = offenders(core_imports, folder)
    assert not bad, f"plugins import the core instead of fdg_audit.api: {bad}"


@pytest.mark.parametrize("check,text,found", [
    ("core_imports", "import fdg_audit.data\nfrom fdg_audit import metrics, api\nfrom fdg_audit.api import seeding\n"
     "import fdg_audit.api.attack\nfrom . import sibling\ndef g():\n    from fdg_audit.errors import UserError\n",
     ["1: fdg_audit.data", "2: fdg_audit.metrics", "7: fdg_audit.errors"]),
    ("literal_record_names", "self.record_truth('amp', idx=i)\nc.record_truth(f'proto_c{c}')\nReconstruction(v, k, 1, "
     "x, truth='amp')\nPredictions(truth=records.AMP)\nself.record_truth(records.STYLE, idx=i)\n",
     ["1: 'amp'", "2: f'proto_c{c}'", "3: 'amp'"]),
])
def test_the_checks_catch_every_form(tmp_path, check, text, found):
    f = tmp_path / "p.py"
    f.write_text(text)
    assert globals()[check](f) == found


def test_every_attack_describes_its_outputs():
    eps = list(entry_points(group="fdg_audit.attacks"))
    assert eps
    for ep in eps:
        outputs = ep.load().outputs
        assert isinstance(outputs, dict) and outputs, ep.name
        assert all(isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in outputs.items()), ep.name


def literal_record_names(path: Path) -> list[str]:
    """"line: text" of every ground-truth record name written as a string in a file: the first argument of
    ``record_truth(...)`` and the ``truth=`` of an output, where ``fdg_audit.api.records`` declares the names."""
    calls = [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.Call)]
    name = lambda c: getattr(c.func, "attr", getattr(c.func, "id", ""))  # noqa: E731
    names = [c.args[0] for c in calls if c.args and name(c) == "record_truth"]
    names += [k.value for c in calls for k in c.keywords if k.arg == "truth"]
    return [f"{a.lineno}: {ast.unparse(a)}" for a in names if isinstance(a, (ast.Constant, ast.JoinedStr))]


def test_record_names_are_declared_once_and_used_by_both_sides():
    """Methods (and the privacy layer) record ground truth, and attacks name it, with the constants of
    fdg_audit.records, never a string agreed in two places."""
    bad = offenders(literal_record_names, "methods", "attacks", "fdg_audit/privacy")
    assert not bad, f"record names written as strings: {bad}"
