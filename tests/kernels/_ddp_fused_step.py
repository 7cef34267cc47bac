"""Two DDP (gloo) training steps of a small net of stride-1 ConvFirst blocks and an MBConv block, once
through the fused training op and the MBConv recompute path (Triton kernels in the interpreter) and
once layer-wise; run by torch.distributed.run from
tests/kernels/test_convfirst_train.py. Rank 0 prints the largest differences as JSON."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from convfirstnet.blocks import ConvFirst, MBConv  # noqa: E402


def make_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(ConvFirst(16, 16, 1, 3), ConvFirst(16, 16, 1, 3, drop_path=0.3),
                        MBConv(16, 16, 1, drop_path=0.3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(16, 4))
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias, 0.0, 0.3)
    return net


def run(backend: str) -> nn.Module:
    os.environ["CONVFIRSTNET_KERNELS"] = backend
    rank = dist.get_rank()
    net = make_net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(2, 16, 8, 9, generator=g).contiguous(memory_format=torch.channels_last)
        target = torch.randint(0, 4, (2,), generator=g)
        torch.manual_seed(10 * step + rank)  # drop-path masks: the same draws in both forms
        loss = nn.functional.cross_entropy(ddp(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    fused, layerwise = run("triton"), run("reference")
    diffs = {}
    for (name, a), b in zip(fused.state_dict().items(), layerwise.state_dict().values()):
        scale = max(b.abs().max().item(), 1e-12) if b.is_floating_point() else 1
        diffs[name] = (a.double() - b.double()).abs().max().item() / scale
    # the replicas agree with each other (DDP averaged the same gradients on both ranks)
    flat = torch.cat([p.detach().flatten() for p in fused.parameters()])
    others = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(others, flat)
    if dist.get_rank() == 0:
        print(json.dumps(dict(diffs=diffs, replicas_equal=all(torch.equal(o, flat) for o in others))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
