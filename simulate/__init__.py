"""sixfold-simulate: what-if capacity planning on a virtual clock, with sixfold's own serving code.

A discrete-event simulation in which the server's real ``DynamicBatcher`` and
``PlanRuntime`` (batching, admission, host-dense tuning, query splitting, routing, card
deadlines) run unchanged on an asyncio loop whose clock is virtual
(``sixfold.simulate.vloop``); host and card stages are FIFO servers priced by the partitioner's
cost model (``sixfold.simulate.platform``, ``sixfold.simulate.devices``); traffic comes from loadgen's
arrival and query-size models or a recording (``sixfold.simulate.traffic``).

    from sixfold.simulate import build_platform, parse_traffic, run_at, max_rate, ServingSettings
    platform = build_platform("dlrm-mlperf", cards=6, card_spec="gpu-l4")
    result = run_at(platform, parse_traffic("poisson", "mlperf"), 5000, duration_s=10, warmup_s=1,
                    settings=ServingSettings())
    print(result.latency_ms["p99"], result.utilisation)

Package order: ``simulate`` sits above every other package (it imports server, loadgen,
partitioner, backends and models; nothing imports it): it drives the server's scheduling code with
loadgen's traffic, and loadgen never imports the server (docs/architecture.md, "Layers").
"""

from sixfold.simulate.capacity import (CardsAnswer, ImpossibleTarget, MaxRate, fewest_cards, latency_curve, lone_query_ms, max_rate,
                       run_at)
from sixfold.simulate.engine import RunResult, ServingSettings, simulate
from sixfold.simulate.platform import Platform, StageModel, build_platform
from sixfold.simulate.traffic import Arrivals, Traffic, parse_traffic
from sixfold.simulate.vloop import SimulationDeadlock, SimulationLimit, VirtualTimeLoop, run_virtual

__all__ = ["build_platform", "Platform", "StageModel", "Traffic", "Arrivals", "parse_traffic", "ServingSettings",
           "RunResult", "simulate", "run_at", "latency_curve", "max_rate", "MaxRate", "fewest_cards", "CardsAnswer",
           "lone_query_ms", "ImpossibleTarget", "VirtualTimeLoop", "run_virtual", "SimulationLimit",
           "SimulationDeadlock"]
