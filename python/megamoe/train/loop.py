"""The training loop: progress bar, metrics JSONL, loss-curve PNG, checkpoints and resume."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .config import Config, ConfigError
from .data import held_out_batches, training_data
from .distributed import ExpertParallel, checkpoint_name, start
from .plot import write_if_plotting, write_loss_curve
from .trainer import Trainer, check_backend_runs_on, resolve_device

METRICS, PLOT, CHECKPOINT = "metrics.jsonl", "loss.png", "checkpoint.pt"


def train(config: Config, resume: bool | None = None, progress: bool = True) -> list[dict]:
    """Trains up to config.train.steps steps; returns the metrics of every step so far, as written to
    <output.dir>/metrics.jsonl.

    resume: None (the default) continues from <output.dir>/checkpoint.pt when there is one, so that
    rerunning a command picks up where it stopped; True requires that checkpoint; False starts over
    (deleting it first, so an interrupted new run cannot resume the old one).

    With [moe].expert_parallel = W > 1 every rank (a torchrun process) runs this: each trains on its
    slice of a W times larger global batch and keeps a checkpoint of its own; rank 0 writes the metrics
    (of the global batch) and the plot."""
    ep = start(config)
    check_backend_runs_on(config, resolve_device(config, ep))
    rank, ranks = (0, 1) if ep is None else (ep.rank, ep.world)
    lead = rank == 0
    out_dir = Path(config.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = out_dir / checkpoint_name(CHECKPOINT, rank, ranks)
    if resume and not checkpoint.exists():
        raise ConfigError(f"nothing to resume: {checkpoint} does not exist")
    if resume is None:
        resume = _all_ranks_have(checkpoint, ep)
    elif not resume and checkpoint.exists():
        checkpoint.unlink()
        print(f"starting over: deleted {checkpoint}", flush=True)

    trainer = Trainer(config, ep)
    if resume:
        trainer.load(checkpoint)
        if lead:
            print(f"resuming from {checkpoint} at step {trainer.step} of {config.train.steps} (--fresh starts over)",
                  flush=True)
    # Steps after the checkpoint (from an interrupted run) are dropped: they are trained again.
    records = [r for r in _read_metrics(out_dir / METRICS) if r["step"] <= trainer.step] if resume else []
    corpus = training_data(config.data, config.model.vocab_size, config.train.seed)
    train_cfg = config.train
    tokens_per_step = ranks * train_cfg.batch_size * train_cfg.seq_len  # the global batch's
    held_out = []
    if train_cfg.eval_every:
        held_out = held_out_batches(config.data, config.model.vocab_size, train_cfg.seed, train_cfg.eval_batches,
                                    ranks * train_cfg.batch_size, train_cfg.seq_len)
        if ep is not None:
            held_out = [ep.batch_slice(batch) for batch in held_out]

    with open(out_dir / METRICS if lead else os.devnull, "w") as metrics:
        for record in records:
            metrics.write(json.dumps(record) + "\n")
        bar = tqdm(total=train_cfg.steps, initial=trainer.step, unit="step", file=sys.stderr,
                   desc=f"{config.moe.backend}/{config.moe.precision}", disable=not (progress and lead))
        while trainer.step < train_cfg.steps:
            input_ids = corpus.batch(trainer.step, ranks * train_cfg.batch_size, train_cfg.seq_len)
            if ep is not None:
                input_ids = ep.batch_slice(input_ids)
            start_time = time.perf_counter()
            result = trainer.train_step(input_ids)  # ends in a host sync: the time is the step's
            seconds = time.perf_counter() - start_time
            record = {"step": trainer.step, "loss": result.loss, "lm_loss": result.lm_loss,
                      "aux_loss": result.aux_loss, "grad_norm": result.grad_norm, "lr": result.lr,
                      "step_time_s": seconds, "tokens_per_s": tokens_per_step / seconds,
                      "backend": config.moe.backend, "precision": config.moe.precision,
                      "expert_parallel": ranks, "peak_memory_gb": _peak_memory_gb(trainer.device)}
            if _due(trainer.step, train_cfg.eval_every, train_cfg.steps):
                record["eval_loss"] = trainer.evaluate(held_out)
            records.append(record)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            bar.update()
            bar.set_postfix(loss=f"{result.lm_loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            if _due(trainer.step, config.output.checkpoint_every, train_cfg.steps):
                trainer.save(checkpoint)
        bar.close()

    if lead:
        write_if_plotting(write_loss_curve, out_dir / PLOT, [r["step"] for r in records],
                          [r["lm_loss"] for r in records],
                          title=f"Qwen3-MoE, {config.moe.backend}/{config.moe.precision} experts",
                          floor=corpus.entropy_floor(),
                          evaluations=[(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r])
    return records


def _due(step: int, every: int, last: int) -> bool:
    """Whether a periodic action (every `every` steps and after the last; never for 0) runs after `step`."""
    return every > 0 and (step % every == 0 or step == last)


def _all_ranks_have(checkpoint: Path, ep: ExpertParallel | None) -> bool:
    """Whether to resume by default: this rank's checkpoint exists, and so do every other rank's."""
    if ep is None:
        return checkpoint.exists()
    have = ep.mean(torch.tensor([float(checkpoint.exists())])).item()
    if 0 < have < 1:
        raise ConfigError(f"only some ranks have their checkpoint ({checkpoint} here: {checkpoint.exists()}); "
                          "restore the missing files, or start over with --fresh")
    return have == 1


def _peak_memory_gb(device: torch.device) -> float | None:
    """This process's peak of allocated GPU memory so far (what the step needs at most), or None on the CPU."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
