"""Mixture-of-experts models exchanged as Qwen3-MoE: a keel model exported gives its logits in transformers'
Qwen3MoeForCausalLM, a Qwen3-MoE made by transformers imports with only `model.init_from` set, trains and
exports again, and what Qwen3-MoE cannot express is refused with one line before anything is written."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel.checkpoint.export import CONFIG, INDEX, SINGLE, export_hf, load_checkpoint_model, load_hf_weights
from keel.config import ModelConfig, MoEConfig, load_config
from keel.errors import CheckpointError
from keel.model.llama import Llama
from tests.unit.checkpoint.test_export import TINY, assert_round_trip, build, logits, save_checkpoint, tokens
from tests.unit.checkpoint.test_hf_import import train_and_export

# Two blocks after a dense one, each of 4 experts of their own width (48, the dense one's 192), 2 chosen per token.
MOE = dataclasses.replace(TINY, n_layers=3, qk_norm=True,
                          moe=MoEConfig(experts=4, top_k=2, expert_dim=48, dense_layers=1, normalize_top_k=True))


@pytest.fixture
def transformers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return pytest.importorskip("transformers")


def decisive(model: torch.nn.Module, suffix: str) -> None:
    """Scale the routers' gates (parameters named ...`suffix`) up: at init every expert scores about the same,
    and a near tie may choose another expert under another summation order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                p.mul_(50.0)


def exported(tmp_path: Path, cfg: ModelConfig, **kwargs) -> tuple[Llama, Path]:
    model = build(cfg)
    decisive(model, "router.gate.weight")
    save_checkpoint(model, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", cfg, tmp_path / "hf", **kwargs)
    return model, tmp_path / "hf"


def refused(tmp_path: Path, cfg: ModelConfig, model: Llama | None = None) -> str:
    """The one-line message with which exporting `model` (of `cfg`) is refused; nothing is written."""
    save_checkpoint(model or build(cfg), tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as e:
        export_hf(tmp_path / "ckpt", cfg, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert len(str(e.value).splitlines()) == 1
    return str(e.value)


# ---------------------------------------------------------------- export

@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "softmax_values"])
def test_transformers_reproduces_keel_moe_logits(tmp_path: Path, transformers, normalize: bool) -> None:
    cfg = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, normalize_top_k=normalize))
    model, out = exported(tmp_path, cfg)
    written = json.loads((out / CONFIG).read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (written["num_experts"], written["num_experts_per_tok"], written["moe_intermediate_size"],
            written["intermediate_size"], written["mlp_only_layers"], written["decoder_sparse_step"],
            written["norm_topk_prob"]) == (4, 2, 48, 192, [0], 1, normalize)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert type(hf.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    x = tokens(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, logits(model, x), rtol=0, atol=1e-4)


def test_each_expert_is_its_own_tensor_and_loads_back_bitwise(tmp_path: Path) -> None:
    model, out = exported(tmp_path, MOE, max_shard_bytes=40_000)
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        found.update(load_file(shard))
    assert sorted(json.loads((out / INDEX).read_text())["weight_map"]) == sorted(found)
    experts = model.layers["2"].moe.experts
    for e in range(4):
        assert torch.equal(found[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"], experts.w1[e])
        assert torch.equal(found[f"model.layers.2.mlp.experts.{e}.up_proj.weight"], experts.w3[e])
        assert torch.equal(found[f"model.layers.2.mlp.experts.{e}.down_proj.weight"], experts.w2[e])
    assert torch.equal(found["model.layers.2.mlp.gate.weight"], model.layers["2"].moe.router.gate.weight)
    assert "model.layers.0.mlp.gate_proj.weight" in found and not any("layers.0.mlp.experts" in n for n in found)
    assert_round_trip(model, out)


@pytest.mark.parametrize(("change", "expect"), [
    ({"score": "sigmoid"}, "model.moe.score = 'sigmoid' has no Qwen3-MoE counterpart (whose score is 'softmax')"),
    ({"shared_experts": 1}, "model.moe.shared_experts = 1 has no Qwen3-MoE counterpart (whose shared_experts is 0)"),
    ({"score_scale": 2.5}, "model.moe.score_scale = 2.5 has no Qwen3-MoE counterpart (whose score_scale is 1.0)"),
    ({"capacity_factor": 1.25}, "model.moe.capacity_factor = 1.25 has no Qwen3-MoE counterpart"),
])
def test_a_mixture_qwen3_moe_cannot_express_is_refused(tmp_path: Path, change: dict, expect: str) -> None:
    cfg = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, **change))
    msg = refused(tmp_path, cfg)
    assert expect in msg and f"only a mixture of experts with model.moe.{next(iter(change))} =" in msg, msg


def test_a_mixture_without_qk_norm_is_refused(tmp_path: Path) -> None:
    msg = refused(tmp_path, dataclasses.replace(MOE, qk_norm=False))
    assert "model.qk_norm = false in a mixture-of-experts model" in msg and "model.qk_norm = true" in msg, msg


def test_a_moved_selection_bias_is_refused_and_a_resting_one_exports(tmp_path: Path) -> None:
    cfg = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, bias_update_rate=0.001))
    exported(tmp_path / "resting", cfg)  # the rate alone changes no output
    model = build(cfg)
    model.layers["2"].moe.update_bias(torch.tensor([5, 1, 1, 1]), 0.001)
    msg = refused(tmp_path / "moved", cfg, model)
    assert "non-zero expert selection bias 'layers.2.moe.expert_bias' (max |bias| 0.001" in msg, msg
    assert "only a model trained with model.moe.bias_update_rate = 0 is exported" in msg, msg


# ---------------------------------------------------------------- import

@pytest.fixture
def qwen3_moe(tmp_path: Path, transformers) -> tuple[Path, torch.nn.Module]:
    """A tiny random Qwen3-MoE saved by transformers: one leading dense layer (mlp_only_layers) of its own
    width, then 4 experts per block, 2 chosen with their weights normalised, heads wider than
    hidden_size / heads, and every norm gain and the routers perturbed so that a misplaced one shows."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, moe_intermediate_size=40, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    decisive(model, "mlp.gate.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    out = tmp_path / "qwen3_moe"
    model.save_pretrained(out)
    return out, model


def test_a_missing_or_misshapen_expert_is_named(tmp_path: Path) -> None:
    model, out = exported(tmp_path, MOE)
    tensors = load_file(out / SINGLE)
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(40, 64)
    save_file(tensors, out / SINGLE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_hf_weights(build(MOE), out)
    assert len(str(e.value).splitlines()) == 1
    assert ("tensor 'model.layers.1.mlp.experts.3.up_proj.weight' has shape [40, 64], keel's "
            "'layers.1.moe.experts.w3[3]' expects [48, 64]") in str(e.value), str(e.value)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, out / SINGLE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        load_hf_weights(build(MOE), out)


def test_a_transformers_qwen3_moe_imports_with_its_logits(qwen3_moe) -> None:
    path, hf = qwen3_moe
    m = load_config(None, [f"model.init_from=hf:{path}", "train.seq_len=64"]).model
    assert (m.qk_norm, m.head_dim, m.ffn_dim, m.n_layers) == (True, 24, 160, 3)
    assert m.moe == MoEConfig(experts=4, top_k=2, expert_dim=40, dense_layers=1, normalize_top_k=True)
    model = Llama(m).eval()
    load_hf_weights(model, path)
    x = tokens(m, seq=48)
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(logits(model, x), theirs, rtol=0, atol=1e-4)


def test_an_imported_qwen3_moe_trains_and_exports_for_transformers(qwen3_moe, transformers, small_corpus: Path,
                                                                   tmp_path: Path) -> None:
    """`keel train --config tiny_moe model.init_from=hf:DIR` on one process, 5 steps (the config's own experts
    give way to the model's); the export loads in transformers and gives keel's logits of the trained
    checkpoint."""
    path, _ = qwen3_moe
    run_dir, out = train_and_export(path, "tiny_moe", 64, 5, small_corpus, tmp_path)
    before, after = load_file(path / SINGLE), load_file(out / SINGLE)
    assert sorted(before) == sorted(after)
    moved = "model.layers.2.mlp.experts.3.down_proj.weight"
    assert not torch.equal(before[moved], after[moved])

    cfg = load_config(run_dir / "config.toml").model
    assert cfg.moe == MoEConfig(experts=4, top_k=2, expert_dim=40, dense_layers=1, normalize_top_k=True)
    model = load_checkpoint_model(run_dir / "checkpoints" / "step-000005", cfg, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = tokens(cfg, seq=64)
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, logits(model, x), rtol=0, atol=1e-4)
