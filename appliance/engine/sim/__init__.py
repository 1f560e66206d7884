"""Simulated vLLM engine: an aiohttp server that speaks vLLM's OpenAI API subset and KV-connector flows.

It stands in for a real vLLM prefill, decode or colocated instance on machines without GPUs: the
HTTP shapes, ``kv_transfer_params`` and the connectors' side channels (NIXL pull, MoRIIO READ/WRITE
with ZMQ registration, ExampleConnector shared storage) behave like the real ones, and a time model
with continuous batching reproduces prefill/decode interference. Run it as ``pdctl sim-engine``.
"""

from appliance.engine.sim.config import FaultConfig, SimConfig
from appliance.engine.sim.server import SimServer, serve

__all__ = ["FaultConfig", "SimConfig", "SimServer", "serve"]
