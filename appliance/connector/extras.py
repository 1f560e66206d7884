"""Which kv_connector_extra_config keys each vLLM release reads: a connector owns its table (ExtraConfigTable),
the plan renders from it only what the engine's release reads, and `pdctl doctor` names a setting it will ignore."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.releases import answer_for

# The vLLM releases whose code the tables were read from (every kv_connector_extra_config / get_from_extra_config
# read of the connector's own files, and of the engine's core). Read another release: add it here and to the tables.
READ_RELEASES = ("0.24.0", "0.32.0")

# Keys the engine's core reads whatever the connector: vLLM 0.24.0's v1/core/kv_cache_utils.py
# (_use_packed_kv_cache_config: one packed KV tensor for a model of several KV cache groups); 0.32.0's core reads
# none (its v1/core and v1/worker never look at the extra config).
ENGINE_READS: dict[str, frozenset[str]] = {"enable_cross_layers_blocks": frozenset({"0.24.0"})}


@dataclass(frozen=True)
class ExtraConfigTable:
    """A connector's kv_connector_extra_config keys: for each, the read releases (READ_RELEASES) whose vLLM
    reads it for this connector, and what reads it instead where this connector does not."""

    vllm_class: str
    reads: Mapping[str, frozenset[str]]
    instead: Mapping[str, str] = field(default_factory=dict)

    def _releases(self, key: str) -> frozenset[str]:
        return self.reads.get(key, frozenset()) | ENGINE_READS.get(key, frozenset())

    def read_by(self, key: str, version: str) -> bool | None:
        """Whether vLLM `version` reads `key` with this connector; None where the read releases cannot tell."""
        releases = self._releases(key)
        return answer_for(version, {release: release in releases for release in READ_RELEASES})

    def kept(self, extra: Mapping[str, Any], version: str) -> dict[str, Any]:
        """`extra` less the keys that vLLM `version` is known not to read with this connector."""
        return {key: value for key, value in extra.items() if self.read_by(key, version) is not False}

    def ignored(self, keys: list[str], version: str) -> list[str]:
        """For each of `keys` that vLLM `version` will not read with this connector: why, in one sentence that
        names the key, the version and what reads it instead (another release, another connector) if anything."""
        why = []
        for key in keys:
            if self.read_by(key, version) is not False:
                continue
            elsewhere = sorted(self._releases(key))
            others = [f"vLLM {', '.join(elsewhere)} does" if elsewhere else ""]
            if key in self.instead:
                others.append(f"in vLLM {version} only {self.instead[key]} reads it")
            said = "; ".join(o for o in others if o) or f"no release pdctl read ({', '.join(READ_RELEASES)}) reads it"
            why.append(f"extra_config key '{key}' is not read by vLLM {version}'s {self.vllm_class} ({said})")
        return why
