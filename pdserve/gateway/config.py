"""The gateway's one frozen config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pdserve.errors import InvalidRequestError
from pdserve.gateway.body import PARSER_MAX_DEPTH
from pdserve.tenants import KeyPolicy


@dataclass(frozen=True)
class GatewayConfig:
    """REST gateway settings. Environment variables and flags are read by `main()`, not here.

    `api_keys` empty means no authentication; they are operator keys (admin, no quota) unless
    `key_policies` (a keys file, `pdserve.tenants`) gives them a policy, and every key of
    `key_policies` is accepted too (`api_keys` holds them all after init). /metrics needs a
    key only with `metrics_require_auth`. `served_model_name` None serves the backend's
    `model_name`; requests may also name the model by one of `model_aliases`.
    `default_max_tokens` applies when a request names no limit, clamped to the context left
    after the prompt. `request_timeout_s` bounds a whole generation, arrival to last token.
    `retry_after_s` is the `Retry-After` sent with 503 responses. Bodies larger than
    `max_body_bytes` are refused with 413, JSON nested deeper than `max_json_depth` levels
    (a chat request needs 4) with 400.
    """

    api_keys: frozenset[str] = frozenset()
    key_policies: Mapping[str, KeyPolicy] = field(default_factory=dict)
    max_body_bytes: int = 1 << 20
    max_json_depth: int = 32
    default_max_tokens: int = 256
    request_timeout_s: float = 600.0
    served_model_name: str | None = None
    model_aliases: frozenset[str] = frozenset({"default"})
    retry_after_s: int = 1
    metrics_require_auth: bool = False  # /metrics is open (Prometheus scrapes) unless set

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_policies", MappingProxyType(dict(self.key_policies)))
        object.__setattr__(self, "api_keys", frozenset(self.api_keys) | set(self.key_policies))
        object.__setattr__(self, "model_aliases", frozenset(self.model_aliases))
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise InvalidRequestError("api_keys must be non-empty strings")
        if self.max_body_bytes < 1:
            raise InvalidRequestError("max_body_bytes must be >= 1")
        if not 1 <= self.max_json_depth < PARSER_MAX_DEPTH:
            raise InvalidRequestError(f"max_json_depth must be in [1, {PARSER_MAX_DEPTH})")
        if self.default_max_tokens < 1:
            raise InvalidRequestError("default_max_tokens must be >= 1")
        if not self.request_timeout_s > 0:
            raise InvalidRequestError("request_timeout_s must be > 0")
        if self.retry_after_s < 0:
            raise InvalidRequestError("retry_after_s must be >= 0")
        if self.served_model_name is not None and not self.served_model_name:
            raise InvalidRequestError("served_model_name must not be empty")
