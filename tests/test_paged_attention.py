"""The compiled CPU step's attention operator (paged_attention.cpp): the numbers of the gather
and two sums it replaces, and a row's result its own, whatever travels with it, however wide
its table is padded and however many threads run it."""

import pytest
import torch

from inference.worker.engine import compiled, cpu_ops

SHAPE = compiled.Shape(heads=9, kv_heads=3, head_dim=64, block_size=16, eps=1e-5)
BLOCKS = 40


@pytest.fixture(scope="module", autouse=True)
def operator(tmp_path_factory):
    cpu_ops.load(tmp_path_factory.mktemp("compiled"))


def step(dtype, rows=12, seed=0):
    """A step of `rows` rows over a shuffled cache: (q, k, v, tables, positions)."""
    generator = torch.Generator().manual_seed(seed)
    slots = BLOCKS * SHAPE.block_size
    k, v = (torch.randn(slots, SHAPE.kv_heads, SHAPE.head_dim, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(rows, SHAPE.heads, SHAPE.head_dim, generator=generator)
    width = 12
    tables = torch.stack([torch.randperm(BLOCKS, generator=generator)[:width] for _ in range(rows)])
    positions = torch.randint(0, width * SHAPE.block_size, (rows,), generator=generator)
    positions[0] = 0  # a first token sees itself alone
    return q, k, v, tables, positions


def run(q, k, v, tables, positions):
    return torch.ops.tokstream.paged_attention(q, k, v, tables, positions, SHAPE.block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_it_gives_the_numbers_of_the_gather_and_two_sums(dtype):
    q, k, v, tables, positions = step(dtype)
    expected = compiled.gathered(q, k, v, tables, positions, SHAPE)
    torch.testing.assert_close(run(q, k, v, tables, positions), expected, rtol=1e-5, atol=1e-5)


def exact(q, k, v, tables, positions):
    """attend() in float64, a row and a head at a time."""
    size, group = SHAPE.block_size, SHAPE.heads // SHAPE.kv_heads
    rows = []
    for row in range(len(q)):
        seen = torch.arange(int(positions[row]) + 1)
        slots = tables[row][seen // size] * size + seen % size
        keys, values = k[slots].double(), v[slots].double()
        weights = [torch.softmax(keys[:, h // group] @ q[row, h].double() * SHAPE.head_dim**-0.5, dim=0) for h in range(SHAPE.heads)]
        rows.append(torch.cat([w @ values[:, h // group] for h, w in enumerate(weights)]))
    return torch.stack(rows)


def test_scores_far_apart_give_the_softmax_still():
    """Queries scaled up so that a row's scores lie hundreds apart: the exponentials reach the
    ends of their range, and the result stays within float32's rounding of scores that large
    (2e-5 here; the gather and two sums 8e-6) of the exact one."""
    q, k, v, tables, positions = step(torch.float32, rows=20, seed=1)
    q = q * 40
    torch.testing.assert_close(run(q, k, v, tables, positions).double(), exact(q, k, v, tables, positions), rtol=0, atol=1e-4)


def test_a_rows_result_is_its_own_whatever_travels_with_it():
    q, k, v, tables, positions = step(torch.bfloat16, rows=40)
    whole = run(q, k, v, tables, positions)
    for row in (0, 7, 39):
        one = slice(row, row + 1)
        assert torch.equal(run(q[one], k, v, tables[one], positions[one]), whole[one])
    wider = torch.cat([tables, torch.zeros(len(tables), 5, dtype=tables.dtype)], dim=1)
    assert torch.equal(run(q, k, v, wider, positions), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(q, k, v, tables, positions), whole)
    finally:
        torch.set_num_threads(threads)


def test_a_cache_of_another_dtype_is_refused_clearly():
    q, k, v, tables, positions = step(torch.float32)
    with pytest.raises(RuntimeError, match="not supported"):
        run(q, k.double(), v.double(), tables, positions)


def test_a_head_size_the_lanes_do_not_divide_is_refused_clearly():
    q, k, v, tables, positions = step(torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        run(q[..., :60].contiguous(), k[..., :60].contiguous(), v[..., :60].contiguous(), tables, positions)


def test_a_position_or_a_block_outside_the_cache_is_refused_not_read():
    q, k, v, tables, positions = step(torch.float32)
    past_table = positions.clone()
    past_table[3] = tables.shape[1] * SHAPE.block_size
    with pytest.raises(RuntimeError, match="outside its row's table"):
        run(q, k, v, tables, past_table)
    with pytest.raises(RuntimeError, match="outside its row's table"):
        run(q, k, v, tables, positions - 1)  # the first row's position becomes -1
    past_cache = tables.clone()
    past_cache[2, 0] = BLOCKS
    with pytest.raises(RuntimeError, match="past the cache"):
        run(q, k, v, past_cache, positions)
