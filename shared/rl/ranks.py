"""The trainer's ranks: the policy sharded over them with FSDP2, and the few collectives that keep them in step.

At world size 1 every method here is the identity and nothing touches torch.distributed: the one-rank trainer runs as
it always has. At N ranks each decoder block is sharded, then the root (embedding, final norm, lm_head); gradients
are summed over ranks, not averaged, because every rank's loss is already divided by the whole step's denominator, so
the update is the same however the step's groups are split.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

from jetroll.shared.model.model import CausalLM, DecoderLayer
from jetroll.shared.model.precision import PrecisionLinear

T = TypeVar("T")
Reduction = Literal["sum", "max"]


@dataclass(frozen=True, slots=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # where collectives' tensors live: NCCL reduces CUDA tensors only

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that reads the bus, writes the ledger and commits."""
        return self.rank == 0

    def reduce(self, values: Sequence[float], op: Reduction = "sum") -> list[float]:
        """`values` summed (or maxed) over ranks, on every rank; in float64, so counts and token sums stay exact."""
        if not self.is_sharded:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor.tolist()

    def most(self, count: int) -> int:
        """The largest `count` of any rank: FSDP2's all-gathers and reduce-scatters run per forward and backward, so
        every rank runs as many as the busiest one."""
        return int(self.reduce([count], "max")[0])


ONE_RANK = Ranks()


def join_ranks(world_size: int, device: torch.device, timeout_s: float) -> Ranks:
    """This process's place among `world_size` trainer ranks, from the environment torchrun (or the Ray launcher)
    sets: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. gloo on CPU, NCCL on CUDA; `timeout_s` bounds each
    collective."""
    if world_size == 1:
        return ONE_RANK
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world_size or "RANK" not in os.environ:
        raise RuntimeError(f"trainer.world_size is {world_size}, but this process was launched as rank "
                           f"{os.environ.get('RANK', '?')} of {launched}: start the trainer's ranks with "
                           "`jetroll run` (or torchrun --nproc-per-node N)")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), world_size, device)


def shard_model(model: CausalLM) -> None:
    """FSDP2 on `model`: each decoder block, then the root. `hidden` is registered as a forward, so the passes that
    call it (not `forward`) gather the root's parameters too. A block drops its FP8 and GEMM copies after its forward:
    they are whole tensors, so keeping them would hold the unsharded model."""
    # late: FSDP2's modules add half a second to the start of every process that imports the loss
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    for layer in model.model.layers:
        fully_shard(layer)
        layer.register_forward_hook(_release_block_copies)
    fully_shard(model)
    register_fsdp_forward_method(model, "hidden")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a divide factor makes a PREMUL_SUM, which gloo lacks


def _release_block_copies(layer: torch.nn.Module, inputs: object, output: object) -> None:
    assert isinstance(layer, DecoderLayer)
    for module in layer.modules():
        if isinstance(module, PrecisionLinear):
            module.release()
    layer.self_attn.qkv.release()
    layer.mlp.gate_up.release()


def split_by_cost(items: Sequence[T], costs: Iterable[float], world_size: int) -> list[list[T]]:
    """Each rank's share of `items`, balanced by cost: the costliest first, each to the rank with the least so far
    (ties to the lower rank); a share keeps the items' order. Every rank gets one when there are enough."""
    loads, shares = [0.0] * world_size, [[] for _ in range(world_size)]
    order = sorted(enumerate(costs), key=lambda item: (-item[1], item[0]))
    owner = {}
    for index, cost in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += cost
        owner[index] = rank
    for index, item in enumerate(items):
        shares[owner[index]].append(item)
    return shares
