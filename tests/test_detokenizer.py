"""The incremental detokenizer, with the real SmolLM2 tokenizer."""

from inference.worker.engine import IncrementalDetokenizer


def stream(tokenizer, text, stop=()):
    detok = IncrementalDetokenizer(tokenizer, stop)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = []
    for token in ids:
        deltas.append(detok.add(token))
        if detok.stopped:  # the engine feeds nothing after a stop string
            return ids, deltas
    deltas.append(detok.flush())
    return ids, deltas


def test_it_never_splits_a_character(tokenizer):
    text = "Tea 🍵 and 日本語の文章, then 👩‍💻 codes 𝄞."
    ids, deltas = stream(tokenizer, text)
    # The test only means something if some tokens carry part of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d) > 5  # it streams, it does not wait for the end


def test_it_holds_a_character_until_its_last_byte(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("🍵", add_special_tokens=False)
    assert len(ids) > 1
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🍵"]


def test_it_cuts_at_a_stop_string_split_across_tokens(tokenizer):
    stop = "###END"
    text = "The answer is 42.###END and then more text"
    ids, deltas = stream(tokenizer, text, stop=[stop])
    stop_ids = tokenizer.encode(stop, add_special_tokens=False)
    assert len(stop_ids) > 1  # the stop string spans several tokens
    assert "".join(deltas) == "The answer is 42."
    assert not any("#" in d for d in deltas)


def test_it_releases_text_that_only_looked_like_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["<stop-here>"])
    released = []
    for i in tokenizer.encode("a <stop now> b", add_special_tokens=False):
        released.append((tokenizer.decode([i]), detok.add(i)))
    # The "<" of " <" and then "stop" were held while they could still become "<stop-here>";
    # " now" let them go, together.
    assert [d for t, d in released if t in (" <", "stop")] == [" ", ""]
    assert "<stop now" in [d for _, d in released]
    assert "".join(d for _, d in released) == "a <stop now> b"


def test_it_keeps_a_partial_stop_string_back_until_the_end(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["STOP!"])
    out = "".join(detok.add(i) for i in tokenizer.encode("Hello ST", add_special_tokens=False))
    assert out == "Hello "
    assert detok.flush() == "ST"  # the sequence ended without the stop string: nothing is lost


def test_a_stop_string_in_one_token_cuts_before_it(tokenizer):
    ids, deltas = stream(tokenizer, "one two three four", stop=[" three"])
    assert "".join(deltas) == "one two"
