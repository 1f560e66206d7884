"""What a model's config.json (and tokenizer.json) say: the TP sizes it can take (its heads), its cost (layers,
parameters, KV bytes per token) and the token ids it accepts.

Read by `pdctl doctor` and `pdctl rebalance` (TP), `pdctl plan --suggest` (its time and capacity model), `pdctl
status` (what a KV descriptor should carry) and `pdctl bench` (prompt ids); kept apart from all of them so that
none pulls another in.

TP: vLLM splits attention heads across TP ranks and refuses a TP that does not divide them (ValueError at start);
KV heads are split (kv % tp == 0) or replicated (tp % kv == 0), anything else fails an assertion when the model
loads. MLA models (DeepSeek) keep one latent KV, split by nobody.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


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
    embedding_params: float = 0.0  # input embedding + LM head (part of params_total; never quantized)
    quantization: str = ""  # the checkpoint's quantization_config quant_method ("" : none)
    linear_bytes: float = 0.0  # bytes per quantized linear weight, scales included (0: dtype_bytes)
    fp8_gemm: bool = False  # W8A8 FP8: the GEMMs run at the accelerator's FP8 rate

    def experts_touched(self, tokens: float) -> float:
        """The share of the routed experts that `tokens` tokens in one step visit (experts_touched)."""
        return experts_touched(self.experts, self.experts_per_token, tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """layers x kv_heads x head_dim x 2 (K and V) x dtype bytes."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def prefill_flops(self) -> tuple[float, float]:
        """FLOPs per prompt token: (2 x active params but the embeddings, attention per token of context it
        attends to). The input embedding is a lookup and the LM head runs for a prompt's last token only."""
        return 2 * (self.params_active - self.embedding_params), 4.0 * self.layers * self.attention_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        """All weights as stored on the GPU: quantized linear layers, embeddings at the model's dtype."""
        return self.bytes_of(self.params_total - self.embedding_params) + self.embedding_params * self.dtype_bytes

    def bytes_of(self, linear_params: float) -> float:
        """The bytes of `linear_params` parameters of linear layers (quantized where the checkpoint is)."""
        return linear_params * (self.linear_bytes or self.dtype_bytes)

    @property
    def streamed_bytes(self) -> float:
        """What a decode step reads of the weights: all but the input embedding (a lookup of a few rows)."""
        return self.weight_bytes - self.embedding_params / 2 * self.dtype_bytes


def experts_touched(experts: int, per_token: int, tokens: float) -> float:
    """The expected share of `experts` routed experts that `tokens` tokens in one step visit, each token
    `per_token` of them (uniform routing): 1 - (1 - k/E)^tokens. Dense (no experts): all weights, 1."""
    if not experts or not per_token:
        return 1.0
    return 1.0 - float((1.0 - per_token / experts) ** max(0.0, tokens))


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}
# vLLM's quantization methods that keep FP8 weights and run FP8 GEMMs (W8A8); the others below are weight-only
# (the GEMMs dequantize to the activations' dtype).
_FP8_METHODS = frozenset({"fp8", "fbgemm_fp8", "ptpc_fp8", "fp_quant"})
_MXFP4_BITS = 4.25  # 4-bit values + one 8-bit scale per 32 (OCP MX)
_NVFP4_BITS = 4.5  # 4-bit values + one FP8 scale per 16


def quantized_weight(quant: dict[str, Any]) -> tuple[str, float, bool] | None:
    """(method, bytes per linear weight with its scales, FP8 GEMMs) of a config.json quantization_config, or
    None when it names no format this model knows (the weights are then taken at the model's dtype)."""
    method = str(quant.get("quant_method") or "").lower()
    group = int(quant.get("group_size") or quant.get("q_group_size") or 128)
    bits = quant.get("bits") or quant.get("w_bit") or quant.get("weight_bits")
    if method in _FP8_METHODS:
        return method, 1.0, True
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
        if weights and isinstance(weights[0], dict) and weights[0].get("num_bits"):
            w = weights[0]
            fp8 = w.get("type") == "float" and int(w["num_bits"]) == 8
            size = int(w.get("group_size") or 0)
            return method, int(w["num_bits"]) / 8 + (2 / size if size else 0.0), fp8
        return None
    if method == "modelopt":
        algo = str(quant.get("quant_algo") or (quant.get("quantization") or {}).get("quant_algo") or "").upper()
        return (method, 1.0, True) if algo == "FP8" else (method, _NVFP4_BITS / 8, False) if "FP4" in algo else None
    if method == "mxfp4":
        return method, _MXFP4_BITS / 8, False
    if method == "bitsandbytes":
        return method, (0.5 + 4 / 64) if quant.get("load_in_4bit") else 1.0, False
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "marlin", "auto-round", "quark") and bits:
        # per group: a 16-bit scale and (asymmetric) a packed zero point
        return method, int(bits) / 8 + (2 + int(bits) / 8) / group, False
    return None


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
    moe = experts and per_token
    raw = cfg.get("quantization_config")
    quant = quantized_weight(raw) if isinstance(raw, dict) else None
    method, linear, fp8 = quant if quant is not None else ("", 0.0, False)
    return ModelShape(layers, kv, head_dim, dtype, layers * (attention + mlp_total) + embed,
                      layers * (attention + mlp_active) + embed, heads, experts=experts if moe else 0,
                      experts_per_token=per_token if moe else 0,
                      expert_params=float(layers * mlp_total) if moe else 0.0, embedding_params=float(embed),
                      quantization=method, linear_bytes=linear, fp8_gemm=fp8)


def with_engine_quantization(shape: ModelShape, engine_args: list[str]) -> ModelShape:
    """The shape as an engine started with `--quantization fp8` serves it (vLLM quantizes a bf16 checkpoint's
    linear weights to FP8 at load); other --quantization values name the checkpoint's own format."""
    for i, arg in enumerate(engine_args):
        value = arg.split("=", 1)[1] if arg.startswith("--quantization=") else (
            engine_args[i + 1] if arg in ("--quantization", "-q") and i + 1 < len(engine_args) else None)
        if value is not None and not shape.quantization and value.lower() in _FP8_METHODS:
            return replace(shape, quantization=value.lower(), linear_bytes=1.0, fp8_gemm=True)
    return shape


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
