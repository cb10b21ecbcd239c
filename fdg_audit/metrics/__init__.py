"""The one metrics module every attack and the scorer use (docs/attacks.md §1, §4.1). Its submodules ``stats``
(intervals and held-out selection for the scorecard) and ``registry`` (unit, direction, range and harm of every
scored metric) are imported on their own (``from fdg_audit.metrics import stats``): this face loads neither."""

from .dp import (clopper_pearson_upper, eps_lower_bound, gaussian_sigma, one_run_eps, one_run_eps_fdp,
                 one_run_p_value)
from .image import (
    LEGIBLE_CORR, PSNR_CAP_DB, aligned, aligned_corr, aligned_mse, aligned_psnr, label_count_accuracy, legible,
    match_batch, matched_psnr, mse, psnr, reidentified, ssim, success_rate,
)
from .membership import (
    auc, balanced_accuracy, chance, existence_f1, relative_error, resolvable, roc, tpr_at_fpr, tpr_interval,
)

__all__ = [
    "PSNR_CAP_DB", "mse", "psnr", "aligned", "aligned_psnr", "ssim", "success_rate", "match_batch",
    "matched_psnr", "label_count_accuracy", "aligned_mse", "reidentified", "aligned_corr", "legible", "LEGIBLE_CORR",
    "roc", "auc", "resolvable", "tpr_at_fpr", "tpr_interval", "balanced_accuracy", "chance", "existence_f1",
    "relative_error",
    "clopper_pearson_upper", "eps_lower_bound", "one_run_p_value", "one_run_eps", "one_run_eps_fdp", "gaussian_sigma",
]
