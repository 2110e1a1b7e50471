"""datatrove's counterpart of `keel data prepare`, run by bench/prepare.py under an interpreter that has datatrove
(it is not a keel dependency): reader → filters → MinHash dedup → tokenizer → writer, on the same input files.

- reader: one document per text file (a small reader class: datatrove has none for whole files), or datatrove's
  JsonlReader for .jsonl/.jsonl.gz files;
- filters: keel's length bounds (32 to 1,000,000 characters, LambdaFilter) and datatrove's GopherRepetitionFilter
  at keel's code limit on repeated lines (0.6), its other limits off (they are for prose and would remove most
  code);
- MinHash: datatrove's four stages (signatures, buckets, clusters, filter) with keel's shape: word 5-grams,
  9 bands of 13 hashes (keel: 9 × 13 out of 128 permutations);
- tokenizer: datatrove's DocumentTokenizer with a byte-level tokenizer.json of the 256 byte values and no merges,
  so one token per UTF-8 byte as keel's byte tokenizer, EOS after each document, uint16 tokens, no shuffling.

The filtered documents are written once as JSON lines between the filter and the MinHash filter (datatrove's
MinHash filter reads its input again); each stage runs `--workers` tasks in as many processes.

  python bench/prepare_datatrove.py --files LIST --out DIR --workers N
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def byte_tokenizer(path: Path) -> None:
    """A tokenizer.json whose ids are the 256 byte values (in byte-level BPE's alphabet) and three specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<|bos|>", "<|eos|>", "<|pad|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    tok.save(str(path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=Path, required=True, help="a file listing the input files, one per line")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()

    from datatrove.data import DocumentsPipeline
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import GopherRepetitionFilter, LambdaFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.readers.base import BaseDiskReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    class WholeFileReader(BaseDiskReader):
        """One document per file, its text decoded as UTF-8 with undecodable bytes replaced (as keel reads)."""

        name = "whole files"

        def read_file(self, filepath: str) -> DocumentsPipeline:
            with self.data_folder.open(filepath, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            document = self.get_document_from_dict({"text": text, "id": filepath}, filepath, 0)
            if document:
                yield document

    files = [Path(line) for line in args.files.read_text().splitlines() if line]
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    paths_file = work / "paths.txt"
    paths_file.write_text("".join(f"{f.relative_to(root)}\n" for f in files))
    jsonl = all(f.name.endswith((".jsonl", ".jsonl.gz")) for f in files)
    reader = (JsonlReader(str(root), paths_file=str(paths_file), compression="infer") if jsonl
              else WholeFileReader(str(root), paths_file=str(paths_file)))
    tokenizer = work / "byte-tokenizer.json"
    byte_tokenizer(tokenizer)
    minhash = MinhashConfig(n_grams=5, num_buckets=9, hashes_per_bucket=13,
                            hash_config=HashConfig(precision=64))
    tasks, workers = args.workers, args.workers

    def run(pipeline: list, n_tasks: int, name: str) -> None:
        LocalPipelineExecutor(pipeline=pipeline, tasks=n_tasks, workers=min(workers, n_tasks),
                              logging_dir=str(work / "logs" / name), skip_completed=False).run()

    run([reader,
         LambdaFilter(lambda doc: len(doc.text.strip()) >= 32 and len(doc.text) <= 1_000_000),
         GopherRepetitionFilter(dup_line_frac=0.6, dup_para_frac=None, dup_line_char_frac=None,
                                dup_para_char_frac=None, top_n_grams=(), dup_n_grams=()),
         JsonlWriter(str(work / "filtered"), compression=None),
         MinhashDedupSignature(output_folder=str(work / "signatures"), config=minhash)], tasks, "1-signatures")
    run([MinhashDedupBuckets(input_folder=str(work / "signatures"), output_folder=str(work / "buckets"),
                             config=minhash)], minhash.num_buckets, "2-buckets")
    run([MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove"),
                             config=minhash)], 1, "3-clusters")
    run([JsonlReader(str(work / "filtered"), compression=None),
         MinhashDedupFilter(input_folder=str(work / "remove")),
         DocumentTokenizer(output_folder=str(args.out / "tokens"), tokenizer_name_or_path=str(tokenizer),
                           eos_token="<|eos|>", shuffle_documents=False, batch_size=1000)], tasks, "4-tokenize")
    sizes = {p.name: p.stat().st_size for p in (args.out / "tokens").rglob("*") if p.is_file()}
    print(json.dumps({"files": len(files), "output_bytes": sum(sizes.values()), "output_files": sizes}))


if __name__ == "__main__":
    main()
