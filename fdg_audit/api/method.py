"""The method plugin contract: what a method plugin imports (with ``fdg_audit.api``).

A method is a subclass of ``MethodPlugin``; its docstring lists every required and optional attribute and hook,
with their defaults. ``Server`` and ``Client`` are the parties it subclasses, ``Reply`` what a client answers,
``Payload`` what a party receives; ``state_arrays``/``load_arrays`` move a model's state in and out of a message.
methods/fedavg.py is the smallest complete example; README's "Writing a method" is the how-to.
"""
from __future__ import annotations

from ..bus import Payload, register_kind  # noqa: F401
from ..params import TrainParams, make_optimizer  # noqa: F401
from ..protocol import (Client, MethodPlugin, Party, Reply, Server, accuracy, default_build, load_arrays,  # noqa: F401
                        state_arrays)
