"""The training loop: progress bar, metrics JSONL, loss-curve PNG, checkpoints and resume."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .config import Config, ConfigError
from .data import SyntheticCorpus
from .plot import write_if_plotting, write_loss_curve
from .trainer import Trainer, check_backend_runs_on, resolve_device

METRICS, PLOT, CHECKPOINT = "metrics.jsonl", "loss.png", "checkpoint.pt"


def train(config: Config, resume: bool | None = None, progress: bool = True) -> list[dict]:
    """Trains up to config.train.steps steps; returns the metrics of every step so far, as written to
    <output.dir>/metrics.jsonl.

    resume: None (the default) continues from <output.dir>/checkpoint.pt when there is one, so that
    rerunning a command picks up where it stopped; True requires that checkpoint; False starts over
    (deleting it first, so an interrupted new run cannot resume the old one)."""
    check_backend_runs_on(config, resolve_device(config))
    out_dir = Path(config.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = out_dir / CHECKPOINT
    if resume and not checkpoint.exists():
        raise ConfigError(f"nothing to resume: {checkpoint} does not exist")
    if resume is None:
        resume = checkpoint.exists()
    elif not resume and checkpoint.exists():
        checkpoint.unlink()
        print(f"starting over: deleted {checkpoint}", flush=True)

    trainer = Trainer(config)
    if resume:
        trainer.load(checkpoint)
        print(f"resuming from {checkpoint} at step {trainer.step} of {config.train.steps} (--fresh starts over)",
              flush=True)
    # Steps after the checkpoint (from an interrupted run) are dropped: they are trained again.
    records = [r for r in _read_metrics(out_dir / METRICS) if r["step"] <= trainer.step] if resume else []
    corpus = SyntheticCorpus(config.data, config.model.vocab_size, config.train.seed)
    train_cfg = config.train
    tokens_per_step = train_cfg.batch_size * train_cfg.seq_len

    with open(out_dir / METRICS, "w") as metrics:
        for record in records:
            metrics.write(json.dumps(record) + "\n")
        bar = tqdm(total=train_cfg.steps, initial=trainer.step, unit="step", file=sys.stderr,
                   desc=f"{config.moe.backend}/{config.moe.precision}", disable=not progress)
        while trainer.step < train_cfg.steps:
            input_ids = corpus.batch(trainer.step, train_cfg.batch_size, train_cfg.seq_len)
            start = time.perf_counter()
            result = trainer.train_step(input_ids)  # ends in a host sync: the time is the step's
            seconds = time.perf_counter() - start
            record = {"step": trainer.step, "loss": result.loss, "lm_loss": result.lm_loss,
                      "aux_loss": result.aux_loss, "grad_norm": result.grad_norm, "lr": result.lr,
                      "step_time_s": seconds, "tokens_per_s": tokens_per_step / seconds,
                      "backend": config.moe.backend, "precision": config.moe.precision}
            records.append(record)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            bar.update()
            bar.set_postfix(loss=f"{result.lm_loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            every = config.output.checkpoint_every
            if every and (trainer.step % every == 0 or trainer.step == train_cfg.steps):
                trainer.save(checkpoint)
        bar.close()

    write_if_plotting(write_loss_curve, out_dir / PLOT, [r["step"] for r in records],
                      [r["lm_loss"] for r in records],
                      title=f"Qwen3-MoE, {config.moe.backend}/{config.moe.precision} experts",
                      floor=corpus.entropy_floor())
    return records


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
