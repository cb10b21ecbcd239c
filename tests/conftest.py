"""Shared test helpers: run a tiny scenario from TOML text into a temporary folder."""
import textwrap

import pytest

from fdg_audit.runner import run_scenario


@pytest.fixture
def run_toml(tmp_path):
    """``run_toml(text, *sets) -> run folder``: write the scenario text and run it quietly."""
    def run(text: str, *sets: str, name: str = "t"):
        f = tmp_path / f"{name}.toml"
        f.write_text(textwrap.dedent(text))
        return run_scenario(str(f), list(sets), out=str(tmp_path / "runs"), quiet=True)
    return run
