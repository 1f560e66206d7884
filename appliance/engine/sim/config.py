"""Settings of one simulated engine, defined once: its command line (sim/cli.py) is generated from these fields
(the description is the flag's help), and the time model is the one pdctl.toml's [engine.sim] sets."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.connector import check_name, get_connector, names
from appliance.roles import Mode, Role
from appliance.settings import SimTimeModel


class FaultConfig(BaseModel):
    """Faults a test can inject; also settable at runtime through POST /sim/fault."""

    model_config = ConfigDict(extra="forbid")

    crash_after_tokens: int | None = Field(default=None, ge=1, description="Exit hard after N generated tokens.")
    hang_prefill: bool = Field(default=False, description="Prefill requests never answer.")
    prefill_delay_s: float = Field(default=0.0, ge=0.0, description="Delay prefill requests.")
    prefill_fail: bool = Field(default=False, description="Prefill requests answer 500.")
    refuse_registration: bool = Field(default=False, description="MoRIIO: never register with the proxy.")
    health_waits_for_metrics: bool = Field(
        default=False, description="/health answers only once /metrics was asked since this was set (30 s at most, "
                                   "then 503): a caller asking both at once sees it healthy, one asking in turn not.")
    health_delay_s: float = Field(default=0.0, ge=0.0, description="Delay /health answers (a busy API server).")


class SimConfig(SimTimeModel):
    """Everything one simulated engine needs; port 0 means "pick a free port" (tests). The time model's knobs
    (prefill_us_per_token, decode_step_ms, ..., block_size) come from SimTimeModel."""

    host: str = Field(default="127.0.0.1", description="Address to bind and advertise.")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (0 = any free port).")
    role: Role = "both"
    connector: str = "none"
    mode: Mode = "read"
    model: str = Field(default="sim-model", description="Served model name.")
    instance_name: str = Field(default="", description="Instance name, e.g. prefill-0 (logs only).")
    max_model_len: int = Field(default=8192, ge=16)
    seed: int = Field(default=0, description="Engine seed for the generated text.")

    # MoRIIO: registration with the proxy and the two ZMQ ports of rank (dp 0, tp 0).
    proxy_ping: str | None = Field(default=None, description="MoRIIO: HOST:PORT of the proxy's registration ROUTER.")
    handshake_port: int | None = Field(default=None, ge=0, le=65535, description="MoRIIO: handshake port (0 = any).")
    notify_port: int | None = Field(default=None, ge=0, le=65535, description="MoRIIO: notify port (0 = any).")
    dp_size: int = Field(default=1, ge=1)
    tp_size: int = Field(default=1, ge=1)
    # MoRIIOConstants.PING_INTERVAL
    ping_interval_s: float = Field(default=3.0, gt=0, description="MoRIIO registration interval.")
    side_channel_port: int | None = Field(default=None, ge=0, le=65535, description="NIXL: side-channel port (0 = any).")
    shared_storage: str | None = Field(default=None, description="ExampleConnector: shared KV directory.")

    # KV handoff timing and bounds.
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    kv_abort_timeout_s: float = Field(default=480.0, gt=0,
                                      description="Free held prefill blocks nobody came for after this long.")
    # MoRIIO transfer_timeout
    kv_wait_timeout_s: float = Field(default=30.0, gt=0,
                                     description="MoRIIO WRITE: how long a decode waits for the prefill's push.")
    kv_connect_timeout_s: float = Field(default=5.0, gt=0)
    kv_transfer_us_per_token: float = Field(default=1.0, ge=0)
    # What a real transfer of one prompt token moves (the vllm:nixl_bytes_transferred figures): Qwen3-32B
    # bf16 is 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 262,144.
    kv_bytes_per_token: int = Field(default=262144, ge=1)
    # 0 is vLLM's cross-layer blocks (every layer in one region); N is what vLLM does where it kept per-layer
    # blocks (the cross-layer setting ignored: Model Runner V2, another attention backend or KV layout).
    kv_per_layer_descriptors: int = Field(default=0, ge=0, description=(
        "NIXL: post N layers x K/V descriptors per block (per-layer blocks); 0: one per block (cross-layer)."))

    max_num_seqs: int = Field(default=256, ge=1)
    chunk_tokens: int = Field(default=2048, ge=1, description="max-num-batched-tokens per step.")
    speed: float = Field(default=1.0, gt=0, description="Run the time model this much faster.")
    # 1 makes a prefill's only token EOS, the case where vLLM's connectors hand no KV over.
    eos_after: int | None = Field(default=None, ge=1, description=(
        "End every request with EOS as its token N (default: 64-511, picked by the prompt)."))
    # vLLM binds its HTTP port only once loaded.
    load_s: float = Field(default=0.0, ge=0,
                          description="Seconds spent 'loading the model' before listening (like vLLM).")
    # vLLM 0.32 compiles its logprob ranking (torch inductor) the first time a request asks for logprobs or prompt
    # logprobs: 2-16 s on a busy 2-core box, paid by that request and any that asks for them meanwhile.
    first_logprobs_s: float = Field(default=0.0, ge=0, description=(
        "The first request asking for logprobs or prompt logprobs waits this long (vLLM compiles on first use)."))
    # vLLM's API server runs its EngineCore (and workers) as children in its process group; when the API server
    # dies by itself they keep running. This child is left behind however the engine ends, the worst case.
    engine_core_child: bool = Field(default=False, description=(
        "Start a child process in the engine's process group, like vLLM's EngineCore, and leave it running "
        "however the engine ends."))

    faults: FaultConfig = Field(default_factory=FaultConfig)

    @field_validator("connector")
    @classmethod
    def _registered(cls, value: str) -> str:
        return check_name(value)

    @model_validator(mode="after")
    def _connector_needs(self) -> SimConfig:
        connector = get_connector(self.connector)
        if self.role in ("prefill", "decode") and not connector.disaggregated:
            disaggregated = [n for n in names() if get_connector(n).disaggregated]
            raise ValueError(
                f"role {self.role!r} needs a KV connector ({', '.join(disaggregated)}), not {self.connector!r}"
            )
        connector.check_mode(self.mode)
        connector.check_sim(self)
        if self.proxy_ping is not None:
            host, _, port = self.proxy_ping.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--proxy-ping must be HOST:PORT, got {self.proxy_ping!r}")
        return self

    @property
    def kv_role(self) -> str:
        """vLLM's kv_role for this engine role."""
        return {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[self.role]
