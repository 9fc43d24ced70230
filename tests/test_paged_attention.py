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
