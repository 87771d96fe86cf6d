"""``TextDeltas``: the pieces a stream sends add up to the final text, with no piece holding half a
character or the start of a stop string that the final text leaves out."""

from types import SimpleNamespace

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


def test_each_token_decodes_with_the_few_before_it_not_the_whole_output():
    """200 tokens of multi-byte text: every decode call sees at most the tokens of two characters
    (decoding the whole output per token costs its length squared), and the text is whole."""
    seen = []

    class Counting(ByteTokenizer):
        def decode(self, ids):
            seen.append(len(ids))
            return super().decode(ids)

    text = "ñ€😀a" * 20  # 2 + 3 + 4 + 1 bytes
    deltas = TextDeltas(Counting())
    pieces = [deltas.add(int(token)) for token in ByteTokenizer().encode(text)]
    assert "".join(pieces) + deltas.finish(text) == text and deltas.finish(text) == ""
    assert max(seen) <= 8, max(seen)


def test_a_tokenizer_that_writes_across_tokens_streams_the_text_it_decodes():
    """SentencePiece's ``▁``: a token decoded alone loses its leading space; with the token before
    it, it keeps it. The pieces add up to the whole decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    decoding = SimpleNamespace(decode=lambda ids: tokenizer.decode(list(ids)))
    ids = [1, 2, 3, 4, 2]
    whole = decoding.decode(ids)
    assert whole == "Hello world! again world" and decoding.decode([2]) == "world"
    deltas = TextDeltas(decoding)
    assert "".join(deltas.add(i) for i in ids) + deltas.finish(whole) == whole
