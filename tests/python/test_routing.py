"""The routing plan through the Python API: host reference invariants, and GPU == host."""

import pytest
import torch

import megamoe
from megamoe.routing import PLAN_FIELDS, build_routing

from conftest import requires_cuda


def check_plan(plan, ids, num_experts, expert_begin=0):
    num_local = plan.expert_counts.numel()
    local = ids.long().flatten() - expert_begin
    is_local = (local >= 0) & (local < num_local)
    counts = torch.bincount(local[is_local], minlength=num_local)
    assert torch.equal(plan.expert_counts.long(), counts)
    padded = (counts + 127) // 128 * 128
    assert torch.equal(plan.expert_offsets.long(), torch.cat([torch.zeros(1), padded.cumsum(0)]).long())
    assert torch.equal(plan.compact_offsets.long(), torch.cat([torch.zeros(1), counts.cumsum(0)]).long())
    slots = plan.route_to_slot.flatten().long()
    assert torch.all(slots[~is_local] == -1)
    assert torch.equal(plan.slot_to_route[slots[is_local]].long(), is_local.nonzero().flatten())
    blocks = int(plan.num_blocks)
    assert blocks * 128 == int(plan.expert_offsets[-1])
    block_rows = torch.arange(blocks) * 128
    assert torch.equal(plan.block_expert[:blocks].long(),
                       torch.searchsorted(plan.expert_offsets.long(), block_rows, right=True) - 1)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("tokens", [0, 1, 333, 4096])
def test_host_plan(routing, tokens):
    ids, _ = megamoe.make_routing(tokens, 64, 6, routing)
    ids[::5, 1] = -1
    check_plan(build_routing(ids, 64), ids, 64)


@pytest.mark.parametrize("experts, top_k", [(1024, 16), (512, 10)])
def test_host_plan_for_many_experts_and_routes(experts, top_k):
    ids, _ = megamoe.make_routing(2000, experts, top_k, "skewed")
    ids[::3, top_k - 1] = -1
    check_plan(build_routing(ids, experts), ids, experts)


def test_host_plan_for_a_slice_of_experts():
    ids, _ = megamoe.make_routing(1000, 32, 4)
    plan = build_routing(ids, 32, expert_begin=8, num_local_experts=8)
    check_plan(plan, ids, 32, expert_begin=8)


def test_invalid_ids_are_counted_and_dropped_from_the_plan():
    ids = torch.tensor([[0, 9], [-3, 1]], dtype=torch.int32)
    plan = build_routing(ids, 4)
    assert int(plan.num_invalid) == 2
    assert plan.route_to_slot.tolist() == [[0, -1], [-1, 128]]


FAR_INT64_IDS = [[0, 2**32 + 1], [-2**32 + 1, 3], [-1, 2**40], [2**63 - 1, -2**63]]  # 2**32 + 1 wraps onto 1


def test_int64_ids_beyond_int32_stay_invalid():
    """The plan reads int64 ids as they are: one that a cast to int32 would wrap onto an expert is
    counted as outside [-1, E), and the plan is that of int32 ids with an invalid id in its place."""
    ids = torch.tensor(FAR_INT64_IDS, dtype=torch.int64)
    plan = build_routing(ids, 4)
    assert int(plan.num_invalid) == 5
    assert plan.route_to_slot.tolist() == [[0, -1], [-1, 128], [-1, -1], [-1, -1]]
    as_int32 = torch.tensor([[0, 9], [-9, 3], [-1, 9], [9, -9]], dtype=torch.int32)
    assert torch.equal(build_routing(as_int32, 4).buffer, plan.buffer)


@requires_cuda
@pytest.mark.parametrize("tokens", [3, 9000])  # built by one cluster, and by three passes
def test_cuda_plan_of_int64_ids_equals_host_plan(tokens):
    ids, _ = megamoe.make_routing(tokens, 128, 8, "skewed")
    ids = ids.long()
    ids[:len(FAR_INT64_IDS), :2] = torch.tensor(FAR_INT64_IDS)[:tokens]
    host = build_routing(ids, 128)
    device = build_routing(ids.cuda(), 128)
    assert torch.equal(device.buffer.cpu(), host.buffer)
    assert torch.equal(host.buffer, build_routing(ids.clamp(-2, 128).int(), 128).buffer)
    torch.cuda.synchronize()
    assert device.num_invalid_host.value == int(host.num_invalid) == int(((ids < -1) | (ids >= 128)).sum())


def test_bad_plan_arguments_raise():
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must lie inside \[0, 4\)"):
        build_routing(ids, 4, expert_begin=2, num_local_experts=4)
    with pytest.raises(ValueError, match="contiguous int32 or int64"):
        build_routing(ids.short(), 4)
    with pytest.raises(ValueError, match="contiguous int32 or int64"):
        build_routing(ids.long().t(), 4)


@requires_cuda
@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("tokens", [1, 1024, 4095, 65536])  # 1, and 1024 at K = 8: one cluster builds it
@pytest.mark.parametrize("experts, top_k", [(128, 8), (1024, 16), (512, 10)])
def test_cuda_plan_equals_host_plan(routing, tokens, experts, top_k):
    ids, _ = megamoe.make_routing(tokens, experts, top_k, routing)
    ids[::7, 3] = -1
    host = build_routing(ids, experts)
    device = build_routing(ids.cuda(), experts)
    for field in PLAN_FIELDS + ("buffer",):
        assert torch.equal(getattr(device, field).cpu(), getattr(host, field)), field
    assert bytes(device.shape) == bytes(host.shape)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_plan_is_built_on_the_ids_gpu_whichever_is_current():
    ids, _ = megamoe.make_routing(1024, 128, 8, "skewed")
    host = build_routing(ids, 128)
    with torch.cuda.device(0):
        device = build_routing(ids.to("cuda:1"), 128)
    assert device.buffer.device == torch.device("cuda:1")
    assert torch.equal(device.buffer.cpu(), host.buffer)


@requires_cuda
@pytest.mark.parametrize("tokens", [3, 9000])  # built by one cluster, and by three passes
def test_the_cuda_plan_writes_its_count_of_invalid_ids_to_host_memory_too(tokens):
    ids = torch.randint(0, 4, (tokens, 2), dtype=torch.int32, device="cuda")
    ids[0, 1], ids[1, 0], ids[2, 1] = 9, -3, -1
    plan = build_routing(ids, 4)
    torch.cuda.synchronize()
    assert plan.num_invalid_host.value == int(plan.num_invalid) == 2


@pytest.mark.parametrize("tokens, top_k, num_local", [(0, 1, 1), (1, 8, 128), (333, 4, 6), (16384, 8, 128)])
def test_plan_buffer_is_the_native_capacity_and_holds_every_field(tokens, top_k, num_local):
    """build_routing sizes its one allocation with pool_capacity: it must agree with the library."""
    import ctypes

    from megamoe import _native
    from megamoe.routing import plan_buffer_size, pool_capacity

    shape = _native.RoutingShape(tokens, top_k, num_local, 0, num_local)
    assert pool_capacity(tokens * top_k, num_local) == _native.library().megamoe_routing_capacity(ctypes.byref(shape))
    ids = torch.randint(0, num_local, (tokens, top_k), dtype=torch.int32)
    plan = build_routing(ids, num_local)
    assert plan.buffer.numel() == plan_buffer_size(tokens, top_k, num_local)
    assert sum(getattr(plan, name).numel() for name in PLAN_FIELDS) == plan.buffer.numel()
    again = type(plan).from_buffer(plan.buffer, tokens, top_k, num_local)
    assert all(torch.equal(getattr(again, name), getattr(plan, name)) for name in PLAN_FIELDS)
