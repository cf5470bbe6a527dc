"""The first token's hand-over from a prefill worker to a decode worker.

It has one channel: the KV transfer's completion notice (`kvxfer`), so the decode worker
admits the request the moment its KV has landed, with no extra round trip through the router.
`FirstToken.to_notice` / `from_notice` are the notice's one codec; the logprob keeps its top
alternatives, so a remote prefill reports the same logprobs as a local one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ErrorCode, KVTransferError
from pdserve.types import TokenLogprob


@dataclass(frozen=True)
class FirstToken:
    token_id: int
    logprob: TokenLogprob | None = None

    def to_notice(self) -> dict[str, Any]:
        """A JSON-serializable notice (kvxfer sends it as JSON)."""
        notice: dict[str, Any] = {"first_token": self.token_id}
        if self.logprob is not None:
            notice["logprob"] = self.logprob.logprob
            notice["top"] = [[t, p] for t, p in self.logprob.top]
        return notice

    @classmethod
    def from_notice(cls, notice: Mapping[str, Any] | None) -> FirstToken:
        """Raises KVTransferError (code "kv_protocol") on a notice this codec did not write."""
        try:
            if notice is None:
                raise ValueError("no notice")
            token_id = _token_id(notice["first_token"])
            logprob = None
            if notice.get("logprob") is not None:
                top = tuple((_token_id(t), _number(p)) for t, p in notice.get("top") or ())
                logprob = TokenLogprob(token_id, _number(notice["logprob"]), top)
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"the transfer's notice carries no valid first token: {exc}",
                                  code=ErrorCode.KV_PROTOCOL) from exc
        return cls(token_id, logprob)


def _token_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"bad token id {value!r}")
    return value


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"bad logprob {value!r}")
    # -inf is a real logprob (a token the sampler masked out); NaN never is.
    if math.isnan(value):
        raise ValueError("logprob is NaN")
    return float(value)


__all__ = ["FirstToken"]
