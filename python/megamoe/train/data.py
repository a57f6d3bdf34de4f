"""A synthetic language that needs no download and that a small model visibly learns.

A fixed, seeded phrase book holds `phrases` random token sequences of `phrase_length` tokens; a training
sequence is a run of phrases drawn uniformly at random, starting at a random offset into the first.
Within a phrase every token is predictable from the ones before it, so the loss falls from
ln(vocab_size) towards ln(phrases) / phrase_length (only phrase starts stay unpredictable).
"""

from __future__ import annotations

import torch

from .config import DataConfig


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
