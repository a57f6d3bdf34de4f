"""`python -m megamoe.train.torchtitan` end to end on a one-layer TorchTitan debug MoE model on the CPU
(megamoe through its grouped baseline): both modes run, time or compare what they should and write
their JSON. Skipped without torchtitan 0.2; the timed GPU runs are the module's own job."""

import copy
import importlib.util
import json

import pytest
import torch

pytest.importorskip("torchtitan.models.moe.moe")

from megamoe.train import torchtitan as harness  # noqa: E402

TINY = ["--flavor", "debugmodel_moe", "--layers", "1", "--seq-len", "64", "--backend", "grouped", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _small_debug_model_on_cpu(monkeypatch):
    """TorchTitan 0.2 counts tokens per expert with torch.histc, which has no CPU kernel for int64; and
    its CPU experts loop over E expert weights, each selection's backward a full-size gradient: 8
    small experts instead of the debug model's 64 keep the runs short."""
    from torchtitan.models.qwen3 import qwen3_args

    monkeypatch.setattr(torch, "histc", lambda ids, bins, min, max: torch.bincount(ids, minlength=bins))
    small = copy.deepcopy(qwen3_args["debugmodel_moe"])
    small.moe_args.num_experts, small.moe_inter_dim = 8, 128
    monkeypatch.setitem(qwen3_args, "debugmodel_moe", small)


def test_bench_times_each_variant(tmp_path):
    assert harness.main(["bench", *TINY, "--variants", "native", "megamoe", "native-fp8", "--steps", "2",
                         "--warmup", "1", "--warmup-seconds", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "torchtitan_bench_latest.json").read_text())
    records = {r["variant"]: r for r in result["records"]}
    assert records["native"]["vs_native"] == 1.0 and records["megamoe"]["step_ms"] > 0
    assert "CUDA GPU" in records["native-fp8"]["skipped"]
    assert result["setting"]["activation_checkpoint"] == "full"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "torchtitan_bench_latest.png").exists() == has_matplotlib
    # Both start from the same weights and data: their first losses agree.
    assert records["megamoe"]["losses"][0] == pytest.approx(records["native"]["losses"][0], rel=1e-3)


def test_parity_compares_with_a_measured_noise_floor(tmp_path):
    assert harness.main(["parity", *TINY, "--steps", "12", "--noise-runs", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "torchtitan_parity_latest.json").read_text())
    assert [c["name"] for c in result["curves"]] == ["native", "native (perturbed init 1)", "megamoe"]
    assert result["comparisons"][0]["within_tolerance"]


def test_compile_applies_torchtitans_per_block_compile():
    setting = harness.Setting("debugmodel_moe", 2, 64, 1, "full", True, "grouped")
    model = harness.build_model(setting, "megamoe", torch.device("cpu"), seed=0)
    assert any(type(m) is torch._dynamo.eval_frame.OptimizedModule for m in model.modules())
