"""`keel ckpt ls|verify|export`: list, verify and export checkpoints."""

from __future__ import annotations

import argparse

from keel.cli.pathargs import TOKENIZER, PathArg, checkpoints_at, writes_dir
from keel.config import ModelConfig
from keel.errors import KeelError
from keel.paths import shown


def add_parsers(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("ckpt", help="list, verify and export checkpoints")
    ksub = k.add_subparsers(dest="ckpt_command", required=True)
    ls = ksub.add_parser("ls", help="steps, sizes, age and state of a run's checkpoints")
    ls.add_argument("path", action=PathArg, check=checkpoints_at(),
                    help="run directory, checkpoints directory or URL, or one checkpoint")
    ls.add_argument("--verify", action="store_true", help="also check every file's checksum (reads everything)")
    ver = ksub.add_parser("verify", help="check manifests and every file's size and checksum")
    ver.add_argument("path", action=PathArg, check=checkpoints_at(),
                     help="run directory, checkpoints directory or URL, or one checkpoint")
    exp = ksub.add_parser("export", help="write a checkpoint's model in another format")
    exp.add_argument("path", action=PathArg, check=checkpoints_at(),
                     help="run directory (its newest verified checkpoint) or one checkpoint")
    exp.add_argument("--format", choices=("hf",), default="hf",
                     help="hf: Hugging Face safetensors (Llama, Qwen3 or Qwen3-MoE)")
    exp.add_argument("--out", action=PathArg, check=writes_dir, required=True,
                     help="output directory (must not exist or be empty)")
    exp.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the exported weights")
    exp.add_argument("--tokenizer", action=PathArg, check=TOKENIZER,
                     help="the run's tokenizer.json or prepared corpus directory (default: "
                     "the corpus recorded in the checkpoint; its sha256 must match)")
    k.set_defaults(handler=cmd_ckpt)


def cmd_ckpt(args: argparse.Namespace) -> int:
    from keel.checkpoint.inspect import find_checkpoints, format_rows, list_rows, verdict
    from keel.checkpoint.manifest import verify

    if args.ckpt_command == "export":
        return _export(args)
    storage, names = find_checkpoints(args.path)
    if args.ckpt_command == "ls":
        print("\n".join(format_rows(list_rows(storage, names, checksums=args.verify))))
        return 0
    if not names:  # a directory with no checkpoint in it yet: say so rather than verify nothing in silence
        raise KeelError(f"{shown(args.path)} holds no checkpoints to verify; pass a run directory, its checkpoints "
                        f"directory or a checkpoints/step-NNNNNN directory")
    bad = 0
    for name in names:
        if verdict(name):  # being written, left by a crash, or set aside: not resumed
            print(f"{storage.path(name)}: {verdict(name)}")
            continue
        problems = verify(storage, name)
        print(f"{storage.path(name)}: {'verified' if not problems else 'FAILED: ' + '; '.join(problems)}")
        bad += bool(problems)
    if bad:
        total = sum(not verdict(n) for n in names)
        raise KeelError(f"{bad} of {total} checkpoints under {args.path} failed verification; `keel train` resumes "
                        f"the newest that verifies and sets the others aside")
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from keel.checkpoint.export import check_export_target, export_hf
    from keel.checkpoint.hf_tokenizer import checkpoint_tokenizer
    from keel.checkpoint.inspect import latest_verified
    from keel.checkpoint.manifest import read_manifest

    check_export_target(args.out)  # before the checkpoint's read lock is taken: a bad --out creates nothing
    storage, name = latest_verified(args.path)
    manifest = read_manifest(storage, name)
    assert manifest is not None  # a checkpoint that verifies has its manifest
    tokenizer = checkpoint_tokenizer(manifest.get("tokenizer"), storage.path(name), args.tokenizer)
    with storage.reading(name):
        files = export_hf(storage.path(name), ModelConfig(**manifest["model"]), args.out,
                          dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, tokenizer=tokenizer)
    print(f"exported {storage.path(name)} (step {manifest['step']}) to {args.out}: "
          f"{', '.join(f.name for f in files)}")
    return 0
