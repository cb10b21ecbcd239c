"""The audit of a finished run folder: the harness (``harness``) describes each attack in a worker (``checks``),
runs it on adversary views in isolated workers (``sandbox``, ``bwrap``, ``worker``, ``serve``, ``confine``,
``transport``), scores its outputs against the truth (``scoring``) and writes the results. ``shadow``: reference runs for attacks."""
