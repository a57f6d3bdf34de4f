"""megamoe.moe(..., group=g): expert parallelism over a torch.distributed process group. The GPU
tests run W processes, on one GPU (gloo group) and, where there are several, one per GPU (NCCL
group, peer access between the GPUs); every rank's output and gradients must equal, bit for bit,
the single-rank fused layer on the whole problem."""

import argparse
import functools
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe
from conftest import requires_cuda
from megamoe.expert_parallel_group import _workspace
from megamoe.reference import relative_error
from test_backends import TESTED_ACTIVATIONS
from test_expert_parallel import _problem, _sm90


def _init(rank: int, world: int, store: str, backend: str = "gloo") -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _layer_matches_one_rank(rank, world, store, tokens_per_rank, cases, one_gpu_per_rank=False,
                            current_elsewhere=False):
    """Each case (activation, precision, recompute, compiled) in turn over one process group: one
    process start per rank for all of them, which takes longer than the cases. current_elsewhere:
    each rank's tensors on its GPU while another GPU is the current one."""
    _init(rank, world, store, "nccl" if one_gpu_per_rank else "gloo")
    device = rank if one_gpu_per_rank else 0
    torch.cuda.set_device((device + 1) % torch.cuda.device_count() if current_elsewhere else device)
    for case in cases:
        _case_matches_one_rank(rank, tokens_per_rank, f"cuda:{device}", *case)
    dist.barrier()
    dist.destroy_process_group()


def _case_matches_one_rank(rank, tokens_per_rank, device, activation, precision, recompute, compiled):
    """This rank's output and gradients, bit for bit those of the single-rank layer on the whole problem."""
    torch.manual_seed(0)  # the same problem in every process
    xs, ids, weights, w13s, w2s, whole = _problem(tokens_per_rank, 8, device)
    dy = torch.randn_like(whole[0])
    layer = functools.partial(megamoe.moe, group=dist.group.WORLD, activation=activation, precision=precision,
                              recompute=recompute)
    if compiled:
        layer = torch.compile(layer, fullgraph=True)
    for _ in range(2):  # the second call reuses the shared buffers and the barrier's epochs
        x, w, w13, w2 = (_leaf(t) for t in (xs[rank], weights[rank], w13s[rank], w2s[rank]))
        y = layer(x, ids[rank], w, w13, w2)
        y.backward(dy.split(tokens_per_rank)[rank])

    x1, w1, w131, w21 = (_leaf(t) for t in (whole[0], whole[2], whole[3], whole[4]))
    y1 = megamoe.moe(x1, whole[1], w1, w131, w21, recompute=True, activation=activation, precision=precision)
    y1.backward(dy)
    tokens = slice(sum(tokens_per_rank[:rank]), sum(tokens_per_rank[:rank + 1]))
    experts = slice(rank * w13.shape[0], (rank + 1) * w13.shape[0])
    case = f"{activation}, {precision}, recompute={recompute!r}{', compiled' if compiled else ''}"
    for name, got, expected in (("y", y, y1[tokens]), ("dx", x.grad, x1.grad[tokens]),
                                ("d topk_weights", w.grad, w1.grad[tokens]),
                                ("dw13", w13.grad, w131.grad[experts]), ("dw2", w2.grad, w21.grad[experts])):
        assert torch.equal(got, expected), f"rank {rank} ({case}): {name} differs from the single-rank layer"


def _moe_layer_matches_one_rank(rank, world, store, tokens_per_rank, cases):
    """Each case (precision, shared_gate) in turn over one process group (_layer_matches_one_rank)."""
    _init(rank, world, store)
    torch.cuda.set_device(0)
    for precision, shared_gate in cases:
        _moe_layer_case_matches_one_rank(rank, world, tokens_per_rank, precision, shared_gate)
    dist.barrier()
    dist.destroy_process_group()


def _moe_layer_case_matches_one_rank(rank, world, tokens_per_rank, precision, shared_gate):
    """MoELayer over the group, with a shared expert (replicated, run on the rank's own tokens), against
    the one-rank layer holding every expert and the shared slices, with the same parameters."""
    torch.manual_seed(0)  # the same parameters and tokens in every process
    options = dict(hidden_size=256, moe_intermediate_size=128, num_experts=8, top_k=2, precision=precision,
                   shared_expert_intermediate_size=256, shared_expert_gate=shared_gate, device="cuda")
    whole = megamoe.MoELayer(**options)
    layer = megamoe.MoELayer(**options, group=dist.group.WORLD)
    local = 8 // world
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name in ("shared_w13", "shared_w2"):
                source = whole.get_parameter(name.removeprefix("shared_"))[8:]
            elif name in ("w13", "w2"):
                source = whole.get_parameter(name)[rank * local:(rank + 1) * local]
            else:
                source = whole.get_parameter(name)
            param.copy_(source)
    x1 = torch.randn(sum(tokens_per_rank), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x1)
    y1, _ = whole(x1)
    y1.backward(dy)
    tokens = slice(sum(tokens_per_rank[:rank]), sum(tokens_per_rank[:rank + 1]))
    x = _leaf(x1[tokens])
    y, _ = layer(x)
    y.backward(dy[tokens])

    def summed(t):  # a replicated parameter's gradient from every rank's tokens
        t = t.cpu().float()
        dist.all_reduce(t)
        return t

    pairs = [("y", y, y1[tokens]), ("dx", x.grad, x1.grad[tokens]),
             ("dw13", layer.w13.grad, whole.w13.grad[rank * local:(rank + 1) * local]),
             ("dw2", layer.w2.grad, whole.w2.grad[rank * local:(rank + 1) * local]),
             ("d shared_w13", summed(layer.shared_w13.grad), whole.w13.grad[8:]),
             ("d shared_w2", summed(layer.shared_w2.grad), whole.w2.grad[8:]),
             ("d gate", summed(layer.gate.weight.grad), whole.gate.weight.grad)]
    if shared_gate:
        pairs.append(("d shared_expert_gate", summed(layer.shared_expert_gate.weight.grad),
                      whole.shared_expert_gate.weight.grad))
    # One rank adds the shared slices in its experts' fp32 combine, a group adds two bf16 outputs; in FP8
    # the shared slices' weight gradients also quantise other 128-token blocks (each rank's own tokens).
    tolerance = 1e-2 if precision == "bf16" else 5e-2
    for name, got, expected in pairs:
        error = relative_error(got.float().cpu(), expected.float().cpu())
        assert error < tolerance, (f"rank {rank} ({precision}, shared_gate={shared_gate}): {name} is {error:.2e} "
                                   "from the one-rank layer")


def _peer_skips_backward(rank, world, store):
    os.environ["MEGAMOE_EP_TIMEOUT_S"] = "2"
    _init(rank, world, store)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    xs, ids, weights, w13s, w2s, _ = _problem([64, 64], 8, "cuda")
    x = _leaf(xs[rank])
    y = megamoe.moe(x, ids[rank], weights[rank], w13s[rank], w2s[rank], group=dist.group.WORLD)
    if rank == 0:
        with pytest.raises(TimeoutError, match="rank 1 did not arrive"):
            y.sum().backward()
    dist.barrier()  # rank 1 keeps its memory mapped until rank 0 is done with it
    dist.destroy_process_group()


def _late_at_barrier_2(rank, world, store):
    """Rank 1 reaches barrier 2 after rank 0's wait there timed out (2 s), but in time for the next
    barrier 1: rank 0 hears of it at that next call's check (the status is read behind barrier 1)."""
    os.environ["MEGAMOE_EP_TIMEOUT_S"] = "2"
    _init(rank, world, store)
    torch.cuda.set_device(0)
    ws = _workspace(dist.group.WORLD, torch.device("cuda", 0))
    ws.barrier(1)
    ws.read_status()
    ws.raise_if_timed_out()
    if rank == 1:
        torch.cuda.synchronize()
        time.sleep(3)
    ws.barrier(2)
    ws.barrier(1)
    ws.read_status()
    if rank == 0:
        with pytest.raises(TimeoutError, match="combine .*phase 2 and rank 1 did not arrive"):
            ws.raise_if_timed_out()
    else:
        ws.raise_if_timed_out()
    dist.barrier()
    dist.destroy_process_group()


def _spawn(fn, world, tmp_path, *args):
    mp.spawn(fn, args=(world, str(tmp_path / "store"), *args), nprocs=world, join=True)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
# K = 4: two ranks copy their peer's rows whole before the pull, four pull them in place.
@pytest.mark.parametrize("tokens_per_rank", [[300, 200], [257, 0], [100, 0, 64, 1]])
def test_group_equals_one_rank_bitwise(tmp_path, tokens_per_rank):
    cases = [(activation, "bf16", False, False) for activation in TESTED_ACTIVATIONS]
    _spawn(_layer_matches_one_rank, len(tokens_per_rank), tmp_path, tokens_per_rank, cases)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.parametrize("tokens_per_rank", [[300, 200], [100, 0, 64, 1]])
def test_group_in_fp8_equals_one_rank_bitwise(tmp_path, tokens_per_rank):
    """Block FP8 over the group: e4m3 rows and their scales travel, the owners run the FP8 kernels."""
    cases = [("swiglu", precision, False, False) for precision in ("fp8", "fp8_bwd")]
    _spawn(_layer_matches_one_rank, len(tokens_per_rank), tmp_path, tokens_per_rank, cases)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.parametrize("tokens_per_rank", [[300, 200], [100, 0, 64, 1]])
def test_group_with_recompute_equals_one_rank_bitwise(tmp_path, tokens_per_rank):
    """recompute=True over the group: only the inputs kept, x pulled again beside dy in the backward;
    "gather": the owners keep z too, and do not recompute it."""
    cases = [("swiglu", precision, recompute, False) for precision, recompute in (
        ("bf16", True), ("fp8", True), ("bf16", "gather"), ("fp8", "gather"), ("fp8_bwd", "gather"))]
    _spawn(_layer_matches_one_rank, len(tokens_per_rank), tmp_path, tokens_per_rank, cases)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
def test_group_under_torch_compile_equals_one_rank_bitwise(tmp_path):
    cases = [("swiglu", precision, recompute, True)
             for precision, recompute in (("bf16", False), ("fp8", True), ("fp8_bwd", "gather"))]
    _spawn(_layer_matches_one_rank, 2, tmp_path, [300, 200], cases)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("current_elsewhere", [False, True])
def test_group_across_gpus_equals_one_rank_bitwise(tmp_path, current_elsewhere):
    _spawn(_layer_matches_one_rank, 2, tmp_path, [300, 200], [("swiglu", "bf16", False, False)], True,
           current_elsewhere)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
def test_moe_layer_with_shared_expert_over_a_group_matches_one_rank(tmp_path):
    _spawn(_moe_layer_matches_one_rank, 2, tmp_path, [300, 200], [("bf16", True), ("fp8", False)])


def test_moe_layer_over_a_group_replicates_its_shared_expert(world_of_one):
    """With a group, the shared slices are parameters of their own (replicated), not experts of w13 / w2."""
    layer = megamoe.MoELayer(64, 32, num_experts=4, top_k=2, group=world_of_one, shared_expert_intermediate_size=64)
    assert layer.w13.shape == (4, 64, 64) and layer.shared_w13.shape == (2, 64, 64)
    assert layer.shared_w2.shape == (2, 64, 32)
    gate_proj, up_proj, down_proj = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)
    layer.load_shared_expert(*(t.bfloat16() for t in (gate_proj, up_proj, down_proj)))
    assert torch.equal(layer.shared_w13[1, :32], gate_proj[32:].bfloat16())
    assert torch.equal(layer.shared_w2[1], down_proj[:, 32:].bfloat16())


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
def test_rank_that_skips_the_backward_times_out_its_peer(tmp_path):
    _spawn(_peer_skips_backward, 2, tmp_path)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="megamoe's kernels need sm_90")
def test_timeout_at_barrier_2_raises_at_the_next_call(tmp_path):
    _spawn(_late_at_barrier_2, 2, tmp_path)


@pytest.fixture
def world_of_one(tmp_path):
    _init(0, 1, str(tmp_path / "store"))
    yield dist.group.WORLD
    dist.destroy_process_group()


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.parametrize("bad_id", [4, 2**32 + 1])
def test_group_raises_for_ids_out_of_range(world_of_one, bad_id):
    xs, ids, weights, w13s, w2s, _ = _problem([8], 4, "cuda")
    ids = ids[0].to(torch.int64)
    ids[3, 1] = bad_id
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, 4\) \(-1 = masked route\), got 1 ids outside"):
        megamoe.moe(xs[0], ids, weights[0], w13s[0], w2s[0], group=world_of_one)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"backend": "grouped"}, NotImplementedError, "over a process group runs backend='fused'"),
    ({}, ValueError, "runs on CUDA tensors"),
])
def test_group_rejects_what_it_does_not_run(world_of_one, kwargs, error, match):
    xs, ids, weights, w13s, w2s, _ = _problem([8], 4, "cpu")
    with pytest.raises(error, match=match):
        megamoe.moe(xs[0], ids[0], weights[0], w13s[0], w2s[0], group=world_of_one, **kwargs)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
def test_ep_bench_runs_on_one_gpu(tmp_path):
    from megamoe.bench import ep
    assert ep.main(["--preset", "tiny", "--tokens", "256", "--one-gpu", "--warmup", "1", "--repeat", "2",
                    "--warmup-seconds", "0", "--budget", "0.1", "--precision", "fp8_bwd", "--recompute", "gather",
                    "true", "--out", str(tmp_path)]) == 0
    gather, inputs_only = json.loads((tmp_path / "ep_latest.json").read_text())["records"]
    for record in (gather, inputs_only):
        assert record["world"] == 2 and record["precision"] == "fp8_bwd"
        assert all(record[k] > 0 for k in ("fwd_ms", "fwdbwd_ms", "one_gpu_fwd_ms", "one_gpu_fwdbwd_ms",
                                           "local_fwd_ms", "local_fwdbwd_ms", "saved_gb", "one_gpu_saved_gb"))
        assert record["exposed_fwd"] == 1 - record["local_fwd_ms"] / record["fwd_ms"]
    assert (gather["recompute"], inputs_only["recompute"]) == ("gather", "true")
    for kept in ("one_gpu_saved_gb", "saved_gb"):  # "gather" keeps z beside x
        assert inputs_only[kept] < gather[kept]


def test_ep_bench_checks_its_world_before_starting(tmp_path):
    from megamoe.bench import ep
    with pytest.raises(SystemExit):
        ep.main(["--preset", "tiny", "--world", "64", "--out", str(tmp_path)])


def test_ep_bench_ranks_derive_the_same_iteration_counts_from_the_slowest_probe(tmp_path):
    """The counts fill --warmup-seconds (the first: 4 s) and --budget at the all-reduced (slowest) probe time."""
    from megamoe.bench import ep
    args = argparse.Namespace(one_gpu=True, warmup=3, warmup_seconds=1.0, repeat=10000, budget=2.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        device = ep.Device(torch.device("cpu"))
        device.settle_seconds = 4.0  # a GPU's FIRST_LOAD_WARMUP_S
        budget = ep._agreed_budget(args, device)
        assert budget(10.0).warmup == 400  # the first warm-up: FIRST_LOAD_WARMUP_S (4 s)
        assert (budget(10.0).warmup, budget(10.0).repeat) == (100, 200)
        assert (budget(1000.0).warmup, budget(1000.0).repeat) == (3, 3)  # the floors: --warmup, MIN_REPEATS
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision,recompute", [("bf16", False), ("bf16", True), ("fp8", False), ("fp8_bwd", True),
                                                ("fp8", "gather")])
def test_group_traces_whole_under_torch_compile(world_of_one, monkeypatch, precision, recompute):
    """torch.compile(fullgraph=True) of a layer with group= traces into one graph holding one forward
    and one backward op (through their fake implementations). Tracing only: the backend stops before
    anything runs, and the fused path's device checks are lifted, since no kernel is reached."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._functorch.partitioners import default_partition

    class Traced(Exception):
        pass

    monkeypatch.setattr(megamoe.functional, "check_fused_support", lambda *args: None)
    traced = {}

    def partition(joint, *args, **kwargs):
        forward, backward = default_partition(joint, *args, **kwargs)
        traced["joint"] = str(joint.graph)
        (outputs,) = [n.args[0] for n in backward.graph.nodes if n.op == "output"]
        traced["grads"] = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in outputs if n is not None]
        return forward, backward

    def stop(*args):
        raise Traced

    torch._dynamo.reset()
    layer = torch.compile(functools.partial(megamoe.moe, group=world_of_one, precision=precision,
                                            recompute=recompute),
                          backend=aot_autograd(fw_compiler=stop, partition_fn=partition), fullgraph=True)
    xs, ids, weights, w13s, w2s, _ = _problem([64], 8, "cpu")
    inputs = [_leaf(t) for t in (xs[0], weights[0], w13s[0], w2s[0])]
    with pytest.raises(BackendCompilerFailed) as failed:
        layer(inputs[0], ids[0], *inputs[1:])
    assert isinstance(failed.value.inner_exception, Traced)
    assert "megamoe.group_moe_forward" in traced["joint"] and "megamoe.group_moe_backward" in traced["joint"]
    assert traced["grads"] == [(tuple(t.shape), t.dtype) for t in inputs]
