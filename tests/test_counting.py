"""Token counts as OpenAI-family vendors bill them, with tiktoken's encodings loaded offline."""

import pytest

from inference import counting, tiktoken_offline

# The example conversation of OpenAI's token-counting guide.
EXAMPLE = [
    {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage.",
    },
    {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
    {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."},
]


def test_the_guide_s_example_counts_129_for_gpt_4_style_models():
    assert counting.chat_prompt_tokens(EXAMPLE, "cl100k_base") == 129


def test_the_guide_s_example_counts_124_for_gpt_4o_style_models():
    assert counting.chat_prompt_tokens(EXAMPLE, "o200k_base") == 124


def test_the_encodings_are_tiktoken_s_own():
    o200k = tiktoken_offline.encoding("o200k_base")
    assert o200k.encode("hello world") == [24912, 2375]
    assert tiktoken_offline.encoding("cl100k_base").encode("hello world") == [15339, 1917]
    assert o200k.decode(o200k.encode("tokstream 漢字 🎉")) == "tokstream 漢字 🎉"


def test_a_data_file_with_the_wrong_hash_is_refused():
    with pytest.raises(tiktoken_offline.EncodingUnavailable, match="hash"):
        tiktoken_offline.checked_ranks("o200k_base", "0" * 64)


def test_tool_definitions_add_their_tokens():
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "description": "Unit.", "enum": ["c", "f"]}}}}}  # fmt: skip
    plain = counting.chat_prompt_tokens(EXAMPLE, "o200k_base")
    with_tool = counting.chat_prompt_tokens(EXAMPLE, "o200k_base", [tool])
    encode = tiktoken_offline.encoding("o200k_base").encode
    expected = (
        7 + len(encode("get_weather:Get the weather")) + 3 + 3 + (-3 + 3 + len(encode("c")) + 3 + len(encode("f"))) + len(encode("unit:string:Unit")) + 12
    )
    assert with_tool - plain == expected


def test_a_malformed_tool_schema_adds_only_what_it_names():
    odd = {"type": "function", "function": {"name": "f", "description": None, "parameters": {"properties": "not an object"}}}
    assert counting.chat_prompt_tokens(EXAMPLE, "o200k_base", [odd]) == 124 + 7 + len(tiktoken_offline.encoding("o200k_base").encode("f:")) + 12
