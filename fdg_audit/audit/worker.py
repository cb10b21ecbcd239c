"""The attack worker: the process that reads one view folder, runs one attack job and writes ``result.npz``
(``_worker``; ``_main`` under bubblewrap). It imports the core, and a plugin only once its limits are set.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from ..attack import AdversaryView, Aux, load_attack
from ..data.base import Split
from ..errors import UserError
from ..models import ModelConfig
from ..protocol import load_method
from ..store.ledger import Ledger
from ..vocab import attack_params
from .bwrap import clean_env
from .limits import LIMITS, check_limits  # noqa: F401  (the sandbox and the harness read them here)
from .confine import confine
from .transport import decode, encode


def portrait(atk) -> dict:
    """What the metadata probe (mode "describe") reports of a constructed attack: plain values only."""
    return dict(name=str(getattr(atk, "name", "")), consumes=list(atk.consumes), adversary=atk.adversary,
                aux=list(atk.aux), ignores=[str(k) for k in getattr(atk, "ignores", ())],
                outputs={str(k): str(v) for k, v in dict(atk.outputs).items()},
                params=json.loads(json.dumps(dataclasses.asdict(atk.p), default=str)),
                threat=json.loads(json.dumps(atk.threat(), default=str)),
                cost={str(k): float(v) for k, v in dict(atk.cost()).items()}, cache=str(getattr(atk, "cache", "") or ""))



def build(spec: dict, cls=None):
    """The attack of a job spec (``attack``, ``label``, ``params``, ``device``, and a run's ``salt``): its ``Params``
    built and checked by ``vocab.attack_params`` (salted by the run's seed), then its ``__init__``. The one place an
    attack is built, in the worker and in the harness (``isolate = False``) alike; ``cls``: the class, if loaded."""
    cls = cls or load_attack(spec["attack"])
    p = attack_params(cls.Params, spec["params"], spec.get("label") or cls.name or spec["attack"], spec.get("salt"))
    return cls(p, torch.device(spec["device"]))


def _split(s):
    return s if s is None else Split(torch.as_tensor(s.x), torch.as_tensor(s.y), np.asarray(s.idx))



def _main(folder: str, nonce: str) -> None:
    """Entry point under bubblewrap: the import paths come in the view folder's ``paths.json`` (a folder removed
    meanwhile, e.g. by Ctrl-C in the harness, ends the worker without a word)."""
    try:
        paths = json.loads((Path(folder) / "paths.json").read_text())
    except (OSError, ValueError):
        sys.exit(1)
    _worker(folder, paths, nonce)



def _worker(folder: str, paths: dict, nonce: str = "") -> None:
    """Entry point of the attack process: read the view folder, run the attack, write ``result.npz``.
    ``paths``: the import path for the run's method and for the attack (see plugins.import_path). Before any plugin
    code: its own session (the harness stops it with everything it started), its limits (``confine``: memory, no
    new process), the working directory
    is the view folder, argv and the environment name nothing of the harness (an allowlist, ENV_ALLOW), and Ctrl-C is
    left to the harness (no traceback from the worker). The result carries ``nonce``, the job's own (the harness's check that
    the answer is this job's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setsid()
    except OSError:
        pass
    try:
        os.chdir(folder)
    except OSError:   # the harness stopped and removed the view before this worker began: nothing to do, nothing to say
        os._exit(1)
    sys.argv = ["fdg_audit-attack-worker"]
    keep = clean_env()
    os.environ.clear()
    os.environ.update(keep, HOME=folder)
    root = Path(folder)
    try:
        spec = json.loads((root / "view.json").read_text())
    except (OSError, ValueError):
        sys.exit(1)
    confine(float(spec.get("memory_gb") or LIMITS["memory_gb"]))
    try:
        data = encode(dict(_job(spec, root, paths), nonce=nonce, cpu=time.process_time()))   # the job's CPU s
    except UserError as e:
        data = encode({"user_error": str(e), "nonce": nonce})
    except Exception as e:  # noqa: BLE001  (reported by the parent as a failed row, like an in-process crash)
        data = encode({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "nonce": nonce})
    out = root / "result.npz"
    if os.path.lexists(out):   # whatever the plugin left there (a link, a FIFO) is replaced, never written through
        os.unlink(out)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _job(spec: dict, root: Path, paths: dict) -> dict:
    """The job of ``view.json`` (``spec``): load the method and the attack, then describe it, run its controls or
    run it on the view; its result (``encode``)."""
    torch.set_num_threads(spec["threads"])   # the job's count, else the harness's: the numbers of in-process
    threadpool_limits(spec["threads"])       # runs; numpy's and scikit-learn's BLAS too: two workers at once on 2
    #                                          cores must not each start a thread per core
    if "run" in spec:   # the method first, so view.protocol finds the installed module, not a shadow
        sys.path[:] = paths["method"]
        load_method(spec["run"]["plugin"])
    sys.path[:] = paths["attack"]
    atk, device = build(spec), torch.device(spec["device"])
    if spec["mode"] == "describe":   # the metadata probe (attack.describe): the harness never imports plugins
        return {"describe": portrait(atk)}
    if spec["mode"] == "control":
        return {"controls": list(atk.control())}
    run = dict(spec["run"], model_cfg=ModelConfig(**spec["run"]["model_cfg"]))
    view = AdversaryView(Ledger.open(root), run, spec["adversary"], spec["me"], device)
    view.cache_dir = str(root / "cache")
    aux = decode((root / "aux.npz").read_bytes(), {"Aux": Aux, "Split": Split}, "aux.npz")
    aux.public = _split(aux.public)
    for part in (aux.domain_samples, aux.candidates):
        part.update({k: _split(s) for k, s in part.items()})
    return {"outputs": list(atk.run(view, aux)), "keep": dict(getattr(view, "_kept", {}))}
