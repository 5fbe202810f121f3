"""A decode step of a compiled model is CUDA-graph capturable (no host–device sync in the forward).

GPU only: the CPU suite skips it with the reason. On the GPU machine:
    MOETUNE_TEST_GPU=1 python -m pytest tests/runtime/test_cuda_graph.py
"""

import pytest
import torch

import moetune
from moetune.testing import VOCAB, build

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="CUDA-graph capture needs a CUDA device (and compiled, not interpreted, Triton kernels)",
)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_replays_in_a_cuda_graph(family, batch):
    """Compile with the triton backend, capture a one-token-per-sequence step, replay it on new ids."""
    model = build(family, dtype=torch.bfloat16).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, 1), device="cuda", generator=gen)  # a decode step: T = batch
    with torch.inference_mode():
        eager = model(input_ids=ids, use_cache=False).logits.float()
        moetune.compile(model, backend="triton")
        assert any(c.block is not None for c in model._moetune_state.captured)
        static_ids = ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream builds every kernel before capture
            for _ in range(2):
                model(input_ids=static_ids, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(input_ids=static_ids, use_cache=False).logits
        graph.replay()
        torch.cuda.synchronize()
        rel = (static_out.float() - eager).norm() / eager.norm()
        assert rel < 2e-2, f"graph replay vs eager: relative error {rel:.2e}"
        new_ids = torch.randint(0, VOCAB, (batch, 1), device="cuda", generator=gen)
        want = model(input_ids=new_ids, use_cache=False).logits.float()
        static_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        rel = (static_out.float() - want).norm() / want.norm()
        assert rel < 1e-3, f"replay on new ids vs a direct call: relative error {rel:.2e}"
        moetune.uncompile(model)
