"""Incremental detokenisation: split multi-byte characters and stop strings across deltas."""

from aiollm.frontend.detokenize import IncrementalText


def _utf8_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_character_is_held_until_complete():
    text = IncrementalText(_utf8_decode)
    euro = list("€".encode())
    assert text.feed([ord("a")] + euro[:1]) == "a"
    assert text.feed(euro[1:2]) == ""
    assert text.feed(euro[2:]) == "€"
    assert text.flush() == "" and text.text == "a€"


def test_stop_string_across_deltas_is_never_shown():
    text = IncrementalText(_utf8_decode, stops=["STOP", "xy"])
    pieces = [text.feed(list(c.encode())) for c in "abST"]
    assert "".join(pieces) == "ab" and not text.stopped
    assert text.feed(list(b"O")) == ""
    assert text.feed(list(b"P tail")) == "" and text.stopped
    assert text.text == "ab" and text.feed([65]) == ""


def test_false_stop_prefix_is_released():
    text = IncrementalText(_utf8_decode, stops=["STOP"])
    assert text.feed(list(b"aST")) == "a"
    assert text.feed(list(b"X")) == "STX"
    assert text.feed(list(b"S")) == ""
    assert text.flush() == "S" and text.text == "aSTXS"
