"""Tokenizer for a local model directory, and the streaming detokenizer used per request."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.engine.model_store import import_transformers_offline
from pdserve.errors import ErrorCode, InvalidRequestError, ModelLoadError

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# Prompt tokens decoded as left context for the first output token, so tokenizers that render a
# token differently at the start of a text (leading-space handling) stream correctly.
_INITIAL_PREFIX_TOKENS = 5


class Tokenizer:
    """The fast (Rust) Hugging Face tokenizer of a model directory, loaded offline.

    `decode` never applies the legacy "clean up tokenization spaces" heuristic, so decoding is
    a plain concatenation of token bytes and streaming pieces add up to the full decode.
    """

    def __init__(self, model_dir: str | os.PathLike[str]):
        root = Path(model_dir)
        transformers = import_transformers_offline()
        try:
            hf = transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {root}: {exc}") from exc
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ModelLoadError(f"{root} has no fast tokenizer (tokenizer.json)")
        self._hf = hf
        self.name = root.name
        self.vocab_size: int = len(hf)
        eos: set[int] = set()
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        for file_name in ("config.json", "generation_config.json"):
            eos |= _token_ids(_read_json(root / file_name).get("eos_token_id"))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"

    @property
    def has_chat_template(self) -> bool:
        return isinstance(self._hf.chat_template, str | dict) and bool(self._hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"prompt must be a string, got {type(text).__name__}", param="prompt"
            )
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (structured output builds its tables)."""
        return self._hf

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def decode_stream(self, context_ids: Sequence[int] = (), skip_special_tokens: bool = True
                      ) -> Callable[[int], str | None]:
        """A `tokenizers.decoders.DecodeStream` over this tokenizer, primed with
        ``context_ids``: call it with each new id; it returns the next final text chunk, or
        None while the ids so far end inside a UTF-8 character (or decode to nothing)."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=[int(t) for t in context_ids] or None,
                              skip_special_tokens=skip_special_tokens)
        backend = self._hf.backend_tokenizer
        return lambda token_id: stream.step(backend, int(token_id))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for `messages`, ending with the assistant turn's opening."""
        clean = validate_chat_messages(messages)
        if not self.has_chat_template:
            raise InvalidRequestError(
                f"model {self.name} has no chat template; send a plain prompt instead",
                code=ErrorCode.CHAT_TEMPLATE_MISSING,
                param="messages",
            )
        import jinja2

        try:
            text = self._hf.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as exc:  # templates raise to reject e.g. role order
            raise InvalidRequestError(
                f"the chat template rejected the messages: {exc}",
                code=ErrorCode.INVALID_MESSAGES,
                param="messages",
            ) from exc
        return text

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat prompt (the template supplies any BOS token itself)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def validate_chat_messages(messages: Any) -> list[dict[str, str]]:
    """Check `messages` is a non-empty list of {role, content} string pairs; return copies
    holding only those two keys. Raises InvalidRequestError otherwise."""

    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(message, code=ErrorCode.INVALID_MESSAGES, param="messages")

    if not isinstance(messages, list):
        raise bad(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise bad("messages must not be empty")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string, got {type(content).__name__}")
        clean.append({"role": role, "content": content})
    return clean


class IncrementalDetokenizer:
    """Turns one request's output token ids, fed one at a time, into final text pieces.

    Multi-byte characters: `tokenizers`' DecodeStream decodes a small window of ids per token
    (the prefix/read offsets of vLLM and TGI) and releases no text while it ends in U+FFFD,
    i.e. while the last tokens hold an incomplete UTF-8 sequence. Cost per token is
    independent of length. The last few prompt tokens are its left context (leading-space
    handling), unless they end inside a character: then the output starts on its own, as
    ``tokenizer.decode(output_ids)`` does.

    Stop strings: text that could still become the start of a stop string is held back. When a
    stop string completes, the text before it is returned with ``True``; the stop string and
    everything after it are never returned, and later feeds return ``("", True)``.

    Invariant: if no stop string is hit, the pieces from `feed` plus `flush()` concatenate to
    ``tokenizer.decode(output_ids)`` (special tokens skipped).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 *, include_stop: bool = False, skip_special_tokens: bool = True):
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._include_stop = include_stop  # a hit stop string ends the text instead of cutting it
        self._skip_special = skip_special_tokens
        context = [int(t) for t in prompt_ids[-_INITIAL_PREFIX_TOKENS:]]
        if context and self._decode(context).endswith("\ufffd"):
            context = []  # DecodeStream would mis-slice a context ending mid-character
        self._step: Callable[[int], str | None] | None = tokenizer.decode_stream(
            context, skip_special_tokens)
        # For flush(): the ids of the last released chunk (its left context) and the ids fed
        # since, which DecodeStream holds while they end inside a character.
        self._context = context
        self._pending: list[int] = []
        self._held = ""  # decoded text that may be the start of a stop string
        self.stopped = False

    def feed(self, token_id: int) -> tuple[str, bool]:
        """Add one output token; return (newly final text, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self._pending.append(int(token_id))
        piece = self._next_piece(int(token_id))
        if not piece:
            return "", False  # nothing new yet (special token or incomplete character)
        self._context, self._pending = self._pending, []
        return self._release(piece)

    def flush(self) -> str:
        """Return all text still held back; call once when the stream ends without a stop."""
        if self.stopped:
            return ""
        tail = ""
        if self._pending:  # an incomplete character at the very end
            prefix_text = self._decode(self._context)
            tail = self._decode(self._context + self._pending)[len(prefix_text) :]
            self._context, self._pending = self._context + self._pending, []
        text, hit = self._release(tail)
        if hit:
            return text
        text, self._held = text + self._held, ""
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _next_piece(self, token_id: int) -> str | None:
        if self._step is not None:
            try:
                return self._step(token_id)
            except Exception:
                # DecodeStream refuses a window whose context decodes differently once
                # extended; an exception here would fail the whole engine step, so this
                # request goes on with the same window decoded by hand.
                self._step = None
        prefix = self._decode(self._context)
        text = self._decode(self._context + self._pending)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return None
        return text[len(prefix) :]

    def _release(self, piece: str) -> tuple[str, bool]:
        if not self._stop:
            return piece, False
        buf = self._held + piece
        hits = [(i, len(s)) for i, s in ((buf.find(s), s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            at, length = min(hits)
            return buf[: at + length if self._include_stop else at], True
        keep = _longest_suffix_prefix(buf, self._stop)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False


def _longest_suffix_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()
