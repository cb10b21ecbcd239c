"""Transitional: the attack contract moved to fdg_audit.api.attack, the harness to fdg_audit.harness, scoring to
fdg_audit.scoring and run-folder files to fdg_audit.runfolder. Removed once every caller imports those."""
from .api.attack import *  # noqa: F401,F403
from .api.attack import AdversaryView, Aux, federate, sample_victims, view_envelopes  # noqa: F401
from .harness import (_make, _selection, applicable, attack_runs, check_attacks, describe, make_attack,  # noqa: F401
                      observer, run_attacks, run_attacks_cli, salted, selection, wanted)
from .runfolder import LEAK_FIELDS, load_items  # noqa: F401
from .scoring import Truth, build_aux, score  # noqa: F401
