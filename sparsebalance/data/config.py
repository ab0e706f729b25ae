"""Where a run's sequences come from."""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.errors import check, check_choice, check_positive

SOURCES = ("distribution", "jsonl", "parquet", "hf_disk", "text_dir")


MAX_SEQUENCES = 10_000_000
"""Most sequences a dataset may hold (about 2 GB of Sequence objects at this bound)."""

MAX_LENGTH = 2**24
"""Most tokens one sequence may have (16,777,216: far past any model's context). A length of 1e30 in a
file would overflow integer arrays or ask for petabytes further on; it is refused where it is read."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """A dataset: a named length distribution or a file/directory of samples."""

    source: str = "distribution"
    """One of distribution, jsonl, parquet, hf_disk, text_dir."""
    distribution: str = "chatqa2-like"
    """For source = distribution: chatqa2-like, longalign-like, longctx-512k (see sparsebalance.data.distributions),
    or fixed (every sequence ``length`` tokens: dense pretraining data cut to the context length)."""
    length: int | None = None
    """For distribution = fixed: tokens of every sequence (required there, refused elsewhere)."""
    path: str | None = None
    """File or directory for the file-based sources (relative paths are relative to the config)."""
    num_sequences: int = 1024
    """Sequences drawn from a distribution, or the cap on sequences read from a file (0 = all)."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory for a ``text`` column; byte-level when absent."""
    max_length: int | None = None
    """Truncate sequences to this many tokens (None = no cap)."""
    min_length: int = 1
    """Drop sequences shorter than this."""
    glob: str = "**/*.py"
    """For source = text_dir: which files are documents."""
    seed: int | None = None
    """Seed for sampling and for the epoch shuffle; None = the run's ``seed`` (one seed means the same
    in every verb), 0 when the data config is used on its own."""
    shuffle: bool = True
    """Shuffle the dataset each epoch before cutting it into global batches."""

    def __post_init__(self) -> None:
        check_choice(self.source, "source", SOURCES)
        if self.source != "distribution":
            check(self.path is not None, "path", f"is required for source = {self.source!r}")
        check_positive(self.num_sequences, "num_sequences", allow_zero=self.source != "distribution")
        check(self.num_sequences <= MAX_SEQUENCES, "num_sequences",
              f"must be <= {MAX_SEQUENCES:,} (each sequence is held in memory), got {self.num_sequences:,}")
        if self.source == "distribution":
            from sparsebalance.data.distributions import DISTRIBUTIONS

            check_choice(self.distribution, "distribution", [*DISTRIBUTIONS, "fixed"])
            fixed = self.distribution == "fixed"
            check((self.length is not None) == fixed, "length",
                  "is required for distribution = \"fixed\" (tokens per sequence)" if fixed
                  else f"applies only to distribution = \"fixed\", not {self.distribution!r}")
            if fixed:
                check(isinstance(self.length, int) and 1 <= self.length <= MAX_LENGTH, "length",
                      f"must be a whole number of tokens in 1..{MAX_LENGTH:,}, got {self.length!r}")
        check_positive(self.min_length, "min_length")
        check(self.min_length <= MAX_LENGTH, "min_length",
              f"must be <= {MAX_LENGTH:,} tokens, got {self.min_length:,}")
        if self.seed is not None:
            check_positive(self.seed, "seed", allow_zero=True)
        if self.max_length is not None:
            check(self.max_length >= self.min_length, "max_length",
                  f"must be >= min_length ({self.min_length}), got {self.max_length}")
            check(self.max_length <= MAX_LENGTH, "max_length",
                  f"must be <= {MAX_LENGTH:,} tokens, got {self.max_length:,}")
