"""MoEBlock from config.json: agrees with capture on every tiny family; bad configs give clear errors."""

import json

import pytest

from moetune.ir import CaptureError, MoEBlock
from moetune.ir.capture import capture
from moetune.ir.config import block_from_config, load_config, moe_layers

HOOKED = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "olmoe", "gpt_oss",
          "granitemoe", "granitemoeshared"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", HOOKED)
def test_config_matches_capture(tiny, family, dtype):
    model = tiny(family, dtype)
    cfg = json.loads(json.dumps(model.config.to_dict()))  # what config.json holds
    for c in capture(model):
        assert c.ok, c.reason
        assert block_from_config(cfg, name=c.path) == c.block


@pytest.mark.parametrize("family", HOOKED)
def test_moe_layers_match_capture(tiny, family):
    model = tiny(family, "float32")
    layers = moe_layers(model.config.to_dict())
    assert [f"model.layers.{i}." for i in layers] == [c.path[: -len(c.path.rsplit(".", 1)[1])]
                                                      for c in capture(model)]


@pytest.mark.parametrize(
    "fields, want",
    [
        (dict(num_hidden_layers=6, mlp_only_layers=[0, 5], decoder_sparse_step=2), [1, 3]),
        (dict(num_hidden_layers=4), [0, 1, 2, 3]),
        (dict(), None),
    ],
)
def test_moe_layers_rules(fields, want):
    assert moe_layers({**_qwen3(), **fields}) == want
    ds = {"model_type": "deepseek_v3", "num_hidden_layers": 5}
    assert moe_layers(ds) == [3, 4] and moe_layers({**ds, "first_k_dense_replace": 1}) == [1, 2, 3, 4]


def test_vlm_config_reads_text_config(tiny):
    model = tiny("qwen3_5_moe", "bfloat16")
    text = model.config.to_dict()
    vlm = {"model_type": "qwen3_5_moe", "dtype": "bfloat16", "text_config": {**text, "dtype": None}}
    want = capture(model)[0].block
    assert block_from_config(vlm, name=want.name) == want


def test_dtype_override_and_default():
    cfg = {"model_type": "olmoe", "hidden_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
           "intermediate_size": 24}
    assert block_from_config(cfg).weight_dtype == "bfloat16"
    b = block_from_config({**cfg, "torch_dtype": "float16"})
    assert (b.weight_dtype, b.routing_weight_dtype) == ("float16", "float16")
    assert block_from_config(cfg, dtype="float32").weight_dtype == "float32"


def _qwen3(**drop_or_set):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_experts": 16, "num_experts_per_tok": 4,
           "moe_intermediate_size": 40, "hidden_act": "silu"}
    for key, v in drop_or_set.items():
        if v is None:
            cfg.pop(key)
        else:
            cfg[key] = v
    return cfg


@pytest.mark.parametrize(
    "cfg, words",
    [
        (_qwen3(num_experts=None), ["config 'my.json'", "missing MoE field", "'num_experts'", "qwen3_moe"]),
        (_qwen3(num_experts_per_tok=None), ["missing MoE field", "'num_experts_per_tok'"]),
        (_qwen3(hidden_size=None), ["'hidden_size'"]),
        (_qwen3(moe_intermediate_size=None), ["'moe_intermediate_size'"]),
        (_qwen3(num_experts=0), ["'num_experts' = 0", "positive integer"]),
        (_qwen3(hidden_act="gelu"), ["'hidden_act' = 'gelu'", "not supported"]),
        (_qwen3(model_type="bert"), ["unknown model_type 'bert'", "qwen3_moe"]),
        (_qwen3(model_type=None), ["no field 'model_type'"]),
        (_qwen3(model_type="llama4_text"), ["llama4_text", "not supported"]),
        (_qwen3(model_type="dbrx"), ["DBRX"]),
        (_qwen3(dtype="float64"), ["float64"]),
        (_qwen3(num_experts_per_tok=17), ["top-k larger than E"]),
        ({"model_type": "deepseek_v3", "hidden_size": 64, "n_routed_experts": 16, "num_experts_per_tok": 4,
          "moe_intermediate_size": 40, "scoring_func": "softmax"}, ["scoring_func='softmax'"]),
    ],
)
def test_bad_configs(cfg, words):
    with pytest.raises(CaptureError) as err:
        block_from_config(cfg, name="my.json")
    assert "my.json" in str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_load_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_qwen3()))
    assert load_config(tmp_path) == _qwen3() == load_config(tmp_path / "config.json")
    assert isinstance(block_from_config(load_config(tmp_path)), MoEBlock)
    with pytest.raises(CaptureError, match="does not exist"):
        load_config(tmp_path / "nope")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CaptureError, match="bad.json is not readable JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(CaptureError, match="expected an object"):
        load_config(tmp_path / "list.json")


QWEN3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
         "moe_intermediate_size": 768, "norm_topk_prob": True, "torch_dtype": "bfloat16"}
# as DeepSeek-V3 and Qwen3-FP8 publish it
FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_fp8_quantization_config_gives_fp8_blocks():
    from moetune.ir import WeightFormat

    plain = block_from_config(QWEN3)
    b = block_from_config({**QWEN3, "quantization_config": FP8_QUANT})
    assert b.weight_format == WeightFormat.fp8_block((128, 128), "float32", "bfloat16")
    assert b == plain.with_weight_format(b.weight_format)
    ue = block_from_config({**QWEN3, "quantization_config": {**FP8_QUANT, "scale_fmt": "ue8m0"}})
    assert ue.weight_format.scale_dtype == "ue8m0"
    assert block_from_config({**QWEN3, "quantization_config": FP8_QUANT}, dtype="float16").weight_format \
        .compute_dtype == "float16"
    vlm = {"model_type": "qwen3_5_moe", "quantization_config": FP8_QUANT,
           "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 256, "num_experts": 8,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 128}}
    assert block_from_config(vlm).weight_format.quantized
    # another quantisation method: the block in the config's dtype, as capture sees it after a dequantising load
    assert block_from_config({**QWEN3, "quantization_config": {"quant_method": "mxfp4"}}) == plain


@pytest.mark.parametrize("quant, words", [
    ({"activation_scheme": "static"}, ["activation_scheme='static'", "dynamic"]),
    ({"weight_block_size": None}, ["no weight_block_size", "per-tensor"]),
    ({"weight_block_size": [128]}, ["weight_block_size=[128]"]),
    ({"fmt": "e5m2"}, ["fmt='e5m2'", "e4m3"]),
    ({"expert_dtype": "fp4"}, ["FP4"]),
    ({"scale_fmt": "e4m3"}, ["scale_fmt='e4m3'", "ue8m0"]),
    ({"weight_block_size": [512, 128]}, ["F (gate/up rows)=768 is not a multiple of 512", "partial last block"]),
])
def test_fp8_quantization_config_refused_with_reason(quant, words):
    with pytest.raises(CaptureError) as err:
        block_from_config({**QWEN3, "quantization_config": {**FP8_QUANT, **quant}}, name="q")
    for w in words:
        assert w in str(err.value), str(err.value)
    assert "'q'" in str(err.value)
