"""What TP a model can take: vLLM splits attention heads across TP ranks and refuses a TP that does not divide
them (ValueError at start); KV heads are split (kv % tp == 0) or replicated (tp % kv == 0), anything else
fails an assertion when the model loads. MLA models (DeepSeek) keep one latent KV, split by nobody."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heads:
    """A model's attention and KV head counts (kv None: MLA, no constraint)."""

    attention: int
    kv: int | None

    def tp_problem(self, tp: int) -> str | None:
        """Why vLLM would refuse TP `tp` for this model, or None when it can take it."""
        if self.attention % tp:
            return f"TP {tp} does not divide the model's {self.attention} attention heads"
        if self.kv is not None and self.kv % tp and tp % self.kv:
            return f"TP {tp} neither divides the model's {self.kv} KV heads nor is a multiple of them"
        return None

    def fitting(self, upto: int) -> list[int]:
        """The TP sizes from 1 to `upto` this model can take."""
        return [tp for tp in range(1, upto + 1) if self.tp_problem(tp) is None]


def read_heads(model_path: str | Path) -> Heads | None:
    """Head counts from a local model directory's config.json; None when it is not one or says nothing usable."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    # multimodal models keep the language model's shape in text_config
    source = text if isinstance(text, dict) and "num_attention_heads" in text else config
    attention = source.get("num_attention_heads")
    if not isinstance(attention, int) or isinstance(attention, bool) or attention < 1:
        return None
    if source.get("kv_lora_rank"):
        return Heads(attention, None)
    kv = source.get("num_key_value_heads") or attention
    return Heads(attention, kv if isinstance(kv, int) and not isinstance(kv, bool) and kv >= 1 else attention)
