"""Stochastic rounding of float32 to bfloat16, reproducible: the random bits are a hash, not a generator's draw.

Rounding to nearest biases a quantity that moves by less than half a bfloat16 step per update (2^-9 of itself): the
update is lost every time, the stored value stalls. AdamW's moments with bfloat16 state are such quantities (beta2 =
0.95 moves the second moment by 5% of the difference to the new squared gradient). Stochastic rounding rounds up
with probability equal to the distance from the lower neighbour, so every stored value equals the float32 one in
expectation, and small updates survive on average.

The random 16 bits of element ``i`` are those of ``hash32((i mod 2^32) ^ hash32(i >> 32) ^ salt)`` where ``i`` is the
element's index in the *global* (unsharded) tensor and the salt mixes a per-tensor key (the parameter's name and the
run's seed), the step counter and which moment it is. So the rounding is:

* the same on every layout: an FSDP or EP shard rounds its elements as one process rounds the whole tensor, and
  replicas (HSDP) stay identical;
* exactly resumable: the step counter is in the optimizer's state, nothing else is;
* the same eagerly on CPU and in the compiled CUDA kernel: integer arithmetic only, no generator state. Inside the
  kernel the bits cost no memory traffic.

The hash is Chris Wellons' "lowbias32" integer hash (two multiply-xorshift rounds), computed in int32 whose
multiplications wrap modulo 2^32 (right shifts are arithmetic there, hence masks). Both forms take the same bits: the
eager one a chunk of ``CHUNK_ELEMENTS`` at a time (``stochastic_round_``), the compiled kernel's in one pass
(``round_to_bf16``), where everything that does not depend on the element (the tensor's key hashed per moment, the
hash of the index's upper 32 bits) is computed once on the host (``kernel_site``): a fused kernel recomputes
per element whatever it is given to compute, and an int64 multiplication costs a GPU several int32 ones. On an H200
the former one-pass form (int64, four hashes per moment and element) made the step's kernel compute-bound: 22.4 ms
for 2.25B parameters, twice its 45 GB of memory traffic.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["CHUNK_ELEMENTS", "TRANSIENT_BYTES_PER_ELEMENT", "hash32", "kernel_site", "round_to_bf16", "salt",
           "shard_index_base", "stochastic_round_"]

_M32 = 0xFFFFFFFF
#: eager rounding works on this many elements at a time, which bounds its temporaries (a power of two: chunks
#: aligned to it in the global index never straddle 2^31 or 2^32)
CHUNK_ELEMENTS = 1 << 16
#: temporaries of the eager rounding per element of a chunk, at their peak: the int32 bits, the NaN mask and the
#: rounded float32 values (measured by the exact tracker in tests/test_optimizer.py)
TRANSIENT_BYTES_PER_ELEMENT = 9


def _mul32(x, c: int):
    """(x * c) mod 2^32 for ``x`` in [0, 2^32) (an int or an int64 tensor), with every product below 2^48."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x):
    """lowbias32 of ``x`` in [0, 2^32), an int or an int64 tensor: a bijection on 32 bits with low bias."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _as_int32(v: int) -> int:
    """The int32 with the bits of ``v`` in [0, 2^32)."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _hash32_int32_(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` in place on an int32 tensor holding the bits: the same values, 3-4x faster on CPU, where int32
    multiplies are vectorised and int64 ones are not. Right shifts are arithmetic on int32, hence the masks;
    multiplies wrap modulo 2^32 (checked against ``hash32`` in tests/test_stochastic_rounding.py)."""
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    x.mul_(0x7FEB352D)
    x ^= (x >> 15).bitwise_and_(0x1FFFF)
    x.mul_(_as_int32(0x846CA68B))
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    return x


def salt(key: torch.Tensor, step: torch.Tensor, tag: int) -> torch.Tensor:
    """A 0-d int64 salt in [0, 2^32) from a tensor's 0-d int64 ``key`` (in [0, 2^32)), its 0-d step counter (any
    dtype holding an integer) and a small ``tag`` telling apart the values rounded in one step (the two moments)."""
    return hash32(hash32(key ^ tag) ^ (step.to(torch.int64) & _M32))


def _add_noise(bits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` rounded by adding random ``bits`` (int32 in [0, 2^16)) below the 16 bits that bfloat16 drops,
    then dropping them: up with probability equal to the remainder. NaN passes unchanged (adding to its bits could
    make a number of it; infinities stay as they are by themselves). ``bits`` is overwritten."""
    rounded = bits.add_(x.view(torch.int32)).bitwise_and_(-65536).view(torch.float32)
    return torch.where(x == x, rounded, x)


def _rounded(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x`` stochastically rounded with the noise of int32 ``bits`` (each element's index bits xor its salt, in the
    shape of ``x``; overwritten)."""
    return _add_noise(_hash32_int32_(bits).bitwise_and_(0xFFFF), x)


def kernel_site(key: int, base: int) -> list[int]:
    """What ``round_to_bf16`` needs of a tensor, computed once on the host: ``hash32(key ^ tag)`` for the two
    moments' tags 0 and 1, ``base`` (the global index of its first element) and the hashes of the upper 32 bits of
    ``base`` and of the next multiple of 2^32 (a tensor of fewer than 2^32 elements crosses one at most)."""
    high = base >> 32
    return [hash32(key ^ 0), hash32(key ^ 1), base, hash32(high), hash32(high + 1)]


def round_to_bf16(x: torch.Tensor, site: torch.Tensor, step: torch.Tensor, tag: int) -> torch.Tensor:
    """Float32 ``x`` stochastically rounded, as float32 values that bfloat16 holds exactly (so ``.to(bfloat16)``
    and ``copy_`` into bfloat16 are exact), in one pass: the compiled kernel's form, the same bits as
    ``stochastic_round_`` with ``salt(key, step, tag)`` and ``base``. ``site``: ``kernel_site(key, base)`` as an
    int64 tensor (so that one graph serves every parameter); ``step``: the 0-d step counter; ``tag``: 0 or 1, the
    moment. Elements in row-major order have the global indices ``base``, ``base + 1``, ...; fewer than 2^32 of
    them."""
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape) + site[2]
    upper = torch.where((index >> 32) == (site[2] >> 32), site[3], site[4]).to(torch.int32)
    salt32 = _hash32_int32_((site[tag] ^ (step.to(torch.int64) & _M32)).to(torch.int32))
    # int32 casts keep the low 32 bits: the index's lower half and the hashes' bits
    return _rounded(x, index.to(torch.int32) ^ upper ^ salt32)


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, base: int, salt_: torch.Tensor) -> None:
    """``dst`` (bfloat16) := ``src`` (float32, same shape) stochastically rounded, elements taken in row-major order
    as global indices ``base``, ``base + 1``, ...: the random 16 bits of index ``i`` are those of
    ``hash32((i mod 2^32) ^ hash32(i >> 32) ^ salt_)``. The eager form: in int32 and a chunk of at most
    ``CHUNK_ELEMENTS`` at a time, so that the temporaries stay at a few bytes per element of one chunk, whatever the
    tensor's size (a non-contiguous ``dst`` takes a contiguous bfloat16 copy besides)."""
    if not dst.is_contiguous():
        rounded = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        stochastic_round_(rounded, src, base, salt_)
        dst.copy_(rounded)
        return
    n = src.numel()
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    start = 0
    while start < n:
        first = base + start
        stop = min(n, start + CHUNK_ELEMENTS - first % CHUNK_ELEMENTS)  # aligned: one value of index >> 32
        low = _as_int32(first & _M32)
        bits = torch.arange(low, low + stop - start, dtype=torch.int32, device=src.device)
        bits ^= (salt_ ^ hash32(first >> 32)).to(torch.int32)
        flat_dst[start:stop].copy_(_rounded(flat_src[start:stop], bits))
        start = stop


def shard_index_base(t: torch.Tensor) -> int | None:
    """Global row-major index of the first element of ``t``'s local part: 0 for a plain tensor or a replicated
    DTensor, the offset of the shard for a DTensor sharded along dim 0 only (FSDP, EP, HSDP: the local part is a
    contiguous slab of the global tensor); None for other shardings (the local part is not a slab)."""
    if not isinstance(t, DTensor):
        return 0
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local_shape[1:]) != tuple(t.shape[1:]) or any(offset[1:]):
        return None
    return offset[0] * math.prod(t.shape[1:]) if offset else 0
