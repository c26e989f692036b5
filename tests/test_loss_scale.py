"""Dynamic loss scaling on 2 gloo ranks: the Inf that a GradScaler's overflowing steps put in every
gradient bucket is counted as its overflow, and NaN entering the job in the same run is still found
where it entered."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commlens.hooks as ch
from commlens.agent.sidecar import Sidecar

STEPS, NAN_STEP = 24, 20


def overflows_then_a_nan(rank, world_size):
    """Mixed precision as a job runs it (float16 forward, GradScaler growing its scale every 3 steps,
    so that the scaled gradients overflow every few steps); at step ``NAN_STEP`` rank 1's activations
    hold NaN in the forward all_reduce of a tensor-parallel layer, before the loss is scaled."""
    ch.instrument()
    check = ch.NanCheckHook(mode="report").register_with_comm()
    unwatch = ch.watch_loss_scaling()
    ring = ch.ring()
    spans = []
    sidecar = Sidecar(ring, rank, hang_threshold_s=60, on_collective=spans.append)
    sidecar.reader.cursor = ring.claimed()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_factor=2.0 ** 4, backoff_factor=2.0 ** -4, growth_interval=3)
    data = torch.Generator().manual_seed(rank)
    skipped, nan_seq = [], None
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(32, 64, generator=data)).float()
        activations = out.detach().clone()
        if step == NAN_STEP and rank == 1:
            activations[0, 0] = float("nan")
        dist.all_reduce(activations)
        if step == NAN_STEP:
            nan_seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
        scale = scaler.get_scale()
        optimizer.zero_grad()
        scaler.scale((out - activations.nan_to_num() / 2).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
    sidecar.drain()
    stats = sidecar.stats.snapshot()
    marked = sorted({c.loss_scale_skipped for c in spans if c.inf})
    unwatch()
    check.unregister()
    ch.uninstrument()
    return skipped, nan_seq, stats.first_nonfinite, stats.loss_scale_steps, stats.nans, marked


def test_a_loss_scalers_overflow_is_counted_and_nan_entering_the_job_is_still_found_where_it_entered(run_ranks):
    for rank, (skipped, nan_seq, first, steps, nans, marked) in enumerate(run_ranks(overflows_then_a_nan, 2)):
        assert sum(skipped) >= 3, skipped  # the scaler did skip steps: Inf in the gradient buckets
        assert steps == {"skipped": sum(skipped), "applied": STEPS - sum(skipped)}
        assert sum(n for (op, _, kind), n in nans.items() if kind == "inf") >= sum(skipped), nans
        assert marked == list(range(1, sum(skipped) + 1))  # each skipped step's Inf spans carry its number
        # the overflow is not where values entered; the NaN is, on the rank whose input held it
        assert first == ({("0", "nan"): (nan_seq, "all_reduce")} if rank == 1 else {}), (rank, first)
