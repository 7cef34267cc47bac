"""Six training steps of Pico under two gloo processes, once through DDP's eager loop and once through
``--cuda-graph``'s step (convfirstnet/commands/train/graphed.py: rank 0's weights copied by
``broadcast_state``, the gradients averaged by ``all_reduce_mean``; CUDA graphs emulated, tests/_graphs.py);
run by torch.distributed.run from tests/test_train.py. Each process starts from different weights, so
both runs depend on the copy from rank 0. Rank 0 prints JSON: the largest difference between the two
runs' parameters over both processes, whether the graphed run's replicas agree, and both runs' losses."""

import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from convfirstnet.commands.train.graphed import GraphedStep, all_reduce_mean, broadcast_state
from convfirstnet.factory import create_model
from tests._graphs import EmulatedGraphs

STEPS = 6


def make(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    return create_model("pico", num_classes=4, drop_path_rate=0.1).train()


def batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 3, 64, 64, generator=g).contiguous(memory_format=torch.channels_last),
             torch.randint(0, 4, (4,), generator=g)) for _ in range(STEPS)]


def optimizer(m: nn.Module):
    # SGD, no clipping: an update in proportion to the gradient, so a wrong average shows (RMSprop's and
    # clipping's normalisation would hide a factor of two)
    return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-5)


def ddp_run(rank: int) -> tuple[nn.Module, list[float]]:
    model = make(rank)
    ddp, opt = DDP(model), optimizer(model)
    torch.manual_seed(10 + rank)  # drop-path: the same draws in both runs
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def graphed_run(rank: int) -> tuple[nn.Module, list[float]]:
    model = make(rank)
    broadcast_state(model)
    step = GraphedStep(model, nn.CrossEntropyLoss(), optimizer(model), None, None, None,
                       EmulatedGraphs(list(model.parameters())), all_reduce_mean)
    torch.manual_seed(10 + rank)
    return model, [step(x, y).item() for x, y in batches(rank)]


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    (a, losses_ddp), (b, losses_graphed) = ddp_run(rank), graphed_run(rank)
    diff = torch.tensor(max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    flat = torch.cat([p.detach().flatten() for p in b.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, flat)
    if rank == 0:
        equal = all(torch.equal(flat, r) for r in replicas)
        print(json.dumps(dict(max_param_diff=diff.item(), replicas_equal=equal, losses_ddp=losses_ddp,
                              losses_graphed=losses_graphed)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
