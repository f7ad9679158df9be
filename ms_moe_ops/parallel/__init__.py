"""Expert parallelism: the experts of each MoE layer split over several processes.

- `ExpertParallel(group=None)`: the process group (create it after
  `mindspore.communication.init()`), passed to `MoELayer(..., expert_parallel=ep)`;
  `ExpertParallel.single()`: the same path on this process alone (no communication).
- `ExpertParallelTrainStep` / `ExpertParallelGradReducer`: a training step whose gradients of
  the replicated parameters are all-reduced, so every rank stays in sync.
- `shard_experts` / `gather_experts`: between a single-process checkpoint and per-rank shards.
- `ExpertDispatcher` (the token dispatcher `ep.dispatcher(...)` gives MoELayer) and the exchange
  pairs it uses (`AlltoAllVExchange`, `AllReduceExchange`, `OneRankExchange`).
- `msrun`: runs a script on several local processes (tests, benchmarks).
"""
from .checkpoint import gather_experts, is_expert_parameter, shard_experts
from .dispatcher import ExpertDispatcher, OneRankExchange
from .exchange import AllReduceExchange, AlltoAllVExchange
from .group import EXCHANGES, ExpertParallel
from .launch import LaunchError, msrun
from .train import ExpertParallelGradReducer, ExpertParallelTrainStep, expert_parameter_names

__all__ = ["ExpertParallel", "EXCHANGES", "ExpertParallelTrainStep", "ExpertParallelGradReducer",
           "expert_parameter_names", "shard_experts", "gather_experts", "is_expert_parameter",
           "ExpertDispatcher", "AllReduceExchange", "AlltoAllVExchange", "OneRankExchange",
           "LaunchError", "msrun"]
