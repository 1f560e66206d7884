"""Workloads: what each request of a replay asks for, read from a JSONL workload file (docs/bench.md,
"Workloads"), and the prompts built from it. Pure and seeded.

A line is pdctl's own shape (`arrival_s`, `input_len`, `output_len`, `prompt`, `prefix_group`, `prefix_len`,
`conversation`, `turn`) or the Mooncake trace's (`timestamp` in ms, `input_length`, `output_length`,
`hash_ids`: ids of 512-token blocks, equal ids meaning the same tokens).
"""

from __future__ import annotations

import difflib
import json
import os
import random
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from appliance.bench.workload import PromptKind, words
from appliance.errors import PdctlError

# The Mooncake traces hash prompts in blocks of 512 tokens (their README); a hash id stands for one block.
TRACE_BLOCK_TOKENS = 512
# No served model takes a longer prompt; a line asking for more is a mistake that would only exhaust memory.
MAX_PROMPT_TOKENS = 1 << 20
# The prompt tokens of a whole file, at most: each rate builds every prompt before it sends them (about 36 bytes
# a token id as Python ints, so ~1.2 GiB at this bound); more is refused before anything is sent.
MAX_WORKLOAD_TOKENS = 1 << 25
# The largest workload file read: 5,000 lines of a Mooncake trace are ~1 MB.
MAX_WORKLOAD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send: its lengths or literal text, arrival time, and what it shares with others."""

    input_len: int  # with a conversation: the new user text of this turn
    output_len: int
    arrival_s: float | None = None
    text: str | None = None
    prefix_group: str | None = None
    prefix_len: int = 0
    conversation: str | None = None
    turn: int | None = None
    blocks: tuple[int, ...] = ()
    line: int = 0  # of its workload file (0: drawn from a mix)


class _Line(BaseModel):
    """One line of a workload file, as written."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    arrival_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    timestamp: float | None = Field(default=None, ge=0, allow_inf_nan=False, description="ms (Mooncake)")
    input_len: int | None = Field(default=None, ge=1, le=MAX_PROMPT_TOKENS,
                                  validation_alias=AliasChoices("input_len", "input_length"))
    output_len: int = Field(ge=1, le=MAX_PROMPT_TOKENS, validation_alias=AliasChoices("output_len", "output_length"))
    prompt: str | None = Field(default=None, min_length=1)
    prefix_group: str | None = Field(default=None, min_length=1, max_length=200)
    prefix_len: int = Field(default=0, ge=0)
    conversation: str | None = Field(default=None, min_length=1, max_length=200)
    turn: int | None = Field(default=None, ge=1)
    hash_ids: list[int] = Field(default_factory=list, max_length=MAX_PROMPT_TOKENS // TRACE_BLOCK_TOKENS)

    @model_validator(mode="after")
    def _consistent(self) -> _Line:
        if self.arrival_s is not None and self.timestamp is not None:
            raise ValueError("give arrival_s (seconds) or timestamp (ms), not both")
        if (self.prompt is None) == (self.input_len is None):
            raise ValueError("give exactly one of input_len (a length) and prompt (literal text)")
        if self.prompt is not None and (self.prefix_group or self.conversation or self.hash_ids):
            raise ValueError("a literal prompt cannot also have a prefix group, conversation or hash_ids")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("prefix_len needs a prefix_group")
        if self.input_len is not None and self.prefix_len > self.input_len:
            raise ValueError(f"prefix_len {self.prefix_len} is longer than input_len {self.input_len}")
        if (self.conversation is None) != (self.turn is None):
            raise ValueError("conversation and turn go together")
        if self.hash_ids and (self.prefix_group or self.conversation):
            raise ValueError("hash_ids already say what is shared: drop prefix_group/conversation")
        if any(h < 0 for h in self.hash_ids):
            raise ValueError("hash_ids are non-negative integers")
        blocks = -(-(self.input_len or 0) // TRACE_BLOCK_TOKENS)
        if len(self.hash_ids) > blocks:
            # each id stands for 512 tokens of the prompt: more ids than input_len covers would only take memory
            raise ValueError(f"{len(self.hash_ids)} hash_ids for input_len {self.input_len}: at most {blocks} "
                             f"(one per {TRACE_BLOCK_TOKENS} tokens)")
        return self

    def request(self, line: int) -> WorkloadRequest:
        """The request this line asks for."""
        arrival = self.timestamp / 1000 if self.timestamp is not None else self.arrival_s
        return WorkloadRequest(
            input_len=self.input_len or 0,
            output_len=self.output_len,
            arrival_s=arrival,
            text=self.prompt,
            prefix_group=self.prefix_group,
            prefix_len=self.prefix_len,
            conversation=self.conversation,
            turn=self.turn,
            blocks=tuple(self.hash_ids),
            line=line,
        )


@dataclass(frozen=True)
class WorkloadFile:
    """A read workload file: its requests in file order; `timed` when every line has an arrival time."""

    path: str
    requests: tuple[WorkloadRequest, ...]

    @property
    def timed(self) -> bool:
        """True when the lines carry arrival times (else a rate spaces them)."""
        return self.requests[0].arrival_s is not None

    @property
    def rate(self) -> float:
        """The file's mean arrival rate in req/s (3 significant digits): its label in the results."""
        times = [r.arrival_s or 0.0 for r in self.requests]
        span = times[-1] - times[0]
        return float(f"{(len(times) - 1) / span:.3g}") if len(times) > 1 and span > 0 else float(len(times))


def prompt_tokens(request: WorkloadRequest, said: int) -> int:
    """The token ids a request's prompt holds, `said` being its conversation's tokens before it."""
    return said + request.input_len if request.conversation is not None else request.input_len


def parse_workload(lines: Iterable[str], path: str, max_requests: int) -> WorkloadFile:
    """The requests of a workload file's lines; a PdctlError naming the first bad line's number."""
    requests: list[WorkloadRequest] = []
    turns: dict[str, int] = {}
    said: dict[str, int] = {}  # tokens of each conversation so far: its next prompt starts with them
    total = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        request = _parse_line(raw, where, number)
        total += prompt_tokens(request, said.get(request.conversation or "", 0))
        if total > MAX_WORKLOAD_TOKENS:
            raise PdctlError(f"{where}: the prompts up to here hold {total} tokens, over the {MAX_WORKLOAD_TOKENS} "
                             "pdctl bench builds in memory", fix="cut the file or its lengths")
        if requests and (request.arrival_s is None) != (requests[0].arrival_s is None):
            raise PdctlError(f"{where}: every line or none has an arrival time (arrival_s or timestamp)",
                             fix="time every line, or none and pass --rates")
        if requests and request.arrival_s is not None and request.arrival_s < (requests[-1].arrival_s or 0.0):
            raise PdctlError(f"{where}: arrival {request.arrival_s:g} s is before the line above's "
                             f"{requests[-1].arrival_s:g} s", fix="sort the file by arrival time")
        if request.conversation is not None:
            expected = turns.get(request.conversation, 0) + 1
            if request.turn != expected:
                raise PdctlError(f"{where}: conversation {request.conversation!r} turn {request.turn} "
                                 f"where turn {expected} comes next", fix="number each conversation's turns 1, 2, 3 in file order")
            turns[request.conversation] = expected
            size = said.get(request.conversation, 0) + request.input_len
            if size > MAX_PROMPT_TOKENS:
                raise PdctlError(f"{where}: conversation {request.conversation!r} turn {request.turn} would send "
                                 f"{size} prompt tokens, over {MAX_PROMPT_TOKENS}", fix="end the conversation earlier")
            said[request.conversation] = size + request.output_len
        requests.append(request)
        if len(requests) > max_requests:
            raise PdctlError(f"{path} has more than {max_requests} requests",
                             fix="raise --max-requests or cut the file")
    if not requests:
        raise PdctlError(f"{path} has no request", fix="one JSON object per line (docs/bench.md)")
    return WorkloadFile(path, tuple(requests))


def _known_keys() -> list[str]:
    """Every key a workload line may have, its aliases (the Mooncake trace's names) included."""
    keys = []
    for name, field in _Line.model_fields.items():
        alias = field.validation_alias
        keys += [str(c) for c in alias.choices] if isinstance(alias, AliasChoices) else [name]
    return keys


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, _known_keys(), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _parse_line(raw: str, where: str, number: int) -> WorkloadRequest:
    try:
        data: Any = json.loads(raw)
    except ValueError as exc:
        raise PdctlError(f"{where}: not JSON: {exc}", fix="one JSON object per line") from None
    if not isinstance(data, dict):
        raise PdctlError(f"{where}: a JSON object is expected, not {type(data).__name__}")
    try:
        return _Line.model_validate(data).request(number)
    except ValidationError as exc:
        errors = exc.errors()
        # an unknown key first: a misspelt one (outptu_len) also leaves its field missing, which alone misleads
        unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            raise PdctlError(f"{where}: unknown key {', '.join(map(repr, unknown))}{_did_you_mean(unknown[0])}",
                             fix=f"the keys are {', '.join(_known_keys())} (docs/bench.md, Workloads)") from None
        err = errors[0]
        field = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        raise PdctlError(f"{where}: {field + ': ' if field else ''}{message}",
                         fix="see docs/bench.md, Workloads") from None


def read_workload(path: Path, max_requests: int) -> WorkloadFile:
    """Read a workload file line by line; a one-line error when it is missing, not a regular file (a FIFO, a
    device), larger than MAX_WORKLOAD_BYTES or not UTF-8."""
    try:
        # O_NONBLOCK: opening a FIFO would wait for a writer; a regular file ignores it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise PdctlError(f"workload file {path} is not a regular file (a FIFO, a device or a folder)",
                             fix="give a JSONL file")
        with os.fdopen(fd, "rb") as f:
            return parse_workload(_lines(f, path), str(path), max_requests)
    except FileNotFoundError:
        raise PdctlError(f"workload file {path} does not exist") from None
    except OSError as exc:
        raise PdctlError(f"workload file {path} cannot be read: {exc}") from None


def _lines(f: BinaryIO, path: Path) -> Iterator[str]:
    """The file's lines as text, read one at a time, and no more than MAX_WORKLOAD_BYTES of them (a regular file
    may grow while it is read, or say nothing of its size: /proc's)."""
    left, number = MAX_WORKLOAD_BYTES, 0
    while raw := f.readline(left + 1):
        left, number = left - len(raw), number + 1
        if left < 0:
            raise PdctlError(f"workload file {path} is larger than {MAX_WORKLOAD_BYTES // 2**20} MiB",
                             fix="cut the file (pdctl bench sends at most --max-requests lines of it)")
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PdctlError(f"{path} line {number}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def check_context(workload: WorkloadFile, context: int, source: str) -> None:
    """A PdctlError naming the first request whose prompt and output do not fit the served model's context
    (`source` says where it was read); vLLM would refuse each such request, and its prompt costs memory here."""
    said: dict[str, int] = {}
    for r in workload.requests:
        prompt = prompt_tokens(r, said.get(r.conversation or "", 0))
        if r.conversation is not None:
            said[r.conversation] = prompt + r.output_len
        if r.text is None and prompt + r.output_len > context:
            raise PdctlError(f"{workload.path} line {r.line}: {prompt} prompt + {r.output_len} output tokens do not "
                             f"fit the model's context of {context} tokens ({source})",
                             fix="shorten the file's lengths, or serve a longer context")


def build_prompts(requests: Sequence[WorkloadRequest], kind: PromptKind, token_range: tuple[int, int],
                  seed: int) -> list[tuple[int, ...] | str]:
    """Each request's prompt: literal text as given; else a shared group prefix, the trace's shared blocks or the
    conversation so far (earlier prompts and stand-in answers), then tokens of its own. Token ids, or words."""
    lo, hi = token_range

    def tokens(key: str, count: int) -> list[int]:
        rng = random.Random(f"pdctl-workload:{seed}:{key}")
        return [rng.randrange(lo, hi) for _ in range(count)]

    groups: dict[str, list[int]] = {}
    blocks: dict[int, list[int]] = {}
    history: dict[str, list[int]] = {}
    out: list[tuple[int, ...] | str] = []
    for index, r in enumerate(requests):
        if r.text is not None:
            out.append(r.text)
            continue
        own = tokens(f"own:{index}", r.input_len)
        if r.conversation is not None:
            ids = history.get(r.conversation, []) + own
            # The earlier answer is a stand-in of output_len tokens: the real one is only known after it streamed.
            history[r.conversation] = ids + tokens(f"answer:{index}", r.output_len)
        elif r.blocks:
            for b in r.blocks:
                blocks.setdefault(b, tokens(f"block:{b}", TRACE_BLOCK_TOKENS))
            ids = [t for b in r.blocks for t in blocks[b]][: r.input_len]
            ids += own[len(ids):]
        elif r.prefix_group is not None:
            group = groups.setdefault(r.prefix_group, [])
            if len(group) < r.prefix_len:
                # One token stream per group: a longer prefix of the same group extends it, never differs.
                group += tokens(f"group:{r.prefix_group}:{len(group)}", r.prefix_len - len(group))
            ids = group[: r.prefix_len] + own[r.prefix_len:]
        else:
            ids = own
        out.append(tuple(ids) if kind == "tokens" else words(ids))
    return out
