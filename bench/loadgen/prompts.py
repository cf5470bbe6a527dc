"""Synthetic prompts of roughly a target token count.

Without a tokenizer, a prompt of N tokens is N short common English words: BPE tokenizers
encode " word" as one token for such words, so the count is close. With a tokenizer the text
is cut to exactly N token ids and decoded, which lands within a token or two of N after
re-encoding. Words are drawn at random per request so that prompts share no prefix and a
prefix cache cannot make the benchmark look better than the workload would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.loadgen.errors import ConfigError

WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """
    the of and to in is was for on that with as by at from it his an were are which this be
    has had one not but have you they all their more her when there been who its into new two
    we some can would time first after also him other most such over many then these them so
    up out no only year city may what world state than about he she way use part each made
    could where during under same like well just both long back end high small large see left
    great through found down each last few old own set work year must life days home how name
    water side house group line book land sea war game team music film road river light light
    play power field tree food story town body cold hot fire hand eye door word fact plan mind
    face head rock wind bird fish rain snow sun moon star ship car bus map art box cup bed red
    blue green gold iron wood stone glass paper bread milk tea salt rice corn farm park bank
    shop room wall floor roof king queen army law court club rule test note page list form
        """.split()
    )
)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class _FastTokenizer:
    """Adapter for a `tokenizers.Tokenizer` (tokenizer.json)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def encode(self, text: str) -> list[int]:
        return list(self._inner.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._inner.decode(ids))


class _HFTokenizer:
    """Adapter for a transformers tokenizer."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def encode(self, text: str) -> list[int]:
        return list(self._inner.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._inner.decode(ids))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a local tokenizer: `DIR/tokenizer.json` via `tokenizers`, else transformers'
    AutoTokenizer with local_files_only (never downloads)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"tokenizer directory {str(directory)!r} does not exist")
    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        from tokenizers import Tokenizer as HFFastTokenizer

        return _FastTokenizer(HFFastTokenizer.from_file(str(tokenizer_json)))
    try:
        from transformers import AutoTokenizer

        return _HFTokenizer(AutoTokenizer.from_pretrained(str(directory), local_files_only=True))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {str(directory)!r}: {exc}") from exc


def synthetic_prompt(
    num_tokens: int, rng: np.random.Generator, tokenizer: Tokenizer | None = None
) -> str:
    """Random English words amounting to about `num_tokens` tokens."""
    words = list(rng.choice(WORDS, size=num_tokens))
    if tokenizer is None:
        return " ".join(words)
    ids = tokenizer.encode(" ".join(words))
    while len(ids) < num_tokens:  # only for tokenizers that merge words; rare
        words.extend(rng.choice(WORDS, size=num_tokens - len(ids) + 1))
        ids = tokenizer.encode(" ".join(words))
    return tokenizer.decode(ids[:num_tokens])
