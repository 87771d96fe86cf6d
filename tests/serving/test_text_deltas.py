"""``TextDeltas``: the pieces a stream sends add up to the final text, with no piece holding half a
character or the start of a stop string that the final text leaves out."""

from ember.core.tokenizer import ByteTokenizer
from ember.serving.text_deltas import TextDeltas


def streamed(text, stop=(), final=None):
    """The pieces of ``text``'s byte tokens (those before the event that ends the request), then
    the finish of ``final`` (default ``text``)."""
    deltas = TextDeltas(ByteTokenizer(), stop)
    pieces = [deltas.add(int(token)) for token in ByteTokenizer().encode(text)]
    return pieces, deltas.finish(text if final is None else final)


def test_a_character_is_sent_whole_once_its_bytes_arrived():
    pieces, rest = streamed("añ€😀z")
    assert pieces == ["a", "", "ñ", "", "", "€", "", "", "", "😀", "z"] and rest == ""


def test_text_that_may_begin_a_stop_string_waits_and_the_stop_string_is_never_sent():
    """Stop "\\n\\n": one character held back; the token completing the stop string ends the
    request, whose result text is what came before it."""
    pieces, rest = streamed("ab\ncd\n", stop=("\n\n",), final="ab\ncd")
    assert pieces == ["", "a", "b", "\n", "c", "d"]
    assert "".join(pieces) + rest == "ab\ncd"
    assert not any("\n\n" in piece for piece in pieces)


def test_a_final_text_shorter_than_what_was_sent_adds_nothing():
    pieces, rest = streamed("abcdef", stop=("xy",), final="abc")
    assert "".join(pieces) == "abcde" and rest == ""
