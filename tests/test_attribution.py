"""Module attribution: the module and phase of every collective, and no module kept alive by it."""

import gc
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commlens.hooks as ch
from commlens.agent.sidecar import Sidecar
from commlens.hooks import attribution, native


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        dist.all_reduce(y.detach().clone())  # a collective issued inside this block's forward
        return y


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class SyncedSGD(torch.optim.SGD):
    def step(self, closure=None):
        dist.all_reduce(torch.ones(1))  # a collective issued inside the optimizer step
        return super().step(closure)


def attributed(rank, world_size):
    ch.instrument()
    attribution.enable()
    ring = ch.ring()
    spans = []
    sidecar = Sidecar(ring, rank, hang_threshold_s=60, on_collective=spans.append)
    sidecar.reader.cursor = ring.claimed()
    net = Net()
    model = DDP(net)
    optimizer = SyncedSGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    dist.all_reduce(torch.ones(1))
    sidecar.drain()
    # in the order issued: the sidecar builds a read's folded collectives after those it reads one by one
    # (a DDP bucket's, whose scale it follows)
    seen = [(c.op, c.module, c.phase, c.bucket >= 0) for c in sorted(spans, key=lambda c: c.start_ns)]
    attribution.disable()
    ch.uninstrument()
    alive = weakref.ref(net.blocks[0])
    del model, net, optimizer
    gc.collect()
    return seen, alive() is None


def test_collectives_carry_their_module_and_phase_and_modules_are_not_kept_alive(run_ranks):
    for seen, freed in run_ranks(attributed, 2):
        construction, seen = seen[:-5], seen[-5:]  # DDP's own C++ collectives: seen on torch >= 2.14
        assert len(construction) == 0 or native.AVAILABLE and all(
            (module, phase, bucket) == ("", "other", False) for _, module, phase, bucket in construction)
        assert seen == [
            ("all_reduce", "module.blocks.0", "forward", False),
            ("all_reduce", "module.blocks.1", "forward", False),
            ("all_reduce", "", "backward", True),  # DDP's gradient bucket
            ("all_reduce", "", "optimizer", False),
            ("all_reduce", "", "other", False),
        ]
        assert freed
