"""Tokenizer and streaming detokenizer tests on the real default model's tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.engine.model_store import pull_default_model
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.errors import InvalidRequestError

TEXTS = [
    "Hello, world!",
    "Héllo wörld, naïve café, crème brûlée, Ærøskøbing, Dvořák",
    "e\u0301 combining accent and ñ precomposed",
    "你好，世界！東京は日本の首都です。한국어 텍스트",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 🙂🙃 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "مرحبا بالعالم — Привет, мир — γειά σου κόσμε",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(pull_default_model())


def stream(
    tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), prompt_ids: list[int] | None = None
) -> tuple[list[str], bool]:
    """Feed ids one at a time; return the pieces (with the flush unless a stop hit) and the hit."""
    detok = IncrementalDetokenizer(tok, prompt_ids or [], stop)
    pieces = []
    for token_id in ids:
        piece, hit = detok.feed(token_id)
        pieces.append(piece)
        if hit:
            assert detok.feed(ids[0]) == ("", True)
            assert detok.flush() == ""
            return pieces, True
    pieces.append(detok.flush())
    return pieces, False


# --------------------------------------------------------------------------- Tokenizer


def test_basic_properties(tok: Tokenizer) -> None:
    assert tok.name == "SmolLM2-135M-Instruct"
    assert tok.vocab_size == 49152
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1
    assert im_end[0] in tok.eos_token_ids
    assert tok.eos_token_ids == frozenset({2})


def test_eos_ids_union_config_and_generation_config(tmp_path, tok: Tokenizer) -> None:
    src = pull_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer(tmp_path).eos_token_ids == frozenset({2, 7, 9})


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_round_trip(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2? 🤔"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    ids = tok.apply_chat_template(messages)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2? 🤔<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages) == expected
    assert tok.decode(ids, skip_special_tokens=False) == expected
    im_start = tok.encode("<|im_start|>", add_special_tokens=False)
    assert ids.count(im_start[0]) == 5  # special tokens are single ids, not spelled out
    assert tok.decode(ids) == expected.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_chat_template_adds_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_extra_message_keys_are_ignored(tok: Tokenizer) -> None:
    plain = [{"role": "user", "content": "Hi"}]
    extra = [{"role": "user", "content": "Hi", "name": "bob"}]
    assert tok.apply_chat_template(extra) == tok.apply_chat_template(plain)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        {"role": "user", "content": "hi"},
        [],
        ["hello"],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "robot", "content": "hi"}],
        [{"role": "User", "content": "hi"}],
        [{"role": 1, "content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": "ok"}, None],
    ],
)
def test_malformed_chat_messages_are_rejected(tok: Tokenizer, messages: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages)  # type: ignore[arg-type]
    assert info.value.param == "messages"


def test_encode_rejects_non_strings(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tok.encode(["not", "a", "string"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    pieces, hit = stream(tok, ids)
    assert not hit
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_streaming_after_a_chat_prompt(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi in Chinese"}])
    ids = tok.encode("你好！ Nǐ hǎo 👋", add_special_tokens=False) + sorted(tok.eos_token_ids)
    pieces, _ = stream(tok, ids, prompt_ids=prompt)
    assert "".join(pieces) == tok.decode(ids) == "你好！ Nǐ hǎo 👋"


def test_multibyte_characters_are_not_split(tok: Tokenizer) -> None:
    ids = tok.encode("a👨‍👩‍👧‍👦b", add_special_tokens=False)
    assert len(ids) > 5  # the emoji spans many byte-level tokens
    pieces, _ = stream(tok, ids)
    assert [p for p in pieces if p] == [
        "a",
        "👨",
        "\u200d",
        "👩",
        "\u200d",
        "👧",
        "\u200d",
        "👦",
        "b",
    ]


def test_incomplete_character_at_the_end_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok 👋", add_special_tokens=False)[:-1]  # cut inside the emoji's bytes
    full = tok.decode(ids)
    assert full.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [], ())
    fed = "".join(detok.feed(i)[0] for i in ids)
    assert "\ufffd" not in fed
    assert fed + detok.flush() == full


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    eos = min(tok.eos_token_ids)
    ids = [eos, *tok.encode("hi there", add_special_tokens=False), eos]
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == "hi there"


def test_random_token_ids_stream_like_full_decode(tok: Tokenizer) -> None:
    # Random ids produce invalid and truncated UTF-8 byte sequences; the invariant still holds.
    rng = random.Random(1234)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        pieces, _ = stream(tok, ids, prompt_ids=prompt)
        assert "".join(pieces) == tok.decode(ids)


# --------------------------------------------------------------------------- stop strings


def test_stop_string_spanning_token_boundaries(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    stop = "k brown f"  # starts inside "quick", ends inside "fox"
    ids = tok.encode(text, add_special_tokens=False)
    assert stop not in [tok.decode([i]) for i in ids]
    pieces, hit = stream(tok, ids, stop=(stop,))
    assert hit
    assert "".join(pieces) == "The quic"
    # The potential stop prefix "k" was held back, never emitted and retracted.
    assert "k" not in "".join(pieces)


def test_stop_string_inside_multibyte_text(tok: Tokenizer) -> None:
    ids = tok.encode("说你好，世界 again", add_special_tokens=False)
    pieces, hit = stream(tok, ids, stop=("好，世",))
    assert hit
    assert "".join(pieces) == "说你"


def test_stop_string_at_the_very_start(tok: Tokenizer) -> None:
    ids = tok.encode("STOP and more text", add_special_tokens=False)
    pieces, hit = stream(tok, ids, stop=("STOP",))
    assert hit
    assert pieces[-1] == ""
    assert "".join(pieces) == ""


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    pieces, hit = stream(tok, ids, stop=("delta", "beta", "gamma"))
    assert hit
    assert "".join(pieces) == "alpha "


def test_held_back_text_is_flushed(tok: Tokenizer) -> None:
    text = "The price is $4"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], ("$40", "is $4 each"))
    fed = [detok.feed(i) for i in ids]
    assert not any(hit for _, hit in fed)
    emitted = "".join(piece for piece, _ in fed)
    assert emitted == "The price "
    assert detok.flush() == "is $4"
    assert detok.flush() == ""


def test_stop_strings_absent_leave_text_unchanged(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces, hit = stream(tok, ids, stop=("zzz-not-there", text[-1] + "\x00"))
        assert not hit
        assert "".join(pieces) == text


def test_empty_stop_string_is_rejected(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok, [], ("",))


def test_output_starting_inside_a_character_after_a_prompt(tok: Tokenizer) -> None:
    # Output ids that begin with the tail bytes of a character (invalid UTF-8 on their own)
    # still stream exactly like decoding the output ids alone.
    prompt = tok.encode("Say hi", add_special_tokens=False)
    ids = tok.encode("👋 ok, 你好", add_special_tokens=False)[1:]
    assert tok.decode(ids).startswith("\ufffd")
    pieces, _ = stream(tok, ids, prompt_ids=prompt)
    assert "".join(pieces) == tok.decode(ids)


def test_decode_stream_failure_falls_back_to_the_window(tok: Tokenizer, monkeypatch) -> None:
    # tokenizers raises from DecodeStream.step on some windows; the request must go on.
    real = Tokenizer.decode_stream
    calls = {"n": 0}

    def flaky(self, context_ids=(), skip_special_tokens=True):  # type: ignore[no-untyped-def]
        step = real(self, context_ids, skip_special_tokens)

        def wrapped(token_id: int) -> str | None:
            calls["n"] += 1
            if calls["n"] == 4:
                raise Exception("Invalid prefix encountered")
            return step(token_id)
        return wrapped

    monkeypatch.setattr(Tokenizer, "decode_stream", flaky)
    for text in TEXTS:
        calls["n"] = 0
        ids = tok.encode(text, add_special_tokens=False)
        pieces, _ = stream(tok, ids, prompt_ids=tok.encode("Say:", add_special_tokens=False))
        assert "".join(pieces) == tok.decode(ids) == text
