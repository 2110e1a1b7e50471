"""A Qwen3-MoE config.json as keel's model config: `model.init_from` fills model.moe from it, a config that
contradicts it is one line, and a layout of expert blocks keel's model cannot hold is refused with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from keel.config import MoEConfig, load_config, to_toml
from keel.config.hf import hf_model_fields, model_config
from keel.errors import CheckpointError, ConfigError
from tests.conftest import REPO

# As transformers 5 writes it: num_local_experts (Qwen's own files say num_experts).
QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 160,
    "moe_intermediate_size": 40, "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 300, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "router_aux_loss_coef": 0.001}
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 300, "max_position_embeddings": 256}
TINY_MOE = REPO / "configs" / "tiny_moe.toml"
IMPORTED = MoEConfig(experts=8, top_k=2, expert_dim=40, dense_layers=1, normalize_top_k=True)


def hf_dir(tmp_path: Path, config: dict[str, Any], **changes: Any) -> Path:
    """A directory holding only config.json: all that filling the model config reads."""
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


def refusal(**changes: Any) -> str:
    with pytest.raises(CheckpointError) as e:
        hf_model_fields({**QWEN3_MOE, **changes})
    assert len(str(e.value).splitlines()) == 1
    return str(e.value)


@pytest.mark.parametrize("experts_key", ["num_local_experts", "num_experts"])
def test_init_from_a_qwen3_moe_fills_model_moe(tmp_path: Path, experts_key: str) -> None:
    config = {k: v for k, v in QWEN3_MOE.items() if k != "num_local_experts"} | {experts_key: 8}
    path = hf_dir(tmp_path, config)
    cfg = load_config(None, [f"model.init_from=hf:{path}"])
    m = cfg.model
    assert (m.qk_norm, m.head_dim, m.ffn_dim, m.n_layers, m.rope_theta) == (True, 24, 160, 4, 1e6)
    # softmax scores, chosen by score alone, no shared experts; the balance loss is the run's to choose
    assert m.moe == IMPORTED
    written = tmp_path / "config.toml"
    written.write_text(to_toml(cfg))
    assert load_config(written).model == m


def test_a_config_files_own_experts_give_way_to_a_command_line_import(tmp_path: Path) -> None:
    """tiny_moe's sigmoid scores and moving biases are the file's model; a command-line init_from replaces it."""
    m = load_config(TINY_MOE, [f"model.init_from=hf:{hf_dir(tmp_path, QWEN3_MOE)}"]).model
    assert m.moe == IMPORTED and m.dim == 64


@pytest.mark.parametrize(("overrides", "expect"), [
    (["model.moe.score=sigmoid"], "model.moe.score = 'sigmoid' but Qwen3-MoE's score = 'softmax'"),
    (["model.moe.bias_update_rate=0.001"], "model.moe.bias_update_rate = 0.001 but Qwen3-MoE's bias_update_rate = 0.0"),
    (["model.moe.shared_experts=1"], "model.moe.shared_experts = 1 but Qwen3-MoE's shared_experts = 0"),
    (["model.moe.experts=4", "model.moe.top_k=1"], "model.moe.experts = 4 but num_experts = 8; model.moe.top_k = 1 "
                                                   "but num_experts_per_tok = 2"),
    (["model.moe.dense_layers=0"], "model.moe.dense_layers = 0 but mlp_only_layers (the leading dense layers) = 1"),
    (["model.moe.expert_dim=0"], "model.moe.expert_dim = 0 but moe_intermediate_size = 40"),  # 0: the dense 160
])
def test_a_config_that_contradicts_the_experts_is_one_line(tmp_path: Path, overrides: list[str], expect: str) -> None:
    path = hf_dir(tmp_path, QWEN3_MOE)
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.init_from=hf:{path}", *overrides])
    assert len(str(e.value).splitlines()) == 1 and expect in str(e.value), str(e.value)


def test_settings_that_agree_with_the_experts_are_accepted(tmp_path: Path) -> None:
    path = hf_dir(tmp_path, QWEN3_MOE, moe_intermediate_size=160)
    config = tmp_path / "own.toml"
    config.write_text(f'[model]\ninit_from = "hf:{path}"\n[model.moe]\nexperts = 8\nexpert_dim = 0\nscore_scale = 1\n')
    assert load_config(config).model.moe == MoEConfig(experts=8, top_k=2, expert_dim=160, dense_layers=1,
                                                      normalize_top_k=True)


def test_a_dense_import_has_no_experts(tmp_path: Path) -> None:
    path = hf_dir(tmp_path, LLAMA)
    assert load_config(TINY_MOE, [f"model.init_from=hf:{path}"]).model.moe.experts == 0
    with pytest.raises(ConfigError, match="model.moe.experts = 4 but num_experts = 0"):
        load_config(None, [f"model.init_from=hf:{path}", "model.moe.experts=4"])


@pytest.mark.parametrize(("changes", "dense_layers"), [
    ({"mlp_only_layers": [0, 1]}, 2),
    ({"mlp_only_layers": []}, 0),
    ({"mlp_only_layers": None}, 0),
    ({"decoder_sparse_step": 4, "mlp_only_layers": []}, 3),  # only the last layer's number divides by 4
])
def test_leading_dense_layers_are_model_moe_dense_layers(changes: dict, dense_layers: int) -> None:
    assert model_config(hf_model_fields({**QWEN3_MOE, **changes})).moe.dense_layers == dense_layers


def test_a_qwen3_moe_without_expert_blocks_is_dense() -> None:
    for changes in ({"mlp_only_layers": [0, 1, 2, 3]}, {"num_local_experts": 0}):
        fields = hf_model_fields({**QWEN3_MOE, **changes})
        assert fields["moe.experts"] == 0 and fields["qk_norm"] and fields["ffn_dim"] == 160


@pytest.mark.parametrize(("changes", "expect"), [
    ({"decoder_sparse_step": 2, "mlp_only_layers": []},
     "decoder_sparse_step = 2 and mlp_only_layers = [] make layers [1, 3] of 4 mixture-of-experts blocks"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers = [2] make layers [0, 1, 3] of 4 mixture-of-experts blocks"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers = '0' is not a list of layer numbers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0 is not a positive integer"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9 exceeds num_experts = 8"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size = 0 is not a positive integer"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob = 'yes' is not a bool"),
])
def test_expert_layouts_keel_cannot_hold_are_refused(changes: dict, expect: str) -> None:
    msg = refusal(**changes)
    assert expect in msg, msg
    if "make layers" in msg:
        assert "keel's are the last ones (decoder_sparse_step = 1, mlp_only_layers the leading layers" in msg


def test_a_command_line_import_replaces_the_files_experts_beside_other_expert_settings(tmp_path: Path) -> None:
    """Only the model.moe fields given on the command line must agree with the model: tiny_moe's own (sigmoid
    scores, moving biases) give way to it even when the command line sets one of model.moe's fields too."""
    path = hf_dir(tmp_path, QWEN3_MOE)
    assert load_config(TINY_MOE, [f"model.init_from=hf:{path}", "model.moe.top_k=2"]).model.moe == IMPORTED
    assert load_config(TINY_MOE, [f"model.init_from=hf:{path}", "model.moe={top_k = 2}"]).model.moe == IMPORTED
    with pytest.raises(ConfigError, match="model.moe.top_k = 3 but num_experts_per_tok = 2") as e:
        load_config(TINY_MOE, [f"model.init_from=hf:{path}", "model.moe.top_k=3"])
    assert "score" not in str(e.value)
