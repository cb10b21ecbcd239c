"""The names of the ground-truth records, declared once for both sides of the unwritten contract.

A method (``Client.record_truth(name, **arrays)``) or the privacy layer writes a record under one of these names
(truth/<run>/<client>/<name>.npz; attacks never see it), and an attack's output names the record its rows refer to
(``Reconstruction.truth``, ``Predictions.truth``, ``Audit.truth``) for the scorer (fdg_audit.audit.scoring) to join.
Plugins import the names as ``from fdg_audit.api import records``. A name with ``{...}`` is a template:
``records.FEATURES.format(round=3)``.
"""

TRAIN = "train"                        # the victim's whole training set: built by the scorer, never recorded
AMP = "amp"                            # FedDG's amplitude bank: the image id of each row (idx)
STYLE = "style"                        # CCST's style bank: the image id of each row (idx)
FEATURES = "features_r{round}"         # FADA's features of a round: the image id of each row (idx)
PROTO = "proto"                        # FPL: the client's image ids, labels and images per class (idx, y, counts)
PROTO_CLASS = "proto_c{c}"             # FPL: the image ids behind the prototype of class c (idx)
CANARIES = "canaries"                  # artifact canaries: which slots hold an inserted canary (member, idx)
UPDATE_CANARIES = "update_canaries"    # client-level DP canaries: which slots were inserted (member)
GRADIENT_CANARIES = "gradient_canaries"   # DP-SGD Dirac canaries: which slots were inserted (member)
