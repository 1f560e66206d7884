"""What every export target shares: one role's cluster shape taken from the Plan, and atomic file output.

The Plan is the single source of truth here too: engine arguments are read back from each instance's vLLM
command line, so a flag the node runs with is a flag the cluster runs with. What only makes sense on one
node (loopback addresses, GPU pinning, the pdctl proxy's registration socket) is dropped or re-derived.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from appliance.connector import described, get_connector, implementing
from appliance.engine.command import NODE_LOCAL_ENV, server_args
from appliance.errors import ExportError
from appliance.plan import Instance, Plan
from appliance.render.templates import secret_env

Target = Literal["ray-serve", "llm-d"]
ClusterRole = Literal["prefill", "decode"]

# vLLM flags that describe where one process listens on this node; a cluster engine decides them itself.
# kv_events_config: the engine publishes to pdctl's proxy on its own node (a socket in the state directory, or
# 127.0.0.1: prefix affinity)
NODE_LOCAL_FLAGS = frozenset({"model", "served_model_name", "host", "port", "data_parallel_rpc_port",
                              "kv_events_config"})

# vLLM flags typed as human-readable integers on its command line ('256M', '32k'); as EngineArgs keyword
# arguments (Ray's engine_kwargs) they must be plain integers. See vllm/engine/arg_utils.py.
HUMAN_READABLE_INT_FLAGS = frozenset({
    "max_num_batched_tokens", "max_num_scheduled_tokens", "kv_cache_memory_bytes",
    "safetensors_prefetch_block_size", "max_num_queued_tokens", "max_model_len",
})
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT])$")
_DECIMAL_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_INT = re.compile(r"^-?\d+$")
_FLOAT = re.compile(r"^-?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE]-?\d+)$")


@dataclass(frozen=True)
class Replicas:
    """How many copies of a role run: fixed (min == max) or autoscaled between bounds."""

    min: int
    max: int
    initial: int

    @property
    def fixed(self) -> bool:
        """True when the count does not change at run time."""
        return self.min == self.max


@dataclass(frozen=True)
class RoleShape:
    """One role of the plan, as a cluster deploys it: a replica template and a replica count."""

    role: ClusterRole
    replicas: Replicas
    tp: int
    dp: int
    gpus_per_replica: int
    engine_kwargs: dict[str, Any]
    kv_transfer_config: dict[str, Any]
    env: dict[str, str]  # the plain environment, values and all
    ports: dict[str, list[int]]
    # the names of the secret environment variables (HF_TOKEN, ...): an export references them, never their values
    secret_env: tuple[str, ...] = ()


@dataclass
class ExportResult:
    """What an export produced: files by relative path, and what the user runs next."""

    target: Target
    files: dict[str, str]
    next_steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _coerce(value: str) -> Any:
    """A flag's text as vLLM's argparse would type it: ints, floats and JSON objects; else the string."""
    if _INT.match(value):
        return int(value)
    if _FLOAT.match(value):
        return float(value)
    if value.startswith("{") or value.startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def human_readable_int(key: str, value: str) -> int:
    """vLLM's reading of '256M' (binary units K/M/G/T) or '25.6k' (decimal units k/m/g/t) as an integer."""
    match = _HUMAN_INT.match(value.strip())
    if not match:
        raise ExportError(f"--{key.replace('_', '-')} '{value}' is not an integer",
                          fix="write it as a number, optionally with k/m/g/t (x1000) or K/M/G/T (x1024)")
    number, unit = match.groups()
    if unit in _BINARY_UNITS:
        if "." in number:
            raise ExportError(f"--{key.replace('_', '-')} '{value}': vLLM allows no decimals with {unit}",
                              fix=f"write {number}{unit.lower()} (decimal) or a whole number of {unit}")
        return int(number) * _BINARY_UNITS[unit]
    return int(float(number) * _DECIMAL_UNITS[unit])


def engine_kwargs_from_argv(argv: list[str]) -> dict[str, Any]:
    """vLLM's server arguments as EngineArgs keyword arguments (`--max-num-seqs 8` -> max_num_seqs=8)."""
    args = server_args(argv)
    if args is None:
        raise ExportError(
            "the plan's engine command is not vLLM's OpenAI server", fix="export a plan with engine.kind = 'vllm'"
        )
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            raise ExportError(f"cannot read vLLM argument '{token}' of the plan's command line",
                              fix="write extra_args as '--flag', 'value' pairs")
        name, eq, inline = token[2:].partition("=")
        key = name.replace("-", "_")
        if eq:
            kwargs[key] = _coerce(inline)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            kwargs[key] = _coerce(args[i + 1])
            i += 2
        elif key.startswith("no_"):
            kwargs[key[3:]] = False
            i += 1
        else:
            kwargs[key] = True
            i += 1
    for key in HUMAN_READABLE_INT_FLAGS & kwargs.keys():
        # 'auto' / -1 for max_model_len stay as vLLM takes them; only unit suffixes need converting.
        if isinstance(kwargs[key], str) and kwargs[key] != "auto":
            kwargs[key] = human_readable_int(key, kwargs[key])
    return kwargs


def argv_from_engine_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """The inverse of engine_kwargs_from_argv: `--flag=value` items for a container's args."""
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            out.extend([flag, json.dumps(value, separators=(",", ":"))])
        else:
            out.append(f"{flag}={value}")
    return out


def parse_replicas(text: str | None, planned: int, what: str) -> Replicas:
    """'3' (fixed) or '1:4' (autoscaled bounds) -> Replicas; None keeps the plan's instance count."""
    if text is None or text == "":
        return Replicas(planned, planned, planned)
    lo_text, sep, hi_text = text.partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise ExportError(f"{what} '{text}' is not a count", fix=f"write {what} as N or MIN:MAX, e.g. 1:4") from None
    if lo < 0 or hi < 1 or lo > hi:
        raise ExportError(f"{what} '{text}' is not a valid range", fix="use 0 <= MIN <= MAX and MAX >= 1")
    return Replicas(lo, hi, min(max(planned, lo), hi))


def role_instances(plan: Plan, role: ClusterRole) -> list[Instance]:
    """The plan's instances of one role; every one of them must share one shape to become one deployment."""
    insts = plan.role_instances(role)
    shapes = {(i.tp, i.dp, len(i.gpus), i.expert_parallel) for i in insts}
    if len(shapes) > 1:
        raise ExportError(f"the {role} instances of the plan differ in shape {sorted(shapes)}",
                          fix=f"give every {role} instance the same TP, DP and GPU count")
    return insts


def role_shape(plan: Plan, role: ClusterRole, replicas: Replicas) -> RoleShape:
    """The replica template of a role, from its first instance (they are identical but for ports and GPUs)."""
    insts = role_instances(plan, role)
    if not insts:
        raise ExportError(f"the plan has no {role} instance", fix="export a disaggregated plan (connector != none)")
    first = insts[0]
    kwargs = engine_kwargs_from_argv(first.argv)
    kv = kwargs.pop("kv_transfer_config", None) or first.kv_transfer_config
    if not isinstance(kv, dict):
        raise ExportError(f"{first.name} has no KV connector configuration", fix="choose a KV connector")
    for key in NODE_LOCAL_FLAGS:
        kwargs.pop(key, None)
    # the engine's GPU pinning and addresses, and what the plan's connector pins to this node
    node_local = NODE_LOCAL_ENV | get_connector(plan.connector).node_local_env
    plain, secret = secret_env({k: v for k, v in first.env.items() if k not in node_local})
    return RoleShape(
        role=role,
        replicas=replicas,
        tp=first.tp,
        dp=first.dp,
        gpus_per_replica=len(first.gpus),
        engine_kwargs=kwargs,
        kv_transfer_config=json.loads(json.dumps(kv)),
        env=plain,
        ports={k: v for k, v in first.ports.items()},
        secret_env=tuple(secret),
    )


# Each target's hook on Connector: the connectors that implement it are the ones the target can deploy.
TARGET_HOOKS: dict[Target, str] = {"ray-serve": "ray_serve", "llm-d": "llm_d"}


def target_connectors(target: Target) -> str:
    """The connectors a target can deploy, with their platforms, for a fix: the registry's, by their hooks."""
    return described(implementing(TARGET_HOOKS[target]))


def check_exportable(plan: Plan, target: Target) -> None:
    """Refuse plans no cluster target can express, with the fix in the message."""
    if plan.engine != "vllm":
        raise ExportError("the plan runs the simulated engine", fix="export with engine.kind = 'vllm' (the default)")
    if plan.layout != "disaggregated":
        raise ExportError(
            f"the plan is colocated (connector '{plan.connector}'); the export targets deploy prefill/decode apps",
            fix=f"choose a KV connector {target} deploys: {target_connectors(target)}",
        )


def write_files(out_dir: str | os.PathLike[str], files: dict[str, str],
                fix: str = "choose a writable --out directory") -> list[Path]:
    """Write every file atomically (temp file + rename), creating folders; returns the paths written."""
    root = Path(out_dir)
    written: list[Path] = []
    try:
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(text)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            written.append(path)
    except OSError as exc:
        raise ExportError(f"cannot write the export to {root}: {exc.strerror or exc}", fix=fix) from None
    return written


def comment(text: str) -> str:
    """`text` as one YAML comment line, escaped as a JSON string is (ASCII: YAML also breaks lines at U+0085,
    U+2028 and U+2029), so that no value (a model path with a newline) can end the comment and add keys."""
    return "# " + json.dumps(text)[1:-1] + "\n"


def dns_label(text: str, limit: int = 40) -> str:
    """A Kubernetes/Ray-safe name from free text: lower case, [a-z0-9-], starts and ends alphanumeric."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return label or "model"


class _PlainDumper(yaml.SafeDumper):
    """A safe dumper that writes repeated objects out in full: no &anchors for people to puzzle over."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(data: Any) -> str:
    """Block-style YAML in the order the data was built."""
    return yaml.dump(data, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)


def to_yaml_all(documents: list[Any]) -> str:
    """Several YAML documents separated by '---'."""
    return yaml.dump_all(documents, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)
