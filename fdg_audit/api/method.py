"""The method plugin contract: what a method plugin imports (with ``fdg_audit.api``).

The contract itself (``MethodPlugin`` and its docstring) is being moved here from fdg_audit.federation; the names
below are the stable import surface for methods/ and for attacks that train on a method's protocol.
"""
from __future__ import annotations

from ..bus import Payload, register_kind  # noqa: F401
from ..federation import (Client, Party, Reply, Server, accuracy, load_arrays, state_arrays)  # noqa: F401
from ..params import TrainParams, make_optimizer  # noqa: F401
