"""The training data: a file of token ids ([data].tokens, TokenFile) or a synthetic language that
needs no download and that a small model visibly learns (SyntheticCorpus).

Synthetic: a fixed, seeded phrase book holds `phrases` random token sequences of `phrase_length` tokens;
a training sequence is a run of phrases drawn uniformly at random, starting at a random offset into
the first. Within a phrase every token is predictable from the ones before it, so the loss falls from
ln(vocab_size) towards ln(phrases) / phrase_length (only phrase starts stay unpredictable).

Either way a batch is a function of (seed, step) only, so a resumed run sees the data order the
uninterrupted run would have seen.
"""

from __future__ import annotations

import os

import torch

from .config import TOKEN_BYTES, ConfigError, DataConfig


class SyntheticCorpus:
    def __init__(self, data: DataConfig, vocab_size: int, seed: int):
        self.seed = seed
        self.phrase_book = torch.randint(0, vocab_size, (data.phrases, data.phrase_length),
                                         generator=torch.Generator().manual_seed(seed))

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """input_ids [batch_size, seq_len] int64 for `step`: a function of (seed, step) only, so a
        resumed run sees the data order the uninterrupted run would have seen."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        phrases, length = self.phrase_book.shape
        per_sequence = seq_len // length + 2  # enough phrases for seq_len tokens after any offset
        picks = torch.randint(0, phrases, (batch_size, per_sequence), generator=generator)
        offsets = torch.randint(0, length, (batch_size, 1), generator=generator)
        tokens = self.phrase_book[picks].reshape(batch_size, -1)
        return tokens.gather(1, offsets + torch.arange(seq_len))

    def entropy_floor(self) -> float:
        """Loss (nats per token) of a model that knows the phrase book."""
        phrases, length = self.phrase_book.shape
        return float(torch.tensor(phrases, dtype=torch.float64).log() / length)


class TokenFile:
    """Token ids from a flat binary file of [data].token_dtype values in the machine's byte order (what
    numpy's ndarray.tofile writes, such as nanoGPT's train.bin), memory-mapped, so only the batches'
    pages are read: a training sequence is seq_len consecutive ids from a random offset. The config
    checked the file's size (config._validate_token_file); each batch's ids are checked against the
    vocabulary before the model sees them."""

    def __init__(self, path: str, token_dtype: str, vocab_size: int, seed: int, key: str = "[data].tokens"):
        count = os.path.getsize(path) // TOKEN_BYTES[token_dtype]
        self.tokens = torch.from_file(path, shared=False, size=count, dtype=getattr(torch, token_dtype))
        self.path, self.key, self.vocab_size, self.seed = path, key, vocab_size, seed

    def batch(self, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """input_ids [batch_size, seq_len] int64 for `step`."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - seq_len + 1, (batch_size,), generator=generator)
        batch = torch.stack([self.tokens[start:start + seq_len].to(torch.int64) for start in starts.tolist()])
        largest = int(batch.max())
        if largest >= self.vocab_size:
            raise ConfigError(f"{self.key} = {self.path!r} holds token id {largest}, outside [model].vocab_size = "
                              f"{self.vocab_size}")
        return batch

    def entropy_floor(self) -> None:
        """None: the loss a file's text allows is not known."""
        return None


Corpus = SyntheticCorpus | TokenFile


def training_data(data: DataConfig, vocab_size: int, seed: int) -> Corpus:
    """The training data [data] names: its token file, or the synthetic corpus."""
    if data.tokens:
        return TokenFile(data.tokens, data.token_dtype, vocab_size, seed)
    return SyntheticCorpus(data, vocab_size, seed)


def held_out_batches(data: DataConfig, vocab_size: int, seed: int, count: int, batch_size: int,
                     seq_len: int) -> list[torch.Tensor]:
    """The evaluation's `count` batches, the same at every evaluation: windows of [data].eval_tokens, or
    sequences of the synthetic language that no training step draws (those of steps -1, -2, ...)."""
    corpus = (TokenFile(data.eval_tokens, data.token_dtype, vocab_size, seed, "[data].eval_tokens")
              if data.eval_tokens else SyntheticCorpus(data, vocab_size, seed))
    return [corpus.batch(-1 - index, batch_size, seq_len) for index in range(count)]
