"""The training loop on the tiny config: outputs, resume, activation checkpointing, bad configs, and the
benchmark and parity entry points."""

import json
from pathlib import Path

import pytest
import torch

from megamoe.shapes import PRESETS

from conftest import requires_cuda

pytest.importorskip("transformers")

from megamoe.train import ConfigError, load_config, train  # noqa: E402 (needs transformers)
from megamoe.train import bench, cli, parity  # noqa: E402
from megamoe.train.data import training_data  # noqa: E402
from megamoe.train.trainer import Trainer  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny.toml"


# On the CPU everywhere: bitwise reproducible, so resume and recomputation can be compared exactly.
CPU = ["--set", "train.device=cpu"]


def tiny(out_dir, *overrides):
    return load_config(TINY, ["train.device=cpu", f"output.dir={out_dir}", *overrides])


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_cli_trains_and_writes_metrics_plot_and_checkpoint(tmp_path, capsys):
    assert cli.main(["--config", str(TINY), *CPU, "--set", f"output.dir={tmp_path}", "--set", "train.steps=8",
                     "--set", "output.checkpoint_every=4"]) == 0
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert {r["backend"] for r in records} == {"naive"}
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 0.3  # it learns
    assert all(r["tokens_per_s"] > 0 and r["aux_loss"] > 0 for r in records)
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "checkpoint.pt").exists()
    assert "step 8" in capsys.readouterr().out


def test_resume_continues_steps_and_data_order(tmp_path, monkeypatch):
    overrides = ("train.steps=6", "output.checkpoint_every=3")
    uninterrupted = train(tiny(tmp_path / "a", *overrides), progress=False)

    original_step = Trainer.train_step

    def crash_at_step_5(self, input_ids):
        if self.step == 4:
            raise KeyboardInterrupt
        return original_step(self, input_ids)

    monkeypatch.setattr(Trainer, "train_step", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(tmp_path / "b", *overrides), progress=False)
    assert len(read_metrics(tmp_path / "b")) == 4  # the checkpoint holds step 3
    monkeypatch.setattr(Trainer, "train_step", original_step)
    resumed = train(tiny(tmp_path / "b", *overrides), resume=True, progress=False)

    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert read_metrics(tmp_path / "b") == resumed
    for a, b in zip(uninterrupted, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]


def test_resume_needs_a_checkpoint_and_a_rerun_resumes_the_one_there(tmp_path):
    config = tiny(tmp_path, "train.steps=2", "output.checkpoint_every=2")
    with pytest.raises(ConfigError, match="nothing to resume"):
        train(config, resume=True, progress=False)
    first = train(config, progress=False)
    assert train(config, progress=False) == first  # step 2 of 2: nothing left to train
    longer = train(tiny(tmp_path, "train.steps=3", "output.checkpoint_every=2"), progress=False)
    assert longer[:2] == first and [r["step"] for r in longer] == [1, 2, 3]


def run_cli(tmp_path, capsys, *args):
    assert cli.main(["--config", str(TINY), *CPU, "--set", f"output.dir={tmp_path}", "--set",
                     "output.checkpoint_every=2", *args]) == 0
    return capsys.readouterr().out


def test_rerunning_the_cli_resumes_from_the_checkpoint_and_says_so(tmp_path, capsys):
    assert "resuming" not in run_cli(tmp_path, capsys, "--set", "train.steps=2")
    first = read_metrics(tmp_path)
    out = run_cli(tmp_path, capsys, "--set", "train.steps=4")
    assert f"resuming from {tmp_path / 'checkpoint.pt'} at step 2" in out
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[:2] == first


def test_fresh_starts_the_run_over(tmp_path, capsys):
    run_cli(tmp_path, capsys, "--set", "train.steps=2")
    first = read_metrics(tmp_path)
    out = run_cli(tmp_path, capsys, "--set", "train.steps=2", "--fresh")
    assert "resuming" not in out and "starting over" in out
    again = read_metrics(tmp_path)
    assert [r["step"] for r in again] == [1, 2]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in first], rel=1e-6)
    with pytest.raises(SystemExit):  # one or the other
        cli.main(["--config", str(TINY), *CPU, "--set", f"output.dir={tmp_path}", "--fresh", "--resume"])


def write_tokens(path, ids, dtype="uint16"):
    torch.tensor(ids, dtype=torch.int64).to(getattr(torch, dtype)).numpy().tofile(path)
    return path


def test_trains_on_a_token_file(tmp_path, capsys):
    """[data].tokens: the batches are windows of the file, and the model learns its text (a phrase of 16
    random ids, repeated)."""
    phrase = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(3))
    tokens = write_tokens(tmp_path / "train.bin", phrase.repeat(64).tolist())
    assert cli.main(["--config", str(TINY), *CPU, "--set", f"output.dir={tmp_path / 'run'}", "--set",
                     f"data.tokens='{tokens}'", "--set", "train.steps=8"]) == 0
    records = read_metrics(tmp_path / "run")
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 1.0
    assert (tmp_path / "run" / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("dtype,vocab", [("uint16", 65536), ("uint32", 100_000)])
def test_token_file_batches_are_its_windows_by_seed_and_step(tmp_path, dtype, vocab):
    ids = [(vocab - 1000 + i) % vocab for i in range(3000)]  # consecutive ids, up to the vocabulary's last
    config = tiny(tmp_path, f"data.tokens='{write_tokens(tmp_path / 'ids.bin', ids, dtype)}'",
                  f"data.token_dtype={dtype}", f"model.vocab_size={vocab}")
    corpus = training_data(config.data, vocab, seed=1)
    batch = corpus.batch(5, 4, 64)
    assert batch.dtype == torch.int64 and batch.shape == (4, 64)
    for row in batch.tolist():
        start = ids.index(row[0])
        assert row == ids[start:start + 64]
    assert torch.equal(corpus.batch(5, 4, 64), batch)  # a function of (seed, step): resume sees the same
    assert not torch.equal(corpus.batch(6, 4, 64), batch)
    assert corpus.entropy_floor() is None


@pytest.mark.parametrize("size,dtype,message", [
    (None, "uint16", r"\[data\]\.tokens = '.*missing.bin': no such file"),
    (33, "uint16", r"33 bytes are not a whole number of uint16 token ids"),
    (60, "uint32", r"holds 15 token ids, fewer than \[train\]\.seq_len = 64"),
    (1024, "int8", r"\[data\]\.token_dtype = 'int8': must be one of uint16, uint32"),
])
def test_bad_token_files_are_named_before_training(tmp_path, size, dtype, message):
    path = tmp_path / "missing.bin"
    if size is not None:
        path.write_bytes(bytes(size))
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, f"data.tokens='{path}'", f"data.token_dtype={dtype}")


def test_token_ids_outside_the_vocabulary_are_refused_before_the_model_sees_them(tmp_path):
    tokens = write_tokens(tmp_path / "ids.bin", [7] * 500 + [512] + [7] * 500)
    corpus = training_data(tiny(tmp_path, f"data.tokens='{tokens}'").data, 512, seed=0)
    with pytest.raises(ConfigError, match=r"holds token id 512, outside \[model\]\.vocab_size = 512"):
        for step in range(100):
            corpus.batch(step, 4, 64)


def test_held_out_loss_every_eval_every_steps_leaves_training_as_it_was(tmp_path):
    plain = train(tiny(tmp_path / "plain", "train.steps=6"), progress=False)
    evaluated = train(tiny(tmp_path / "eval", "train.steps=6", "train.eval_every=4", "train.eval_batches=2"),
                      progress=False)
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [4, 6]  # every 4 steps, and the last
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]
    first, last = (r["eval_loss"] for r in evaluated if "eval_loss" in r)
    assert last < first < evaluated[0]["lm_loss"]


def test_held_out_loss_of_a_token_file_run_reads_eval_tokens(tmp_path):
    phrase = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(3))
    tokens = write_tokens(tmp_path / "train.bin", phrase.repeat(64).tolist())
    other = write_tokens(tmp_path / "val.bin", torch.randint(0, 512, (1024,)).tolist())  # text it never sees
    same = write_tokens(tmp_path / "val_same.bin", phrase.repeat(8).tolist())
    losses = {}
    for name, path in (("other", other), ("same", same)):
        records = train(tiny(tmp_path / name, f"data.tokens='{tokens}'", f"data.eval_tokens='{path}'",
                             "train.steps=8", "train.eval_every=8"), progress=False)
        losses[name] = records[-1]["eval_loss"]
    assert losses["same"] < 1.0 < 5.0 < losses["other"]


@pytest.mark.parametrize("overrides,message", [
    (["data.tokens='{tokens}'", "train.eval_every=2"], r"\[train\]\.eval_every = 2: .* set \[data\]\.eval_tokens"),
    (["data.eval_tokens='{tokens}'"], r"\[data\]\.eval_tokens = .*: is held-out text for a run on \[data\]\.tokens"),
    (["data.tokens='{tokens}'", "data.eval_tokens='{tokens}.missing'"], r"\[data\]\.eval_tokens = .*: no such file"),
    (["train.eval_every=-1"], r"\[train\]\.eval_every = -1: must be >= 0"),
])
def test_bad_evaluation_settings_are_named(tmp_path, overrides, message):
    tokens = write_tokens(tmp_path / "ids.bin", [1] * 100)
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, *(o.format(tokens=tokens) for o in overrides))


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_precisions_are_trainable_on_the_fused_backend(tmp_path, precision):
    config = tiny(tmp_path, f"moe.precision={precision}", "moe.backend=fused")
    assert config.moe.precision == precision and config.moe.backend == "fused"


@pytest.mark.parametrize("backend", ["grouped", "naive"])
@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
def test_fp8_precisions_on_another_backend_are_refused_by_the_config(tmp_path, precision, backend):
    with pytest.raises(ConfigError, match=rf"\[moe\]\.precision = '{precision}': precision '{precision}' runs on "
                                          rf"backend 'fused' only, not '{backend}'"):
        tiny(tmp_path, f"moe.precision={precision}", f"moe.backend={backend}")


def test_mxfp8_is_refused_naming_fp8(tmp_path):
    with pytest.raises(ConfigError, match=r"\[moe\]\.precision = 'mxfp8': needs Blackwell.*use 'fp8'.*"
                                          r"supported: bf16, fp8, fp8_bwd"):
        tiny(tmp_path, "moe.precision=mxfp8", "moe.backend=fused")


def test_the_cli_refuses_fp8_with_a_baseline_backend_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", str(TINY), *CPU, "--backend", "grouped", "--set", "moe.precision=fp8",
                  "--set", f"output.dir={tmp_path}"])
    assert exit_info.value.code == 2
    assert "runs on backend 'fused' only, not 'grouped'" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_fused_without_a_gpu_is_refused_before_training_naming_the_cpu_backends(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", str(TINY), *CPU, "--backend", "fused", "--set", f"output.dir={tmp_path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "[moe].backend = 'fused'" in err and "grouped" in err and "naive" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("mode", ["full", "moe"])
def test_activation_checkpointing_gives_the_same_losses(tmp_path, mode):
    losses = {}
    for checkpointing in ("none", mode):
        config = tiny(tmp_path / checkpointing, "train.steps=3", f"train.activation_checkpointing={checkpointing}")
        losses[checkpointing] = [r["loss"] for r in train(config, progress=False)]
    assert losses[mode] == pytest.approx(losses["none"], rel=1e-5)


def test_micro_batches_accumulate_the_whole_batchs_gradients(tmp_path):
    """[train].micro_batches = 2: two forward + backward passes over halves of the batch leave every
    parameter the gradient of the whole batch's mean loss (up to bf16 sums), and report its loss."""
    import torch

    from megamoe.reference import relative_error

    batch = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    grads, losses = {}, {}
    for parts in (1, 2):  # without the aux loss, which is not a mean over tokens
        trainer = Trainer(tiny(tmp_path, f"train.micro_batches={parts}", "model.router_aux_loss_coef=0.0"))
        losses[parts] = trainer.accumulate_gradients(batch)
        grads[parts] = {name: p.grad.float() for name, p in trainer.model.named_parameters()}
    assert losses[2][0].item() == pytest.approx(losses[1][0].item(), rel=1e-3)
    for name, grad in grads[1].items():
        assert relative_error(grads[2][name], grad) < 1e-2, name


def test_moe_checkpointing_of_fused_experts_is_their_own_recompute(tmp_path):
    import torch

    from megamoe.hf import qwen3_moe_experts
    from megamoe.train.trainer import build_model

    config = tiny(tmp_path, "moe.backend=fused", "train.activation_checkpointing=moe")
    model = build_model(config, torch.device("cpu"))
    assert model.config._experts_implementation == "megamoe_fused_bf16_recompute"
    assert all("forward" not in vars(experts) for experts in qwen3_moe_experts(model))  # no checkpoint wrapper
    grouped = build_model(tiny(tmp_path, "moe.backend=grouped", "train.activation_checkpointing=moe"),
                          torch.device("cpu"))
    assert grouped.config._experts_implementation == "megamoe_grouped_bf16"
    assert all("forward" in vars(experts) for experts in qwen3_moe_experts(grouped))
    gather = build_model(tiny(tmp_path, "moe.backend=fused", "train.activation_checkpointing=moe-gather"),
                         torch.device("cpu"))
    assert gather.config._experts_implementation == "megamoe_fused_bf16_recompute_gather"


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=0.1", r"unknown key\(s\) \[train\]\.learning_rate"),
    ("optimizer.lr=0.1", r"unknown section\(s\) \[optimizer\]"),
    ("moe.backend=fast", r"\[moe\]\.backend = 'fast': must be one of fused, grouped, naive"),
    ("moe.precision=fp4", r"\[moe\]\.precision"),
    ("moe.expert_parallel=2", r"\[moe\]\.expert_parallel = 2: splits the experts of backend 'fused'"),
    ("moe.expert_parallel=3", r"\[moe\]\.expert_parallel = 3: must be >= 1 and divide num_experts = 8"),
    ("train.activation_checkpointing=moe-gather", r"is the fused experts' own"),
    ("train.steps=0", r"\[train\]\.steps = 0: must be >= 1"),
    ("train.steps=ten", r"\[train\]\.steps must be of type int"),
    ("train.lr=-1.0", r"\[train\]\.lr = -1\.0: must be > 0"),
    ("train.micro_batches=3", r"\[train\]\.micro_batches = 3: must divide batch_size = 4"),
    ("train.activation_checkpointing=some", r"\[train\]\.activation_checkpointing"),
    ("model.preset=qwen4", r"\[model\]\.preset = 'qwen4' is unknown"),
    ("model.num_experts_per_tok=9", r"\[model\]\.num_experts_per_tok = 9: exceeds num_experts = 8"),
    ("steps=3", r"must look like section\.key=value"),
])
def test_bad_configs_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, override)


def test_missing_keys_and_bad_toml_are_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nhidden_size = 64\n'
                    '[train]\nseq_len = 8\nbatch_size = 1\nsteps = 1\n'
                    '[output]\ndir = "x"\n')
    with pytest.raises(ConfigError, match=r"missing key\(s\) \[model\]\.vocab_size.*preset"):
        load_config(path)
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match="c.toml is not valid TOML"):
        load_config(path)


def test_cli_reports_config_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", str(TINY), "--backend", "fast", "--set", f"output.dir={tmp_path}"])
    assert exit_info.value.code == 2
    assert "[moe].backend = 'fast'" in capsys.readouterr().err


def test_shipped_benchmark_config_is_qwen3_30b_shaped_and_fused():
    config = load_config(CONFIGS / "qwen3-30b-a3b-small.toml")
    shape = PRESETS["qwen3-30b-a3b"]
    model = config.model
    assert (model.hidden_size, model.moe_intermediate_size, model.num_experts, model.num_experts_per_tok) == (
        shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k)
    assert config.moe.backend == "fused"
    assert config.train.batch_size * config.train.seq_len == 16384


def test_bench_entry_point_records_every_backend(tmp_path):
    assert bench.main(["--config", str(TINY), *CPU, "--warmup", "1", "--warmup-seconds", "0", "--steps", "2",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "train_latest.json").read_text())
    assert {"gpu", "commit", "date", "records"} <= set(result)
    records = {r["backend"]: r for r in result["records"]}
    assert set(records) == {"fused", "grouped", "naive"}
    for backend in ("grouped", "naive"):
        assert records[backend]["skipped"] is None and records[backend]["step_ms"] > 0
    assert records["grouped"]["vs_grouped"] == 1.0
    assert "fused" in records["fused"]["skipped"]  # CUDA only: recorded with the reason


def test_bench_warms_up_for_warmup_seconds_as_well_as_warmup_steps(tmp_path):
    assert bench.main(["--config", str(TINY), *CPU, "--backends", "grouped", "--warmup", "1", "--warmup-seconds",
                       "0.5", "--steps", "1", "--out", str(tmp_path)]) == 0
    (record,) = json.loads((tmp_path / "train_latest.json").read_text())["records"]
    assert len(record["losses"]) == record["warmup_steps"] + 1
    assert record["warmup_steps"] > 1 or record["step_ms"] > 100  # by time: more than --warmup's 1 step


def test_parity_entry_point_compares_with_the_reference(tmp_path):
    code = parity.main(["--config", str(TINY), *CPU, "--steps", "3", "--backends", "grouped",
                        "--out", str(tmp_path), "--set", "train.seq_len=32", "--set", "train.batch_size=2"])
    result = json.loads((tmp_path / "train_parity_latest.json").read_text())
    assert [c["name"] for c in result["curves"]] == ["naive", "naive (perturbed init 1)", "naive (perturbed init 2)",
                                                      "grouped"]
    # The floor is the widest of the perturbed runs' gaps; the tolerance is measured from it.
    gaps = [n["mean_smoothed_rel_gap"] for n in result["noise_runs"]]
    assert len(gaps) == parity.NOISE_RUNS and result["noise_floor"]["mean_smoothed_rel_gap"] == max(gaps)
    [comparison] = result["comparisons"]
    assert comparison["backend"] == "grouped" and comparison["step1_rel_diff"] < parity.STEP1_TOLERANCE
    assert comparison["tolerance"] == max(parity.FLOOR_FACTOR * max(gaps), parity.MIN_TOLERANCE)
    assert code == (0 if comparison["within_tolerance"] else 1)
    assert (tmp_path / "train_parity_latest.png").read_bytes().startswith(b"\x89PNG")


def test_parity_rejects_no_noise_runs(tmp_path):
    with pytest.raises(SystemExit):
        parity.main(["--config", str(TINY), *CPU, "--noise-runs", "0", "--out", str(tmp_path)])


def test_bench_has_a_row_per_precision_and_skips_backends_without_one(tmp_path):
    assert bench.main(["--config", str(TINY), *CPU, "--backends", "grouped", "fused", "--precision", "bf16", "fp8",
                       "--warmup", "1", "--warmup-seconds", "0", "--steps", "1", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "train_latest.json").read_text())["records"]
    assert [(r["backend"], r["precision"]) for r in records] == [
        ("grouped", "bf16"), ("fused", "bf16"), ("grouped", "fp8"), ("fused", "fp8")]
    by_key = {(r["backend"], r["precision"]): r for r in records}
    assert by_key["grouped", "bf16"]["step_ms"] > 0 and by_key["grouped", "bf16"]["vs_grouped"] == 1.0
    assert by_key["grouped", "fp8"]["skipped"] == "precision 'fp8' runs on backend 'fused' only, not 'grouped'"
    assert by_key["grouped", "fp8"]["step_ms"] is None
    assert by_key["fused", "fp8"]["skipped"]  # CUDA only, recorded with the reason


def test_bench_and_parity_refuse_an_unknown_precision(tmp_path):
    for main in (bench.main, parity.main):
        with pytest.raises(SystemExit):
            main(["--config", str(TINY), *CPU, "--precision", "mxfp8", "--out", str(tmp_path)])


def test_parity_runs_each_precision_and_compares_fp8_with_bf16_fused_too():
    assert parity.runs(["grouped"], ["bf16"], "naive") == [("grouped", "bf16")]
    # fp8 needs the BF16 fused run as its second baseline: added when not asked for.
    assert parity.runs(["fused"], ["fp8", "fp8_bwd"], "naive") == [
        ("fused", "bf16"), ("fused", "fp8"), ("fused", "fp8_bwd")]
    assert parity.runs(["fused", "grouped"], ["bf16", "fp8"], "naive") == [
        ("fused", "bf16"), ("grouped", "bf16"), ("fused", "fp8"), ("grouped", "fp8")]
    assert parity.runs(["fused"], ["bf16", "fp8"], "fused") == [("fused", "fp8")]  # the reference is fused
    assert parity.run_name("fused", "fp8") == "fused/fp8" and parity.run_name("grouped", "bf16") == "grouped"


def test_parity_records_precisions_and_skips_what_has_no_path_at_one(tmp_path, monkeypatch):
    curves = {}

    def fake_curve(config, name, backend, perturbation=0, precision="bf16"):
        why = parity.backend_cannot_run(backend, precision)
        if why:
            return parity.Curve(name, [], skipped=why, precision=precision)
        # Every run learns alike, off by a little: within any tolerance.
        losses = [5.0 - 0.01 * step + 1e-4 * perturbation for step in range(3)]
        curves[name] = precision
        return parity.Curve(name, losses, precision=precision)

    monkeypatch.setattr(parity, "train_curve", fake_curve)
    code = parity.main(["--config", str(TINY), *CPU, "--steps", "3", "--backends", "grouped", "fused",
                        "--precision", "bf16", "fp8", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "train_parity_latest.json").read_text())
    assert result["precisions"] == ["bf16", "fp8"]
    assert curves == {"naive": "bf16", "naive (perturbed init 1)": "bf16", "naive (perturbed init 2)": "bf16",
                      "grouped": "bf16", "fused": "bf16", "fused/fp8": "fp8"}
    skipped = {c["name"]: c["skipped"] for c in result["curves"] if c["skipped"]}
    assert skipped == {"grouped/fp8": "precision 'fp8' runs on backend 'fused' only, not 'grouped'"}
    pairs = [(c["backend"], c["precision"], c["reference"]) for c in result["comparisons"]]
    assert pairs == [("grouped", "bf16", "naive"), ("fused", "bf16", "naive"), ("fused/fp8", "fp8", "naive"),
                     ("fused/fp8", "fp8", "fused")]
    assert all(c["within_tolerance"] for c in result["comparisons"]) and code == 0


@requires_cuda
def test_bench_profile_records_a_steps_kernels(tmp_path):
    assert bench.main(["--config", str(TINY), "--set", "train.device=cuda", "--backends", "fused", "--warmup", "1",
                       "--warmup-seconds", "0", "--steps", "1", "--profile", "--out", str(tmp_path)]) == 0
    (record,) = json.loads((tmp_path / "train_latest.json").read_text())["records"]
    profile = record["profile"]
    assert 0 < profile["kernel_ms"] and profile["idle_ms"] >= 0
    assert len(profile["kernels"]) == bench.PROFILED_KERNELS
    assert any("grouped_gemm_kernel" in k["name"] for k in profile["kernels"])  # the fused layer's GEMMs


def test_bench_profile_leaves_cpu_records_without_one(tmp_path):
    assert bench.main(["--config", str(TINY), *CPU, "--backends", "grouped", "--warmup", "0", "--warmup-seconds", "0",
                       "--steps", "1", "--profile", "--out", str(tmp_path)]) == 0
    (record,) = json.loads((tmp_path / "train_latest.json").read_text())["records"]
    assert record["step_ms"] > 0 and record["profile"] is None
