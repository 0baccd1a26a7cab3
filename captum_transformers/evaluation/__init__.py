"""Faithfulness metrics for explanations, as batch accumulators.

Each metric takes tensors and model callables (``forward(batch) -> logits (B, C)``), is fed
with ``update(...)`` per batch and returns a frozen result from ``compute()``; its state is
float64 sums (``state()``) that ``all_reduce_metrics`` sums across processes exactly.

=====================  =============================================================
PixelPerturbation      positive / negative pixel removal AUC (Chefer et al. CVPR'21; 1 % steps
                       to 10 % by default, fractions="cvpr21" for the authors' steps)
SegmentationScores     pixAcc, mIoU, mAP of thresholded maps (Chefer et al. CVPR'21)
RationaleF1            ERASER token F1 of top-k words (DeYoung et al. 2020)
TokenActivation        AUAC: reveal most relevant tokens first (Ali et al. ICML'22)
TokenPruning           AU-MSE: [UNK] the least |relevant| tokens first (Ali et al. ICML'22)
ModalityTokenRemoval   drop one modality's tokens by relevance (Chefer et al. ICCV'21)
ClassSpecificity       share of positive relevance on the explained object
=====================  =============================================================
"""
from .accumulator import Accumulator, exact_sum, limbs_value
from .average_precision import average_precision
from .class_specificity import ClassSpecificity
from .curves import trapezoid
from .distributed import all_reduce_metrics, shard_indices
from .modality_removal import MODALITY_FRACTIONS, ModalityTokenRemoval
from .pixel_perturbation import (CVPR21_PIXEL_FRACTIONS, FINE_PIXEL_FRACTIONS, PIXEL_FRACTIONS, PIXEL_PROTOCOLS,
                                 PixelPerturbation)
from .plots import plot_curves
from .rationale_f1 import RationaleF1
from .results import (CurveResult, RationaleF1Result, ResultRecord, SegmentationResult, SpecificityResult, read_csv,
                      read_json, result_from_dict, write_csv, write_json)
from .saliency_maps import minmax_normalize
from .segmentation import SegmentationScores
from .token_compaction import compact_tokens
from .token_flipping import TOKEN_FRACTIONS, TokenActivation, TokenPruning

__all__ = [
    "Accumulator", "exact_sum", "limbs_value", "average_precision", "ClassSpecificity", "trapezoid", "all_reduce_metrics",
    "shard_indices", "MODALITY_FRACTIONS", "ModalityTokenRemoval", "CVPR21_PIXEL_FRACTIONS", "FINE_PIXEL_FRACTIONS",
    "PIXEL_FRACTIONS", "PIXEL_PROTOCOLS", "PixelPerturbation",
    "plot_curves", "RationaleF1", "CurveResult", "RationaleF1Result", "ResultRecord", "SegmentationResult",
    "SpecificityResult", "read_csv", "read_json", "result_from_dict", "write_csv", "write_json", "minmax_normalize",
    "SegmentationScores", "compact_tokens", "TOKEN_FRACTIONS", "TokenActivation", "TokenPruning",
]
