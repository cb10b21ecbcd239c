"""Training: a run's federation (``federation``) over the bus, its engines (``engines``, ``cohort``, ``ray_engine``),
and a scenario's runs into a run folder (``runs``). Training imports neither the audit nor the report."""
