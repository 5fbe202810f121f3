"""Test set-up: Triton kernels run interpreted on CPU (set before any kernel module is imported)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not os.environ.get("MOETUNE_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_models.py

import torch  # noqa: E402

torch.set_num_threads(1)
