"""serving.py: `ProxyConfig`, how the proxy serves: one frozen, self-validating record.

The run config (coordinator/config.py `CoordinatorConfig.serving()`), `gyre serve`, `gyre
tasks run` and `gyre eval` (coordinator/serve.py `serving_config`) all build this one
record, so a serving field has one default and one rule wherever it is set. A value that
cannot be served is a `ValueError` naming the field as a user sets it (SERVING_FIELDS: the
run config's names, e.g. rollout_temperature for `temperature`). Nothing here reads a
model: limits resolved against the model's context are the coordinator's
(runconfig.model_defaults). Not the proxy itself (server.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The fields a user sets (in a run config, or with `--set`), by their run-config names, and
# the ProxyConfig field each one is.
SERVING_FIELDS = {
    "proxy_host": "host", "proxy_port": "port", "default_max_tokens": "default_max_tokens",
    "max_tokens_cap": "max_tokens_cap", "max_context": "max_context", "rollout_temperature": "temperature",
    "rollout_top_p": "top_p", "max_calls_in_flight_per_execution": "max_calls_in_flight_per_execution",
    "max_tokens_per_minute_per_execution": "max_tokens_per_minute_per_execution", "budget_wait_s": "budget_wait_s",
}
_USER_NAME = {field: name for name, field in SERVING_FIELDS.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = 32 * 1024 * 1024
    default_max_tokens: int | None = None  # when a request sets no output limit; None: the remaining context
    max_tokens_cap: int | None = None  # a request asking more gets this; None: the remaining context
    max_context: int = 32768  # prompt + output tokens (callers pass the model's max_position_embeddings)
    temperature: float = 1.0  # every call samples at this (the run's rollout_temperature) ...
    top_p: float = 1.0  # ... and this; a harness's own values are recorded, not used
    ping_interval_s: float = 5.0
    role_rule: str = "generic"
    served_model: str = "gyre-policy"
    record_requests: bool = False  # also keep each raw request body (keys stripped) in requests.jsonl
    # What one client can hold (slowloris): a connection's request line and headers must
    # arrive within header_timeout_s of its opening, a body within body_timeout_s of its
    # headers; an idle keep-alive connection closes after keepalive_timeout_s; connections
    # past max_connections (clamped below the fd limit) are answered 503 and closed. None
    # of these touches a response being streamed.
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 4096
    # Below this many free bytes where records are written, model calls are answered 503
    # (retry-after) before any byte instead of failing a record mid-call; 0: never.
    min_free_disk_bytes: int = 16 * 1024 * 1024
    # Each execution's share of the proxy (proxy/budget.py): at most this many model calls in
    # flight (0: unlimited) and this many tokens a minute, prefilled and generated (0:
    # unlimited); a call over either waits its turn at most budget_wait_s, then is answered
    # 429 in the provider's shape with retry-after (harnesses retry it). Defaults: as
    # CoordinatorConfig's, which says why 4.
    max_calls_in_flight_per_execution: int = 4
    max_tokens_per_minute_per_execution: int = 0
    budget_wait_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("default_max_tokens", "max_tokens_cap"):
            _int(self, name, low=1, optional=True)
        _int(self, "max_context", low=2)
        _int(self, "port", low=0, high=65535)
        for name in ("max_calls_in_flight_per_execution", "max_tokens_per_minute_per_execution",
                     "min_free_disk_bytes"):
            _int(self, name, low=0)
        for name in ("max_body_bytes", "max_connections"):
            _int(self, name, low=1)
        _number(self, "temperature", low=0.0)
        _number(self, "budget_wait_s", low=0.0, high=1e6)
        for name in ("ping_interval_s", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            _number(self, name, low=0.0, strict=True)
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise ValueError(f"{_USER_NAME['top_p']} must be in (0, 1], got {top_p!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"{_USER_NAME['host']} must be a host name or address, got {self.host!r}")

    @classmethod
    def from_fields(cls, values: dict[str, Any], **more: Any) -> ProxyConfig:
        """The config of user-named serving fields (SERVING_FIELDS' keys) and ProxyConfig's
        own keyword arguments `more`; an unknown name is a ValueError listing the known."""
        unknown = sorted(set(values) - set(SERVING_FIELDS))
        if unknown:
            raise ValueError(f"not a serving field: {', '.join(unknown)} (serving fields: "
                             f"{', '.join(SERVING_FIELDS)})")
        return cls(**{SERVING_FIELDS[name]: value for name, value in values.items()}, **more)

    def as_fields(self) -> dict[str, Any]:
        """The user-named serving fields of this config (from_fields' inverse), for a run
        directory's config.json."""
        return {name: getattr(self, field) for name, field in SERVING_FIELDS.items()}



def _int(c: ProxyConfig, field: str, *, low: int, high: int | None = None, optional: bool = False) -> None:
    value = getattr(c, field)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        raise ValueError(f"{_USER_NAME.get(field, field)} must be {bound}, got {value!r}")


def _number(c: ProxyConfig, field: str, *, low: float, high: float | None = None, strict: bool = False) -> None:
    value = getattr(c, field)
    ok = (not isinstance(value, bool) and isinstance(value, int | float)
          and (value > low if strict else value >= low) and (high is None or value < high))
    if not ok:
        bound = f"{'>' if strict else '>='} {low:g}" + ("" if high is None else f" and < {high:g}")
        raise ValueError(f"{_USER_NAME.get(field, field)} must be a number {bound}, got {value!r}")
