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
ImageRelevanceGain     MIF / LIF curves and SRG (Blücher et al. TMLR 2024); also
TokenRelevanceGain,    for tokens and graphs
GraphRelevanceGain
RiseDeletion,          deletion / insertion AUC (Petsiuk et al., BMVC 2018)
RiseInsertion
Comprehensiveness,     ERASER AOPC over 1/5/10/20/50 % of tokens (DeYoung et al. 2020)
Sufficiency
CompletenessError      |sum of relevance - score| / |score|
ROAD                   remove and debias: noisy linear imputation (Rong et al. ICML 2022)
PixelFlipping,         Quantus 0.6.0's definitions (equal to it, benchmarks/quantus_parity.py)
RegionPerturbation,
Monotonicity
GenerationFaithfulness per generated token: score drop for its top-k prompt tokens,
                       MIF / LIF and SRG over the prompt
=====================  =============================================================
"""
from .accumulator import Accumulator, exact_sum, limbs_value
from .tokens.aopc import ERASER_FRACTIONS, AOPCResult, Comprehensiveness, Sufficiency
from .average_precision import average_precision
from .images.class_specificity import ClassSpecificity
from .completeness import CompletenessError, CompletenessResult
from .images.deletion_insertion import RISE_FRACTIONS, RiseDeletion, RiseInsertion
from .curves import trapezoid
from .distributed import all_reduce_metrics, shard_indices
from .generation.faithfulness import (GENERATION_KS, GenerationFaithfulness, GenerationFaithfulnessResult, TokenScores,
                                      generation_token_scores)
from .images.occlusion import OCCLUSIONS
from .tokens.modality_removal import MODALITY_FRACTIONS, ModalityTokenRemoval
from .images.pixel_perturbation import (CVPR21_PIXEL_FRACTIONS, FINE_PIXEL_FRACTIONS, PIXEL_FRACTIONS, PIXEL_PROTOCOLS,
                                 PixelPerturbation)
from .monotonicity import Monotonicity
from .images.pixel_flipping import PixelFlipping, RegionPerturbation
from .quantus_bridge import quantus_explain_func
from .tokens.rationale_f1 import RationaleF1
from .relevance_gain import GAIN_FRACTIONS, GAIN_SCORES, GainAreas, RelevanceGainResult, symmetric_relevance_gain
from .graphs.relevance_gain import GraphRelevanceGain
from .images.relevance_gain import ImageRelevanceGain
from .tokens.relevance_gain import TokenRelevanceGain
from .images.road import ROAD, ROAD_PERCENTAGES, noisy_linear_imputation
from .results import (CurveResult, RationaleF1Result, ResultRecord, SegmentationResult, SpecificityResult, read_csv,
                      read_json, result_from_dict, write_csv, write_json)
from .images.saliency_maps import minmax_normalize
from .images.segmentation import SegmentationScores
from .tokens.token_compaction import compact_tokens
from .tokens.token_flipping import TOKEN_FRACTIONS, TokenActivation, TokenPruning

__all__ = [
    "Accumulator", "exact_sum", "limbs_value", "average_precision", "ClassSpecificity", "trapezoid", "all_reduce_metrics",
    "shard_indices", "MODALITY_FRACTIONS", "ModalityTokenRemoval", "CVPR21_PIXEL_FRACTIONS", "FINE_PIXEL_FRACTIONS",
    "PIXEL_FRACTIONS", "PIXEL_PROTOCOLS", "PixelPerturbation",
    "RationaleF1", "CurveResult", "RationaleF1Result", "ResultRecord", "SegmentationResult",
    "SpecificityResult", "read_csv", "read_json", "result_from_dict", "write_csv", "write_json", "minmax_normalize",
    "SegmentationScores", "compact_tokens", "TOKEN_FRACTIONS", "TokenActivation", "TokenPruning",
    "ERASER_FRACTIONS", "AOPCResult", "Comprehensiveness", "Sufficiency", "CompletenessError", "CompletenessResult",
    "RISE_FRACTIONS", "RiseDeletion", "RiseInsertion", "GENERATION_KS", "GenerationFaithfulness",
    "GenerationFaithfulnessResult", "TokenScores", "generation_token_scores", "OCCLUSIONS", "GAIN_FRACTIONS",
    "GAIN_SCORES", "GainAreas", "RelevanceGainResult", "symmetric_relevance_gain", "GraphRelevanceGain",
    "ImageRelevanceGain", "TokenRelevanceGain", "ROAD", "ROAD_PERCENTAGES", "noisy_linear_imputation", "PixelFlipping",
    "RegionPerturbation", "Monotonicity", "quantus_explain_func",
]
