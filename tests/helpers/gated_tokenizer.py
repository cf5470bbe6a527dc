"""A real tokenizer that can be held inside `encode`, to prove who waits for tokenizing."""

from __future__ import annotations

import os
import threading

from pdserve.engine.tokenizer import Tokenizer


class GatedTokenizer(Tokenizer):
    """The model's tokenizer; once armed, the next `encode` (chat templating included) holds
    until released, as tokenizing a multi-megabyte prompt would. `released` records whether
    it was released rather than timed out."""

    def __init__(self, model_dir: str | os.PathLike[str]):
        super().__init__(model_dir)
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: bool | None = None

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()
        self.released = None
        self.armed = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.released = self.release.wait(timeout=30)
        return super().encode(text, add_special_tokens)
