"""Conformance of every registered plugin (entry points), on tiny data: a method is a ``MethodPlugin`` that runs
one round and sends only the kinds it declares; an attack is an ``Attack`` that describes itself, reads kinds some
method sends, and whose controls pass."""
import dataclasses
from importlib.metadata import entry_points

import pytest

from fdg_audit.api.attack import ADVERSARIES, AUX, Attack
from fdg_audit.api.method import MethodPlugin, TrainParams
from fdg_audit.bus import ARTIFACT_KINDS
from fdg_audit.data import DataConfig, load_data
from fdg_audit.train.federation import RunSpec, run_federation
from fdg_audit.store.ledger import MemoryLedger
from fdg_audit.models import ModelConfig
from fdg_audit.attack import load_attack
from fdg_audit.protocol import load_method

METHODS = sorted(ep.name for ep in entry_points(group="fdg_audit.methods"))
ATTACKS = sorted(ep.name for ep in entry_points(group="fdg_audit.attacks"))
TINY = DataConfig(dataset="digits", per_domain=24, domains=["rot0", "rot15", "rot30"])


@pytest.fixture(scope="module")
def tiny():
    return load_data(TINY)


@pytest.mark.parametrize("name", METHODS)
def test_method_conforms_and_sends_only_what_it_declares(name, tiny):
    m = load_method(name)
    assert issubclass(m, MethodPlugin) and m.name == name
    assert dataclasses.is_dataclass(m.Params) and issubclass(m.Params, TrainParams)
    assert m.kinds and set(m.kinds) <= ARTIFACT_KINDS
    params = m.Params(rounds=1, batch_size=8, local_steps=1, eval_every=1)
    led = MemoryLedger()
    data_cfg, model_cfg, data = TINY, ModelConfig(), tiny
    if m.public_data:   # a method that needs the server's public data gets a domain outside the run
        data_cfg, model_cfg = dataclasses.replace(TINY, public="rot45"), ModelConfig(pretrain_epochs=1)
        data = load_data(data_cfg)
    res = run_federation(RunSpec(f"c/{name}/rot0/s0", name, params, data_cfg, model_cfg, "rot0"), led, data)
    sent = {e.kind for e in led.envelopes if e.sender != "public"}   # the core's record of the public data
    assert sent and sent <= set(m.kinds), f"{name} sent {sorted(sent - set(m.kinds))} it does not declare"
    assert [r["round"] for r in res["history"]] == [0, 1] and 0.0 <= res["target_acc"] <= 1.0


@pytest.mark.parametrize("name", ATTACKS)
def test_attack_conforms_and_its_controls_pass(name):
    a = load_attack(name)
    assert issubclass(a, Attack) and a.name
    assert a.adversary in ADVERSARIES and set(a.aux) <= set(AUX)
    sent = {k for n in METHODS for k in load_method(n).kinds}
    assert a.consumes and ("*" in a.consumes or set(a.consumes) & sent), \
        f"{name} reads {a.consumes}, which no registered method sends"
    assert a.outputs and all(isinstance(k, str) and isinstance(v, str) and v for k, v in a.outputs.items())
    controls = a().control()
    failed = [c for c in controls if not c.passed]
    assert not failed, f"{name}: controls failed: {failed}"


def test_report_and_privacy_name_no_plugin():
    """The core stays generic: no method or attack name (as a word, in code, strings or comments) and no output
    variant (as a string) under fdg_audit/report/ or fdg_audit/privacy/. Variants that are words of the core's own
    vocabulary (its aux names, its selection and row modes) are the core's, not the plugin's."""
    import ast
    import re
    from pathlib import Path
    words = set(METHODS) | set(ATTACKS)
    core_words = set(AUX) | {"mean", "first", "heldout", "image", "aggregate", "count"}
    variants = {v for n in ATTACKS for v in load_attack(n).outputs if v} - core_words
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, words))) + r")\b", re.I)
    root = Path(__file__).parent.parent / "fdg_audit"
    hits = []
    for f in sorted((root / "report").glob("*.py")) + sorted((root / "privacy").glob("*.py")):
        text = f.read_text()
        hits += [f"{f.name}: {m.group(0)}" for m in pattern.finditer(text)]
        hits += [f"{f.name}: {n.value!r}" for n in ast.walk(ast.parse(text))
                 if isinstance(n, ast.Constant) and n.value in variants]
    assert not hits, hits
