"""The NaN check's one pass over a tensor agrees with torch's own element-wise verdict, for every
float dtype, wherever the NaN or Inf sits, and where a sum of finite values would overflow; and its
count of a non-finite tensor's NaNs and Infs agrees with torch's."""

import pytest
import torch

from commlens.hooks.finite import SCAN_UP_TO, counted
from commlens.hooks.nan_check import tensor_finite

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_single_non_finite_element_is_found_wherever_it_sits(dtype, special):
    for n in (1, 7, 64, 1000, SCAN_UP_TO // 2 + 3, SCAN_UP_TO + 1):  # the last one is summed by torch
        for where in {0, n // 2, n - 1}:
            t = torch.randn(n, dtype=dtype)
            t[where] = special
            assert not tensor_finite(t) and not bool(torch.isfinite(t).all()), (n, where)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_extremes_are_finite_even_where_their_sum_overflows(dtype):
    real = torch.empty(0, dtype=dtype).real.dtype
    info = torch.finfo(real)
    t = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0, info.max, info.max], dtype=real).to(dtype)
    assert tensor_finite(t) and bool(torch.isfinite(t).all())
    assert tensor_finite(torch.empty(0, dtype=dtype))


def test_the_imaginary_part_counts_too():
    t = torch.zeros(5, dtype=torch.complex64)
    t[3] = complex(0.0, float("nan"))
    assert not tensor_finite(t)


def test_a_view_is_judged_by_its_own_elements_only():
    base = torch.ones(4, 6)
    base[:, 5] = float("nan")
    assert tensor_finite(base[:, :5]) and not base[:, :5].is_contiguous()  # strided: summed, not scanned
    assert tensor_finite(base[1:3, 0])
    assert not tensor_finite(base[2:, 3:])
    assert tensor_finite(base.view(-1)[6:11])  # contiguous, at an offset in the storage: scanned
    assert not tensor_finite(base.view(-1)[6:12])


def test_random_tensors_agree_with_torch():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        dtype = DTYPES[trial % len(DTYPES)]
        t = torch.randn(int(torch.randint(1, 300, (1,), generator=generator)), generator=generator).to(dtype)
        for _ in range(int(torch.randint(0, 3, (1,), generator=generator))):
            index = int(torch.randint(0, t.numel(), (1,), generator=generator))
            t[index] = (float("nan"), float("inf"), float("-inf"))[index % 3]
        assert tensor_finite(t) == bool(torch.isfinite(t).all()), t
        if not t.is_complex():  # complex tensors are counted by torch
            assert counted(t) == (int(torch.isnan(t).sum()), int(torch.isinf(t).sum())), t
