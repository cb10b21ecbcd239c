"""Everything a plugin imports. ``methods/`` and ``attacks/`` (and a user's own plugins) import only from
``fdg_audit.api`` and its modules: ``api.method`` (the method contract), ``api.attack`` (the attack contract),
``api.privacy`` (DP mechanisms); this module re-exports the shared library pieces (data splits and loaders, the
model zoo, metrics, the one-line error, the method loader for shadow runs, ``records`` (the names of the ground-truth
records a method writes and an attack's outputs name) and ``seeding``, from which every random stream is derived).
The core never imports ``fdg_audit.api``'s package root, so the import graph stays top-down: plugins -> api -> core."""
from __future__ import annotations

from .. import metrics, records, seeding  # noqa: F401
from ..data import DataConfig, Split, load_data  # noqa: F401
from ..data.digits import place, rotate  # noqa: F401
from ..errors import UserError  # noqa: F401
from ..models import ModelConfig, Net, build_model  # noqa: F401
from ..protocol import load_method  # noqa: F401
