"""keel as a user installs it: `pip install .` (a wheel, not an editable install) into a new virtual environment,
then `keel train` outside the source tree with a shipped config named on the command line. The environment
holds keel's runtime dependencies only: no test, lint or benchmark tool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SMALL_RUN

TEST_ONLY = ("pytest", "ruff", "mypy", "moto", "transformers", "playwright", "hypothesis", "datasketch")


def test_a_wheel_install_trains_with_a_shipped_config(small_corpus: Path, tmp_path: Path) -> None:
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The CPU build, as make does; not byte-compiled ahead (pip's compiling of torch's modules took 28 s of
    # the install, and the run below imports a fraction of them).
    subprocess.run([*pip, "--no-compile", "torch==2.13.0"], check=True, timeout=900, env=env)
    source = tmp_path / "source"  # what a source distribution holds; the build leaves its files there, not here
    shutil.copytree(REPO / "src" / "keel", source / "src" / "keel", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([*pip, str(source)], check=True, timeout=900, env=env, cwd=tmp_path)
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"], check=True,
                            capture_output=True, text=True, env=env).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert "keel-pretrain" in names and not names & set(TEST_ONLY), sorted(names)

    work = tmp_path / "elsewhere"  # no configs/ here: the shipped tiny config comes from the installed package
    work.mkdir()
    result = subprocess.run([str(venv / "bin" / "keel"), "train", "--config", "tiny", "--run-dir", "run",
                             *SMALL_RUN, f"data.dir={small_corpus}", "train.steps=2", "--quiet"], cwd=work,
                            env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["name"] == "tiny" and summary["step"] == 2
    installed = subprocess.run([str(venv / "bin" / "python"), "-c", "import keel; print(keel.__file__)"],
                               cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    assert str(REPO) not in installed and "site-packages" in installed  # not the source tree
    check_export_and_eval(venv, work, env)


def check_export_and_eval(venv: Path, work: Path, env: dict[str, str]) -> None:
    """The run of the runtime-only install exports with its tokenizer (no `tokenizers` there), which transformers
    loads with keel's ids; `keel eval` scores keel's shipped tasks and names the extra that lm-eval's need."""
    keel = str(venv / "bin" / "keel")
    exported = subprocess.run([keel, "ckpt", "export", "run", "--out", "hf"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0 and exported.stderr == "", exported.stderr
    transformers = pytest.importorskip("transformers")
    from keel.data.tokenizer import ByteTokenizer

    texts = [Path(json.__file__).read_text(), "say <|eos|> and go on", "naïve 日本語 😀", ""]
    hf = transformers.AutoTokenizer.from_pretrained(work / "hf")
    assert hf(texts)["input_ids"] == [ids.tolist() for ids in ByteTokenizer().encode_documents(texts)]
    evaluated = subprocess.run([keel, "eval", "run", "--tasks", "keel_stdlib_next_line,keel_stdlib_heldout",
                                "--limit", "8", "--json"], cwd=work, env=env, capture_output=True, text=True,
                               timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr
    scores = json.loads(evaluated.stdout)["tasks"]
    assert 0 <= scores["keel_stdlib_next_line"]["acc"] <= 1 and scores["keel_stdlib_heldout"]["bits_per_byte"] > 0
    needs_lm_eval = subprocess.run([keel, "eval", "run", "--tasks", "hellaswag"], cwd=work, env=env,
                                   capture_output=True, text=True, timeout=300)
    assert needs_lm_eval.returncode == 2 and needs_lm_eval.stderr.strip().splitlines() == [
        "keel: error: downstream evaluation needs lm-evaluation-harness: pip install 'keel-pretrain[eval]'"]
    shipped = subprocess.run([str(venv / "bin" / "python"), "-c", "from keel.downstream.tasks import SHIPPED; "
                              "print(sorted(p.name for p in SHIPPED.iterdir()))"], cwd=work, env=env,
                             capture_output=True, text=True, check=True).stdout
    assert "keel_stdlib_next_line.yaml" in shipped and "stdlib_heldout.jsonl" in shipped and "stdlib_data.py" in shipped
