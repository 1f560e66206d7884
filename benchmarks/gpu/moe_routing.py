"""How many of an MoE model's routed experts a decode step visits, on real vLLM with the dummy weights pdctl's GPU
runs use (`--load-format dummy`), with and without `--quantization fp8`.

Why: on one H200 the Qwen3-30B-A3B shape decoded at 20.5 ms a step in bf16 but 9.2 ms with FP8 at 64 running
(results/gpu-h200x1/s5), and from ~1 to 64 running the FP8 step grew by about the running sequences' KV read
alone, as if the experts a step streams did not grow with the batch. Under uniform routing 64 tokens x 8 of 128
experts visit 98 % of them. This counts, for every MoE layer of every forward, the tokens and the distinct experts
their router picks (the gate run a second time beside vLLM's own, in eager mode), and the distinct tokens the
sequences sampled at each decode position (greedy).

    python3 benchmarks/gpu/moe_routing.py MODEL_DIR [--quantization fp8] [--seqs 64] [--prompt-len 512]
        [--tokens 32] [--out FILE.json]

Needs vLLM (the GPU kit); runs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the hook applies.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models import qwen3_moe

    config = json.loads((Path(args.model) / "config.json").read_text())
    top_k, vocab = config["num_experts_per_tok"], config["vocab_size"]
    seen: dict[int, list[int]] = defaultdict(list)  # tokens in a forward -> distinct experts, per MoE layer call
    original = qwen3_moe.Qwen3MoeSparseMoeBlock.forward

    def counted(self, hidden_states):  # type: ignore[no-untyped-def]
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        logits, _ = self.gate(flat)
        picked = torch.topk(logits.float(), top_k, dim=-1).indices
        seen[flat.shape[0]].append(int(torch.unique(picked).numel()))
        return original(self, hidden_states)

    qwen3_moe.Qwen3MoeSparseMoeBlock.forward = counted
    llm = LLM(model=args.model, load_format="dummy", enforce_eager=True, max_model_len=4096,
              max_num_seqs=args.seqs, quantization=args.quantization, gpu_memory_utilization=0.85,
              enable_prefix_caching=False)
    seen.clear()  # the profiling and warm-up forwards
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_len)])
               for _ in range(args.seqs)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0))
    tokens = [o.outputs[0].token_ids for o in outs]
    distinct_sampled = [len({t[i] for t in tokens if len(t) > i}) for i in range(args.tokens)]
    experts = config["num_experts"]
    uniform = {n: experts * (1 - (1 - top_k / experts) ** n) for n in seen}
    report = {
        "quantization": args.quantization or "bf16", "experts": experts, "top_k": top_k, "seqs": args.seqs,
        "distinct_sampled_tokens_per_position": distinct_sampled,
        "by_tokens": {n: {"calls": len(v), "distinct_experts_median": statistics.median(v),
                          "min": min(v), "max": max(v), "uniform_routing": round(uniform[n], 1)}
                      for n, v in sorted(seen.items())},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
