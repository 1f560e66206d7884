"""Settings of one simulated engine: the CLI maps its flags onto these fields, nothing else reads flags."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.connector import check_name, get_connector, names
from appliance.roles import Mode, Role


class FaultConfig(BaseModel):
    """Faults a test can inject; also settable at runtime through POST /sim/fault."""

    model_config = ConfigDict(extra="forbid")

    crash_after_tokens: int | None = Field(default=None, ge=1)
    hang_prefill: bool = False
    prefill_delay_s: float = Field(default=0.0, ge=0.0)
    prefill_fail: bool = False
    refuse_registration: bool = False


class SimConfig(BaseModel):
    """Everything one simulated engine needs; port 0 means "pick a free port" (tests)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    role: Role = "both"
    connector: str = "none"
    mode: Mode = "read"
    model: str = "sim-model"
    instance_name: str = ""
    max_model_len: int = Field(default=8192, ge=16)
    seed: int = 0

    # MoRIIO: registration with the proxy and the two ZMQ ports of rank (dp 0, tp 0).
    proxy_ping: str | None = None
    handshake_port: int | None = Field(default=None, ge=0, le=65535)
    notify_port: int | None = Field(default=None, ge=0, le=65535)
    dp_size: int = Field(default=1, ge=1)
    tp_size: int = Field(default=1, ge=1)
    ping_interval_s: float = Field(default=3.0, gt=0)  # MoRIIOConstants.PING_INTERVAL
    # NIXL: the side channel the decode pulls blocks through.
    side_channel_port: int | None = Field(default=None, ge=0, le=65535)
    # ExampleConnector: the shared directory KV files go to.
    shared_storage: str | None = None

    # KV handoff timing and bounds.
    kv_abort_timeout_s: float = Field(default=480.0, gt=0)  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    kv_wait_timeout_s: float = Field(default=30.0, gt=0)  # MoRIIO transfer_timeout (WRITE wait)
    kv_connect_timeout_s: float = Field(default=5.0, gt=0)
    kv_transfer_us_per_token: float = Field(default=1.0, ge=0)
    # What a real transfer of one prompt token moves (the vllm:nixl_bytes_transferred figures): Qwen3-32B
    # bf16 is 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 262,144.
    kv_bytes_per_token: int = Field(default=262144, ge=1)
    # NIXL descriptors per block: 0 posts one per block (vLLM's cross-layer blocks, every layer in one region);
    # N posts N layers x K and V per block, as vLLM does where it kept per-layer blocks (the cross-layer
    # setting ignored: Model Runner V2, another attention backend or KV layout).
    kv_per_layer_descriptors: int = Field(default=0, ge=0)

    # Time model.
    prefill_us_per_token: float = Field(default=20.0, ge=0)
    decode_step_ms: float = Field(default=5.0, ge=0)
    decode_step_ms_per_seq: float = Field(default=0.05, ge=0)
    max_num_seqs: int = Field(default=256, ge=1)
    chunk_tokens: int = Field(default=2048, ge=1)
    num_blocks: int = Field(default=8192, ge=1)
    block_size: int = Field(default=16, ge=1)
    speed: float = Field(default=1.0, gt=0)
    # The "model" ends every request with EOS as its token N (default: at a length between 64 and 511 that the
    # prompt picks); 1 makes a prefill's only token EOS, the case where vLLM's connectors hand no KV over.
    eos_after: int | None = Field(default=None, ge=1)
    # Seconds "loading the model" before anything listens: vLLM binds its HTTP port only once loaded.
    load_s: float = Field(default=0.0, ge=0)

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
