"""Pipeline placement: a dense part too big for one card is cut into stages across cards.

Checked on the zoo's rm2 with cards too small for its dense part: stages cover
every node once and in dependency order, each fits its card, the split equals
the unsplit model through ONNX Runtime and through the server's dense loader
on simulated cards, and the plan round-trips through plan.json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from sixfold import models
from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.pricing.cost import PartitionCost, module_param_bytes
from sixfold.partitioner.cut.pipeline import GraphCosts, NodeCost, compute_nodes, node_costs, run_stages, split_stages
from sixfold.partitioner.plan import DeviceInfo, PartitionPlan
from sixfold.partitioner.placement.strategy import ACTIVATION_HEADROOM, PlanError, _StageModel, choose, pipeline
from sixfold.server.scheduling.batcher import BatchInfo
from sixfold.server.execution.dense_loader import PipelineExecutable, load_dense
from sixfold.server.loading.loader import load_host_stage
from sixfold.server.execution.runtime import PlanRuntime

CARD_MEMORY = 400_000
"""rm2's dense weights are ~494 KiB and its widest layer ~296 KiB: two stages, no fewer."""


def _tiny(memory: int = CARD_MEMORY):
    return dataclasses.replace(load_spec("m2-card"), name="tiny", memory_bytes=memory)


@pytest.fixture(scope="module")
def rm2_pipelined():
    return partition_builtin("rm2", max_rows=50, cards=5, card_spec=_tiny())


@pytest.fixture(scope="module")
def unsplit():
    """The same rm2, replicated: its one dense ONNX partition in ONNX Runtime is the reference.

    (ONNX Runtime and torch differ by up to ~1e-5 on rm2's saturated scores, so the
    split is compared with the unsplit model in the same runtime: it matches exactly.)
    """
    model, partitioned = partition_builtin("rm2", max_rows=50, cards=1)
    session = ort.InferenceSession(partitioned.artifacts[DENSE_PARTITION].payload)

    def scores(request: dict[str, np.ndarray]) -> np.ndarray:
        env = _card_inputs(partitioned, request)
        out = session.run(["scores"], {n: env[n] for n in partitioned.split.dense_inputs})[0]
        np.testing.assert_allclose(out, _torch_scores(model, request), rtol=0, atol=1e-4)
        return out
    return scores


def _request(model, items: int, seed: int) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(model.config, seed=seed).make(items)


def _torch_scores(model, request) -> np.ndarray:
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in (models.DENSE, models.LENGTHS, models.INDICES)]).numpy()


def _card_inputs(partitioned, request) -> dict[str, np.ndarray]:
    split = partitioned.split
    with torch.inference_mode():
        boundary = split.host(*[torch.from_numpy(request[n]) for n in split.host_inputs])
    return {**request, **{n: t.numpy() for n, t in zip(split.boundary, boundary)}}


def test_a_dense_part_too_big_for_a_card_is_pipelined_in_stages(rm2_pipelined) -> None:
    _, partitioned = rm2_pipelined
    plan = partitioned.plan
    stages = plan.dense_stages()
    assert plan.strategy == "pipeline" and stages == ["dense.0", "dense.1"]
    # 5 cards, 2 stages: two pipeline replicas, card4 idle.
    assert [(p.partition, p.device, p.replica) for p in plan.placements if p.partition != HOST_PARTITION] == [
        ("dense.0", "card0", 0), ("dense.1", "card1", 0), ("dense.0", "card2", 1), ("dense.1", "card3", 1)]
    assert plan.devices_of(HOST_PARTITION) == ["host"]
    assert set(partitioned.artifacts) == {HOST_PARTITION, "dense.0", "dense.1"}


def test_every_dense_node_is_in_exactly_one_stage_in_dependency_order(rm2_pipelined) -> None:
    _, partitioned = rm2_pipelined
    plan, dense = partitioned.plan, partitioned.split.dense
    placed = [n for s in plan.dense_stages() for n in plan.partition(s).nodes]
    assert sorted(placed) == sorted(compute_nodes(dense)) and len(placed) == len(set(placed))
    stage_of = {n: k for k, s in enumerate(plan.dense_stages()) for n in plan.partition(s).nodes}
    for node in dense.graph.nodes:  # no edge runs backwards: the stage graph has no cycle
        for source in node.all_input_nodes:
            if node.name in stage_of and source.name in stage_of:
                assert stage_of[source.name] <= stage_of[node.name], (source.name, node.name)
    # A stage reads only model inputs and what earlier stages produced.
    available = set(partitioned.split.dense_inputs)
    for name in plan.dense_stages():
        info = plan.partition(name)
        assert {t.name for t in info.inputs} <= available, name
        available |= {t.name for t in info.outputs}
    assert [t.name for t in plan.partition(plan.dense_stages()[-1]).outputs] == ["scores"]


def test_each_stage_fits_its_card_and_the_estimates_name_the_stages(rm2_pipelined) -> None:
    _, partitioned = rm2_pipelined
    plan = partitioned.plan
    for name in plan.dense_stages():
        info = plan.partition(name)
        fx_stage = partitioned.variants[name][0].payload
        assert info.param_bytes == module_param_bytes(fx_stage)
        for device in plan.devices_of(name):
            assert info.param_bytes * ACTIVATION_HEADROOM <= plan.device(device).spec.memory_bytes
    total = plan.partition(HOST_PARTITION).param_bytes
    assert sum(plan.partition(s).param_bytes for s in plan.dense_stages()) > CARD_MEMORY / ACTIVATION_HEADROOM
    est = plan.estimates
    assert total > 0 and est.bottleneck in {HOST_PARTITION, *plan.dense_stages()}
    cards = {d.device: d for d in est.per_device if d.device != "host"}
    assert set(cards) == {"card0", "card1", "card2", "card3"}
    assert all(0 < d.transfer_seconds < d.batch_seconds for d in cards.values())


def test_stages_through_onnx_runtime_equal_the_unsplit_model(rm2_pipelined, unsplit) -> None:
    model, partitioned = rm2_pipelined
    sessions = [(partitioned.artifacts[s], ort.InferenceSession(partitioned.artifacts[s].payload))
                for s in partitioned.plan.dense_stages()]
    for items, seed in ((1, 3), (37, 4)):
        request = _request(model, items, seed)
        env = _card_inputs(partitioned, request)
        for artifact, session in sessions:
            outputs = session.run(list(artifact.output_names), {n: env[n] for n in artifact.input_names})
            env.update(zip(artifact.output_names, outputs))
        np.testing.assert_allclose(env["scores"], unsplit(request), rtol=0, atol=1e-5)


async def test_load_dense_runs_each_pipeline_replica_on_simulated_cards(rm2_pipelined, unsplit) -> None:
    model, partitioned = rm2_pipelined
    backend = SimCardBackend()
    lanes, reload = load_dense(partitioned.plan, lambda name: partitioned.artifact_for(name, backend), backend)
    try:
        assert len(lanes) == 2 and all(isinstance(lane, PipelineExecutable) for lane in lanes)
        assert [s.device.name for s in lanes[1].stages] == ["tiny/card2", "tiny/card3"]
        assert lanes[0].input_names == tuple(partitioned.split.dense_inputs)
        assert lanes[0].output_names == ("scores",)
        held = {f"tiny/card{i}": backend.memory_used(f"tiny/card{i}") for i in range(5)}
        assert held["tiny/card4"] == 0 and all(0 < held[f"tiny/card{i}"] <= CARD_MEMORY for i in range(4))
        requests = [_request(model, items, seed) for items, seed in ((5, 1), (64, 2), (17, 3))]
        results = await asyncio.gather(*(lanes[i % 2].infer({n: _card_inputs(partitioned, r)[n]
                                                            for n in lanes[0].input_names})
                                         for i, r in enumerate(requests)))
        for request, outputs in zip(requests, results):
            np.testing.assert_allclose(outputs["scores"], unsplit(request), rtol=0, atol=1e-5)
        assert lanes[0].stats().batches == 4  # two batches x two simulated stages
        # Restart a lane the way the runtime restarts a failed card: close, then reload.
        lanes[0].close()
        assert backend.memory_used("tiny/card0") == 0
        lanes[0] = reload(0)
        out = await lanes[0].infer({n: _card_inputs(partitioned, requests[0])[n] for n in lanes[0].input_names})
        np.testing.assert_allclose(out["scores"], unsplit(requests[0]), rtol=0, atol=1e-5)
    finally:
        for lane in lanes:
            lane.close()


async def test_the_plan_runtime_serves_pipeline_lanes_and_restarts_a_failed_one(rm2_pipelined, unsplit) -> None:
    model, partitioned = rm2_pipelined
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    backend = SimCardBackend()
    lanes, reload = load_dense(partitioned.plan, lambda name: partitioned.artifact_for(name, backend), backend)
    runtime = PlanRuntime(host, lanes, reload_card=reload, max_card_rows=16)
    try:
        # Take stage 1 of lane 0 down: its batch is retried on lane 1, then lane 0 is reloaded.
        lanes[0].stages[1].close()
        for items, seed in ((3, 5), (40, 6), (7, 7)):  # 40 rows split into sub-batches across lanes
            request = _request(model, items, seed)
            outputs = await runtime.run(dict(request), BatchInfo())
            np.testing.assert_allclose(outputs["scores"], unsplit(request), rtol=0, atol=1e-5)
        for _ in range(200):
            if runtime.router.loads[0].healthy:
                break
            await asyncio.sleep(0.02)
        assert runtime.router.loads[0].healthy and runtime.cards[0] is not lanes[0]
        assert backend.memory_used("tiny/card1") > 0  # the restarted lane holds its cards again
    finally:
        runtime.close()


async def test_load_dense_gives_one_lane_per_card_when_replicated() -> None:
    model, partitioned = partition_builtin("rm1", max_rows=50, cards=3)
    assert partitioned.plan.strategy == "replicate" and partitioned.plan.dense_stages() == [DENSE_PARTITION]
    backend = SimCardBackend()
    lanes, reload = load_dense(partitioned.plan, lambda n: partitioned.artifact_for(n, backend), backend)
    try:
        assert [lane.device.name for lane in lanes] == [f"m2-card/card{i}" for i in range(3)]
        request = _request(model, 9, 1)
        out = await lanes[2].infer({n: _card_inputs(partitioned, request)[n] for n in lanes[2].input_names})
        np.testing.assert_allclose(out["scores"], _torch_scores(model, request), rtol=0, atol=1e-5)
        lanes[1].close()
        lanes[1] = reload(1)
        assert lanes[1].device.name == "m2-card/card1"
    finally:
        for lane in lanes:
            lane.close()


def test_forced_replicate_that_does_not_fit_is_refused_with_numbers() -> None:
    with pytest.raises(PlanError, match=r"dense partition needs 0\.5 MiB \(weights 0\.5 MiB \+ 10% headroom\); "
                                        r"largest card card0 \(tiny\) has 0\.4 MiB"):
        partition_builtin("rm2", max_rows=50, cards=2, card_spec=_tiny(), strategy="replicate")


def test_a_node_too_big_for_any_card_is_refused_with_numbers() -> None:
    with pytest.raises(PlanError, match=r"dense node linear_2 alone needs 326\.1 KiB "
                                        r"\(weights 296\.5 KiB \+ 10% headroom\); "
                                        r"smallest card card0 \(tiny\) has 293\.0 KiB"):
        partition_builtin("rm2", max_rows=50, cards=4, card_spec=_tiny(300_000), strategy="pipeline")


def test_too_few_cards_for_the_stages_is_refused_with_numbers() -> None:
    # "auto" says why neither strategy works.
    with pytest.raises(PlanError, match=r"dense partition needs 0\.5 MiB .* has 0\.4 MiB, and it cannot be "
                                        r"pipelined either: .*needs at least 2 pipeline stages .* there are 1 cards"):
        partition_builtin("rm2", max_rows=50, cards=1, card_spec=_tiny(), strategy="auto")


def test_unknown_strategy_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'shard'; available: auto, replicate, pipeline"):
        partition_builtin("rm2", max_rows=50, cards=1, strategy="shard")


def test_pipelined_plan_round_trips_through_plan_json(rm2_pipelined, unsplit, tmp_path) -> None:
    model, partitioned = rm2_pipelined
    path = write_artifacts(partitioned, tmp_path)
    plan = PartitionPlan.load(path)
    assert plan == partitioned.plan
    assert [plan.partition(s).artifact for s in plan.dense_stages()] == ["dense.0.onnx", "dense.1.onnx"]
    request = _request(model, 8, 9)
    env = _card_inputs(partitioned, request)
    for name in plan.dense_stages():
        session = ort.InferenceSession(str(tmp_path / plan.partition(name).artifact))
        names = [o.name for o in session.get_outputs()]
        env.update(zip(names, session.run(names, {i.name: env[i.name] for i in session.get_inputs()})))
    np.testing.assert_allclose(env["scores"], unsplit(request), rtol=0, atol=1e-5)
    # A plan written before stage transfer times existed still loads.
    old = json.loads(path.read_text())
    for d in old["estimates"]["per_device"]:
        del d["transfer_seconds"]
    assert PartitionPlan.from_dict(old).estimates.per_device[1].transfer_seconds == 0.0


def test_cli_pipelines_on_request_and_explains_stages_and_transfers(tmp_path, capsys) -> None:
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps(_tiny().to_dict()))
    out = tmp_path / "out"
    assert partition_main(["--model", "rm2", "--max-rows", "50", "--cards", "4", "--card-spec", str(spec),
                           "--strategy", "pipeline", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline: 2 stages x 2 replicas" in text and "dense.0 -> dense.1:" in text
    assert "transfer" in text and "dense.0.onnx, dense.1.onnx" in text
    assert (out / "dense.0.onnx").is_file() and (out / "dense.1.onnx").is_file()


# --- the policy alone, on hand-made costs --------------------------------------------------------

def _chain(flops: list[float], weights: list[int], act: float = 1024.0) -> GraphCosts:
    """A chain of units: unit i reads unit i-1 (unit 0 reads input x), each with its own weight."""
    nodes = tuple(NodeCost(name=f"n{i}", flops_per_item=f, out_bytes_per_item=act, params=(f"w{i}",),
                           reads=(f"n{i - 1}" if i else "x",), batch_major=True) for i, f in enumerate(flops))
    return GraphCosts(nodes=nodes, inputs=(("x", act),), outputs=(f"n{len(flops) - 1}",),
                      param_bytes=tuple((f"w{i}", w) for i, w in enumerate(weights)))


def _cards(n: int, memory: int) -> list[DeviceInfo]:
    return [DeviceInfo(id=f"card{i}", spec=_tiny(memory)) for i in range(n)]


def test_pipeline_policy_finds_the_best_bottleneck_by_brute_force() -> None:
    rng = np.random.default_rng(0)
    host = DeviceInfo(id="host", spec=load_spec("host-cpu"))
    solved = 0
    for _ in range(8):
        n = 7
        costs = _chain([float(f) for f in rng.integers(1, 40, n) * 1e6],
                       [int(w) for w in rng.integers(1, 7, n) * 1000], act=float(rng.integers(1, 64) * 256))
        cards = _cards(3, 15_000)
        model = _StageModel(costs, cards[0].spec, 64)
        best = min((max(model.seconds(a, b) for a, b in zip((0, *cut), (*cut, n)))
                    for cut in itertools.combinations(range(1, n), 2)
                    if all(model.fits(a, b) for a, b in zip((0, *cut), (*cut, n)))), default=None)
        if best is None:
            with pytest.raises(PlanError, match=r"needs at least 4 pipeline stages .* there are 3 cards"):
                pipeline("sparse", "dense", costs, host, cards, batch_rows=64, stages=3)
            continue
        choice = pipeline("sparse", "dense", costs, host, cards, batch_rows=64, stages=3)
        assert choice.bottleneck_seconds == pytest.approx(best)
        assert all(w * ACTIVATION_HEADROOM <= 15_000 for w in choice.stage_param_bytes)
        solved += 1
    assert solved >= 4


def test_pipeline_policy_trades_stages_for_replicas() -> None:
    host = DeviceInfo(id="host", spec=load_spec("host-cpu"))
    costs = _chain([1e6] * 6, [1000] * 6)
    # Everything fits one card: one stage on each of 6 cards beats any deeper pipeline.
    assert pipeline("sparse", "dense", costs, host, _cards(6, 10**6), batch_rows=64).replicas == 6
    # Two units per card at most: three stages, two replicas.
    choice = pipeline("sparse", "dense", costs, host, _cards(6, 2300), batch_rows=64)
    assert (len(choice.stage_names), choice.replicas, choice.cuts) == (3, 2, (2, 4))
    whole = PartitionCost(param_bytes=6000, flops_per_item=6e6, bytes_per_item=0.0, weight_bytes_per_batch=6000)
    assert choose("auto", whole, _cards(2, 10**6)) == "replicate"
    assert choose("auto", whole, _cards(2, 2300)) == "pipeline"
    assert choose("replicate", whole, _cards(2, 2300)) == "replicate"  # forced: replicate() will refuse


def test_surgery_refuses_cuts_out_of_order(rm2_pipelined) -> None:
    dense = rm2_pipelined[1].split.dense
    with pytest.raises(ValueError, match="cut points must rise strictly"):
        split_stages(dense, [5, 3])
    before = [n.format_node() for n in dense.graph.nodes]
    split_stages(dense, [4, 9])
    assert [n.format_node() for n in dense.graph.nodes] == before  # the input graph is left intact


def test_no_cut_separates_a_tuple_from_its_getitems() -> None:
    class MaxPool(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 5)

        def forward(self, x):
            values, index = torch.max(self.linear(x), dim=1, keepdim=True)
            return torch.sigmoid(values + index.float())

    x4, x9 = torch.randn(4, 3), torch.randn(9, 3)
    gm = torch.export.export(MaxPool(), (x4,), dynamic_shapes={"x": {0: torch.export.Dim.AUTO}}).module()
    costs = node_costs(gm, (x4,), 4, (x9,), 9)
    names = [n.name for n in costs.nodes]
    after_max = names.index(next(n for n in names if n.startswith("max"))) + 1
    assert not costs.can_cut(after_max) and costs.can_cut(after_max - 1)
    with pytest.raises(ValueError, match=r"crosses the cut and is not a tensor \(tuple\)"):
        split_stages(gm, [after_max])
    # Every allowed cut gives stages that compute what the model computes.
    for cut in (c for c in range(1, len(names)) if costs.can_cut(c)):
        stages = split_stages(gm, [cut], ["y"])
        torch.testing.assert_close(run_stages(stages, {"x": x9})[1]["y"], gm(x9), rtol=0, atol=0)
