"""A byte-level tokenizer (ids 0..255): what the shipped token sources (``text_dir``, byte-level)
produce, so a torchtitan job needs no tokenizer files and fetches nothing. The SparseBalance loader
reads token ids from the run's data; torchtitan's trainer still builds a tokenizer, and this is it."""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.titan.compat import import_torchtitan

import_torchtitan()

from torchtitan.components.tokenizer import BaseTokenizer


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as token ids."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        del config, tokenizer_path

    def encode(self, text: str, *args, **kwargs) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, *args, **kwargs) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 256
