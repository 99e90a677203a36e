"""HF interop: logits parity with transformers' own DeepSeek-V3/V2 (an independent implementation), export /
re-import round trips, FP8 block dequantization, import errors, and the convert_hf CLI. Offline, tiny models."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_cli
from safetensors import safe_open
from safetensors.torch import save_file

import models.deepseek_v3.convert_hf as convert_hf
from models.deepseek_v3.args import FLAVORS, ModelArgs
from models.deepseek_v3.convert_hf import MODEL_KEY
from models.deepseek_v3.convert_hf import main as convert_main
from models.deepseek_v3.hf import (
    INDEX_FILE,
    args_from_hf_config,
    args_from_hf_config_file,
    dequantize_fp8,
    expected_shapes,
    from_hf,
    hf_config_from_args,
    load_hf_pretrained,
    read_hf_state_dict,
    save_hf_checkpoint,
    to_hf,
)
from models.deepseek_v3.model import DeepSeekV3Model
from trainer.job_config import load_config, model_job
from trainer.train import run

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
PARITY_ATOL = 1e-4

# Tiny shapes; hidden and intermediate sizes are multiples of 8 (grouped_mm needs 16-byte row strides).
HF_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
               max_position_embeddings=256)
NO_ROPE_SCALING = dict(rope_type="default", rope_theta=10000.0)


def _yarn(factor: float, mscale: float) -> dict:
    # max_position_embeddings 256 > original 64: YaRN is on for both implementations
    return dict(rope_type="yarn", rope_theta=10000.0, factor=factor, original_max_position_embeddings=64,
                beta_fast=32, beta_slow=1, mscale=mscale, mscale_all_dim=mscale)


OUR_TINY = ModelArgs(
    vocab_size=256, dim=64, inter_dim=96, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=4,
    max_seq_len=128, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=4,
    n_limited_groups=2, score_func="sigmoid", group_score_func="top2_sum", route_norm=True, route_scale=2.5,
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    original_seq_len=32, rope_factor=4.0, mscale=0.707,
)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Weights at a scale that gives O(1) activations and logits (the default 0.02 init would make any logits
    difference tiny), norms around 1, and a non-zero expert selection bias, so routing is exercised for real."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.dim() == 1:
            p.copy_(1 + 0.1 * noise)
        elif "embed" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[-1]))
    for name, b in module.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_ours(args: ModelArgs, seed: int = 0) -> DeepSeekV3Model:
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    randomize_(model, seed)
    return model.eval()


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ config mapping

def test_config_maps_v3_hub_fields():
    hub = dict(model_type="deepseek_v3", **{**HF_BASE, "max_position_embeddings": 163840}, q_lora_rank=None,
               n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
               rope_theta=10000, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                                   beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    args = args_from_hf_config(hub)
    assert (args.q_lora_rank, args.n_expert_groups, args.n_limited_groups, args.num_mtp_layers) == (0, 4, 2, 1)
    assert (args.score_func, args.group_score_func, args.route_norm, args.route_scale) == ("sigmoid", "top2_sum",
                                                                                            True, 2.5)
    assert args.yarn_enabled and (args.rope_factor, args.original_seq_len, args.mscale) == (40, 4096, 1.0)
    # and back: transformers reads our config as the same model
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in hf_config_from_args(args).items()
                                           if k not in ("architectures", "model_type", "torch_dtype")})
    assert args_from_hf_config(cfg.to_dict()) == args


def test_config_v2_scaling_applies_only_without_normalisation():
    v2 = dict(model_type="deepseek_v2", **HF_BASE, topk_method="group_limited_greedy", n_group=4, topk_group=2,
              routed_scaling_factor=16.0)
    args = args_from_hf_config({**v2, "norm_topk_prob": False})
    assert (args.score_func, args.group_score_func, args.route_norm, args.route_scale) == ("softmax", "max", False,
                                                                                            16.0)
    args = args_from_hf_config({**v2, "norm_topk_prob": True})
    assert (args.route_norm, args.route_scale) == (True, 1.0)
    assert args_from_hf_config({**v2, "topk_method": "greedy"}).n_expert_groups == 1


@pytest.mark.parametrize("change, words", [
    (dict(model_type="llama"), "model_type"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(rope_parameters=dict(_yarn(4.0, 1.0), mscale_all_dim=0.5)), "mscale"),
    (dict(rope_parameters=dict(_yarn(4.0, 1.0), original_max_position_embeddings=512)), "original"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)), "linear"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(topk_group=9), "n_limited_groups"),
])
def test_unsupported_config_is_one_line_value_error(change, words):
    cfg = dict(model_type="deepseek_v3", **HF_BASE, n_group=4, topk_group=2, rope_parameters=NO_ROPE_SCALING)
    with pytest.raises(ValueError, match=words) as info:
        args_from_hf_config({**cfg, **change})
    assert "\n" not in str(info.value)


def test_config_file_path_or_directory(tmp_path):
    cfg = dict(model_type="deepseek_v3", **HF_BASE, n_group=4, topk_group=2, rope_parameters=NO_ROPE_SCALING)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert args_from_hf_config_file(tmp_path) == args_from_hf_config_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="not found"):
        args_from_hf_config_file(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------------ logits parity

PARITY_CASES = {
    # q LoRA, group-limited routing (2 of 4 groups), top-k normalisation, YaRN with mscale 0.707
    "v3_qlora_groups_norm_yarn": ("DeepseekV3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                                     rope_parameters=_yarn(4.0, 0.707))),
    # plain q projection, no groups, no normalisation, scale 1.7, two dense layers, plain RoPE
    "v3_plainq_dense2_nonorm": ("DeepseekV3", dict(num_hidden_layers=4, first_k_dense_replace=2, q_lora_rank=None,
                                                   n_group=1, topk_group=1, norm_topk_prob=False,
                                                   routed_scaling_factor=1.7, rope_parameters=NO_ROPE_SCALING)),
    # 16 experts in 8 groups, 3 kept, top-4, YaRN factor 8, block norm eps 1e-5 (MLA latent norms stay at 1e-6)
    "v3_groups_top4_yarn_eps": ("DeepseekV3", dict(q_lora_rank=None, n_routed_experts=16, n_group=8, topk_group=3,
                                                   num_experts_per_tok=4, rms_norm_eps=1e-5,
                                                   max_position_embeddings=512, rope_parameters=_yarn(8.0, 1.0))),
    # DeepSeek-V2 softmax scores, greedy top-k, scale 2.0
    "v2_softmax_greedy": ("DeepseekV2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=2.0,
                                             rope_parameters=NO_ROPE_SCALING)),
    # DeepSeek-V2 softmax scores, group-limited greedy (group max), q LoRA, YaRN
    "v2_softmax_group_max_yarn": ("DeepseekV2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                                                     topk_group=2, routed_scaling_factor=3.0,
                                                     rope_parameters=_yarn(4.0, 0.707))),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_logits_match_transformers(case, tmp_path):
    family, overrides = PARITY_CASES[case]
    cfg = getattr(transformers, f"{family}Config")(**{**HF_BASE, **overrides})
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    hf_model.set_attn_implementation("eager")
    hf_model = hf_model.float().eval()
    randomize_(hf_model, seed=1)
    hf_model.save_pretrained(tmp_path)

    ours = load_hf_pretrained(tmp_path)
    args = ours.args
    assert args.yarn_enabled == (cfg.rope_parameters["rope_type"] == "yarn")
    if family == "DeepseekV3":
        assert ours.layers[str(args.n_dense_layers)].moe.expert_bias.abs().min() > 0  # the bias really came over
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        expected = hf_model(x).logits
        got = ours(x)
    diff = (got - expected).abs().max().item()
    print(f"\n{case}: max |logits diff| = {diff:.3g} (logits up to {expected.abs().max().item():.3g})")
    assert diff <= PARITY_ATOL


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_our_export_loads_in_transformers_with_same_logits(score_func, tmp_path):
    if score_func == "sigmoid":
        args = OUR_TINY.replace(num_mtp_layers=1)
    else:  # a V2-shaped model: softmax scores, group max, no selection bias
        args = OUR_TINY.replace(score_func="softmax", group_score_func="max", route_norm=False, route_scale=2.0)
    model = build_ours(args)
    if score_func == "softmax":
        for moe in model.moe_layers():
            moe.expert_bias.zero_()
    save_hf_checkpoint(model, args, tmp_path)
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    x = tokens(args.vocab_size, seed=1)
    with torch.no_grad():
        diff = (hf_model.float().eval()(x).logits - model(x)).abs().max().item()
    print(f"\nexport {score_func}: max |logits diff| = {diff:.3g}")
    assert diff <= PARITY_ATOL


# ------------------------------------------------------------------------------------------------ round trips

def test_export_reimport_is_bit_identical_including_mtp(tmp_path):
    args = OUR_TINY.replace(num_mtp_layers=1)
    model = build_ours(args)
    ours = model.state_dict()
    save_hf_checkpoint(model, args, tmp_path, max_shard_bytes=64 * 1024)

    index = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 1  # really sharded
    mtp = f"model.layers.{args.n_layers}."
    for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                "embed_tokens.weight", "mlp.experts.7.down_proj.weight", "self_attn.q_a_proj.weight"):
        assert mtp + key in index
    reread = read_hf_state_dict(tmp_path, args_from_hf_config_file(tmp_path), dtype=None)
    assert reread.keys() == ours.keys()
    for fqn, t in ours.items():
        assert reread[fqn].dtype == t.dtype and torch.equal(reread[fqn], t), fqn
    loaded = load_hf_pretrained(tmp_path, num_mtp_layers=None).state_dict()
    assert all(torch.equal(loaded[fqn], t) for fqn, t in ours.items())
    # the in-memory adapters agree with the files
    adapted = from_hf(to_hf(ours, args), args)
    assert adapted.keys() == ours.keys() and all(torch.equal(adapted[fqn], t) for fqn, t in ours.items())


def test_bf16_export_keeps_the_selection_bias_fp32(tmp_path):
    model = build_ours(OUR_TINY)
    save_hf_checkpoint(model, OUR_TINY, tmp_path, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reread = read_hf_state_dict(tmp_path, OUR_TINY, dtype=None)
    for fqn, t in model.state_dict().items():
        want = t if fqn.endswith("expert_bias") else t.to(torch.bfloat16)
        assert torch.equal(reread[fqn], want), fqn


# ------------------------------------------------------------------------------------------------ FP8

def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and fp32 128x128 block scales (amax / 448 per block, as DeepSeek's checkpoints)."""
    M, N = w.shape
    scales = torch.empty(-(-M // block), -(-N // block))
    q = torch.empty(M, N, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scales[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def reference_dequant(q: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = q.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scales[i, j]
    return out


def assert_within_fp8_rounding(w: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor) -> None:
    # e4m3: half an ulp is at most 2^-4 relative for normals, 2^-10 absolute (in scaled units) for subnormals
    scale_full = scales.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + scale_full * 2**-10 + 1e-12).all()


def test_fp8_block_dequantization_with_ragged_edges():
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_fp8(w)
    assert scales.shape == (2, 2)
    deq = dequantize_fp8(q, scales)
    assert torch.equal(deq, reference_dequant(q, scales))
    assert_within_fp8_rounding(w, deq, scales)
    with pytest.raises(ValueError, match="scales"):
        dequantize_fp8(q, scales[:1])


def test_fp8_checkpoint_import(tmp_path):
    # dense FFN weights of 200x136 / 136x200: ragged 128x128 tiles in both dimensions
    args = OUR_TINY.replace(dim=136, inter_dim=200)
    model = build_ours(args)
    save_hf_checkpoint(model, args, tmp_path)
    index_path = tmp_path / INDEX_FILE
    index = json.loads(index_path.read_text())
    scales_shard, expected = {}, {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / shard, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for key, t in tensors.items():
            if key.endswith("_proj.weight") and t.dim() == 2:  # the hub quantizes the projections only
                tensors[key], scales_shard[key + "_scale_inv"] = quantize_fp8(t)
                expected[key] = (t, tensors[key], scales_shard[key + "_scale_inv"])
        save_file(tensors, tmp_path / shard)
    # the scales live in a shard of their own, so the importer must follow the index to find them
    save_file(scales_shard, tmp_path / "scales.safetensors")
    index["weight_map"].update({k: "scales.safetensors" for k in scales_shard})
    index_path.write_text(json.dumps(index))

    reread = to_hf(read_hf_state_dict(tmp_path, args), args)
    assert "model.layers.0.mlp.gate_proj.weight" in expected
    for key, (w, q, scales) in expected.items():
        assert torch.equal(reread[key], reference_dequant(q, scales)), key
        assert_within_fp8_rounding(w, reread[key], scales)


# ------------------------------------------------------------------------------------------------ import errors

@pytest.fixture
def exported(tmp_path):
    args = OUR_TINY
    save_hf_checkpoint(build_ours(args), args, tmp_path, max_shard_bytes=64 * 1024)
    return tmp_path, json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]


def _rewrite(path: Path, change) -> None:
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, path)


def test_missing_shard_is_named(exported):
    root, weight_map = exported
    shard = weight_map["model.layers.1.mlp.experts.3.up_proj.weight"]
    (root / shard).unlink()
    with pytest.raises(ValueError, match=shard):
        load_hf_pretrained(root)


def test_missing_key_is_named(exported):
    root, weight_map = exported
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    _rewrite(root / weight_map[key], lambda t: t.pop(key))
    with pytest.raises(ValueError, match=f"missing key {key}"):
        load_hf_pretrained(root)


def test_wrong_shape_is_named(exported):
    root, weight_map = exported
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    _rewrite(root / weight_map[key], lambda t: t.update({key: t[key][:-1]}))
    with pytest.raises(ValueError, match=f"{key}: shape"):
        load_hf_pretrained(root)


def test_unexpected_key_is_named(exported):
    root, weight_map = exported
    _rewrite(root / weight_map["model.norm.weight"], lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="model.extra.weight"):
        load_hf_pretrained(root)


def test_another_flavors_experts_are_named_by_shape_and_skipped_by_a_partial_load(tmp_path):
    """A checkpoint whose experts have other shapes under the same names (moe_intermediate_size 48, the model's 32):
    the preflight comparison lists them with both shapes, the trainer's line names the first ones and their count, a
    full load refuses them, and a partial load reads every other weight and leaves these to the model's own."""
    from models.deepseek_v3.hf import compare_checkpoint
    from trainer.checkpoint.weights import WeightMismatch

    other = OUR_TINY.replace(moe_inter_dim=48)
    saved = build_ours(other).state_dict()
    save_hf_checkpoint(saved, other, tmp_path, max_shard_bytes=64 * 1024)
    missing, extra, reshaped = compare_checkpoint(tmp_path, OUR_TINY)
    assert not missing and not extra
    assert len(reshaped) == 2 * (3 + 8 * 3)  # two MoE layers: the shared expert and 8 routed experts, 3 weights each
    assert all(".mlp.shared_experts." in key or ".mlp.experts." in key for key in reshaped)
    first = "model.layers.1.mlp.shared_experts.gate_proj.weight"
    assert next(iter(reshaped.items())) == (first, ((48, 64), (32, 64)))
    assert reshaped["model.layers.2.mlp.experts.7.down_proj.weight"] == ((64, 48), (64, 32))
    mismatch = WeightMismatch(str(tmp_path), [], [], [], reshaped)
    line = mismatch.problem({}, allow_partial=False, resume=False)
    assert (f"holds {first}, model.layers.1.mlp.shared_experts.up_proj.weight, "
            "model.layers.1.mlp.shared_experts.down_proj.weight and 51 more (54 weights) in other shapes than the "
            f"model's ({first}: [48, 64] saved, [32, 64] in the model)") in line
    assert line.endswith("checkpoint.allow_partial_load = true loads the weights that match and skips these")
    assert mismatch.problem({}, allow_partial=True, resume=False) is None
    assert "skipped model.layers.1.mlp.shared_experts.gate_proj.weight" in mismatch.note()

    with pytest.raises(ValueError, match=r"\.mlp\.(shared_)?experts\.\S+: shape \[(48, 64|64, 48)\] in checkpoint"):
        read_hf_state_dict(tmp_path, OUR_TINY)
    partial = read_hf_state_dict(tmp_path, OUR_TINY, partial=True)
    skipped = {f"layers.{i}.moe.{part}" for i in (1, 2) for part in (
        "shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight", "experts.w1",
        "experts.w2", "experts.w3")}
    assert partial.keys() == expected_shapes(OUR_TINY).keys() - skipped
    assert all(torch.equal(partial[fqn], saved[fqn]) for fqn in partial)


@pytest.mark.parametrize("mtp_layers, from_flavor, from_hf_config", [("-1", 3, 1), ("0", 0, 0), ("2", 2, 2)])
def test_model_mtp_layers_builds_the_flavors_or_configs_depth_none_or_n(tmp_path, monkeypatch, mtp_layers,
                                                                          from_flavor, from_hf_config):
    """`model.mtp_layers`: -1 = the flavor's depth (here a debug flavor given 3) or the HF config's
    num_nextn_predict_layers (1), 0 = no MTP, N = N layers."""
    from trainer.registry import get_model_spec

    monkeypatch.setitem(FLAVORS, "debugmodel", FLAVORS["debugmodel"].replace(num_mtp_layers=3))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf_config_from_args(FLAVORS["debugmodel"].replace(num_mtp_layers=1))))
    build_args = get_model_spec("deepseek_v3").build_args
    argv = ["--job.config_file", "train_configs/debug_model.toml", "--model.mtp_layers", mtp_layers]
    assert build_args(model_job(load_config(argv))).num_mtp_layers == from_flavor
    with_hf_config = model_job(load_config(argv + ["--model.hf_config_path", str(config)]))
    assert build_args(with_hf_config).num_mtp_layers == from_hf_config


# ------------------------------------------------------------------------------------------------ CLI

def _cli(*argv: str) -> subprocess.CompletedProcess:
    return run_cli("models.deepseek_v3.convert_hf", list(argv), timeout=120)


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in root.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys())
    return out


@pytest.mark.slow
def test_cli_round_trip_through_dcp(tmp_path):
    args = OUR_TINY.replace(num_mtp_layers=1)
    save_hf_checkpoint(build_ours(args), args, tmp_path / "hf", max_shard_bytes=64 * 1024)
    done = _cli("to_dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert done.returncode == 0, done.stderr
    done = _cli("from_dcp", str(tmp_path / "dcp"), str(tmp_path / "back"), "--hf-config", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    before, after = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_bad_path_exits_2_with_one_line(tmp_path):
    done = _cli("to_dcp", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "not found" in done.stderr and "Traceback" not in done.stderr


def test_cli_wrong_flavor_for_checkpoint(tmp_path, capsys):
    save_hf_checkpoint(build_ours(OUR_TINY), OUR_TINY, tmp_path / "hf")
    assert convert_main(["to_dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert convert_main(["from_dcp", str(tmp_path / "dcp"), str(tmp_path / "out"), "--flavor", "debugmodel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("convert_hf: error: tok_embeddings.weight: shape") and "wrong flavor" in err


# ------------------------------------------------------------------------------------------------ debug flavor export

def _dcp_save(state: dict[str, torch.Tensor], path: Path) -> None:
    """A model state dict saved as a trainer checkpoint holds it (under "model"), single process."""
    dcp.save({MODEL_KEY: state}, checkpoint_id=str(path), no_dist=True)


def _assert_transformers_logits_match(hf_dir: Path, model: DeepSeekV3Model) -> float:
    """transformers loads hf_dir as DeepSeek-V2 with every key, and its logits equal model's; returns their max."""
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert hf_model.config.model_type == "deepseek_v2"
    x = tokens(model.args.vocab_size, seed=2)
    with torch.no_grad():
        expected = hf_model.float().eval()(x).logits
        diff = (model.eval()(x) - expected).abs().max().item()
    print(f"\n{hf_dir.name}: max |logits diff| = {diff:.3g} (logits up to {expected.abs().max().item():.3g})")
    assert diff <= PARITY_ATOL, diff
    return expected.abs().max().item()


def test_debug_flavor_with_zero_bias_exports_and_matches_transformers(tmp_path):
    """The debug flavor routes with softmax: with a zero expert bias it is a DeepSeek-V2 model, and the CLI's
    export loads in transformers with the same logits (weights randomised so the logits are O(1))."""
    model = build_ours(FLAVORS["debugmodel"])
    for moe in model.moe_layers():
        moe.expert_bias.zero_()
    _dcp_save(model.state_dict(), tmp_path / "dcp")
    assert convert_main(["from_dcp", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--flavor", "debugmodel"]) == 0
    assert _assert_transformers_logits_match(tmp_path / "hf", model) > 1.0


def test_debug_flavor_with_a_bias_is_refused_before_loading_with_the_way_out(tmp_path, capsys, monkeypatch):
    # What the default run saves: its expert biases move away from zero (moe.load_balance_coeff = 1e-3).
    state = {fqn: torch.zeros(shape) for fqn, shape in expected_shapes(FLAVORS["debugmodel"]).items()}
    state["layers.1.moe.expert_bias"][3] = 1e-3
    _dcp_save(state, tmp_path / "dcp")

    loaded = []
    real_load = convert_hf.dcp.load

    def recording_load(state_dict, **kwargs):
        loaded.append(sorted(state_dict[MODEL_KEY]))
        real_load(state_dict, **kwargs)

    monkeypatch.setattr(convert_hf.dcp, "load", recording_load)
    assert convert_main(["from_dcp", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--flavor", "debugmodel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convert_hf: error: cannot export layers.1.moe.expert_bias")
    assert "moe.load_balance_coeff = 0" in err[0] and "deepseek_v3" in err[0]
    # only the biases were read, and nothing was written
    assert len(loaded) == 1 and all(fqn.endswith("moe.expert_bias") for fqn in loaded[0])
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_trained_debug_checkpoint_without_bias_updates_exports(tmp_path):
    """The way out the refusal names: a real trainer checkpoint of the debug flavor trained with
    moe.load_balance_coeff = 0 exports and loads in transformers with the logits of the trained model."""
    dump = tmp_path / "dump"
    run(load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(dump),
                     "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
                     "--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--memory.track", "off",
                     "--checkpoint.enable", "true", "--moe.load_balance_coeff", "0"]))
    ckpt = dump / "checkpoint" / "step-2"
    assert convert_main(["from_dcp", str(ckpt), str(tmp_path / "hf"), "--flavor", "debugmodel"]) == 0
    model = build_ours(FLAVORS["debugmodel"])
    dcp.load({MODEL_KEY: model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)  # in place: the trained weights
    _assert_transformers_logits_match(tmp_path / "hf", model)


# ------------------------------------------------------------------------------------------------ the trainer's import

def test_initial_load_in_hf_builds_the_checkpoints_own_model_or_names_the_config_key(tmp_path, capsys):
    """The README's command, `--checkpoint.initial_load_path <hf> --checkpoint.initial_load_in_hf true`, on a tiny
    checkpoint saved by transformers (not the debug flavor's shapes): without model.hf_config_path the model is the
    one the checkpoint's own config.json describes, and its weights load. Without a config.json beside the weights,
    or with model.hf_config_path naming another config, the refusal names model.hf_config_path (before, it said
    the checkpoint lacks model.layers.0.*, ..., which it holds in other shapes)."""
    import shutil

    from core.config import run_with_config_errors
    from trainer.prepare import prepare
    from trainer.tools.preflight import main as preflight
    from trainer.train import Trainer

    cfg = transformers.DeepseekV3Config(**{**HF_BASE, "vocab_size": 2048}, n_group=1, topk_group=1,
                                        num_nextn_predict_layers=0)
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(hf_dir)
    capsys.readouterr()  # transformers' progress bar
    argv = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "dump"),
            "--training.seq_len", "32", "--training.local_batch_size", "1", "--validation.enable", "false",
            "--memory.track", "off", "--metrics.enable_tensorboard", "false", "--checkpoint.initial_load_path"]

    prep = prepare(load_config(argv + [str(hf_dir), "--checkpoint.initial_load_in_hf", "true"]), 1, 0)
    assert prep.cfg.model.hf_config_path == str(hf_dir / "config.json")
    assert (prep.model_args.dim, prep.model_args.n_layers, prep.model_args.q_lora_rank) == (64, 3, 1536)
    trainer = Trainer(prep, torch.device("cpu"))
    try:
        loaded = trainer.model_parts[0].state_dict()["layers.2.attention.wq_a.weight"]
    finally:
        trainer.close()
    with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
        assert torch.equal(loaded, f.get_tensor("model.layers.2.self_attn.q_a_proj.weight"))

    def refusal(*args: str) -> str:
        with pytest.raises(SystemExit) as exc:
            run_with_config_errors(preflight, argv + list(args) + ["--checkpoint.initial_load_in_hf", "true"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1, err
        return err[0]

    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare, ignore=shutil.ignore_patterns("config.json"))
    line = refusal(str(bare))
    assert line.endswith(f"; {bare} has no config.json, so model.flavor 'debugmodel' builds the model: set "
                         "model.hf_config_path to the config.json the checkpoint was saved with"), line
    (bare / "config.json").write_text("{}")  # not a DeepSeek config: the key at fault is the checkpoint's path
    assert refusal(str(bare)).startswith("config error: checkpoint.initial_load_path: unsupported HF config: "
                                         "model_type None")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(hf_config_from_args(OUR_TINY.replace(vocab_size=2048))))
    line = refusal(str(hf_dir), "--model.hf_config_path", str(other))
    assert line.endswith(f"; the model comes from model.hf_config_path {other}, not from the checkpoint's own "
                         f"{hf_dir / 'config.json'}: leave model.hf_config_path empty to build the checkpoint's "
                         "model"), line
    assert not (tmp_path / "dump").exists()
