"""Op profiles and the op-level stage price: measured from real exported graphs, priced by hand-checked sums."""

from __future__ import annotations

import pytest
import torch

from sixfold.partitioner.pricing.cost import OpCost, PartitionCost, op_profile, op_seconds, stage_seconds
from tests.backends.factories import device


class _Interaction(torch.nn.Module):
    """An MLP layer (fused ReLU), a batched dot product, an index_select and a concat."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
        self.register_buffer("pairs", torch.tensor([1, 2, 5]))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))                             # [B, 8]
        z = torch.bmm(e, e.transpose(1, 2)).flatten(1)        # [B, 4*4]
        return torch.cat([h, torch.index_select(z, 1, self.pairs)], dim=1)


class _Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.EmbeddingBag(100, 6, mode="sum")

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.table(ids, offsets)


def _by_name(ops: tuple[OpCost, ...]) -> dict[str, OpCost]:
    return {o.name: o for o in ops}


def test_dense_profile_kinds_flops_products_and_fusion():
    dims = torch.export.Dim("rows", min=2)
    module = _Interaction()
    small = (torch.randn(4, 16), torch.randn(4, 4, 3))
    large = (torch.randn(64, 16), torch.randn(64, 4, 3))
    gm = torch.export.export(module, small, dynamic_shapes=({0: dims}, {0: dims})).module()
    ops = op_profile(gm, small, 4, large, 64)
    kinds = sorted(o.kind for o in ops)
    assert kinds == ["index", "matmul", "matmul", "memory"], [(o.name, o.kind) for o in ops]  # relu folded
    linear = next(o for o in ops if o.kind == "matmul" and o.products == (1.0, 0.0))
    bmm = next(o for o in ops if o.kind == "matmul" and o.products != (1.0, 0.0))
    assert linear.flops == pytest.approx((0.0, 2 * 16 * 8))
    assert bmm.flops == pytest.approx((0.0, 2 * 4 * 3 * 4)) and bmm.products == pytest.approx((0.0, 1.0))
    pairs = next(o for o in ops if o.kind == "index")
    assert pairs.ids == pytest.approx((0.0, 3.0)) and pairs.row_bytes == 4.0  # 3 pairs per row, one float each
    # Weights are a fixed read; activations per row: x in [16 floats] + out [8 floats].
    assert linear.bytes == pytest.approx(((16 * 8 + 8) * 4, (16 + 8) * 4))


def test_lookup_profile_counts_ids_and_row_bytes():
    module = _Lookup()
    small = (torch.randint(0, 100, (8,)), torch.arange(0, 8, 2))
    large = (torch.randint(0, 100, (128,)), torch.arange(0, 128, 2))
    ids, bags = torch.export.Dim("ids", min=2), torch.export.Dim("bags", min=2)
    gm = torch.export.export(module, small, dynamic_shapes=({0: ids}, {0: bags})).module()
    ops = _by_name(op_profile(gm, small, 4, large, 64))
    (bag,) = [o for o in ops.values() if o.kind == "gather"]
    assert bag.ids == pytest.approx((0.0, 2.0)) and bag.row_bytes == 6 * 4
    # Indices (8 B) and offsets (8 B per bag) in, one 6-float sum out per bag.
    assert bag.bytes == pytest.approx((0.0, 2 * 8 + 8 + 6 * 4))


def test_profile_needs_two_sizes():
    with pytest.raises(ValueError, match=r"large_rows \(4\) must exceed small_rows \(4\)"):
        op_profile(torch.fx.symbolic_trace(_Lookup()), (), 4, (), 4)


def test_stage_seconds_sums_ops_on_a_calibrated_spec():
    spec = device(flops=1e9, memory_bandwidth=1e9, link_bandwidth=0.0, link_latency_s=0.0,
                  matmul_efficiency=((1e3, 0.25), (1e5, 1.0)), gather_bandwidth=5e8, per_id_seconds=1e-8,
                  per_index_seconds=5e-9, per_op_seconds=1e-6, per_batch_seconds=1e-5)
    ops = (
        # GEMM: 100 rows x 1e3 FLOPs = 1e5 FLOPs in one product -> efficiency 1.0 -> 1e-4 s;
        # bytes (1e3 + 100 * 10) / 1e9 = 2e-6 s, below compute.
        OpCost("fc", "matmul", flops=(0.0, 1e3), bytes=(1e3, 10.0)),
        # Batched: 100 products of 1e3 FLOPs -> efficiency 0.25 -> 1e5 / 2.5e8 = 4e-4 s.
        OpCost("bmm", "matmul", flops=(0.0, 1e3), products=(0.0, 1.0)),
        # Gather: 100 x 2 ids x (1e-8 + 16 / 5e8) = 200 x 4.2e-8 = 8.4e-6 s, plus 100 x 40 B / 1e9 = 4e-6 s.
        OpCost("bag", "gather", ids=(0.0, 2.0), row_bytes=16.0, bytes=(0.0, 40.0)),
        # Memory: 100 x 1e3 B / 1e9 = 1e-4 s.
        OpCost("cat", "memory", bytes=(0.0, 1e3)),
        # Index: 100 x 3 indices x 5e-9 = 1.5e-6 s (not the gather's per-id 1e-8), plus 100 x 20 B / 1e9 = 2e-6 s.
        OpCost("pairs", "index", ids=(0.0, 3.0), row_bytes=4.0, bytes=(0.0, 20.0)),
    )
    cost = PartitionCost(param_bytes=0, flops_per_item=2e3, bytes_per_item=0.0, weight_bytes_per_batch=0, ops=ops)
    expected = 1e-5 + 5 * 1e-6 + 1e-4 + 4e-4 + (8.4e-6 + 4e-6) + 1e-4 + (1.5e-6 + 2e-6)
    assert stage_seconds(spec, cost, 100, 0.0, 0.0) == pytest.approx(expected)
    assert op_seconds(spec, ops[1], 100) == pytest.approx(1e-6 + 4e-4)


def test_uncalibrated_specs_and_profile_free_costs_keep_the_roofline():
    ops = (OpCost("bmm", "matmul", flops=(0.0, 1e3), products=(0.0, 1.0)),)
    with_ops = PartitionCost(param_bytes=0, flops_per_item=1e3, bytes_per_item=10.0, weight_bytes_per_batch=100,
                             ops=ops)
    without = PartitionCost(param_bytes=0, flops_per_item=1e3, bytes_per_item=10.0, weight_bytes_per_batch=100)
    plain = device(flops=1e9, memory_bandwidth=1e9, link_bandwidth=0.0)  # efficiency 1.0, nothing calibrated
    roofline = max(100 * 1e3 / 1e9, (100 + 100 * 10) / 1e9)
    assert stage_seconds(plain, with_ops, 100, 0.0, 0.0) == pytest.approx(roofline)
    calibrated = device(flops=1e9, memory_bandwidth=1e9, link_bandwidth=0.0, per_op_seconds=1e-6)
    assert stage_seconds(calibrated, without, 100, 0.0, 0.0) == pytest.approx(roofline)


def test_plans_on_a_calibrated_spec_are_priced_op_by_op():
    """partition_builtin wires the op profiles in: only an op-by-op price moves with ``per_op_seconds``."""
    import dataclasses

    from sixfold.backends.spec_catalog import load_spec
    from sixfold.partitioner.compile import partition_builtin

    base = load_spec("host-calibrated")
    assert base.calibrated
    slower = dataclasses.replace(base, per_op_seconds=base.per_op_seconds + 1e-3)

    def seconds(spec) -> dict[str, float]:
        _, partitioned = partition_builtin("rm1", max_rows=200, cards=1, card_spec=spec, host_spec=spec,
                                           batch_rows=64, compile=False)
        return {d.device: d.batch_seconds for d in partitioned.plan.estimates.per_device}

    before, after = seconds(base), seconds(slower)
    for device_id in ("host", "card0"):
        extra_ops = (after[device_id] - before[device_id]) / 1e-3
        # One extra millisecond per priced op: a whole number of ops, at least one matmul/gather.
        assert extra_ops >= 1 and extra_ops == pytest.approx(round(extra_ops), abs=1e-6), (device_id, extra_ops)
