"""A hostile attack plugin for the OS-sandbox test (tests/test_trust.py): it is its own top-level module, importing
only fdg_audit, so that under bubblewrap nothing but this file is exposed of the tests directory."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fdg_audit.api.attack import Attack, AttackParams, Control, Skipped


@dataclass
class Params(AttackParams):
    paths: list = field(default_factory=list)   # what the plugin tries to open (the test names them)
    harness: int = 0                             # the harness's pid
    port: int = 0                                # a port the harness listens on (127.0.0.1)


class Escape(Attack):
    """Reports which of ``paths`` it could read, whether /proc shows the harness, and whether it reaches the harness's listening socket."""
    name = "escape"
    consumes = ("weights",)
    Params = Params

    def run(self, view, aux):
        got = []
        for p in self.p.paths:
            try:
                got.append(f"{p}: {sorted(os.listdir(p))[:3]}" if Path(p).is_dir() else f"{p}: {Path(p).read_bytes()[:8]}")
            except OSError:
                pass
        if Path(f"/proc/{self.p.harness}/environ").exists():
            got.append("/proc/<harness>")
        import socket
        try:
            socket.create_connection(("127.0.0.1", self.p.port), timeout=2).close()
            got.append("network")
        except OSError:
            pass
        return [Skipped(view.me, "weights", 1, json.dumps(got))]

    def control(self):
        """Shadow training needs the installed methods inside the sandbox: load one."""
        from fdg_audit.protocol import load_method
        return [Control("installed_methods_load", "loaded", float(load_method("fedavg").name == "fedavg"), 1.0)]
