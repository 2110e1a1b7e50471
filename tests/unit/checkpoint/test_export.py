"""Hugging Face Llama interchange: keel checkpoint -> HF directory -> keel model round trips, logits
agreeing with transformers' LlamaForCausalLM (Qwen3ForCausalLM with QK-norm), an exported tokenizer
giving keel's ids through AutoTokenizer, and refusals of what keel cannot represent or cannot find."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from keel.checkpoint.export import (
    CONFIG,
    INDEX,
    SINGLE,
    check_hf_matches,
    export_hf,
    hf_config,
    load_checkpoint_model,
    load_hf_weights,
    model_config_from_hf,
    read_hf_config,
)
from keel.checkpoint.hf_tokenizer import TOKENIZER_FILES, checkpoint_tokenizer, write_hf_tokenizer
from keel.config import ModelConfig, MoEConfig
from keel.errors import CheckpointError
from keel.model.init import init_weights
from keel.model.llama import Llama, ffn_hidden_dim

# GQA (4 query heads share 2 KV heads), a SwiGLU size that needs rounding (170 -> 192), and RoPE base and
# norm eps away from Hugging Face's defaults, so a config field that is not carried over changes the logits.
TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=64,
                   rope_theta=1000.0, norm_eps=1e-5)
TIED = dataclasses.replace(TINY, tie_embeddings=True)
QK_NORM = dataclasses.replace(TINY, qk_norm=True)


def build(cfg: ModelConfig, seed: int = 0) -> Llama:
    model = Llama(cfg)
    init_weights(model, seed)
    with torch.no_grad():  # norms start at 1: perturb them so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def tokens(cfg: ModelConfig, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def save_checkpoint(model: Llama, path: Path) -> None:
    """A checkpoint laid out as keel's manager writes it, optimizer state included, without a process group."""
    optim = {"state.output.weight.exp_avg": torch.randn(model.cfg.vocab_size, model.cfg.dim), "step": torch.tensor(7.0)}
    with warnings.catch_warnings():  # DCP's notice that it saves from a single process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "optim": optim}, checkpoint_id=path, no_dist=True)


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def export(tmp_path: Path, cfg: ModelConfig, **kwargs) -> tuple[Llama, Path, list[Path]]:
    model = build(cfg)
    save_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "hf"
    return model, out, export_hf(tmp_path / "ckpt", cfg, out, **kwargs)


def assert_round_trip(model: Llama, out: Path) -> None:
    fresh = build(model.cfg, seed=1)
    load_hf_weights(fresh, out)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    x = tokens(model.cfg)
    torch.testing.assert_close(logits(fresh, x), logits(model, x), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- round trips

def test_round_trip_single_file(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()  # an empty directory may receive the export
    model, out, files = export(tmp_path, TINY)
    assert files == [out / SINGLE, out / CONFIG]
    assert sorted(p.name for p in out.iterdir()) == [CONFIG, SINGLE]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    with safe_open(out / SINGLE, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
    assert len(names) == 3 + 9 * TINY.n_layers and "lm_head.weight" in names
    assert not any("optim" in n or "exp_avg" in n for n in names)
    assert_round_trip(model, out)


def test_round_trip_qk_norm(tmp_path: Path) -> None:
    model, out, _ = export(tmp_path, QK_NORM)
    assert json.loads((out / CONFIG).read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert_round_trip(model, out)


def test_round_trip_tied_embeddings(tmp_path: Path) -> None:
    model, out, _ = export(tmp_path, TIED)
    assert "lm_head.weight" not in load_file(out / SINGLE)
    assert json.loads((out / CONFIG).read_text())["tie_word_embeddings"] is True
    assert_round_trip(model, out)
    fresh = build(TIED, seed=1)
    load_hf_weights(fresh, out)
    assert fresh.output.weight is fresh.tok_embeddings.weight


def test_sharded_export_writes_an_index(tmp_path: Path) -> None:
    model, out, files = export(tmp_path, TINY, max_shard_bytes=40_000)
    index = json.loads((out / INDEX).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert [p.name for p in files] == [*shards, INDEX, CONFIG]
    assert set(index["weight_map"].values()) == set(shards)
    found: dict[str, torch.Tensor] = {}
    for shard in shards:
        found.update(load_file(out / shard))
    assert sorted(index["weight_map"]) == sorted(found)
    assert all(index["weight_map"][name] == shard for shard in shards for name in load_file(out / shard))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in found.values())
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    assert_round_trip(model, out)


def test_bf16_export_casts(tmp_path: Path) -> None:
    model, out, _ = export(tmp_path, TINY, dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(out / SINGLE).values()} == {torch.bfloat16}
    assert json.loads((out / CONFIG).read_text())["dtype"] == "bfloat16"
    fresh = build(TINY, seed=1)
    load_hf_weights(fresh, out)  # cast back to the fp32 parameters
    torch.testing.assert_close(fresh.layers["0"].attention.wq.weight,
                               model.layers["0"].attention.wq.weight.bfloat16().float(), rtol=0, atol=0)


def test_pipeline_stage_loads_its_share(tmp_path: Path) -> None:
    from keel.parallel.pipeline import stage_module

    model, out, _ = export(tmp_path, TINY)
    last = stage_module(build(TINY, seed=1), 1, 2)  # layer 1, final norm and output only
    load_hf_weights(last, out)
    expected = dict(model.named_parameters())
    for name, p in last.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_dtensor_parameters_keep_their_shard(tmp_path: Path) -> None:
    """A parameter sharded over 2 ranks (FSDP's Shard(0)) receives its rows of the full tensor. The fake
    backend lets one process play rank 0 of 2 without communication."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    model, out, _ = export(tmp_path, TINY)
    dist.init_process_group("fake", rank=0, world_size=2, store=fake_pg.FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        sharded = build(TINY, seed=1)
        for module in list(sharded.modules()):
            for key, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(key, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)],
                                                                                    src_data_rank=None)))
        load_hf_weights(sharded, out)
        expected = dict(model.named_parameters())
        for name, p in sharded.named_parameters():
            rows = -(-p.shape[0] // 2)  # rank 0 holds the larger half of an odd row count
            assert torch.equal(p.to_local(), expected[name][:rows]), name
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- transformers

@pytest.fixture
def transformers(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("cfg", [TINY, TIED, QK_NORM], ids=["untied", "tied", "qk_norm"])
def test_transformers_reproduces_keel_logits(tmp_path: Path, transformers, cfg: ModelConfig) -> None:
    model, out, _ = export(tmp_path, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM")
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    x = tokens(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, logits(model, x), rtol=0, atol=1e-4)


def imported_with_its_logits(hf: torch.nn.Module, out: Path) -> ModelConfig:
    """Save a transformers model, import it into keel and check that keel gives its logits; keel's config."""
    with torch.no_grad():  # transformers initialises norms to 1; perturb every gain so a misplaced one shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(out)
    cfg = read_hf_config(out)
    model = Llama(cfg)
    load_hf_weights(model, out)
    x = tokens(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(logits(model, x), theirs, rtol=0, atol=1e-4)
    return cfg


def test_keel_loads_a_transformers_model(tmp_path: Path, transformers) -> None:
    """Import of a directory transformers wrote itself, from a config keel did not write."""
    hf_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, vocab_size=300,
                                      max_position_embeddings=64, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(0)
    cfg = imported_with_its_logits(transformers.LlamaForCausalLM(hf_cfg).eval(), tmp_path / "hf")
    assert (cfg.n_kv_heads, ffn_hidden_dim(cfg), cfg.rope_theta, cfg.norm_eps) == (1, 160, 50000.0, 1e-6)


def test_keel_loads_a_transformers_qwen3_model_as_qk_norm(tmp_path: Path, transformers) -> None:
    hf_cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                                      max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    assert imported_with_its_logits(transformers.Qwen3ForCausalLM(hf_cfg).eval(), tmp_path / "hf").qk_norm


@pytest.mark.parametrize("embedding_norm", ["scale", "rmsnorm"])
def test_an_embedding_scale_or_norm_is_refused_before_anything_is_written(tmp_path: Path,
                                                                          embedding_norm: str) -> None:
    cfg = dataclasses.replace(TINY, embedding_norm=embedding_norm)
    save_checkpoint(build(cfg), tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as e:
        export_hf(tmp_path / "ckpt", cfg, tmp_path / "hf")
    assert len(str(e.value).splitlines()) == 1 and f"model.embedding_norm = {embedding_norm!r}" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _, out, _ = export(tmp_path / "plain", TINY)
    with pytest.raises(CheckpointError, match="model.embedding_norm"):
        load_hf_weights(build(cfg), out)


# ---------------------------------------------------------------- configs

@pytest.mark.parametrize(("dim", "hidden"), [(4096, 11008), (4096, 14336), (64, 192), (64, 170), (64, 32), (64, 171),
                                             (5120, 13824), (8192, 28672), (96, 1000), (2, 1), (8, 1), (8192, 7)])
def test_intermediate_size_is_reproduced_exactly(dim: int, hidden: int) -> None:
    hf = hf_config(dataclasses.replace(TINY, dim=dim, n_heads=1, n_kv_heads=1), torch.float32)
    hf["intermediate_size"] = hidden
    assert ffn_hidden_dim(model_config_from_hf(hf)) == hidden


def test_intermediate_size_is_taken_as_given() -> None:
    hf = hf_config(dataclasses.replace(TINY, dim=4096, n_heads=32, n_kv_heads=32), torch.float32)
    hf["intermediate_size"] = 11008
    cfg = model_config_from_hf(hf)
    assert cfg.ffn_dim == 11008
    assert hf_config(cfg, torch.float32)["intermediate_size"] == 11008


def test_config_round_trip() -> None:
    for cfg in (TINY, TIED, QK_NORM):
        back = model_config_from_hf(hf_config(cfg, torch.float32))
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta",
                  "max_seq_len", "tie_embeddings", "qk_norm"):
            assert getattr(back, f) == getattr(cfg, f), f
        assert ffn_hidden_dim(back) == ffn_hidden_dim(cfg)


@pytest.mark.parametrize(("change", "expect"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"model_type": "mistral"}, "model_type = 'mistral'"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "no 'rope_scaling.low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling.rope_type = 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type = 'yarn'"),
    ({"head_dim": 15}, "head_dim = 15"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3"),
    ({"vocab_size": "259"}, "vocab_size"),
])
def test_unsupported_hf_config_is_refused(change: dict, expect: str) -> None:
    hf = {**hf_config(TINY, torch.float32), **change}
    with pytest.raises(CheckpointError) as e:
        model_config_from_hf(hf)
    assert len(str(e.value).splitlines()) == 1 and expect in str(e.value), str(e.value)


def test_missing_field_is_named() -> None:
    hf = hf_config(TINY, torch.float32)
    del hf["num_hidden_layers"]
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        model_config_from_hf(hf)


def test_mismatched_run_config_names_the_fields(tmp_path: Path) -> None:
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(TINY, torch.float32)))
    with pytest.raises(CheckpointError, match="holds neither"):  # the config matches; then the weights are looked for
        check_hf_matches(tmp_path, TINY)
    other = dataclasses.replace(TINY, n_heads=8, multiple_of=256)  # same tensor shapes for attention
    with pytest.raises(CheckpointError) as e:
        check_hf_matches(tmp_path, other)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "model.n_heads = 8 but num_attention_heads = 4" in msg and "intermediate_size = 192" in msg, msg
    assert "model.dim =" not in msg and "the head size" in msg, msg
    with pytest.raises(CheckpointError, match="no config.json"):
        read_hf_config(tmp_path / "missing")


# ---------------------------------------------------------------- bad inputs

def test_export_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    model = build(TINY)
    save_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory") as e:
        export_hf(tmp_path / "ckpt", TINY, out)
    assert len(str(e.value).splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]


def test_export_with_the_wrong_model_config_names_the_tensor(tmp_path: Path) -> None:
    save_checkpoint(build(TINY), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"'tok_embeddings.weight' with shape \[259, 64\].*expects \[300, 64\]"):
        export_hf(tmp_path / "ckpt", dataclasses.replace(TINY, vocab_size=300), tmp_path / "hf")
    with pytest.raises(CheckpointError, match="no model tensor 'layers.2"):
        export_hf(tmp_path / "ckpt", dataclasses.replace(TINY, n_layers=3), tmp_path / "hf")
    with pytest.raises(CheckpointError, match="not a readable keel checkpoint"):
        export_hf(tmp_path / "nowhere", TINY, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_load_names_a_wrong_shape_and_a_missing_tensor(tmp_path: Path) -> None:
    _, out, _ = export(tmp_path, TINY)
    tensors = load_file(out / SINGLE)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, out / SINGLE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_hf_weights(build(TINY), out)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert "'model.layers.1.mlp.up_proj.weight' has shape [128, 64]" in msg and "expects [192, 64]" in msg, msg
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, out / SINGLE, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_weights(build(TINY), out)


def test_a_checkpoint_keeps_its_selection_biases_when_loaded(tmp_path: Path) -> None:
    """`keel eval` reads a checkpoint's model: the experts it chooses depend on the biases saved with it."""
    cfg = dataclasses.replace(TINY, moe=MoEConfig(experts=4, top_k=2, bias_update_rate=0.25))
    model = build(cfg)
    model.layers["1"].moe.update_bias(torch.tensor([1, 5, 1, 1]), 0.25)
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint_model(tmp_path / "ckpt", cfg, torch.device("cpu"))
    assert torch.equal(loaded.layers["1"].moe.expert_bias, torch.tensor([0.25, -0.25, 0.25, 0.25]))
    assert not loaded.layers["0"].moe.expert_bias.any()


# ---------------------------------------------------------------- tokenizers

# Text that looks special to one tokenizer or another, keel's own special tokens, whitespace runs and
# characters from every plane: keel encodes all of it as text, and so must the export.
LOOKALIKES = ["<|bos|>", "<|eos|>", "<|pad|>", "<|endoftext|>", "</s>", "<s>", "<|begin_of_text|>", "<unk>",
              "[PAD]", "<pad>", "<|", "|>", "<", ">"]
PIECES = [*LOOKALIKES, " ", "  ", "   \t", "\n", "\n\n\n", "\r\n", "\u00a0", "\u3000", "\u200b", "\ufeff", "\x00",
          "\x7f", "naïve", "e\u0301", "日本語", "😀", "👩‍👩‍👧", "\U0010ffff", "def", " return", "x = 1", "ü"]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """`n` texts of up to 12 pieces, each a lookalike, a word, whitespace or any character but a lone
    surrogate (which no Python str reaching transformers may hold), with the plain cases first."""
    rng = random.Random(seed)

    def char() -> str:
        while 0xD800 <= (c := rng.randrange(0x110000)) <= 0xDFFF:
            pass
        return chr(c)

    texts = ["", " ", "  \n\t ", *LOOKALIKES, "".join(LOOKALIKES), "say <|eos|> and go on"]
    while len(texts) < n:
        texts.append("".join(rng.choice(PIECES) if rng.random() < 0.6 else char() for _ in range(rng.randrange(13))))
    return texts


def committed_checkpoint(run_dir: Path, cfg: ModelConfig, tokenizer: dict) -> None:
    """A checkpoint as training commits it, manifest and all, from keel's CheckpointManager in one process,
    recording `tokenizer` as the trainer does, in a run directory with the trainer's config.toml."""
    from keel.checkpoint.manager import CheckpointManager
    from keel.config import Config, to_toml
    from keel.core.state import TrainState
    from keel.rundir.events import EventLog

    run_config = Config()
    run_config.model = cfg
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(run_config))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build(cfg)
        manager = CheckpointManager(run_config, run_dir, "dp1", EventLog(run_dir / "events.jsonl", 0),
                                    tokenizer=tokenizer)
        [outcome] = manager.save([model], [torch.optim.AdamW(model.parameters())], TrainState(step=1), wait=True)
        assert outcome.committed, outcome.error
    finally:
        dist.destroy_process_group()


def export_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`keel ckpt export ARGS` in this process: its exit code and its error output."""
    from keel.cli import main

    code = main(["ckpt", "export", *args])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def tokenizer_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """A committed checkpoint for each kind of tokenizer keel trains with, the BPE and given ones in a
    corpus directory as `keel data prepare` leaves them: run directory and keel's tokenizer."""
    pytest.importorskip("tokenizers")
    from keel.data.tokenizer import ByteTokenizer, load_tokenizer_file, train_bpe
    from tests.unit.data.test_tokenizer import TRAIN_FILES, gpt2_like, read

    root = tmp_path_factory.mktemp("tokenizer_runs")
    given = gpt2_like(root / "gpt2.json")
    tokenizers = {"byte": ByteTokenizer(), "bpe": train_bpe(read(TRAIN_FILES[:5]), 400),
                  "given": load_tokenizer_file(given)}
    runs = {}
    for kind, tok in tokenizers.items():
        corpus = root / f"corpus-{kind}"
        corpus.mkdir()
        tok.save(corpus)
        committed_checkpoint(root / kind, dataclasses.replace(TINY, vocab_size=max(tok.vocab_size, 259)),
                             {**tok.describe(), "corpus": str(corpus)})
        runs[kind] = root / kind, tok
    return runs


@pytest.mark.parametrize("kind", ["byte", "bpe", "given"])
def test_exported_tokenizer_gives_keel_ids_on_any_text(tmp_path: Path, transformers, capsys, tokenizer_runs,
                                                       kind: str) -> None:
    run_dir, tok = tokenizer_runs[kind]
    out = tmp_path / "hf"
    assert export_cli(capsys, str(run_dir), "--out", str(out)) == (0, "")
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG, SINGLE, *TOKENIZER_FILES])
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos, tok.eos, tok.pad)
    config = json.loads((out / CONFIG).read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (tok.bos, tok.eos, tok.pad)

    texts = random_texts(1000)
    documents = [ids.tolist() for ids in tok.encode_documents(texts)]
    assert hf(texts)["input_ids"] == documents, "add_special_tokens (the default): BOS text EOS, as keel trains"
    assert hf(texts, add_special_tokens=False)["input_ids"] == [ids[1:-1] for ids in documents]
    assert hf("<|eos|>", "</s>")["input_ids"] == documents[texts.index("<|eos|>")] + documents[texts.index("</s>")]
    decoded = [hf.decode(ids, skip_special_tokens=True) for ids in documents]
    assert decoded == [tok.decode(ids) for ids in documents] == texts, "byte-level: every text comes back"
    padded = hf(["a", "a longer text"], padding=True)
    assert padded["input_ids"][0][-1] == tok.pad and padded["attention_mask"][0][-1] == 0


def test_export_finds_the_tokenizer_or_says_what_to_pass(tmp_path: Path, capsys, tokenizer_runs) -> None:
    run_dir, tok = tokenizer_runs["bpe"]
    checkpoint = run_dir / "checkpoints" / "step-000001"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    corpus = Path(manifest["tokenizer"]["corpus"])
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes((corpus / "tokenizer.json").read_bytes())
    out = tmp_path / "hf"

    def refused(*args: str) -> str:
        code, err = export_cli(capsys, str(run_dir), "--out", str(out), *args)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
        return err

    original = (corpus / "tokenizer.json").read_bytes()
    try:
        (corpus / "tokenizer.json").write_bytes(original + b"\n")  # the corpus prepared again, or edited
        err = refused()
        assert f"{corpus / 'tokenizer.json'} is not the bpe tokenizer" in err and "--tokenizer PATH" in err, err
        (corpus / "tokenizer.json").unlink()
        assert "cannot read" in refused() and "--tokenizer PATH" in refused()
        assert "is not the bpe tokenizer" in refused("--tokenizer", str(run_dir / "events.jsonl"))
        # A copy of the very file, as a file or as the directory that holds it, is what the run used.
        for given in (copy, tmp_path):
            assert export_cli(capsys, str(run_dir), "--out", str(out), "--tokenizer", str(given)) == (0, "")
            assert json.loads((out / "tokenizer.json").read_text())["model"] == json.loads(original)["model"]
            shutil.rmtree(out)
    finally:
        (corpus / "tokenizer.json").write_bytes(original)

    byte_run, _ = tokenizer_runs["byte"]
    err = export_cli(capsys, str(byte_run), "--out", str(out), "--tokenizer", str(copy))[1]
    assert "trained with the byte tokenizer" in err and not out.exists(), err
    old = {k: v for k, v in manifest["tokenizer"].items() if k != "corpus"}
    with pytest.raises(CheckpointError, match="records its bpe tokenizer's sha256 but not its corpus.*--tokenizer"):
        checkpoint_tokenizer(old, str(checkpoint))
    with pytest.raises(CheckpointError, match="records no tokenizer"):
        checkpoint_tokenizer(None, str(checkpoint))


# `keel ARGS` in a process where the named packages cannot be imported, as in keel's runtime-only install.
WITHOUT = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in sys.argv[1].split(","):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from keel.cli import main
code = main(sys.argv[2:])
assert not set(sys.argv[1].split(",")) & set(sys.modules), "a blocked package was imported"
sys.exit(code)
"""


def keel_without(packages: str, *args: str) -> subprocess.CompletedProcess:
    from tests.conftest import keel_env

    return subprocess.run([sys.executable, "-c", WITHOUT, packages, *args], env=keel_env(), capture_output=True,
                          text=True, timeout=120)


def test_the_byte_tokenizer_exports_without_the_tokenizers_package(tmp_path: Path, transformers,
                                                                    tokenizer_runs) -> None:
    run_dir, tok = tokenizer_runs["byte"]
    out = tmp_path / "hf"
    done = keel_without("tokenizers,transformers", "ckpt", "export", str(run_dir), "--out", str(out))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG, SINGLE, *TOKENIZER_FILES])
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    # Real text, as the built-in corpus holds it, and the texts that look special to one tokenizer or another
    texts = [Path(json.__file__).read_text(), Path(dataclasses.__file__).read_text(), *random_texts(200)]
    documents = [ids.tolist() for ids in tok.encode_documents(texts)]
    assert len(documents[1]) > 10_000
    assert hf(texts)["input_ids"] == documents
    assert hf(texts, add_special_tokens=False)["input_ids"] == [ids[1:-1] for ids in documents]
    assert [hf.decode(ids, skip_special_tokens=True) for ids in documents] == texts


def test_a_bpe_export_without_the_tokenizers_package_names_the_extra(tmp_path: Path, tokenizer_runs) -> None:
    run_dir, _ = tokenizer_runs["bpe"]
    out = tmp_path / "hf"
    done = keel_without("tokenizers", "ckpt", "export", str(run_dir), "--out", str(out))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "pip install 'keel-pretrain[bpe]'" in done.stderr, done.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [], "nothing written"


def test_the_byte_tokenizer_file_is_the_one_tokenizers_builds(tmp_path: Path) -> None:
    """keel writes the byte tokenizer's tokenizer.json itself; `tokenizers`, given the same model, pre-tokenizer,
    decoder, special tokens and post-processor, serialises the same JSON."""
    hf = pytest.importorskip("tokenizers")
    from keel.data.tokenizer import SPECIALS, ByteTokenizer, byte_level_alphabet

    write_hf_tokenizer(ByteTokenizer(), tmp_path, 64)
    written = json.loads((tmp_path / TOKENIZER_FILES[0]).read_text(encoding="utf-8"))
    model = hf.Tokenizer(hf.models.BPE(vocab=byte_level_alphabet(), merges=[]))
    model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = hf.decoders.ByteLevel()
    model.add_special_tokens([hf.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    model.post_processor = hf.processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", pair="<|bos|> $A <|eos|> <|bos|>:1 $B:1 <|eos|>:1",
        special_tokens=[("<|bos|>", 256), ("<|eos|>", 257)])
    assert written == json.loads(model.to_str())
    loaded = hf.Tokenizer.from_file(str(tmp_path / TOKENIZER_FILES[0]))
    loaded.encode_special_tokens = True  # as transformers' split_special_tokens sets it
    assert loaded.encode("é<|eos|>").ids == [256, 195, 169, *b"<|eos|>", 257]
