"""The tuner: one Optuna study per bucket of a block, winners into the dispatch table (needs Optuna).

    from moetune.search import TuneOptions, tune_block
"""

from .options import BucketResult, TuneOptions
from .tune import BucketInputs, bucket_inputs, tune_block, tune_bucket

__all__ = ["BucketInputs", "BucketResult", "TuneOptions", "bucket_inputs",
           "tune_block", "tune_bucket"]
