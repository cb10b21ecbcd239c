"""Every metric the scorer emits (fdg_audit.audit.scoring.score, fdg_audit.privacy.audit.audit_rows), in one place.

One line per metric: its unit, its direction (``higher``: a larger value is a stronger attack; False for error
metrics), its range ``[lo, hi]`` (intervals are cut to it; PSNR is capped at ``PSNR_CAP_DB``), the harm it measures
and a short label for tables. ``card`` marks the metric that scores its harm in the scorecard; ``per_victim`` marks
estimates with one value per victim (their items are the victims). The report reads all of this from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError
from .image import PSNR_CAP_DB

HARMS = ("reconstruction", "membership", "domain", "class", "label_distribution", "dataset_size", "dp_audit", "none")


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    higher: bool              # a larger value means a stronger attack (more leakage)
    lo: float
    hi: float
    harm: str                 # one of HARMS
    label: str                # short, for table headings
    text: str                 # one sentence, for the report's list of metrics
    card: bool = False        # the metric the scorecard scores its harm by
    per_victim: bool = False  # one value per victim (an estimate): the victims are its items


INF = math.inf
_ROWS = [  # name, unit, higher, lo, hi, harm, label, text, card, per_victim
    ("reid", "fraction", True, 0.0, 1.0, "reconstruction", "re-identified",
     "linkable: fraction of reconstructions that pick their true image out of it and 99 same-domain images the "
     "victim did not hold, of its class first (nearest neighbour, aligned, each channel standardised); baseline: the "
     "strongest guess an attacker has for free (free_guess: the public class mean of the inferred label; for the "
     "bank the true amplitude with a random or public class-mean phase), scored the same way, never below chance "
     "(1/(1 + D), or for k outputs matched among a victim's N images the hit rate of free guesses sent through the "
     "same matching)", True, False),
    ("reid_free", "fraction", True, 0.0, 1.0, "reconstruction", "free guess re-identified",
     "the strongest free guess's re-identification against chance: above chance, the artifact links an image "
     "without any attack (the bank's amplitude is a fingerprint)", False, False),
    ("legible", "fraction", True, 0.0, 1.0, "reconstruction", "legible",
     "fraction of reconstructions with an aligned correlation of at least 0.6 with the true image (textured noise "
     "that wins re-identification by a hair is not legible; checked against a labelled set in "
     "tests/test_legible.py); baseline: the free guess's legibility", False, False),
    ("psnr", "dB", True, 0.0, PSNR_CAP_DB, "reconstruction", "recon PSNR dB",
     "mean PSNR of the aligned reconstructions against the true images", False, False),
    ("psnr_plain", "dB", True, 0.0, PSNR_CAP_DB, "reconstruction", "plain PSNR dB",
     "mean PSNR of the reconstructions as returned (no alignment)", False, False),
    ("psnr_max", "dB", True, 0.0, PSNR_CAP_DB, "reconstruction", "best PSNR dB", "best single-image PSNR", False,
     False),
    ("ssim", "", True, -1.0, 1.0, "reconstruction", "SSIM", "mean SSIM (Gaussian window 11x11, sigma 1.5)", False,
     False),
    ("success@20dB", "fraction", True, 0.0, 1.0, "reconstruction", "PSNR >= 20 dB",
     "fraction of images reconstructed at aligned PSNR >= 20 dB", False, False),
    ("success@25dB", "fraction", True, 0.0, 1.0, "reconstruction", "PSNR >= 25 dB",
     "fraction of images reconstructed at aligned PSNR >= 25 dB", False, False),
    ("cpu_seconds", "s", True, 0.0, INF, "none", "CPU s", "process CPU seconds the attack spent on the output "
     "(its cost, not a leak)", False, False),
    ("iterations", "", True, 0.0, INF, "none", "iterations", "optimisation steps run before the plateau rule or "
     "the cap stopped it (not a leak)", False, False),
    ("label_acc", "fraction", True, 0.0, 1.0, "class", "label acc",
     "accuracy of the labels inferred with the reconstructions", True, False),
    ("auc", "", True, 0.0, 1.0, "membership", "membership AUC", "membership ROC AUC", True, False),
    ("auc_ci_low", "", True, 0.0, 1.0, "none", "AUC 95% CI low",
     "low end of the membership AUC's 95% DeLong interval (per victim: it clears the cell's baseline or not)", False,
     False),
    ("auc_ci_high", "", True, 0.0, 1.0, "none", "AUC 95% CI high",
     "high end of the membership AUC's 95% DeLong interval", False, False),
    ("blind_auc", "", True, 0.0, 1.0, "none", "blind AUC",
     "best cross-validated AUC of a model-free classifier of member vs non-member on the candidates' images and "
     "labels alone (no model; not a measurement of the attack): a membership cell's baseline is max(0.5, it)",
     False, False),
    ("tpr@0.01fpr", "fraction", True, 0.0, 1.0, "membership", "TPR@1%FPR", "membership TPR at 1% FPR", False, False),
    ("tpr@0.001fpr", "fraction", True, 0.0, 1.0, "membership", "TPR@0.1%FPR", "membership TPR at 0.1% FPR", False,
     False),
    ("tpr@0fpr", "fraction", True, 0.0, 1.0, "membership", "TPR@0FPR", "membership TPR with no false positive", False,
     False),
    ("class_balanced_acc", "fraction", True, 0.0, 1.0, "class", "class acc",
     "balanced accuracy of the inferred class", True, False),
    ("domain_balanced_acc", "fraction", True, 0.0, 1.0, "domain", "domain bal. acc",
     "balanced accuracy of the inferred source domain", True, False),
    ("n_samples_rel_error", "fraction", False, 0.0, INF, "dataset_size", "size rel. error",
     "relative error of the estimated dataset size", True, True),
    ("label_count_acc", "fraction", True, 0.0, 1.0, "label_distribution", "label count acc",
     "label-count accuracy (multiset overlap)", False, True),
    ("label_dist_acc", "fraction", True, 0.0, 1.0, "label_distribution", "label counts acc",
     "label-distribution accuracy (1 - total variation)", True, True),
    ("label_existence_f1", "", True, 0.0, 1.0, "label_distribution", "label existence F1",
     "F1 of which labels a client holds", False, False),
    ("eps_lb_one_run", "", True, 0.0, INF, "dp_audit", "ε lower bound (one run)",
     "empirical ε lower bound from canaries (one-run audit, 95% conf.)", False, False),
    ("eps_lb_fdp", "", True, 0.0, INF, "dp_audit", "ε lower bound (f-DP one run)",
     "empirical ε lower bound from canaries (f-DP one-run audit, Gaussian trade-offs, 95% conf.)", False, False),
    ("eps_lb_ceiling", "", True, 0.0, INF, "none", "ε ceiling of the audit",
     "the f-DP bound with every guess right: the most these canaries can certify (not a measurement)", False, False),
    ("eps_lb_cp", "", True, 0.0, INF, "dp_audit", "ε lower bound (CP)",
     "empirical ε lower bound from canaries (Clopper–Pearson, 95% conf.)", False, False),
    ("eps_theory", "", True, 0.0, INF, "none", "ε of the accountant",
     "the accountant's ε of the audited mechanism (not a measurement)", False, False),
    ("audit_auc", "", True, 0.0, 1.0, "dp_audit", "canary AUC", "ROC AUC of the canary scores", False, False),
]
METRICS = {r[0]: Metric(*r) for r in _ROWS}


# The artifact kind that carries a metric's quantity itself (a protocol that sends n_k sends it as ``n_samples``): a
# cell scored on that kind read the value off the message. Its state is "sent in the clear", not an attack finding.
IN_THE_CLEAR = {"n_samples_rel_error": "n_samples"}


def info(metric: str) -> Metric:
    """The registry entry of ``metric``; a name not in the registry is a one-line error."""
    try:
        return METRICS[metric]
    except KeyError:
        raise UserError(f"metric {metric!r} is not in the metric registry (fdg_audit/metrics/registry.py): add it "
                        "there with its unit, direction, range and harm") from None


def harm_of(metric: str) -> str:
    return info(metric).harm


# The smallest difference between two methods that matters, per metric (``margin``): a firm "not distinguishable"
# (fdg_audit.metrics.stats.call) needs the whole 95% interval of the difference inside ±margin, so that it claims
# "they differ by less than this", not "we found nothing". Accuracy: two points of held-out accuracy, the size of the
# gains FedDG papers report; a rate of images, labels or victims: a tenth of them; membership AUC: 0.05 (the
# distance from chance at which audits start to call a leak); a dataset size's relative error: a quarter; PSNR:
# 1 dB; SSIM: 0.05. A metric of another unit has no margin, so its differences never get the firm "equal" call.
MARGINS = {"target_acc": 0.02, "auc": 0.05, "n_samples_rel_error": 0.25, "psnr": 1.0, "psnr_plain": 1.0,
           "psnr_max": 1.0, "ssim": 0.05}


def margin(metric: str) -> float:
    """The margin of ``metric`` (``MARGINS``; a fraction without its own: 0.1; else, or no metric (""), NaN: no
    margin)."""
    if metric in MARGINS:
        return MARGINS[metric]
    return 0.1 if metric in METRICS and info(metric).unit == "fraction" else math.nan


def card_metrics(harm: str) -> tuple[str, ...]:
    """The metrics that score ``harm`` in the scorecard, in registry order."""
    return tuple(m.name for m in METRICS.values() if m.card and m.harm == harm)


def stronger(metric: str, a: float, b: float) -> bool:
    """Whether value ``a`` is a stronger attack result than ``b`` (NaN is never stronger)."""
    if math.isnan(a):
        return False
    if math.isnan(b):
        return True
    return a > b if info(metric).higher else a < b


__all__ = ["HARMS", "METRICS", "Metric", "card_metrics", "harm_of", "info", "stronger"]
