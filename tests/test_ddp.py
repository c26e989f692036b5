"""DDP gradient buckets through the wrapped communication hooks, on 2 gloo ranks."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, quantization_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from commlens.hooks import ddp
from commlens.ring.layout import STATUS, bucket_of, exponent_of
from commlens.ring.ops import CODE
import commlens.hooks as ch

from monitoring import wait_for


def _model(layers=2, width=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _grads(model, rank, steps=2, nan=False, after_backward=lambda model: None):
    out = []
    device = next(model.parameters()).device
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank * 100 + step)).to(device)
        if nan:
            x[0, 0] = float("nan")
        model.zero_grad()
        model(x).pow(2).mean().backward()
        after_backward(model)
        out.append([p.grad.to("cpu", copy=True) for p in model.parameters()])
    return out


def _noop_then_average(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def wrapped_hooks_match_plain_ddp(rank, world_size):
    plain = _grads(DDP(_model()), rank)
    ch.instrument()
    buckets = []
    handle = ch.register_post_hook(lambda a: buckets.append((a.pre.bucket, a.status)) if a.pre.bucket else None)
    results = {"plain": plain}
    for phase, (name, hook) in enumerate((("allreduce", default_hooks.allreduce_hook),
                                          ("fp16", default_hooks.fp16_compress_hook), ("default", None))):
        model = DDP(_model())
        if hook is not None:
            model.register_comm_hook(None, hook)  # wrapped by instrument(), not replaced
        results[name] = _grads(model, rank)
        # a bucket's post-hook fires when its reduce's future completes, on gloo's thread, possibly
        # after the step has its gradients: the list holds the models' buckets in order once it came
        wait_for(lambda: len(buckets) == 2 * (phase + 1), f"the {name} model's bucket post-hooks")
    model = DDP(_model())
    model.register_comm_hook(None, debugging_hooks.noop_hook)
    noop_phase = []
    seqs = ch.register_post_hook(lambda a: noop_phase.append((a.name.value, a.pre.seq, a.status)))
    results["noop"] = _grads(model, rank, after_backward=_noop_then_average)
    seqs.remove()
    handle.remove()
    results["noop_phase"] = noop_phase
    results["buckets"] = [(b.index, b.is_last, b.nbytes, b.wire_bytes, status) for b, status in buckets]
    ch.uninstrument()
    return results


def test_wrapped_builtin_hooks_give_plain_ddps_gradients_and_record_each_bucket(run_ranks):
    for r in run_ranks(wrapped_hooks_match_plain_ddp, 2):
        for name, atol in (("allreduce", 0), ("default", 0), ("fp16", 1e-4)):
            for got, want in zip(r[name], r["plain"]):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-5 if atol == 0 else 0, atol=atol)
        for got, want in zip(r["noop"], r["plain"]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        params_bytes = sum(p.numel() * 4 for p in _model().parameters())
        # allreduce, fp16, default: 2 steps each, one bucket each; noop: its hook issues nothing
        assert [b[:3] for b in r["buckets"]] == [(0, True, params_bytes)] * 8
        assert [b[3] for b in r["buckets"]] == [params_bytes] * 2 + [params_bytes // 2] * 2 + [params_bytes] * 2 + [0] * 2
        assert [b[4] for b in r["buckets"]] == ["ok"] * 6 + ["not_issued"] * 2
        # the manual all_reduces after noop_hook's buckets each hold a sequence number of their own
        issued = [seq for _, seq, status in r["noop_phase"] if status == "ok"]
        assert len(set(issued)) == len(issued), r["noop_phase"]
        manual = [op for op, _, status in r["noop_phase"] if status == "ok" and op == "all_reduce"]
        assert len(manual) == 2 * len(list(_model().parameters())), r["noop_phase"]


def eleven_layers(rank, world_size):
    ch.instrument()
    seen = []
    handle = ch.register_pre_hook(lambda a: seen.append((a.bucket.index, a.bucket.is_last)) if a.bucket else None)
    model = DDP(_model(layers=11, width=512), bucket_cap_mb=1)
    _grads_wide(model, rank)  # DDP's first backward uses one bucket; it rebuilds them by size after
    seen.clear()
    _grads_wide(model, rank)
    handle.remove()
    ch.uninstrument()
    return seen


def _grads_wide(model, rank):
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()


def test_only_the_last_bucket_of_a_backward_pass_is_last(run_ranks):
    for seen in run_ranks(eleven_layers, 2):
        assert len(seen) == 11
        assert [is_last for _, is_last in seen] == [False] * (len(seen) - 1) + [True]


def nan_in_one_rank(rank, world_size):
    ch.instrument()
    found = []
    check = ch.NanCheckHook(mode="report").register_with_comm()
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    model = DDP(_model())
    _grads(model, rank, steps=1, nan=(rank == 1))
    found = [(r.op, r.aux) for r in reader.read() if r.kind == ch.NAN]
    check.unregister()
    ch.uninstrument()
    return found


def test_a_nan_in_one_ranks_gradient_is_reported_for_that_rank_before_the_reduce_spreads_it(run_ranks):
    found = run_ranks(nan_in_one_rank, 2)
    assert found[0] == [] and len(found[1]) == 1


def nan_checked_every_other_step(rank, world_size):
    """Six steps of two models of several buckets on one group (a GAN's two, say), NaN in rank 1's input
    on steps 1, 2 and 5, the check on one step in two: per step and model, the seqs of its buckets and of
    those that held NaN."""
    ch.instrument()
    check = ch.NanCheckHook(mode="report", every=2).register_with_comm()
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    models = [DDP(_model(layers=4), bucket_cap_mb=0.001) for _ in range(2)]
    steps = []
    for step in range(6):
        for model in models:
            _grads(model, rank, steps=1, nan=(rank == 1 and step in (1, 2, 5)))
            records = list(reader.read())
            steps.append(([r.seq for r in records if r.kind == ch.START and r.aux > 0],
                          [r.seq for r in records if r.kind == ch.NAN]))
    check.unregister()
    ch.uninstrument()
    return steps


def test_checked_on_one_step_in_two_a_nan_is_reported_on_the_checked_steps_only(run_ranks):
    """``every=2``, steps counted per model: steps 0, 2 and 4 of each model are checked, each bucket of
    them; the NaN of step 2 is reported on every bucket of both models, those of steps 1 and 5 are not (on
    rank 1, who held them; rank 0 never did)."""
    clean, faulty = run_ranks(nan_checked_every_other_step, 2)
    assert all(nans == [] for _, nans in clean)
    assert [len(buckets) for buckets, _ in faulty] == [1, 1] + [4] * 10  # DDP rebuilds its buckets after step 0
    assert [nans for _, nans in faulty] == [[]] * 4 + [faulty[4][0], faulty[5][0]] + [[]] * 6


def hookless_cpu_model(rank, world_size, cache=None):
    """A hookless model's buckets, recorded by the C++ hook, or (``cache``: a fresh one, and no
    compiler) by the Python one."""
    plain = _grads(DDP(_model(layers=4), bucket_cap_mb=0.001), rank)
    if cache is not None:
        os.environ["XDG_CACHE_HOME"], os.environ["CXX"] = cache, "false"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ch.instrument()
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    recorded = _grads(DDP(_model(layers=4), bucket_cap_mb=0.001), rank)  # no post-hook: END is written from C
    records = [r for r in reader.read() if r.kind in (ch.START, ch.END) and r.op == CODE[ch.OpName.all_reduce]]
    ch.uninstrument()
    starts = [r for r in records if r.kind == ch.START and r.aux > 0]  # a bucket's START: its index, its scale
    ends = {r.op_id: r for r in records if r.kind == ch.END}
    return {"plain": plain, "recorded": recorded, "cpp": ddp.cpp_hook() is not None,
            "warnings": [str(w.message) for w in caught if "DDP" in str(w.message)],
            "buckets": [(s.seq, bucket_of(s.aux), s.nbytes, ends[s.op_id].seq, ends[s.op_id].flags, ends[s.op_id].aux,
                         ends[s.op_id].t_ns >= s.t_ns) for s in starts if s.op_id in ends],
            "scales": [exponent_of(s.aux) for s in starts],
            "unended": [s.op_id for s in starts if s.op_id not in ends]}


def _same_buckets_as_plain_ddp(results):
    params_bytes = sum(p.numel() * 4 for p in _model(layers=4).parameters())
    for r in results:
        for got, want in zip(r["recorded"], r["plain"]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=0)
        assert r["unended"] == []
        # DDP's first backward reduces one bucket; it rebuilds them by size (one per layer here) after
        assert [index for _, index, *_ in r["buckets"]] == [0, 0, 1, 2, 3]
        if r["cpp"]:  # its pass found each bucket's largest exponent (the Python hook's path makes none)
            assert all(scale is not None and -127 <= scale < 128 for scale in r["scales"]), r["scales"]
        assert sum(nbytes for _, _, nbytes, *_ in r["buckets"]) == 2 * params_bytes
        for start_seq, _, nbytes, end_seq, status, wire, ordered in r["buckets"]:
            assert (end_seq, STATUS[status], wire, ordered) == (start_seq, "ok", nbytes, True)
    assert [b[0] for b in results[0]["buckets"]] == [b[0] for b in results[1]["buckets"]]  # the same (pg, seq)


def test_a_hookless_cpu_model_records_each_bucket_from_cpp_with_plain_ddps_gradients(run_ranks):
    results = run_ranks(hookless_cpu_model, 2)
    assert [(r["cpp"], r["warnings"]) for r in results] == [(True, [])] * 2
    _same_buckets_as_plain_ddp(results)


class _Cast(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def dtype_buckets(rank, world_size, dtype):
    """A hookless model of ``dtype``'s gradients under plain DDP, then recorded by the C++ hook; the scale
    its pass found of each bucket, and the largest of the rank's own gradients of the last step (the
    buckets' values before their all_reduce, once divided by the world's size)."""
    model = lambda: torch.nn.Sequential(_Cast(dtype), *_model(layers=4)).to(dtype)  # noqa: E731
    own = max((g / world_size).abs().max().item() for g in _grads(model(), rank)[-1])
    plain = _grads(DDP(model(), bucket_cap_mb=0.001), rank)
    ch.instrument()
    reader = ch.RingReader(ch.ring(), start=ch.ring().claimed())
    recorded = _grads(DDP(model(), bucket_cap_mb=0.001), rank)
    scales = [exponent_of(r.aux) for r in reader.read() if r.kind == ch.START and r.aux > 0]
    ch.uninstrument()
    return plain, recorded, scales, own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpp_hook_divides_buckets_as_plain_ddp_and_finds_their_scale(run_ranks, dtype):
    for plain, recorded, scales, own in run_ranks(dtype_buckets, 2, dtype=dtype):
        for got, want in zip(recorded, plain):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)  # bit for bit (halved): 16-bit divided in float, rounded so
        assert len(scales) > 2 and None not in scales, scales  # one bucket, then DDP's rebuilt ones
        assert max(scales[1:]) == torch.frexp(torch.tensor(own)).exponent.item() - 1, (scales, own)


def test_without_a_compiler_a_hookless_model_is_recorded_by_the_python_hook_with_a_warning(run_ranks, tmp_path):
    results = run_ranks(hookless_cpu_model, 2, timeout_s=120, cache=str(tmp_path / "cache"))
    for r in results:
        assert not r["cpp"] and len(r["warnings"]) == 1
        assert "C++ hook could not be built" in r["warnings"][0] and "C++ compiler and ninja" in r["warnings"][0]
    _same_buckets_as_plain_ddp(results)


def refused_bucket(rank, world_size):
    ch.instrument()

    def refuse(args):
        if args.bucket is not None:
            raise ValueError(f"bucket {args.bucket.index} refused")

    handle = ch.register_pre_hook(refuse, propagate=True)
    try:
        _grads(DDP(_model()), rank, steps=1)
    except ValueError as error:
        return str(error)
    finally:
        handle.remove()
        ch.uninstrument()


def test_a_propagating_pre_hooks_error_reaches_backwards_caller_through_the_cpp_hook(run_ranks):
    assert run_ranks(refused_bucket, 2) == ["bucket 0 refused"] * 2


def raise_mode_buckets(rank, world_size):
    ch.instrument()
    check = ch.NanCheckHook(mode="raise").register_with_comm()
    model = DDP(_model())
    try:
        _grads(model, rank, steps=1)  # finite: the C++ hook's division proves it, the check steps aside
        _grads(model, rank, steps=1, nan=True)
    except RuntimeError as error:
        return str(error)
    finally:
        check.unregister()
        ch.uninstrument()


def test_in_raise_mode_a_finite_bucket_is_reduced_and_a_nan_bucket_refused_through_the_cpp_hook(run_ranks):
    for message in run_ranks(raise_mode_buckets, 2):
        assert message is not None and message.startswith("commlens NaN check: all_reduce"), message
        assert "input tensor 0 holds" in message and " 0 NaN" not in message


def quantize_outcomes(rank, world_size):
    """Each quantize hook's outcome on gloo/CPU, plain and wrapped: its error (torch 2.13 and 2.14 fail
    there), or the gradients it gives (2.15 runs them)."""
    outcomes = {}
    for name, hook in (("per_tensor", quantization_hooks.quantization_pertensor_hook),
                       ("per_channel", quantization_hooks.quantization_perchannel_hook)):
        for wrapped in (False, True):
            model = DDP(_model())
            model.register_comm_hook(None, ddp.wrap(hook) if wrapped else hook)
            try:
                outcomes[(name, wrapped)] = [[g.tolist() for g in step] for step in _grads(model, rank, steps=1)]
            except Exception as error:
                outcomes[(name, wrapped)] = (type(error).__name__, str(error).splitlines()[0])
    return outcomes


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the quantize hooks run; this checks them on CPU")
def test_the_wrapper_gives_the_quantize_hooks_outcome_unchanged_their_error_or_their_gradients(run_ranks):
    for outcomes in run_ranks(quantize_outcomes, 2):
        for name in ("per_tensor", "per_channel"):
            assert outcomes[(name, True)] == outcomes[(name, False)], name


def gpu_hooks(rank, world_size):
    def model():
        return DDP(_model().cuda(), device_ids=[rank])

    results = {"plain": _grads(model(), rank)}
    for name, hook in (("bf16", default_hooks.bf16_compress_hook),
                       ("per_tensor", quantization_hooks.quantization_pertensor_hook),
                       ("per_channel", quantization_hooks.quantization_perchannel_hook)):
        unwrapped = model()
        unwrapped.register_comm_hook(None, hook)
        results[name] = _grads(unwrapped, rank)
        wrapped = model()
        wrapped.register_comm_hook(None, ddp.wrap(hook))
        results[name + " wrapped"] = _grads(wrapped, rank)
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="the bf16 hook needs NCCL and the quantize hooks CUDA: 2 GPUs, one per rank")
def test_wrapped_bf16_and_quantize_hooks_give_the_unwrapped_hooks_gradients_on_nccl(run_ranks):
    for r in run_ranks(gpu_hooks, 2, backend="nccl"):
        for name, atol in (("bf16", 0), ("per_tensor", 1e-4), ("per_channel", 1e-4)):
            for got, want in zip(r[name + " wrapped"], r[name]):
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=0, atol=atol)
        for got, want in zip(r["bf16"], r["plain"]):  # bf16 keeps 8 bits of mantissa
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-3)
