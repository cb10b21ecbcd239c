"""Reports: tables and plots from run folders (placeholder API; filled in by the report module)."""
from pathlib import Path
import json


def headline(root) -> str:
    s = json.loads((Path(root) / "summary.json").read_text())
    return "\n".join(f"{r['run']}: target_acc={r.get('target_acc')}" for r in s["runs"])


def write_report(run_dirs, out, quiet=False):
    return Path(out)
