"""fdg_audit: a privacy-auditing testbed for federated domain generalization."""

__version__ = "0.1.0"
