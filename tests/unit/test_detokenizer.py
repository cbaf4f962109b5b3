"""Incremental detokenization (no partial characters) and stop-string holdback."""

from __future__ import annotations

import pytest

from tests.support.fake_verifier import build_tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher

TOKENIZER = build_tiny_tokenizer()


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _push_in_chunks(detokenizer: IncrementalDetokenizer, token_ids: list[int],
                    sizes: list[int]) -> list[str]:
    pieces, start, index = [], 0, 0
    while start < len(token_ids):
        size = sizes[index % len(sizes)] if sizes else 1
        pieces.append(detokenizer.push(token_ids[start:start + size]))
        start += size
        index += 1
    pieces.append(detokenizer.flush())
    return pieces


def test_two_byte_character_is_held_until_complete():
    token_ids = _ids("é")
    assert len(token_ids) == 2  # the tiny tokenizer never saw "é": one token per byte
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    assert detokenizer.push(token_ids[:1]) == ""
    assert detokenizer.push(token_ids[1:]) == "é"
    assert detokenizer.flush() == ""


def test_emoji_split_over_four_tokens():
    token_ids = _ids("ok 😀!")
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.push([t]) for t in token_ids]
    assert "".join(pieces) == "ok 😀!"
    assert "😀" in pieces
    assert not any("\ufffd" in piece for piece in pieces)


def test_prompt_context_keeps_leading_space():
    prompt_ids = _ids("Hello")
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt_ids)
    assert detokenizer.push(_ids(" world")) == " world"


def test_special_tokens_are_skipped():
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    assert detokenizer.push(_ids("Hello") + [TOKENIZER.eos_token_id]) == "Hello"


def test_flush_releases_a_truncated_character():
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    token_ids = _ids("a😀")
    assert detokenizer.push(token_ids[:1]) == "a"
    assert detokenizer.push(token_ids[1:3]) == ""
    assert detokenizer.flush() == "\ufffd"  # the model really ended inside a character


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("Helo wrd!.,é—ï😀中文ß\n")), max_size=30),
       sizes=st.lists(st.integers(1, 4), max_size=5))
def test_chunked_decoding_matches_full_decode(text, sizes):
    token_ids = _ids(text)
    pieces = _push_in_chunks(IncrementalDetokenizer(TOKENIZER, _ids("Hi there")), token_ids,
                             sizes)
    assert "".join(pieces) == TOKENIZER.decode(token_ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


STOP_CASES = [
    # (stop strings, pushed chunks, released pieces, stopped)
    (["STOP"], ["abc", "def"], ["abc", "def"], False),
    (["STOP"], ["abc S", "TO", "P tail"], ["abc ", "", ""], True),
    (["STOP"], ["abc S", "TOX"], ["abc ", "STOX"], False),
    (["\n\n", "END"], ["line\n", "\nmore"], ["line", ""], True),
    (["END", "\n\n"], ["xEN", "D\n\n"], ["x", ""], True),
    (["abcd", "bc"], ["ab", "cd"], ["", "a"], True),  # "bc" completes first
    (["abcd", "bc"], ["abcd"], ["a"], True),  # the same whatever the chunking
    (["aaa"], ["aa", "aa"], ["", ""], True),
    ([], ["anything"], ["anything"], False),
]


@pytest.mark.parametrize("stop,chunks,released,stopped", STOP_CASES)
def test_stop_string_matcher(stop, chunks, released, stopped):
    matcher = StopStringMatcher(stop)
    pieces = []
    for chunk in chunks:
        piece, found = matcher.push(chunk)
        pieces.append(piece)
        if found:
            break
    assert pieces == released
    assert matcher.stopped is stopped


def test_held_back_text_is_released_at_the_end():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("the end ST") == ("the end ", False)
    assert matcher.flush() == "ST"
    assert matcher.push("more after the end is ignored STOP")[1] is True
    assert matcher.push("x") == ("", True)


def _reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Character-at-a-time semantics: the first stop string to complete wins."""
    for end in range(1, len(text) + 1):
        completed = [s for s in stops if text[:end].endswith(s)]
        if completed:
            return text[:end - max(len(s) for s in completed)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=24),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1,
                      max_size=3),
       cuts=st.lists(st.integers(0, 24), max_size=6))
def test_stop_matcher_matches_reference(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    released, stopped = [], False
    for start, end in zip(bounds, bounds[1:]):
        piece, stopped = matcher.push(text[start:end])
        released.append(piece)
        if stopped:
            break
    if not stopped:
        released.append(matcher.flush())
    assert ("".join(released), stopped) == _reference_cut(text, stops)
