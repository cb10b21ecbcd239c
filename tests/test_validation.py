"""Bad input is one line (UserError, exit code 2) before any work, and leaves no run folder behind."""
import pytest

from conftest import tiny_scenario
from fdg_audit.errors import UserError

BASE = tiny_scenario(data=dict(per_domain=30))   # tests/conftest.py

BAD = {
    "seeds=[-1]": "seeds are integers from 0",
    'device="tpu"': "device = 'tpu'",
    "train.weight_decay=-1": "weight_decay >= 0",
    "train.lr=nan": "not a finite number",
    "train.lr=inf": "not a finite number",
    "train.momentum=nan": "not a finite number",
    'store="al"': "store = 'al'",
    'store_rounds=["a"]': "store_rounds",
    "train.rounds=1000000000000": "from 1 to 100000",
    'model.arch="vit"': "model.arch = 'vit'",
    'model.norm="layer"': "model.norm = 'layer'",
    'name="../../../x"': "letters, digits",
    'methods.fedavg.label="../m"': "letters, digits",
    'attacks=[{name="dataset_size", max_victims=-1}]': "max_victims = -1",
    'attacks=[{name="dataset_size", label="../../escaped"}]': "letters, digits",
    'data.label="a/b"': "letters, digits",
    'train.cohort="vamp"': "cohort = 'vamp'",   # refused at plan time, not when its run starts
}


@pytest.mark.parametrize("assignment", list(BAD))
def test_bad_settings_are_one_line_before_any_work(run_toml, tmp_path, assignment):
    with pytest.raises(UserError, match=BAD[assignment].replace("(", r"\(").replace("[", r"\[")):
        run_toml(BASE, assignment)
    assert not (tmp_path / "runs").exists()      # nothing written: no empty run folder


def test_cuda_without_a_gpu_and_unwritable_out_and_non_utf8(run_toml, tmp_path):
    import torch

    from fdg_audit.runner import run_scenario
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available"):
            run_toml(BASE, 'device="cuda"')
        assert not (tmp_path / "runs").exists()   # refused at plan time: no empty run folder
    f = tmp_path / "s.toml"
    f.write_text(BASE)
    with pytest.raises(UserError, match="writable folder"):
        run_scenario(str(f), out="/proc/not-here", quiet=True)
    f.write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(UserError, match="not UTF-8"):
        run_scenario(str(f), quiet=True)


def test_a_one_class_data_set_is_refused(run_toml, tmp_path):
    import numpy as np
    from PIL import Image
    root = tmp_path / "imgs"
    for dom in ("a", "b", "c"):
        (root / dom / "only").mkdir(parents=True)
        for k in range(6):
            Image.fromarray(np.full((8, 8, 3), 40 * k, np.uint8)).save(root / dom / "only" / f"{k}.png")
    text = tiny_scenario(data=dict(dataset="folder", root=str(root), image_size=8, family=None, per_domain=30,
                                   domains=["a", "b", "c"], targets=["a"]))
    with pytest.raises(UserError, match="at least 2 classes"):
        run_toml(text)
