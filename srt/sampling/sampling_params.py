"""Per-request sampling parameters with SGLang's field names, defaults and checks."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy decoding (SGLang's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-6

_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed", "stream_interval")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)
_STR_LIST_FIELDS = ("stop", "stop_regex")
_STR_FIELDS = ("json_schema", "regex", "ebnf")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias

# SGLang's sampling parameters that srt does not implement, with the values that leave them
# unused. A request may send them at those values (SGLang's clients send them as null); any
# other value is refused, never ignored.
UNSUPPORTED_PARAMS: dict[str, tuple] = {
    "structural_tag": ("",),
    "beam_width": (1,),
    "custom_params": ({},),
    "watermark": (),
}


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `max_new_tokens=True` is a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_type(name: str, value: Any) -> None:
    if name in _INT_FIELDS:
        ok, expected = _is_int(value), "an integer"
    elif name in _FLOAT_FIELDS:
        ok, expected = _is_number(value), "a number"
    elif name in _BOOL_FIELDS:
        ok, expected = isinstance(value, bool), "a boolean"
    elif name in _STR_FIELDS:
        ok, expected = isinstance(value, str), "a string"
    elif name in _STR_LIST_FIELDS:
        is_list = isinstance(value, list) and all(isinstance(s, str) for s in value)
        ok, expected = isinstance(value, str) or is_list, "a string or a list of strings"
    elif name == "logit_bias":
        ok = isinstance(value, dict) and all(_is_number(v) for v in value.values())
        expected = "an object mapping token ids to numbers"
    else:  # stop_token_ids
        ok = isinstance(value, (list, set)) and all(_is_int(t) for t in value)
        expected = "a list of integers"
    if not ok:
        raise ValueError(f"sampling parameter '{name}' must be {expected}, got {value!r}")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | set[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    stop_regex: str | list[str] | None = None  # stop once the output text matches one
    no_stop_trim: bool = False  # keep the matched stop string or token in the text
    stream_interval: int | None = None  # stream every this many tokens (None: every step)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    # Structured output, at most one of them (srt/constrained/grammar.py); "" means unset.
    json_schema: str | None = None  # a JSON schema, or "$$ANY$$" for any JSON value
    regex: str | None = None
    ebnf: str | None = None
    # Set by normalize(): the longest stop string in tokens, so the scheduler decodes only
    # that many trailing tokens when looking for stop strings.
    stop_str_max_len: int = field(default=0, compare=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's JSON dict; None values mean the default."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"stop_str_max_len"}
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            if name in UNSUPPORTED_PARAMS:
                if value is not None and value not in UNSUPPORTED_PARAMS[name]:
                    raise ValueError(f"sampling parameter '{name}' is not supported by this server")
                continue
            if name not in names:
                raise ValueError(f"unknown sampling parameter '{name}'")
            if value is None or (name in _STR_FIELDS and value == ""):
                continue
            _check_type(name, value)
            kwargs[name] = float(value) if name in _FLOAT_FIELDS else value
        if isinstance(kwargs.get("stop_token_ids"), set):
            kwargs["stop_token_ids"] = sorted(kwargs["stop_token_ids"])
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1 or 0 <= self.temperature < _SAMPLING_EPS

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first out-of-range field."""
        self._verify_sampling()
        self._verify_penalties()
        self._verify_lengths()
        if self.stop_token_ids is not None and vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {sorted(bad)}")
        self._verify_stop_regex()
        self._verify_logit_bias(vocab_size)
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")

    def _verify_stop_regex(self) -> None:
        patterns = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
        for pattern in patterns or ():
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regex: {e}") from None

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        for key, bias in (self.logit_bias or {}).items():
            token = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else None
            if token is None or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(f"logit_bias: {key!r} is not a token id of this model")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                )

    def _verify_sampling(self) -> None:
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

    def _verify_penalties(self) -> None:
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

    def _verify_lengths(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )

    def normalize(self, tokenizer: Any | None) -> None:
        """Canonical forms for the scheduler; idempotent. Call after verify()."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex or ())
        self.stop_token_ids = set(self.stop_token_ids or ())
        self.stop_str_max_len = max((_token_len(s, tokenizer) for s in self.stop), default=0)
        if 0 <= self.temperature < _SAMPLING_EPS:
            # Greedy, as SGLang: top_k = 1 selects the argmax; temperature 1 avoids a division by 0.
            self.top_k = 1
            self.temperature = 1.0


def _token_len(text: str, tokenizer: Any | None) -> int:
    if tokenizer is None:
        # A token is at least one character, so this is an upper bound.
        return len(text)
    return len(tokenizer.encode(text, add_special_tokens=False))
