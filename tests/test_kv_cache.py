"""The block pool's bookkeeping: reservations hold, cached blocks are reused, then evicted."""

import torch

from inference import backends
from inference.worker.engine.kv_cache import BLOCK_SIZE, BlockPool, block_hashes


def pool(blocks=4):
    return BlockPool(1, blocks, 2, 1, 1, torch.float32, "cpu")


def test_a_reservation_is_never_taken_by_someone_else():
    p = pool(4)
    assert p.reserve(3) and not p.reserve(2) and p.reserve(1)
    blocks = [p.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2]  # lowest first: a sequence's blocks are neighbours
    p.release(blocks)
    assert p.available() == 3  # one still reserved


def test_cached_blocks_are_reused_until_space_is_needed():
    p = pool(3)
    assert p.reserve(2)
    blocks = [p.allocate(), p.allocate()]
    hashes = block_hashes([1, 2, 3, 4], 2)
    for block, digest in zip(blocks, hashes):
        p.register(block, digest)
    p.release(blocks)
    assert p.available() == 3  # cached but idle: still available
    assert p.lookup(hashes) == blocks and p.available() == 1
    p.release(blocks)
    assert p.reserve(3)
    assert sorted(p.allocate() for _ in range(3)) == [0, 1, 2]  # evicted to make room
    assert p.lookup(hashes) == []


def test_a_lookup_does_not_take_blocks_promised_to_a_reservation():
    p = pool(2)
    assert p.reserve(1)
    block = p.allocate()
    p.register(block, block_hashes([7, 8], 2)[0])
    p.release([block])
    assert p.reserve(2)  # counts the idle cached block
    assert p.lookup(block_hashes([7, 8], 2)) == []  # so a lookup may not claim it now


def test_hashes_cover_everything_before_their_block():
    assert block_hashes([1, 2, 3, 4], 2)[1] != block_hashes([9, 9, 3, 4], 2)[1]
    assert len(block_hashes([1, 2, 3], 2)) == 1  # only full blocks


def test_eviction_takes_a_cached_chain_from_its_tail():
    p = pool(3)
    assert p.reserve(3)
    blocks = [p.allocate() for _ in range(3)]
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2)
    for block, digest in reversed(list(zip(blocks, hashes))):  # as the engine registers them
        p.register(block, digest)
    p.release(blocks)
    assert p.reserve(1)
    p.allocate()  # evicts one cached block
    assert p.lookup(hashes) == blocks[:2]  # the head of the chain is still there


def test_admission_rounds_the_cache_as_the_pool_does():
    # The gateway may not import the engine, so it keeps its own copy of the block size.
    assert backends.KV_BLOCK_SIZE == BLOCK_SIZE
