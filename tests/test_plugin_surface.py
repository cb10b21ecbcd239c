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


@pytest.mark.parametrize("folder", ["attacks", "methods"])
def test_plugins_import_only_the_api(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): b for f in files if (b := core_imports(f))}
    assert not bad, f"plugins import the core instead of fdg_audit.api: {bad}"


def test_core_imports_catches_every_form(tmp_path):
    f = tmp_path / "p.py"
    f.write_text("import fdg_audit.data\nfrom fdg_audit import metrics, api\nfrom fdg_audit.api import seeding\n"
                 "import fdg_audit.api.attack\nfrom . import sibling\ndef g():\n    from fdg_audit.errors import UserError\n")
    assert core_imports(f) == ["1: fdg_audit.data", "2: fdg_audit.metrics", "7: fdg_audit.errors"]


def test_every_attack_describes_its_outputs():
    eps = list(entry_points(group="fdg_audit.attacks"))
    assert eps
    for ep in eps:
        outputs = ep.load().outputs
        assert isinstance(outputs, dict) and outputs, ep.name
        assert all(isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in outputs.items()), ep.name
