"""A Hugging Face model imported from its own config.json: `model.init_from` alone fills the model config,
a config that contradicts the model is one line, and a Llama 3.2-shaped model (tied embeddings, Llama 3's
RoPE scaling) made by transformers gives transformers' logits beyond its original context, in keel and
after keel trained and exported it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keel.checkpoint.export import CONFIG, SINGLE, hf_config, load_checkpoint_model, load_hf_weights
from keel.config import load_config, to_toml
from keel.errors import ConfigError
from keel.model.llama import Llama
from tests.conftest import run_keel

ORIGINAL = 64  # the context the model "was first trained at": the checks run beyond it
SEQ = 160


@pytest.fixture
def transformers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return pytest.importorskip("transformers")


@pytest.fixture
def llama32(tmp_path: Path, transformers) -> tuple[Path, torch.nn.Module]:
    """A tiny random Llama 3.2-shaped model saved by transformers: GQA, tied embeddings, an intermediate size
    no rounding rule of keel's gives at this width, and Llama 3's RoPE scaling whose three frequency bands
    (kept, ramped, divided) each hold some of the head's frequencies."""
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: perturb them so a misplaced gain shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    out = tmp_path / "llama32"
    model.save_pretrained(out)
    return out, model


def tokens(vocab: int = 259) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


def hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def keel_logits(model: Llama, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_init_from_alone_fills_the_model_config(llama32) -> None:
    path, _ = llama32
    m = load_config(None, [f"model.init_from=hf:{path}"]).model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_dim, m.norm_eps, m.max_seq_len,
            m.tie_embeddings, m.qk_norm) == (64, 2, 4, 2, 300, 176, 1e-5, 256, True, False)
    assert (m.rope_theta, m.rope_scaling, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
            m.rope_original_max_seq_len) == (500000.0, "llama3", 32.0, 1.0, 4.0, ORIGINAL)
    # The run directory's config.toml names init_from beside every field: it loads back to the same config.
    written = path.parent / "config.toml"
    written.write_text(to_toml(load_config(None, [f"model.init_from=hf:{path}"])))
    assert load_config(written).model == m


def test_keel_gives_transformers_logits_beyond_the_original_context(llama32) -> None:
    path, hf = llama32
    cfg = load_config(None, [f"model.init_from=hf:{path}"]).model
    model = Llama(cfg).eval()
    load_hf_weights(model, path)
    x = tokens()
    theirs = hf_logits(hf, x)
    torch.testing.assert_close(keel_logits(model, x), theirs, rtol=0, atol=1e-5)
    # The same weights with unscaled RoPE differ where the scaling matters: beyond the original context.
    unscaled = Llama(dataclasses.replace(cfg, rope_scaling="none")).eval()
    unscaled.load_state_dict(model.state_dict())
    gap = (keel_logits(unscaled, x) - theirs).abs().amax(dim=(0, 2))
    assert gap[ORIGINAL:].max() > 1e-3


def test_a_config_that_contradicts_the_model_is_one_line(llama32, tmp_path: Path) -> None:
    path, _ = llama32
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.init_from=hf:{path}", "model.dim=32", "model.rope_factor=8.0", "model.n_layers=2"])
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "model.dim = 32 but hidden_size = 64" in msg
    assert "model.rope_factor = 8.0 but rope_parameters.factor = 32.0" in msg
    assert "n_layers" not in msg and "drop these model.* settings" in msg, msg
    with pytest.raises(ConfigError, match=r"model.multiple_of = 256 make a SwiGLU size of 256 but intermediate_size"):
        load_config(None, [f"model.init_from=hf:{path}", "model.multiple_of=256"])
    # A config file that names init_from must agree with it; one that does not is replaced by a command-line one.
    config = tmp_path / "own.toml"
    config.write_text(f'[model]\ninit_from = "hf:{path}"\ndim = 256\n')
    with pytest.raises(ConfigError, match="model.dim = 256 but hidden_size = 64"):
        load_config(config)
    config.write_text("[model]\ndim = 256\nn_layers = 4\nmultiple_of = 64\nmax_seq_len = 128\n")
    m = load_config(config, [f"model.init_from=hf:{path}"]).model
    assert (m.dim, m.n_layers, m.ffn_dim, m.max_seq_len) == (64, 2, 176, 256)
    # The RoPE tables' length changes no weight: a run may set it.
    shorter = load_config(None, [f"model.init_from=hf:{path}", "model.max_seq_len=128", "train.seq_len=128"])
    assert shorter.model.max_seq_len == 128


def test_a_qwen3_head_size_is_taken_as_given(tmp_path: Path, transformers) -> None:
    """Qwen3's heads are wider than hidden_size / heads (128 at hidden_size 1024 with 16 heads in Qwen3-0.6B)."""
    hf_cfg = transformers.Qwen3Config(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path / "qwen3")
    cfg = load_config(None, [f"model.init_from=hf:{tmp_path / 'qwen3'}", "train.seq_len=64"]).model
    assert (cfg.head_dim, cfg.qk_norm, cfg.ffn_dim) == (32, True, 96)
    model = Llama(cfg).eval()
    load_hf_weights(model, tmp_path / "qwen3")
    x = tokens()[:, :48]
    torch.testing.assert_close(keel_logits(model, x), hf_logits(hf, x), rtol=0, atol=1e-5)
    assert hf_config(cfg, torch.float32)["head_dim"] == 32


def test_llama3_scaling_goes_back_into_config_json(llama32, transformers) -> None:
    path, _ = llama32
    cfg = load_config(None, [f"model.init_from=hf:{path}"]).model
    written = hf_config(cfg, torch.float32)
    assert written["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": ORIGINAL}
    assert written["rope_scaling"]["rope_type"] == "llama3"  # the form transformers < 5 reads
    assert written["intermediate_size"] == 176 and written["tie_word_embeddings"] is True
    loaded = transformers.LlamaConfig.from_dict(written)
    assert loaded.rope_parameters["rope_type"] == "llama3" and loaded.rope_parameters["factor"] == 32.0


def train_and_export(path: Path, config: str, seq_len: int, steps: int, corpus: Path,
                     tmp_path: Path) -> tuple[Path, Path]:
    """`keel train --config CONFIG model.init_from=hf:PATH` on one process for `steps` steps, checkpointed at the
    last, then `keel ckpt export` of the run: (the run directory, the export)."""
    run_dir, out = tmp_path / "run", tmp_path / "export"
    trained = run_keel(["train", "--config", config, "--run-dir", str(run_dir), f"model.init_from=hf:{path}",
                        f"data.dir={corpus}", f"train.seq_len={seq_len}", "train.global_batch=4",
                        "train.micro_batch=4", f"train.steps={steps}", f"checkpoint.interval={steps}",
                        "eval.interval=0", "eval.final=false", "health.preflight_probe_mib=4"], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"initialised the weights from hf:{path}" in trained.stdout
    exported = run_keel(["ckpt", "export", str(run_dir), "--format", "hf", "--out", str(out)], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    return run_dir, out


def test_an_imported_llama32_trains_and_exports_transformers_logits(llama32, transformers, small_corpus: Path,
                                                                    tmp_path: Path) -> None:
    """`keel train --config tiny model.init_from=hf:DIR` on one process, a few steps; the export, loaded by
    transformers, gives keel's logits of the trained checkpoint beyond the original context."""
    path, _ = llama32
    run_dir, out = train_and_export(path, "tiny", 128, 3, small_corpus, tmp_path)
    assert json.loads((out / CONFIG).read_text())["rope_parameters"]["rope_type"] == "llama3"
    before, after = load_file(path / SINGLE), load_file(out / SINGLE)
    assert not torch.equal(before["model.layers.0.mlp.down_proj.weight"], after["model.layers.0.mlp.down_proj.weight"])

    cfg = load_config(run_dir / "config.toml").model
    model = load_checkpoint_model(run_dir / "checkpoints" / "step-000003", cfg, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    x = tokens()
    torch.testing.assert_close(hf_logits(hf, x), keel_logits(model, x), rtol=0, atol=1e-5)
