"""The scheduler on its own: its line and its running set, admission and preemption over a
real block pool, with no engine and no model (each step's tokens are made up here)."""

from collections import Counter

import torch

from inference.worker.engine import Request, RequestStatus, SamplingParams
from inference.worker.engine.budget import GAP_BOUND, StepCost
from inference.worker.engine.kv_cache import BlockPool
from inference.worker.engine.kv_manager import KVCacheManager
from inference.worker.engine.scheduler import Scheduler


def scheduler(blocks, max_running=8):
    pool = BlockPool(1, blocks, 2, 1, 1, torch.float32, "cpu")  # two tokens a block
    return Scheduler(KVCacheManager(pool), StepCost(), Counter(), 64, max_running, 24, 512, lambda: 0.0, verifies_drafts=False)


def request(name, prompt, max_tokens=2, **fields):
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), arrived_at=0.0, **fields)


def computed(s, plan, token=9):
    """What the engine does with a step's chunks: their keys and values are in, and each
    request whose prompt is done shares it and takes a token."""
    for req, chunk in plan.scheduled:
        req.computed = chunk.start + len(chunk.token_ids)
        if req.pending():
            s.kv.register_prompt(req)
        else:
            if not req.output_ids:
                s.kv.register_computed(req)
            req.output_ids.append(token)
            req.all_ids.append(token)
            req.generated.append(True)


def finish(s, req):
    """What the engine does with a request it ends."""
    req.status = RequestStatus.FINISHED
    s.kv.free(req)


def names(requests):
    return [r.request_id for r in requests]


def test_the_line_is_admitted_first_come_first_served_up_to_the_running_limit():
    s = scheduler(blocks=32, max_running=2)
    s.add([request("a", [1, 2, 3]), request("b", [4, 5, 6]), request("c", [7, 8, 9])])
    plan = s.schedule()
    assert names(s.running) == ["a", "b"] and names(s.waiting) == ["c"]
    assert [(r.request_id, chunk.token_ids) for r, chunk in plan.scheduled] == [("a", [1, 2, 3]), ("b", [4, 5, 6])]
    assert not plan.failed and s.waiting[0].status is RequestStatus.WAITING


def test_a_finished_request_frees_its_slot_for_the_head_of_the_line():
    s = scheduler(blocks=32, max_running=1)
    s.add([request("a", [1, 2, 3]), request("b", [4, 5, 6])])
    computed(s, s.schedule())
    finish(s, s.running[0])
    plan = s.schedule()
    assert names(s.running) == ["b"] and not s.waiting
    assert names(r for r, _ in plan.scheduled) == ["b"]


def test_a_full_cache_sends_the_newest_request_back_to_the_head_of_the_line():
    s = scheduler(blocks=5)
    a, b = request("a", [1, 2, 3]), request("b", [4, 5, 6])
    s.add([a, b])
    computed(s, s.schedule())  # both prompts in, a token each: each needs a third block next
    plan = s.schedule()
    assert names(s.running) == ["a"] and list(s.waiting) == [b]
    assert b.status is RequestStatus.WAITING and b.computed == 0 and b.all_ids == [4, 5, 6, 9]  # it keeps its sequence
    assert s.stats["preemptions"] == 1 and names(r for r, _ in plan.scheduled) == ["a"]
    finish(s, a)
    plan = s.schedule()
    assert names(s.running) == ["b"] and [chunk.token_ids for _, chunk in plan.scheduled] == [[6, 9]]  # its first block came from the prefix cache


def test_a_request_that_can_never_fit_leaves_both_queues_with_why():
    s = scheduler(blocks=4)
    s.add([request("huge", [1, 2, 3], max_tokens=100), request("empty", []), request("ok", [1, 2, 3])])
    plan = s.schedule()
    assert [(r.request_id, why) for r, why in plan.failed] == [("huge", "the request is larger than the whole KV cache"), ("empty", "the prompt is empty")]
    assert names(s.requests()) == ["ok"]


def test_a_later_choice_waits_in_line_until_its_leader_has_a_token():
    s = scheduler(blocks=32)
    leader = request("x.0", [1, 2, 3, 4, 5], group="x")
    follower = request("x.1", [1, 2, 3, 4, 5], group="x", index=1, leader=leader)
    s.add([leader, follower])
    computed(s, s.schedule())
    assert names(s.running) == ["x.0"] and names(s.waiting) == ["x.1"]
    s.schedule()
    assert names(s.running) == ["x.0", "x.1"] and follower.computed == 4  # the prompt's full blocks were cached


def test_removing_a_group_takes_its_waiting_and_running_requests():
    s = scheduler(blocks=32, max_running=1)
    s.add([request("a", [1, 2, 3], group="g"), request("b", [4, 5, 6]), request("c", [7, 8, 9], group="g")])
    s.schedule()
    assert names(s.remove({"g"})) == ["c", "a"]
    assert names(s.requests()) == ["b"]


def test_requests_arriving_together_with_one_beginning_compute_it_once():
    s = scheduler(blocks=64)
    system = list(range(1, 9))  # four blocks of a system turn every prompt begins with
    a, b, c = (request(name, system + [20 + n, 30 + n, 40 + n]) for n, name in enumerate("abc"))
    s.add([a, b, c])
    computed(s, s.schedule())
    assert names(s.running) == ["a"] and names(s.waiting) == ["b", "c"]  # they wait for what a computes
    plan = s.schedule()
    assert names(s.running) == ["a", "b", "c"] and b.cached_tokens == c.cached_tokens == len(system)
    assert [(r.request_id, chunk.token_ids) for r, chunk in plan.scheduled][1:] == [("b", [21, 31, 41]), ("c", [22, 32, 42])]


def test_a_prefix_is_shared_block_by_block_while_its_prompt_is_still_computing():
    s = scheduler(blocks=64)
    s.add([request("d", [99, 98], max_tokens=30)])
    computed(s, s.schedule())  # one decoding stream: prompts now go in pieces of s.step_tokens
    system = list(range(100, 160))
    a, b = request("a", system + [1, 2, 3]), request("b", system + [4, 5, 6])
    s.add([a, b])
    computed(s, s.schedule())
    assert 0 < a.computed < len(system) and b in s.waiting
    steps = 1
    while b in s.waiting:
        computed(s, s.schedule())
        steps += 1
    assert steps > 2 and b.cached_tokens == len(system)  # it waited piece by piece, and computes only its own end


def test_a_burst_behind_one_decoding_stream_gets_its_first_tokens_within_the_gap_bound():
    # The step costs of this machine (compiled int4): 7 ms and 1.9 ms a row. Bounded by a plain
    # step of the streams decoding, 31 prompts behind the first to decode went 16 tokens a step at first:
    # 57 steps before the last first token.
    s = scheduler(blocks=2048, max_running=32)
    for rows in (1, 4, 8, 16, 32, 8):
        s.step_cost.add(rows, 0, 0.007 + 0.0019 * rows)
    s.add([request("first", [7] * 46, max_tokens=60)])
    computed(s, s.schedule())
    burst = [request(f"r{n}", [1000 + 50 * n + k for k in range(46)], max_tokens=60) for n in range(31)]
    s.add(burst)
    steps, bound = 0, GAP_BOUND * s.step_cost.plain(32)
    while any(not r.output_ids for r in burst):
        plan = s.schedule()
        rows = sum(len(chunk.token_ids) for _, chunk in plan.scheduled)
        assert 0.007 + 0.0019 * rows <= bound * 1.01  # no step beyond the bound of the width they make
        computed(s, plan)
        steps += 1
    assert steps <= 25  # 21 now
