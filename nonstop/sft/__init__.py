"""Supervised and preference tuning: SFT, DPO and ORPO losses and their data pipelines."""

from nonstop.sft.config import SFTRunConfig  # noqa: E402
from nonstop.sft.data import (
    EXAMPLE_KINDS,
    DataConfig,
    ExampleEncoder,
    ExampleKind,
    PackedBatchDataset,
    make_dataset,
)
from nonstop.sft.datasets import JsonlSource, ParquetSource, SourceRecord, open_source
from nonstop.sft.losses import (
    DPOConfig,
    DPOMetrics,
    MaskedSum,
    ORPOConfig,
    ORPOLoss,
    ORPOMetrics,
    PairLogprobs,
    SequenceLogprobs,
    dpo_loss,
    masked_cross_entropy,
    orpo_loss,
    preference_pairs,
    sequence_logprobs,
)
from nonstop.sft.trainer import RunResult, train  # noqa: E402

__all__ = [
    "RunResult",
    "SFTRunConfig",
    "train",
    "EXAMPLE_KINDS",
    "DPOConfig",
    "DPOMetrics",
    "DataConfig",
    "ExampleEncoder",
    "ExampleKind",
    "JsonlSource",
    "MaskedSum",
    "ORPOConfig",
    "ORPOLoss",
    "ORPOMetrics",
    "PackedBatchDataset",
    "PairLogprobs",
    "ParquetSource",
    "SequenceLogprobs",
    "SourceRecord",
    "dpo_loss",
    "make_dataset",
    "masked_cross_entropy",
    "open_source",
    "orpo_loss",
    "preference_pairs",
    "sequence_logprobs",
]
