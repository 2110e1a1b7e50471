"""Zero-dependency byte-level tokenizer: the 256 byte values plus BOS, EOS and PAD."""

from __future__ import annotations

import numpy as np

from keel.errors import DataError


class ByteTokenizer:
    name = "byte"
    bos, eos, pad = 256, 257, 258
    vocab_size = 259

    def encode_document(self, text: bytes) -> np.ndarray:
        """BOS, the document's bytes, EOS."""
        out = np.empty(len(text) + 2, dtype=np.uint16)
        out[0], out[-1] = self.bos, self.eos
        out[1:-1] = np.frombuffer(text, dtype=np.uint8)
        return out

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos": self.bos, "eos": self.eos, "pad": self.pad}


def get_tokenizer(name: str) -> ByteTokenizer:
    if name == "byte":
        return ByteTokenizer()
    raise DataError(f"unknown tokenizer {name!r}; available: byte")
