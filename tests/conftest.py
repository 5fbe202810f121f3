"""Test set-up: no hub access, Triton kernels run interpreted on CPU (both set before any import of
transformers or of a kernel module)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not os.environ.get("MOETUNE_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
