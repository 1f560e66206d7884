"""Built-in workloads (`--workload NAME[:key=value,...]`): what per-request routing is judged on. Pure and seeded.

- shared-prefix: `groups` system prompts, each `prefix` of --input-len long, shared by every request of its group.
- multi-turn: conversations of `turns` turns; the first turn's prompt is --input-len tokens, each later turn
  adds the earlier answer (--output-len tokens) and `user` x --input-len tokens of new text.
- mixed-lengths: a `long` share of --input-len prompts, the rest `short` x --input-len.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.bench.trace import WorkloadRequest
from appliance.errors import PdctlError


class _Mix(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SharedPrefix(_Mix):
    """K groups of requests, each group sharing one long system prompt."""

    name: Literal["shared-prefix"] = "shared-prefix"
    groups: int = Field(default=4, ge=1, le=10_000)
    prefix: float = Field(default=0.75, ge=0, le=1, description="share of --input-len the group shares")

    def requests(self, count: int, input_len: int, output_len: int, rng: random.Random) -> list[WorkloadRequest]:
        """`count` requests, each in a random group."""
        shared = int(input_len * self.prefix)
        return [WorkloadRequest(input_len, output_len, prefix_group=f"group-{rng.randrange(self.groups)}",
                                prefix_len=shared) for _ in range(count)]


class MultiTurn(_Mix):
    """Conversations whose later turns resend everything said before."""

    name: Literal["multi-turn"] = "multi-turn"
    turns: int = Field(default=4, ge=1, le=100)
    user: float = Field(default=0.25, gt=0, le=1, description="a later turn's new text, share of --input-len")

    def requests(self, count: int, input_len: int, output_len: int, rng: random.Random) -> list[WorkloadRequest]:
        """`count` turns of ceil(count / turns) conversations, interleaved: request j is turn j // C + 1 of
        conversation j % C, so a conversation's next turn comes C arrivals after its last."""
        conversations = math.ceil(count / self.turns)
        later = max(1, int(input_len * self.user))
        return [WorkloadRequest(input_len if j < conversations else later, output_len,
                                conversation=f"conv-{j % conversations}", turn=j // conversations + 1)
                for j in range(count)]


class MixedLengths(_Mix):
    """Short and long prompts, drawn at random."""

    name: Literal["mixed-lengths"] = "mixed-lengths"
    long: float = Field(default=0.25, ge=0, le=1, description="share of requests with --input-len prompts")
    short: float = Field(default=0.1, gt=0, le=1, description="a short prompt's length, share of --input-len")

    def requests(self, count: int, input_len: int, output_len: int, rng: random.Random) -> list[WorkloadRequest]:
        """`count` requests, each long with probability `long`."""
        short = max(1, int(input_len * self.short))
        return [WorkloadRequest(input_len if rng.random() < self.long else short, output_len) for _ in range(count)]


Mix = SharedPrefix | MultiTurn | MixedLengths
MIXES: dict[str, type[Mix]] = {"shared-prefix": SharedPrefix, "multi-turn": MultiTurn, "mixed-lengths": MixedLengths}


def parse_mix(spec: str) -> Mix:
    """'NAME' or 'NAME:key=value,...' -> the mix; a PdctlError naming the bad part."""
    name, _, params = spec.strip().partition(":")
    kind = MIXES.get(name)
    if kind is None:
        raise PdctlError(f"--workload {spec!r} is neither a built-in mix nor a file",
                         fix=f"name a JSONL file or one of {', '.join(MIXES)}")
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in params.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise PdctlError(f"--workload {spec!r}: {part!r} is not key=value", fix=f"e.g. {name}:{_example(kind)}")
        values[key.strip()] = value.strip()
    try:
        return kind.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise PdctlError(f"--workload {spec!r}: {field}: {err['msg']}",
                         fix=f"{name} takes {', '.join(f for f in kind.model_fields if f != 'name')}") from None


def _example(kind: type[Mix]) -> str:
    return ",".join(f"{f}={info.default}" for f, info in kind.model_fields.items() if f != "name")
