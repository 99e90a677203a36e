"""Stochastic rounding to bfloat16 (trainer/stochastic_rounding.py): the hash against an independent numpy uint32
implementation, the rounding's statistics (unbiased, up with probability equal to the remainder), the eager
chunked form against the compiled kernel's one-pass form, and special values."""

import numpy as np
import pytest
import torch

from trainer.stochastic_rounding import (CHUNK_ELEMENTS, _hash32_int32_, hash32, kernel_site, round_to_bf16,
                                         salt, stochastic_round_)


def lowbias32(x: np.ndarray) -> np.ndarray:
    """Chris Wellons' lowbias32 in numpy uint32 arithmetic (wraps modulo 2^32 by definition)."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def reference_round(x: torch.Tensor, index: np.ndarray, salt_: int) -> torch.Tensor:
    """Float32 `x` rounded by adding the element's 16 random bits below bfloat16's mantissa and truncating, written
    from the definition in the module docstring with numpy."""
    hi = lowbias32((index >> 32).astype(np.uint64) & 0xFFFFFFFF)
    element = (index & 0xFFFFFFFF).astype(np.uint32) ^ hi
    noise = lowbias32(element ^ np.uint32(salt_)) & np.uint32(0xFFFF)
    bits = x.numpy().view(np.uint32).astype(np.uint64) + noise
    rounded = (bits & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return torch.from_numpy(rounded.copy())


def one_pass(x: torch.Tensor, key: int, step: float, tag: int, base: int = 0) -> torch.Tensor:
    """The compiled kernel's form, run eagerly: `x` rounded with the bits of `salt(key, step, tag)` from `base` on."""
    return round_to_bf16(x, torch.tensor(kernel_site(key, base)), torch.tensor(step), tag)


def test_hash_is_lowbias32_in_both_forms():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([torch.arange(1000), torch.randint(0, 2 ** 32, (4093,), generator=gen),
                        torch.tensor([2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1])])
    want = torch.from_numpy(lowbias32(values.numpy()).astype(np.int64))
    assert torch.equal(hash32(values), want)
    # the int32 form (any length, so the vectorised loop's tail runs too) holds the same bits
    as_int32 = torch.from_numpy(values.numpy().astype(np.uint32).view(np.int32).copy())
    assert torch.equal(_hash32_int32_(as_int32.clone()).to(torch.int64) & 0xFFFFFFFF, want)
    assert hash32(12345) == int(lowbias32(np.array([12345]))[0])


@pytest.mark.parametrize("base", [0, 5, 2 ** 31 - CHUNK_ELEMENTS - 3, 2 ** 32 - 70_000, 3 * 2 ** 32 + 11])
def test_eager_chunked_form_equals_the_one_pass_form_and_the_reference(base):
    gen = torch.Generator().manual_seed(1)
    n = 2 * CHUNK_ELEMENTS + 777
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 10 ** torch.randint(-30, 30, (n,),
                                                                                            generator=gen)
    salt_ = salt(torch.tensor(987654321), torch.tensor(17.0), 1)
    rounded = one_pass(x, 987654321, 17.0, 1, base)  # from 2^32 - 70000 and 2^31 - CHUNK_ELEMENTS - 3 on it crosses
    assert torch.equal(rounded, reference_round(x, np.arange(base, base + n), int(salt_)))  # 2^32 and 2^31
    assert torch.equal(rounded.bfloat16().float(), rounded)  # bfloat16 values: the cast is exact
    chunked = torch.empty(n, dtype=torch.bfloat16)
    stochastic_round_(chunked, x, base, salt_)
    assert torch.equal(chunked.float(), rounded)
    # a non-contiguous destination takes the one-pass form over its row-major order
    x2 = x[:1000].view(25, 40)
    strided = torch.empty(40, 25, dtype=torch.bfloat16).t()
    stochastic_round_(strided, x2, base, salt_)
    assert torch.equal(strided.float(), rounded[:1000].view(25, 40))


def test_rounds_up_with_probability_equal_to_the_remainder():
    """Between two bfloat16 neighbours at fractions 1/8, 1/2 and 0.9 of the way, negative values too: every
    result is a neighbour, the share rounded up is the fraction (binomial, 5 sigma), the mean is unbiased."""
    n = 1 << 18
    lower = torch.tensor(1.5).bfloat16().float()
    ulp = 2.0 ** -7
    for fraction in (1 / 8, 1 / 2, 0.9):
        for sign in (1, -1):
            x = torch.full((n,), sign * (lower.item() + fraction * ulp))
            r = one_pass(x, 3, 1.0, 0)
            assert set(r.abs().unique().tolist()) == {lower.item(), lower.item() + ulp}
            up = (r.abs() > lower).double().mean().item()
            assert abs(up - fraction) < 5 * (fraction * (1 - fraction) / n) ** 0.5, (fraction, sign, up)
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0 ** -130, 3.0e38]).bfloat16().float()
    assert torch.equal(one_pass(exact, 99, 1.0, 0), exact)


def test_special_values_and_independent_streams():
    """Infinities stay, NaN stays NaN whatever its bits (CUDA's canonical NaN 0x7FFFFFFF would wrap to -0.0 if the
    noise were added to it); the bits differ between steps, moments and parameters."""
    bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1, 0x7F800000, -8388608], dtype=torch.int32)  # NaNs, +-inf
    x = bits.view(torch.float32).repeat(1000)
    for s in range(20):
        r = one_pass(x, s, 1.0, 0)
        assert r.view(1000, 5)[:, :3].isnan().all() and torch.equal(r.view(1000, 5)[:, 3:], x.view(1000, 5)[:, 3:])
    index = torch.arange(1 << 16)

    def noise(key, step, tag):
        return hash32((index ^ salt(torch.tensor(key), torch.tensor(float(step)), tag)) & 0xFFFFFFFF) & 0xFFFF

    base = noise(1, 1, 0).double()
    for other in (noise(1, 2, 0), noise(1, 1, 1), noise(2, 1, 0)):
        assert abs(np.corrcoef(base.numpy(), other.double().numpy())[0, 1]) < 0.02
    assert abs(base.mean().item() / 65535 - 0.5) < 0.01


@pytest.mark.cuda
def test_cuda_compiled_one_pass_form_has_the_eager_bits():
    """The compiled kernel's form through inductor on CUDA (int32 multiplications that must wrap, int64 to int32
    casts that must keep the low bits) rounds bit for bit as the eager chunked form on CPU, across 2^31 and 2^32
    in the global index, for both moments' tags."""
    compiled = torch.compile(round_to_bf16, dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3 * CHUNK_ELEMENTS + 5, generator=gen) * 3
    for base in (7, 2 ** 31 - CHUNK_ELEMENTS, 2 ** 32 - 70_000, 3 * 2 ** 32 + 11):
        for tag in (0, 1):
            want = torch.empty(x.shape, dtype=torch.bfloat16)
            stochastic_round_(want, x, base, salt(torch.tensor(4321), torch.tensor(9.0), tag))
            got = compiled(x.cuda(), torch.tensor(kernel_site(4321, base), device="cuda"),
                           torch.tensor(9.0, device="cuda"), tag)
            assert torch.equal(got.cpu().bfloat16(), want), (base, tag)
