"""The layout-invariant initialisation (`models/common/init.py`) against its definition, computed here one block at a
time on one thread: block b of parameter `fqn` (rows 64 b .. 64 b + 63 along dim 0) is the rule's draw from a
generator seeded by sha256("seed/fqn/b"). Whatever rows a rank holds, it must hold exactly those rows of that tensor.
"""

import hashlib

import pytest
import torch

import models.common.init as init


def _definition(shape, rule, seed: int, fqn: str) -> torch.Tensor:
    """The full parameter by the definition (an independent reference: its own seeding, no staging, no threads)."""
    blocks = []
    for start in range(0, shape[0], 64):
        digest = hashlib.sha256(f"{seed}/{fqn}/{start // 64}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        block = torch.empty((min(64, shape[0] - start), *shape[1:]))
        rule(block, gen)
        blocks.append(block)
    return torch.cat(blocks)


def _trunc(t, g):
    torch.nn.init.trunc_normal_(t, std=0.02, generator=g)


def _normal(t, g):
    t.normal_(0, 1, generator=g)


@pytest.fixture(autouse=True)
def _threads():
    """The tests set torch's thread count: the next tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


SHAPES = {"wide": (200, 96), "experts": (5, 24, 16), "vector": (70,), "one_row": (1, 8)}


@pytest.mark.parametrize("staging_bytes", [1 << 30, 4096], ids=["one_group", "a_group_per_parameter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_parameters_equal_the_definition(staging_bytes, dtype):
    """Plain tensors (float32 ones are drawn in place, bf16 ones staged and cast), in one staging group or one
    group per parameter, drawn on several threads: bit for bit the definition."""
    torch.set_num_threads(2)
    params = {fqn: torch.full(shape, float("nan"), dtype=dtype) for fqn, shape in SHAPES.items()}
    rules = {fqn: (_normal if fqn == "vector" else _trunc) for fqn in SHAPES}
    init.init_parameters_(((fqn, p, rules[fqn]) for fqn, p in params.items()), seed=7, staging_bytes=staging_bytes)
    for fqn, p in params.items():
        assert torch.equal(p, _definition(SHAPES[fqn], rules[fqn], 7, fqn).to(dtype)), fqn


@pytest.mark.parametrize("rows", [range(50, 140), range(0, 10), range(199, 200), [3, 64, 65, 130, 199, 0]],
                         ids=["range_across_blocks", "range_inside_a_block", "last_row", "scattered_rows"])
def test_a_shard_holds_exactly_its_rows_of_the_definition(monkeypatch, rows):
    """A rank's local rows (a row range as Shard(0) gives, with partial first and last blocks, or any set of rows as
    strided shardings give) are those rows of the full tensor."""
    rows = torch.tensor(list(rows))
    local = torch.full((rows.numel(), 96), float("nan"))
    monkeypatch.setattr(init, "_local_part", lambda param: (param, rows, SHAPES["wide"][0]))
    init.init_parameters_([("wide", local, _trunc)], seed=3)
    assert torch.equal(local, _definition(SHAPES["wide"], _trunc, 3, "wide")[rows])


def test_the_values_do_not_depend_on_the_threads():
    """One thread or several: the same values (each block has its own generator)."""
    out = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        p = torch.empty(300, 40)
        init.init_parameters_([("w", p, _trunc)], seed=1)
        out.append(p)
    assert torch.equal(*out)
