"""Smoke tests of `python -m megamoe.bench` on the CPU: it runs end to end and writes the JSON contract;
on a GPU every backend runs at every precision and setting it takes."""

import json
import time

import pytest
import torch

from megamoe.bench import backends, main, timing
from megamoe.bench.timing import SINGLE_CALLS, Budget, Device, mean_clock_and_power, measure
from megamoe.shapes import PRESETS

from conftest import requires_cuda

TOP_LEVEL_KEYS = {"gpu", "commit", "date", "peak_bf16_tflops", "peak_fp8_tflops", "torch", "command", "records"}
RECORD_KEYS = {"preset", "tokens", "routing", "backend", "precision", "fwd_ms", "fwdbwd_ms", "peak_mem_gb",
               "fwd_sm_mhz", "fwdbwd_sm_mhz", "fwd_single_ms", "fwdbwd_single_ms"}
# A short run of the tiny preset on any device; SMOKE: on the CPU.
SHORT_RUN = ["--preset", "tiny", "--tokens", "64", "--warmup", "1", "--warmup-seconds", "0", "--repeat", "1"]
SMOKE = ["--device", "cpu", *SHORT_RUN]


def read_results(out_dir):
    latest = json.loads((out_dir / "latest.json").read_text())
    dated = [p for p in out_dir.glob("*.json") if p.name != "latest.json"]
    assert len(dated) == 1 and dated[0].name == f"{latest['date'][:10]}_{latest['commit']}.json"
    assert json.loads(dated[0].read_text()) == latest
    assert TOP_LEVEL_KEYS <= latest.keys()
    for record in latest["records"]:
        assert RECORD_KEYS <= record.keys()
    return latest


def test_bench_times_backends_and_writes_the_json_contract(tmp_path):
    assert main([*SMOKE, "--backends", "naive", "grouped", "--out", str(tmp_path), "--plot"]) == 0
    result = read_results(tmp_path)
    assert result["peak_bf16_tflops"] > 0
    assert result["command"].startswith("python -m megamoe.bench --device cpu")
    records = {r["backend"]: r for r in result["records"]}
    assert sorted(records) == ["grouped", "naive"] and len(result["records"]) == 2
    for r in records.values():
        assert (r["preset"], r["tokens"], r["routing"], r["precision"]) == ("tiny", 64, "balanced", "bf16")
        assert r["skipped"] is None, r["skipped"]
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0
        assert r["fwd_single_ms"] > 0 and r["fwdbwd_single_ms"] > 0
        assert r["fwd_tflops"] > 0 and r["fwdbwd_tflops"] > 0
        assert r["routes"] == 64 * 2  # tiny: K = 2, nothing masked
        assert r["peak_mem_gb"] is None  # only measured on a GPU
        assert r["fwd_sm_mhz"] is None and r["fwdbwd_sm_mhz"] is None  # likewise the clock
        # At least x's activations are kept for the backward: 64 tokens x 256 hidden x 2 bytes.
        assert r["saved_gb"] >= 64 * 256 * 2 / 1e9
    assert records["grouped"]["fwd_vs_grouped"] == records["grouped"]["fwdbwd_vs_grouped"] == 1.0
    assert records["naive"]["fwd_vs_grouped"] > 0
    assert (tmp_path / "latest.png").stat().st_size > 0


def test_bench_with_main_grad_gives_the_weights_fp32_buffers_and_records_it(tmp_path, monkeypatch):
    """--main-grad: w13 and w2 get fp32 main_grad buffers (where the fused backward adds its weight
    gradients), and the JSON's settings say so."""
    from megamoe.bench import runner

    seen = []
    preset_inputs = runner._preset_inputs

    def recording(*args):
        x_all, w13, w2 = preset_inputs(*args)
        seen.extend(getattr(w, "main_grad", None) for w in (w13, w2))
        return x_all, w13, w2
    monkeypatch.setattr(runner, "_preset_inputs", recording)
    assert main([*SMOKE, "--backends", "grouped", "--modes", "fwdbwd", "--main-grad", "--out", str(tmp_path)]) == 0
    assert read_results(tmp_path)["settings"]["main_grad"] is True
    tiny = PRESETS["tiny"]
    shapes = ((tiny.num_experts, 2 * tiny.intermediate_size, tiny.hidden_size),
              (tiny.num_experts, tiny.hidden_size, tiny.intermediate_size))
    assert [(g.dtype, tuple(g.shape)) for g in seen] == [(torch.float32, shape) for shape in shapes]


def test_bench_with_int64_ids_times_them_and_records_it(tmp_path, monkeypatch):
    """--ids int64: the backends get topk_ids as torch.topk gives them, and the JSON's settings say so."""
    from megamoe.bench import runner

    seen = []
    operand_sets = runner._operand_sets

    def recording(*args):
        sets = operand_sets(*args)
        seen.extend(s.topk_ids.dtype for s in sets)
        return sets
    monkeypatch.setattr(runner, "_operand_sets", recording)
    assert main([*SMOKE, "--backends", "grouped", "--modes", "fwd", "--ids", "int64", "--out", str(tmp_path)]) == 0
    assert read_results(tmp_path)["settings"]["ids"] == "int64"
    assert seen and set(seen) == {torch.int64}


class FakeClock:
    """time.perf_counter for megamoe.bench.timing on the CPU: calls advance it by what they say they
    take, so the warm-up and repeat counts do not depend on how busy the machine is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


STEP = 2 ** -8  # seconds per call: warm-up times below are whole numbers of it, exactly


def _count_calls(clock, seconds=STEP):
    calls = []

    def run(i):
        calls.append(i)
        clock.now += seconds(i) if callable(seconds) else seconds
    return calls, run


def test_warm_up_lasts_warmup_seconds_so_the_timed_runs_see_the_sustained_clock(clock):
    calls, run = _count_calls(clock)
    result = measure(run, lambda: None, Device(torch.device("cpu")),
                     Budget(warmup=2, repeat=4, seconds=1.0, warmup_seconds=0.25))
    assert result.repeats == 4
    warm_ups = len(calls) - 2 * 4  # the timed calls, then as many timed one at a time
    assert warm_ups == 1 + 0.25 / STEP  # by time (after the first call), not by --warmup's 2


def test_a_devices_first_sustained_warm_up_lasts_until_the_power_settles(clock):
    device = Device(torch.device("cpu"))
    device.settle_seconds = 0.5  # a GPU's FIRST_LOAD_WARMUP_S, shortened
    budget = Budget(warmup=2, repeat=1, seconds=1.0, warmup_seconds=0.125)
    warm_ups = []
    for _ in range(2):
        calls, run = _count_calls(clock)
        measure(run, lambda: None, device, budget)
        warm_ups.append(len(calls) - 2)
    assert warm_ups == [1 + 0.5 / STEP, 1 + 0.125 / STEP]


def test_calls_are_also_timed_one_at_a_time_after_the_timed_run(clock):
    calls, run = _count_calls(clock)
    result = measure(run, lambda: None, Device(torch.device("cpu")),
                     Budget(warmup=1, repeat=50, seconds=0.5, warmup_seconds=0.0))
    assert len(calls) == 1 + result.repeats + SINGLE_CALLS
    assert result.single_call_ms == STEP * 1e3


def test_clock_samples_are_averaged_and_what_is_not_a_number_is_left_out():
    assert mean_clock_and_power("1500, 690.5\n1400, 700.5\n[N/A], [N/A]\n14") == (1450.0, 695.5)
    assert mean_clock_and_power("") == (None, None)


def test_the_first_warm_up_which_may_compile_does_not_count_as_warming_the_gpu(clock):
    # a first call that compiles, with the GPU idle
    calls, run = _count_calls(clock, lambda i: 0.5 if i == 0 else STEP)
    measure(run, lambda: None, Device(torch.device("cpu")), Budget(warmup=2, repeat=1, seconds=1.0,
                                                                   warmup_seconds=0.125))
    assert len(calls) - 2 == 1 + 0.125 / STEP


def test_a_slow_backend_stops_warming_up_after_two_runs(clock):
    calls, run = _count_calls(clock, 0.25)
    result = measure(run, lambda: None, Device(torch.device("cpu")),
                     Budget(warmup=5, repeat=100, seconds=0.5, warmup_seconds=0.25))
    assert len(calls) - 2 * result.repeats == 2 and result.repeats == 3  # MIN_REPEATS, each also alone


def test_bench_records_a_backend_that_cannot_run_as_skipped(tmp_path):
    args = [*SMOKE, "--backends", "hf-grouped_mm", "--precision", "fp8", "--modes", "fwd"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    (record,) = read_results(tmp_path)["records"]
    assert record["skipped"] and record["fwd_ms"] is None and record["fwdbwd_ms"] is None
    assert record["precision"] == "fp8"


@pytest.mark.parametrize("backend", backends.GRAPHED_BACKENDS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_graphed_runs_on_a_gpu_only(precision, backend):
    with pytest.raises(backends.Unavailable, match="CUDA graphs"):
        backends.build(backend, PRESETS["tiny"], precision, torch.device("cpu"))


def test_bench_records_out_of_memory_and_carries_on(tmp_path, monkeypatch):
    build = backends.build

    def build_or_fail(name, shape, precision, device=None):
        if name == "naive":
            def out_of_memory(*args):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 GiB.\nmore")
            return out_of_memory
        return build(name, shape, precision, device)

    monkeypatch.setattr(backends, "build", build_or_fail)
    assert main([*SMOKE, "--backends", "naive", "grouped", "--out", str(tmp_path)]) == 0
    records = {r["backend"]: r for r in read_results(tmp_path)["records"]}
    assert records["naive"]["skipped"].startswith("out of memory (CUDA out of memory.")
    assert records["naive"]["fwd_ms"] is None and records["naive"]["fwdbwd_ms"] is None
    assert records["grouped"]["skipped"] is None and records["grouped"]["fwdbwd_ms"] > 0


def test_profile_charges_idle_time_to_the_kernels_around_it():
    from types import SimpleNamespace

    from megamoe.bench.profile import idle_gaps

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    # b overlaps a and ends first: the gap after it starts where a ends, and is charged to a → c.
    events = [kernel("a", 0, 10), kernel("b", 2, 5), kernel("c", 14, 20), kernel("a", 20, 30),
              kernel("c", 36, 40)]
    assert idle_gaps(events, iterations=2) == {("a", "c"): 5.0}


def test_profile_drops_the_first_profiled_call():
    from types import SimpleNamespace

    from megamoe.bench.profile import last_iterations

    events = [SimpleNamespace(name=name, call=call) for call in range(3) for name in ("routing", "gemm")]
    assert [(e.name, e.call) for e in last_iterations(events, iterations=2)] == [
        ("routing", 1), ("gemm", 1), ("routing", 2), ("gemm", 2)]
    with pytest.raises(RuntimeError, match="did not launch the same sequence"):
        last_iterations(events[:-1], iterations=2)


def test_bench_on_the_cpu_defaults_to_a_smoke_run_of_the_tiny_preset():
    from megamoe.bench.cli import parse_args

    args = parse_args(["--device", "cpu"])
    assert args.preset == ["tiny"] and max(args.tokens) <= 1024
    assert args.budget <= 0.5 and args.warmup_seconds == 0
    explicit = parse_args(["--device", "cpu", "--preset", "qwen3-30b-a3b", "--tokens", "8", "--budget", "3"])
    assert explicit.preset == ["qwen3-30b-a3b"] and explicit.tokens == [8] and explicit.budget == 3


def test_bench_on_the_cpu_with_its_defaults_finishes_in_about_a_minute(tmp_path):
    start = time.perf_counter()
    assert main(["--device", "cpu", "--backends", "naive", "grouped", "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - start < 180  # about a minute, with room for a busy machine
    assert {r["preset"] for r in read_results(tmp_path)["records"]} == {"tiny"}


def test_bench_writes_under_the_current_directory_not_the_repositorys_records(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*SMOKE, "--backends", "naive", "--modes", "fwd"]) == 0
    read_results(tmp_path / "runs" / "bench")
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("module", ["megamoe.bench.cli", "megamoe.bench.gemm", "megamoe.bench.ep",
                                    "megamoe.bench.profile", "megamoe.train.bench", "megamoe.train.parity",
                                    "megamoe.train.torchtitan"])
def test_every_entry_point_defaults_its_output_to_runs_bench(module, capsys):
    import importlib

    if module.startswith("megamoe.train"):
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "default: runs/bench" in text and "--out bench/results" in text  # the records: on purpose only


def test_bench_at_fp8_records_what_has_no_fp8_path_as_skipped_with_the_reason(tmp_path):
    args = [*SMOKE, "--backends", "fused", "grouped", "grouped-fp8", "--precision", "bf16", "fp8"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    records = {(r["backend"], r["precision"]): r for r in read_results(tmp_path)["records"]}
    assert set(records) == {(b, p) for b in ("fused", "grouped", "grouped-fp8") for p in ("bf16", "fp8")}
    assert records["grouped", "bf16"]["skipped"] is None and records["grouped", "bf16"]["fwd_ms"] > 0
    assert records["grouped", "fp8"]["skipped"].startswith("grouped runs bf16 only")
    assert "--precision fp8" in records["grouped-fp8", "bf16"]["skipped"]
    assert "sm_90" in records["grouped-fp8", "fp8"]["skipped"]  # a CPU run
    assert records["fused", "fp8"]["skipped"]  # no CUDA tensors here
    for r in records.values():
        assert r["skipped"] or r["precision"] == "bf16"


@requires_cuda
@pytest.mark.parametrize("settings", [[], ["--main-grad", "--ids", "int64"]], ids=["defaults", "main_grad-int64"])
def test_every_backend_times_both_modes_at_every_precision_it_takes(tmp_path, settings):
    """What the benchmark records on a GPU for each backend and precision: both modes timed, or skipped
    only where the backend does not take that precision (backends.build says so), with fp32 main_grad
    weights and int64 ids as well (graph capture once failed there). grouped-compiled is left out: its
    compiles take minutes, and test_backends covers it."""
    names = [b for b in backends.BACKENDS if b != "grouped-compiled"]
    precisions = ["bf16", "fp8", "fp8_bwd"]
    args = [*SHORT_RUN, "--budget", "0", "--backends", *names, "--precision", *precisions, *settings]
    assert main([*args, "--out", str(tmp_path)]) == 0
    records = read_results(tmp_path)["records"]
    assert sorted((r["backend"], r["precision"]) for r in records) == sorted(
        (b, p) for b in names for p in precisions)
    for r in records:
        try:
            backends.build(r["backend"], PRESETS["tiny"], r["precision"])
        except backends.Unavailable as why:
            assert r["skipped"] == str(why)
            continue
        assert r["skipped"] is None, (r["backend"], r["precision"], r["skipped"])
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0, (r["backend"], r["precision"])


def test_fp8_records_are_compared_with_grouped_fp8_where_it_ran():
    from megamoe.bench.record import Record, fill_derived
    records = [Record("tiny", 64, "balanced", backend, precision, fwd_ms=ms, routes=128)
               for backend, precision, ms in (("grouped", "bf16", 4.0), ("grouped-fp8", "fp8", 2.0),
                                              ("fused", "fp8", 0.5), ("fused", "bf16", 1.0))]
    fill_derived(records, peak_bf16_tflops=1.0)
    ratios = {(r.backend, r.precision): (r.fwd_vs_grouped, r.grouped_baseline) for r in records}
    assert ratios["fused", "fp8"] == (4.0, "grouped-fp8/fp8")
    assert ratios["grouped-fp8", "fp8"] == (1.0, "grouped-fp8/fp8")
    assert ratios["fused", "bf16"] == (4.0, "grouped/bf16")
    fill_derived(records[:1] + records[2:3], peak_bf16_tflops=1.0)  # no grouped-fp8: the bf16 baseline
    assert (records[2].fwd_vs_grouped, records[2].grouped_baseline) == (8.0, "grouped/bf16")
