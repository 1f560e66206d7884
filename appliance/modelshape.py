"""What a model's config.json says about its cost: layers, parameters, and KV bytes per token.

Read by `pdctl plan --suggest` (its time and capacity model) and `pdctl status` (what a KV descriptor should
carry); kept apart from both so that neither pulls the other in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the model's config.json says about its cost: parameters, and KV bytes per token."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    params_total: float
    params_active: float  # per token (MoE: the experts a token visits)
    attention_heads: int = 0  # query heads: a prompt token's attention FLOPs grow with heads x head_dim x context
    experts: int = 0  # MoE: routed experts per layer (0: dense)
    experts_per_token: int = 0  # MoE: the experts each token visits
    expert_params: float = 0.0  # MoE: every layer's routed experts together (part of params_total)

    def experts_touched(self, tokens: float) -> float:
        """The share of the routed experts that `tokens` tokens in one step visit (experts_touched)."""
        return experts_touched(self.experts, self.experts_per_token, tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """layers x kv_heads x head_dim x 2 (K and V) x dtype bytes."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def prefill_flops(self) -> tuple[float, float]:
        """FLOPs per prompt token: (2 x active params, attention per token of context it attends to)."""
        return 2 * self.params_active, 4.0 * self.layers * self.attention_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        """All weights, at the model's dtype."""
        return self.params_total * self.dtype_bytes


def experts_touched(experts: int, per_token: int, tokens: float) -> float:
    """The expected share of `experts` routed experts that `tokens` tokens in one step visit, each token
    `per_token` of them (uniform routing): 1 - (1 - k/E)^tokens. Dense (no experts): all weights, 1."""
    if not experts or not per_token:
        return 1.0
    return 1.0 - float((1.0 - per_token / experts) ** max(0.0, tokens))


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


def read_model_shape(path: str | Path) -> ModelShape | None:
    """The cost-relevant shape of a local model directory's config.json; None when it is not one."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return model_shape(cfg) if isinstance(cfg, dict) else None


def model_shape(cfg: dict[str, Any]) -> ModelShape | None:
    """The cost-relevant shape of a parsed config.json; None when it lacks the sizes."""
    cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    try:
        hidden, layers, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    dtype = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
    experts, per_token = int(cfg.get("num_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    if experts and per_token:
        expert = 3 * hidden * int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        mlp_total, mlp_active = experts * expert, per_token * expert
    else:
        mlp_total = mlp_active = 3 * hidden * int(cfg.get("intermediate_size") or 4 * hidden)
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    moe = (experts, per_token, layers * mlp_total) if experts and per_token else (0, 0, 0.0)
    return ModelShape(layers, kv, head_dim, dtype, layers * (attention + mlp_total) + embed,
                      layers * (attention + mlp_active) + embed, heads, *moe)


@dataclass(frozen=True)
class Vocabulary:
    """The token ids a model accepts, 0 <= id < size, and the file that says so."""

    size: int
    source: str


def read_vocabulary(path: str | Path) -> Vocabulary | None:
    """The ids a local model directory accepts: the fewer of config.json's vocab_size and one past
    tokenizer.json's highest id (vLLM refuses a prompt id above its tokenizer's, whatever the config says);
    None when it has neither (a hub name, a remote model)."""
    found: list[Vocabulary] = []
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        found.append(Vocabulary(int(cfg["vocab_size"]), str(Path(path) / "config.json")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        tok = json.loads((Path(path) / "tokenizer.json").read_text())
        ids = [int(i) for i in tok["model"]["vocab"].values()]
        ids += [int(added["id"]) for added in tok.get("added_tokens") or []]
        found.append(Vocabulary(max(ids) + 1, str(Path(path) / "tokenizer.json")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return min(found, key=lambda v: v.size) if found else None
