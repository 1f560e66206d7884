"""A decode step's time on real vLLM (CUDA graphs, dummy weights), split into what the weights and what the running
sequences' KV cost: `batch` sequences decode with short and with long contexts, and one sequence alone.

Why: on one H200 the Qwen3-30B-A3B shape decoded at 9.2 ms a step with FP8 weights and 20.5 ms in bf16 at 64
running (results/gpu-h200x1/s5), and moe_routing.py showed both route near-uniformly (124-126 of 128 experts a
64-token step). This measures each part directly instead of reading it off a benchmark's ITL.

    python3 benchmarks/gpu/moe_step.py MODEL_DIR [--quantization fp8] [--batch 64] [--contexts 128,2500]
        [--steps 128] [--batches 16,32] [--out FILE.json]

Each point: the wall time of generate(max_tokens=1) (the prefill) and of generate(max_tokens=1+steps) on the
same prompts; the step is their difference / steps (prefix caching off, so both prefill alike).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="128,2500")
    ap.add_argument("--batches", default="", help="more batch sizes at the first context, e.g. 16,32")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model=args.model, load_format="dummy", max_model_len=4096, max_num_seqs=args.batch,
              quantization=args.quantization, gpu_memory_utilization=0.85, enable_prefix_caching=False)
    rng = random.Random(0)

    def timed(prompts: list[TokensPrompt], tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
        return time.perf_counter() - start

    points = []
    first = int(args.contexts.split(",")[0])
    extra = [(int(b), first) for b in args.batches.split(",") if b]
    for batch, context in [(1, 128), *extra] + [(args.batch, int(c)) for c in args.contexts.split(",")]:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, vocab - 1000) for _ in range(context)])
                   for _ in range(batch)]
        timed(prompts, 2)  # warm
        prefill = min(timed(prompts, 1) for _ in range(2))
        whole = min(timed(prompts, 1 + args.steps) for _ in range(2))
        points.append({"batch": batch, "context": context, "prefill_s": round(prefill, 4),
                       "step_ms": round((whole - prefill) / args.steps * 1000, 3)})
        print(points[-1], flush=True)
    report = {"quantization": args.quantization or "bf16", "steps": args.steps, "points": points}
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
