"""What an upstream is sent and how its replies are counted, rule by rule (the relay end to end:
tests/test_upstream.py and tests/test_upstream_llama_cpp.py)."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from inference import upstream
from inference.protocol.entries import FinishReason
from inference.protocol.errors import ApiError


def entry(**options):
    return {"source": "openai-compatible", "base_url": "http://gpu-1:8000/v1", "upstream_model": "m", "tokenizer": "o200k_base", **options}


def test_it_forwards_the_fields_the_client_sent_but_its_own_and_nulls():
    sent = {"model": "ours", "messages": [{"role": "user", "content": "hi"}], "stream": False, "tokstream": {"beam_width": 1}}
    sent |= {"response_format": {"type": "json_object"}, "parallel_tool_calls": False, "temperature": None, "stream_options": {"continuous_usage_stats": True}}
    body = upstream.body(sent, "theirs")
    assert body == {
        "model": "theirs",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    upstream.refuse_unforwarded(sent)  # everything it holds is forwarded or ours


def test_a_turn_without_content_is_sent_with_empty_content_and_an_empty_call_list_is_no_call():
    sent = [{"role": "user", "content": None}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert upstream.messages(sent) == [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("name", ["function_call", "service_tier", "include_stop_str_in_output", "chat_template"])
def test_a_field_that_is_not_forwarded_is_refused_by_name_not_dropped(name):
    with pytest.raises(ApiError) as refused:
        upstream.refuse_unforwarded({"model": "m", "messages": [], name: "x", "seed": None})
    assert refused.value.status == 400 and refused.value.body()["error"]["param"] == name


def test_a_stop_string_cut_is_counted_as_the_upstream_says_it_stopped(tokenizer):
    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    def estimate(stop_reason=upstream.UNSAID):
        return upstream.completion_estimate(count, "one, two", FinishReason.STOP, [" three", "\n"], True, stop_reason)

    assert estimate(" three") == count("one, two three")  # vLLM named the stop string
    assert estimate(None) == count("one, two") + 1  # vLLM: the model ended its turn
    assert estimate() == min(count("one, two three"), count("one, two\n"))  # not said: the cut is assumed


def test_a_reply_that_llama_cpp_python_cut_at_a_stop_string_is_counted_without_it(tokenizer):
    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    def billed(**options):
        server = entry(**options)
        return upstream.completion_estimate(
            count, "one, two", FinishReason.STOP, [","], upstream.counts_end_of_turn(server), upstream.UNSAID, upstream.counts_stop_string(server)
        )

    assert billed(server="llama-cpp-python") == count("one, two")  # its usage leaves the cut out
    assert billed(server="vllm") == billed(server="llama.cpp") == count("one, two,")
    assert billed(server="llama-cpp-python", counts_stop_string=True) == count("one, two,")  # an entry may say otherwise


def test_models_of_one_server_share_its_slots_and_llama_cpp_python_gets_one_at_a_time():
    narrow, wide = entry(server="vllm", upstream_model="a", max_concurrent=2), entry(server="vllm", upstream_model="b", max_concurrent=6)
    elsewhere = entry(server="vllm", base_url="http://gpu-2:8000/v1/")
    entries = [narrow, wide, elsewhere, {"source": "echo", "tokenizer": "x"}]
    assert [upstream.max_concurrent(e, entries) for e in (narrow, wide, elsewhere)] == [2, 2, upstream.DEFAULT_MAX_CONCURRENT]
    single = entry(server="llama-cpp-python")
    assert upstream.max_concurrent(single, [single]) == 1


def test_a_vendor_api_limits_each_model_apart():
    mini, big = entry(server="openai", upstream_model="gpt-4o-mini", max_concurrent=64), entry(server="openai", upstream_model="gpt-4o", max_concurrent=4)
    assert [upstream.max_concurrent(e, [mini, big]) for e in (mini, big)] == [64, 4]
    assert upstream.slots_of(mini) != upstream.slots_of(big)


@pytest.mark.parametrize("options", [{"max_concurrent": 0}, {"max_concurrent": "4"}, {"max_concurrent": True}, {"server": "vLLM"}])
def test_a_registry_entry_that_cannot_be_right_stops_the_start(options):
    bad = entry(**options)
    with pytest.raises(ImproperlyConfigured):
        upstream.max_concurrent(bad, [bad])
