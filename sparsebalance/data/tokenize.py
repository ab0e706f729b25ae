"""Text → token ids: byte-level (UTF-8 bytes as ids 0-255) or a local Hugging Face tokenizer.

Token ids are ``np.int32`` arrays of shape [n_tokens]: every vocabulary we meet fits, and it halves
the memory of a large corpus compared to int64 (``torch.nn.Embedding`` accepts int32 indices).
No special tokens (BOS/EOS) are added, so a sequence's length is the length of its own text.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Protocol

import numpy as np

from sparsebalance.errors import ConfigError


class Tokenizer(Protocol):
    """Anything that turns texts into token-id arrays."""

    name: str

    def encode_many(self, texts: Seq[str | bytes]) -> list[np.ndarray]:
        """Token ids (int32, shape [n_tokens]) of each text."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255 (vocabulary 256); ``bytes`` input is taken as is."""

    name = "byte-level"
    vocab_size = 256

    def encode_many(self, texts: Seq[str | bytes]) -> list[np.ndarray]:
        out = []
        for t in texts:
            raw = t if isinstance(t, bytes) else t.encode("utf-8")
            out.append(np.frombuffer(raw, dtype=np.uint8).astype(np.int32))
        return out


class HFTokenizer:
    """A Hugging Face tokenizer read from a local directory (never from the hub)."""

    def __init__(self, directory: Path) -> None:
        self.name = str(directory)
        self._fast = None
        self._auto = None
        tok_json = directory / "tokenizer.json"
        try:
            if tok_json.is_file():
                # The `tokenizers` library alone reads tokenizer.json quickly without transformers.
                from tokenizers import Tokenizer as _Tok

                self._fast = _Tok.from_file(str(tok_json))
                self.vocab_size = self._fast.get_vocab_size()
            else:
                from transformers import AutoTokenizer

                self._auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
                self.vocab_size = len(self._auto)
        except ImportError as e:
            raise ConfigError(f"tokenizer: needs the `tokenizers`/`transformers` packages ({e}); "
                              "install the `train` or `dev` extra, or leave tokenizer unset for "
                              "byte-level") from None
        except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception on bad files)
            raise ConfigError(f"tokenizer: cannot load a tokenizer from {directory}: {e}") from None

    def encode_many(self, texts: Seq[str | bytes]) -> list[np.ndarray]:
        strs = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        if self._fast is not None:
            encs = self._fast.encode_batch(strs, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.int32) for e in encs]
        ids = self._auto(strs, add_special_tokens=False)["input_ids"]
        return [np.asarray(i, dtype=np.int32) for i in ids]


def make_tokenizer(tokenizer: str | None, base_dir: str | Path = ".") -> Tokenizer:
    """Byte-level when ``tokenizer`` is None, else the local directory (relative to ``base_dir``)."""
    if tokenizer is None:
        return ByteTokenizer()
    d = Path(tokenizer)
    if not d.is_absolute():
        d = Path(base_dir) / d
    if not d.is_dir():
        raise ConfigError(f"tokenizer: {str(d)!r} is not a directory; give a local Hugging Face "
                          "tokenizer directory (with tokenizer.json or tokenizer_config.json), "
                          "or leave it unset for byte-level")
    return HFTokenizer(d)
