"""`pdctl plan --suggest`: rank colocated shapes and disaggregated splits together with a small analytic model.

Candidates: every colocated shape (N instances x TP over the usable GPUs, each with a chunked-prefill
budget B = max_num_batched_tokens from BUDGETS and the engine's default) and every prefill:decode split
(instances x TP per role) that the planner accepts and the model's heads allow.

The engine step (continuous batching): a step costs `step(n) = base(n) + per_seq x n` for n running
sequences (per_seq: each sequence's KV read; base: the weights the step streams, constant for a dense model,
for an MoE one the non-expert weights and routing plus the share 1 - (1 - k/E)^tokens of the experts the
step's tokens visit). Prefill compute of c prompt tokens attending to k tokens on
average is `c x (prefill_us_per_token + k x prefill_us_per_context_token)`. TP t divides a cost by
eff(t) = t x factor^log2(t) (a factor for prefill and one for decode: TP is never free).

- Colocated instance (rate r per instance): running decode tokens take their share of the step's token
  budget B, so a prompt is computed in k = ceil(P / (B - n)) chunks, one per step (a fixed point in n). A
  step with a chunk is slow by its compute less the share `chunk_overlap` of the base that the compute hides
  under (the weights are streamed once for both). With u = r x k x that extra, the mean gap is
  step(n) / (1 - u); the judgements see the slowest chunk (the last, attending to the whole prompt).
- Disaggregated: the prefill instance is an M/D/1 queue (service: the whole prompt's compute). The KV
  hand-off posts d descriptors, d = ceil(P / block_size) with cross-layer blocks, else layers x 2 x that;
  post = post_ms + d x post_us, transfer = d x transfer_us + bytes / link. READ: the decode posts, and its
  step stalls for the post; WRITE: the prefill posts. Either way a joining request's own first step slows
  the running streams by P x join_us. The decode's mean gap is step(n) / (1 - r x stall).
- Running sequences per decode-capable instance follow Little's law, n = r x O x gap, solved exactly
  (gap depends on n). n is bounded by the KV cache: (GPU memory x gpu_memory_utilization - weights / TP
  - reserve) x TP / kv_bytes_per_token tokens, each running sequence holding P + O/2 tokens on average;
  and by max_num_seqs. Above either bound requests queue without end: the shape is saturated.
- TTFT p90 = overhead + service + 2.3 x the M/D/1 mean wait (+ transfer + one decode step).
- ITL judgements: `mean`: the mean gap. `p99` / `max`: a request's O - 1 gaps include X slow ones, X
  Poisson with mean q x (O - 1), q = r x gap (the share of steps that carry a joining request). When the
  slow gap exceeds the target the request fails once X exceeds what the judgement tolerates (`max`: 0;
  `p99`: the gaps above numpy's 99th-percentile rank, ~10 of 999), so attainment = P(X <= m).
- Goodput under a judgement: the highest rate with TTFT p90 <= target, attainment >= slo.attainment,
  and no saturation (bisection).

Profiles (the constants; every figure's source is in docs/operations.md and below):
- `sim`: the simulated engine's time model (settings engine.sim); it ignores TP (factor 0.5: eff = 1).
- `h200`: calibrated on 2 x H200 (vLLM 0.24.0, Qwen3-32B shape, dummy weights; results/gpu-h200x2), one
  measurement per constant, scaled to another model by its config.json (FLOPs per token, weight and KV
  bytes); benchmarks/gpu/suggest_check.py checks it against every goodput measured there.
- a `pdctl bench` result (--profile FILE): prefill and step costs measured at its lowest rate.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from appliance import runsim
from appliance.connector import disaggregated_name, get_connector, resolve_name
from appliance.errors import PdctlError
from appliance.inventory.models import Inventory
from appliance.model_config import Heads, ModelShape, experts_touched
from appliance.plan import SLOW_GAP_SPREAD, SLOW_STEP_SHARE, _usable, decode_only_below, plan, platform_of
from appliance.settings import EMBEDDED_MODEL, Settings, SloSettings

TP_SIZES = (1, 2, 4, 8)
BUDGETS = (256, 512, 2048)  # the chunked-prefill budgets colocated candidates are tried with (as bench)
JUDGEMENTS = ("p99", "max", "mean")
GIB = 1024**3

# --- hardware: each accelerator's public peaks and the share of them vLLM reaches ---------------------------
# Rates scale with the accelerator: a calibrated constant below is a share of the H200's public peak (4.8 TB/s
# HBM3e, 989 TFLOP/s dense bf16, 1,979 dense FP8), and another accelerator gets its own peak x its own share.


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's public facts (docs/hardware.md cites them), the shares of its peaks vLLM reaches, and
    what measured those shares: this card, a card of its family (carried), or nothing (assumed)."""

    name: str
    vendor: Literal["nvidia", "amd"]
    family: str  # the shares carry within a family: same compute units, same memory controller
    names: tuple[str, ...]  # what NVML / amdsmi report for it, lower case, spaces dropped
    hbm_gib: float  # what NVML / amdsmi report as total memory (the nearest-profile fact)
    hbm_tbps: float
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense
    link: str  # GPU-GPU, per GPU, both directions together
    weight_share: float  # of hbm_tbps, streaming a decode step's weights
    kv_share: float  # of hbm_tbps, each running sequence's KV read
    gemm_share: float  # of bf16_tflops in a prefill
    fp8_gemm_share: float  # of fp8_tflops in a prefill with FP8 weights (W8A8)
    calibrated: str  # what measured the shares ("": measured on no card of this one's)
    band: tuple[float, float] = (1.0, 1.0)  # the shares' transfer: goodput x this range on top of MODEL_BAND
    carried_from: str = ""  # the card whose measured shares this one carries


# Decode step, weights: the 1-GPU decode of issue14-s2/disagg-read-w8000x200.json at 0.4 req/s: median gap
# 18.9 ms with ~1.5 running sequences (Little: 0.4 x 200 x 19 ms) whose KV read is ~0.8 ms -> 18.1 ms for
# 64.0 GB of weights a step reads (65.5 GB less the input embedding, a lookup) = 3.53 TB/s, 0.736 of 4.8.
# Each running sequence's KV read: issue14-s2/disagg-read-w2000x1000.json at 2 req/s: mean gap 27.2 ms with
# 54 running (2 x 1000 x 27.2 ms) of 2,500 tokens at 256 KiB: 35.6 GB in 27.2 - 18.1 = 9.1 ms = 3.9 TB/s.
# Prefill compute (2 x active params less the embeddings, which are no GEMM, + 4 x layers x heads x head_dim x
# context FLOPs per token) and the TTFT outside the engine, solved together from two 1-GPU prefill TTFTs at low
# load: 2000 tokens in one step (bench.json, colocated-2 at vLLM defaults: TTFT p10 232 ms) and 8000 tokens on
# the disaggregated prefill (issue14-s2/disagg-read-w8000x200.json: TTFT min 928 ms, incl. an 18 ms hand-off
# and a 19 ms decode step): 660 TFLOP/s (0.667 of the bf16 peak) and 32 ms.
# FP8 GEMMs (W8A8, vLLM's fp8 method): Qwen3-8B shape with --quantization fp8 (results/gpu-h200x1/s4), an
# 8000-token prompt in one step: TTFT p50 156 ms = 32 + 28.6 ms of bf16 attention + 111 TFLOP of FP8 linear
# layers in 95 ms: 1,170 TFLOP/s, 0.59 of the FP8 peak (1.77x the bf16 rate). Weights streamed at the same
# bytes/s as bf16 (the 8B's one-sequence step, 4.0 ms for 8.2 GB, is mostly per-step overhead: no calibration).
H200 = Accelerator("H200", "nvidia", "hopper", ("h200",), 140.4, hbm_tbps=4.8, bf16_tflops=989.0, fp8_tflops=1979.0,
                   link="NVLink 4, 900 GB/s", weight_share=3.53 / 4.8, kv_share=3.9 / 4.8, gemm_share=660.0 / 989.0,
                   fp8_gemm_share=1170.0 / 1979.0,
                   calibrated="2 x H200, vLLM 0.24.0 (results/gpu-h200x2, results/gpu-h200x1)")
# Hopper cards carry the H200's shares: the same SM and HBM controller, so a decode step's weight stream is the
# same share of each card's bandwidth and a prefill GEMM the same share of its tensor peak. The lent cards bear
# it out: a device-to-device copy reached 0.90 of the peak bandwidth on both an H100 SXM (3.0 of 3.35 TB/s) and
# an H200 (4.3 of 4.8), a bf16 GEMM 0.81 and 0.80 of 989 TFLOP/s (/work/.library/device/KINDS.md readings). The
# band is what the shares' move between those two cards allows (2 %), widened by the one vLLM figure that was
# not re-measured: the per-step launch time, which no bandwidth scales (the 8B's 4.0 ms H200 step for 2.3 ms of
# weights): a step of a small model is up to 1.15 x slower or faster than its bytes say.
HOPPER_BAND = (0.85, 1.15)
H100_SXM = replace(H200, name="H100 SXM", names=("h10080gbhbm3", "h100sxm"), hbm_gib=79.6, hbm_tbps=3.35,
                   link="NVLink 4, 900 GB/s", calibrated="", band=HOPPER_BAND, carried_from="H200")
# The PCIe card: 350 W against 700 W, so its clocks (and the GEMM share of the peak its datasheet states) drop
# further under a long prefill: a wider band on the low side.
H100_PCIE = replace(H100_SXM, name="H100 PCIe", names=("h100pcie",), hbm_tbps=2.0, bf16_tflops=756.0,
                    fp8_tflops=1513.0, link="NVLink bridge 600 GB/s (pairs), else PCIe 5 x16 128 GB/s", band=(0.7, 1.15))
# Blackwell: other compute units (5th-generation tensor cores) and HBM3e at 8 TB/s: the H200's shares are taken
# as a guess, with the assumed-shares band.
ASSUMED_BAND = (0.6, 1.4)
B200 = replace(H200, name="B200", family="blackwell", names=("b200",), hbm_gib=179.1, hbm_tbps=8.0,
               bf16_tflops=2250.0, fp8_tflops=4500.0, link="NVLink 5, 1.8 TB/s", calibrated="", band=ASSUMED_BAND)
# MI300X (docs/hardware.md): 192 GB HBM3 at 5.3 TB/s, 1,307 TFLOP/s dense bf16, 2,615 dense FP8, 7 XGMI links per
# GPU. Shares are public measurements, not pdctl's: HBM streaming reaches ~0.81 of peak in microbenchmarks
# (vLLM's decode reached 0.74 on the H200, so 0.70 is taken); dense GEMMs deliver ~0.45 of the peak in practice
# (hipBLASLt, bf16 and FP8 alike). Hence the band.
MI300X = Accelerator("MI300X", "amd", "cdna3", ("mi300x",), 192.0, hbm_tbps=5.3, bf16_tflops=1307.0,
                     fp8_tflops=2615.0, link="7 x Infinity Fabric, 896 GB/s", weight_share=0.70, kv_share=0.75,
                     gemm_share=0.45, fp8_gemm_share=0.45, calibrated="", band=ASSUMED_BAND)
# MI325X: the MI300X's compute dies with HBM3e: its shares carry (same family) at its own bandwidth.
MI325X = replace(MI300X, name="MI325X", names=("mi325x",), hbm_gib=256.0, hbm_tbps=6.0)
# MI355X (CDNA 4): twice the matrix rate per compute unit, HBM3e at 8 TB/s: the MI300X's assumed shares.
MI355X = replace(MI300X, name="MI355X", family="cdna4", names=("mi355x", "mi350x"), hbm_gib=288.0, hbm_tbps=8.0,
                 bf16_tflops=2500.0, fp8_tflops=5000.0, link="7 x Infinity Fabric, 1,075 GB/s")
ACCELERATORS = (H200, H100_SXM, H100_PCIE, B200, MI300X, MI325X, MI355X)
# An accelerator with no profile: the nearest one by its vendor and memory, with the band widened by how far
# the peaks of two neighbours in that table differ (H100 PCIe to SXM: 0.6 x the bandwidth, 0.76 x the compute).
UNKNOWN_BAND = (0.5, 1.6)
# How far measured goodput lay from the calibrated H200 profile's prediction on every recorded run
# (benchmarks/gpu/suggest_check.py, 401 intervals; tests/bench/test_suggest_check.py holds every one inside):
# per layout and ITL judgement, [the lowest b / predicted, the highest a / predicted] over the intervals [a, b),
# rounded outward. A split judged by its max gap is the model's weak spot (join stalls near the target).
MODEL_BAND: dict[tuple[str, str], tuple[float, float]] = {
    ("colocated", "p99"): (0.75, 1.7), ("colocated", "mean"): (0.75, 1.3), ("colocated", "max"): (0.5, 1.3),
    ("disaggregated", "p99"): (0.35, 3.4), ("disaggregated", "mean"): (0.35, 1.3),
    ("disaggregated", "max"): (0.35, 34.0),
}
H200_TTFT_OVERHEAD_MS = 32.0
# A prefill chunk rides in a decode step: its compute overlaps the step's weight streaming. The share of the
# step's base hidden under the chunk, from issue14/long-colocated-2-mbt256.json (1 GPU, budget 256, 8000
# tokens at 0.4 req/s): TTFT min 1,066 ms = 31 + 32 chunk steps of 32.3 ms = 18.6 ms step + 27.3 ms of chunk
# compute - 0.75 x 18.1 ms.
H200_CHUNK_OVERLAP = 0.57
# TP2 on one node, per doubling eff(2) / 2: decode 0.82 (median gap 11.5 ms at TP2,
# issue14-s2/colocated-1-mbt256-w8000x200.json at 0.4 req/s, vs 18.9 ms at TP1); prefill 0.95 (2000-token
# TTFT p10 136 ms at TP2 vs 232 ms at TP1, bench.json colocated-1 / colocated-2 at vLLM defaults).
H200_DECODE_TP_FACTOR = 0.82
H200_PREFILL_TP_FACTOR = 0.95
# A request joining the decode: its own first step there (mixed, outside the full CUDA graph) slows the
# running streams' gap by ~1.2 us per prompt token: with a join in the gap, ITL p99 +9-10 ms at 8000 tokens
# (READ and WRITE with 0.6 ms posts; summarize.py --joins in results/gpu-h200x2/README.md).
H200_JOIN_US_PER_PROMPT_TOKEN = 1.2
# MoE (Qwen3-30B-A3B shape, 48 layers x 128 experts, 8 per token; results/gpu-h200x1/moe-s3, 1 x H200): a
# decode step streams the non-expert weights and the share of the experts its tokens visit, at the dense
# bandwidth above, plus the routing kernels (router, top-k, token sorting) of each MoE layer: 58 us per layer,
# from the 1-GPU decode of colocated-1-w8000x200 at 0.6 req/s: median gap 4.7 ms for one running sequence
# (2.8 GB non-expert + 6.25 % of 58 GB experts + 0.8 GB of KV = 1.92 ms of reads). The same arithmetic gives
# 17.9 / 29.0 / 32.1 ms at 25 / 150 / 200 running where the 2000/1000 sweeps measured 19.2 / 31 / 32.7 ms.
H200_MOE_US_PER_LAYER = 58.0
# A prefill chunk hides much less of its compute under an MoE step's weight streaming than under a dense one
# (H200_CHUNK_OVERLAP): from colocated-1-mbt256-w8000x200's TTFT min, 682 ms = 31 + 32 chunk steps of 20.3 ms
# = 19.7 ms (every expert read, one running sequence) + 2.9 ms of chunk compute - 0.15 x 19.5 ms. The same
# arithmetic gives 23.6 / 43 / 121 ms per step for budgets 512 / 2048 / the whole 8000-token prompt, where
# those runs' TTFT min gives 23.8 / 47 / 129 ms.
H200_MOE_CHUNK_OVERLAP = 0.15
# But a step that mixes running decodes with more prompt tokens than vLLM's largest CUDA graph (512 tokens in
# these runs: "PIECEWISE=51 (largest=512)") was much slower than that for the MoE shape: the running streams'
# gaps in such steps had a median of 80 ms in colocated-1-mbt2048-w8000x200 at 1.0 req/s (2,048-token chunks,
# 46 ms by the arithmetic above, 47 ms per chunk from the same run's TTFT min, when no decode ran beside
# them). Taken as a floor for such steps: 80 ms / 48 layers = 1.67 ms per MoE layer. Other rates and runs put
# those gaps' median at 52-91 ms; the cause (eager execution above the largest graph is the suspect) is not
# established, and the dense runs show no such floor (their prompt steps are compute-bound above it).
# Established since (results/gpu-h200x1/s4): with graphs captured up to 2,048 tokens (--compilation-config
# '{"max_cudagraph_capture_size": 2048}') the same run's slow gaps had a median of 48 ms at 1.0 req/s (45 ms
# at p50 of the gaps over 2.5x the median), the chunk's own cost: the floor is eager execution above the
# largest captured graph, and applies only to steps larger than it.
H200_MOE_MIXED_US_PER_LAYER = 1670.0
VLLM_CUDAGRAPH_MAX_TOKENS = 512  # vLLM 0.24's largest captured CUDA graph (tokens per step) on these runs
# KV cache: vLLM's budget is GPU memory x gpu_memory_utilization - weights; activations and CUDA graphs come
# out of the rest. This gives 267,626 tokens per H200 at TP1; vLLM reported 269,312 (README, 2000/1000 runs).
H200_RESERVE_GIB = 0.0
# vLLM 0.24's max_num_batched_tokens when unset, for an API server on a >= 70 GiB GPU: the MoE run at the
# default logged "Compiling a graph for compile range (1, 8192)" on an H200 (results/gpu-h200x1).
VLLM_GPU_DEFAULT_BUDGET = 8192
VLLM_DEFAULT_BLOCK_SIZE = 16  # CUDA
VLLM_GPU_DEFAULT_MAX_NUM_SEQS = 1024  # vLLM's max_num_seqs when unset, for an API server on a large GPU


def _graph_tokens(engine_args: list[str]) -> int:
    """vLLM's largest captured CUDA graph (tokens per step) when --compilation-config sets it
    (max_cudagraph_capture_size); 0: vLLM's default (`_default_graph_tokens`)."""
    for flag, value in zip(engine_args, engine_args[1:], strict=False):
        if flag in ("--compilation-config", "-cc"):
            try:
                size = json.loads(value).get("max_cudagraph_capture_size")
            except (ValueError, AttributeError):
                continue
            if isinstance(size, int) and size > 0:
                return size
    return 0


def _default_graph_tokens(max_num_seqs: int, budget: int) -> int:
    """vLLM's default largest CUDA graph (VllmConfig._set_cudagraph_sizes): twice max_num_seqs, at most 512 (1024
    on Blackwell), and never over the step's token budget. So `--max-num-seqs 64` caps the graphs at 128 tokens,
    and a step of 64 decodes and a 512-token prompt chunk runs eagerly (results/gpu-h200x1/s5: the MoE shape's
    such steps took ~100 ms, where budget 512 with graphs up to 512 gave 24 ms)."""
    return min(2 * max_num_seqs, VLLM_CUDAGRAPH_MAX_TOKENS, budget)


def accelerator_of(gpu_name: str) -> Accelerator | None:
    """The hardware profile of a GPU by its reported name (None: no profile for it)."""
    name = gpu_name.lower().replace(" ", "")
    return next((a for a in ACCELERATORS if any(n in name for n in a.names)), None)


def nearest_accelerator(vendor: str, memory_mib: int) -> Accelerator:
    """The profile nearest a card that has none: its vendor's, closest in memory (the fact NVML and amdsmi give
    for every card), with the unknown card's band."""
    same = [a for a in ACCELERATORS if a.vendor == vendor] or list(ACCELERATORS)
    gib = max(memory_mib, 1) / 1024
    near = min(same, key=lambda a: abs(math.log(gib / a.hbm_gib)))
    return replace(near, calibrated="", band=UNKNOWN_BAND, carried_from=near.carried_from or near.name)


def goodput_band(p: Profile, layout: str, judgement: str) -> tuple[float, float]:
    """Where the goodput under `judgement` lies, x the prediction: the model's own spread on the runs that
    calibrated it (MODEL_BAND) times the profile's transfer to this card (Profile.band)."""
    low, high = MODEL_BAND[(layout, judgement)]
    return low * p.band[0], high * p.band[1]


@dataclass(frozen=True)
class Profile:
    """Per-GPU costs the model uses, and where they came from."""

    prefill_us_per_token: float  # at TP1, without attention
    decode_step_ms: float
    decode_step_ms_per_seq: float
    max_num_seqs: int  # the decode role's (and a colocated instance's, unless colocated_max_num_seqs)
    source: str
    prefill_tp_factor: float = 0.9
    decode_tp_factor: float = 0.9
    kv_read_tbps: float | None = None  # per running sequence: its KV (P + O/2 tokens) read each step
    ttft_overhead_ms: float = 0.0
    prefill_us_per_context_token: float = 0.0  # attention: a prompt token's extra cost per token it attends to
    chunk_overlap: float = 0.0  # share of a step's base cost a prefill chunk's compute hides under
    post_ms: float = 0.0  # per hand-off
    post_us_per_descriptor: float = 0.0
    transfer_us_per_descriptor: float = 0.0
    transfer_us_per_token: float = 0.0
    link_gbps: float | None = None
    join_us_per_prompt_token: float = 0.0  # a joining request's first decode step, felt by the running streams
    expert_step_ms: float = 0.0  # MoE: streaming every routed expert's weights at TP1 (a step reads the share
    experts: int = 0  # its tokens visit: 1 - (1 - k/E)^tokens); decode_step_ms holds the rest
    experts_per_token: int = 0
    mixed_floor_ms: float = 0.0  # a step of running decodes and over graph_tokens prompt tokens: at least this
    graph_tokens: int = 0  # the largest CUDA graph's tokens as --compilation-config sets it (0: vLLM's default)
    kv_bytes_per_token: int | None = None
    layers: int = 1
    block_size: int = VLLM_DEFAULT_BLOCK_SIZE
    descriptors: str = "layer-block"  # HandoffFacts.descriptors: how one hand-off is cut into descriptors
    post_on_decode: bool = True  # READ: the decode posts the pull (its step stalls); WRITE: the prefill posts
    write_overlaps_prefill: bool = False  # WRITE pushes each layer as it is computed (only the last one waits)
    handoff_source: str = ""
    calibrated: bool = True  # measured on this accelerator; False: its goodput lies anywhere in `band`
    band: tuple[float, float] = (1.0, 1.0)
    kv_tokens_per_gpu: Callable[[int], float | None] = field(default=lambda tp: None, compare=False, repr=False)
    default_budget: int = 2048
    colocated_max_num_seqs: int | None = None  # [colocated] max_num_seqs, when it differs from the decode's


@dataclass(frozen=True)
class Shape:
    """Instances x TP of one role."""

    instances: int
    tp: int

    @property
    def gpus(self) -> int:
        """GPUs the role takes."""
        return self.instances * self.tp

    def __str__(self) -> str:
        return f"{self.instances}xTP{self.tp}"


@dataclass(frozen=True)
class Candidate:
    """One deployment: a colocated shape with its chunked-prefill budget, or a prefill:decode split."""

    layout: Literal["colocated", "disaggregated"]
    prefill: Shape | None = None
    decode: Shape | None = None
    colocated: Shape | None = None
    budget: int | None = None  # colocated max_num_batched_tokens; None: the engine's default

    def __str__(self) -> str:
        if self.colocated is not None:
            return f"colocated {self.colocated}" + (f" mbt{self.budget}" if self.budget else "")
        return f"{self.prefill} : {self.decode}"

    @property
    def bench_name(self) -> str:
        """The `pdctl bench --compare` shape name this candidate corresponds to (on its own GPUs)."""
        if self.colocated is not None:
            return f"colocated-{self.colocated.instances}" + (f"-mbt{self.budget}" if self.budget else "")
        return "disagg-read"


@dataclass(frozen=True)
class State:
    """A candidate at one rate."""

    ttft_ms: float | None  # p90; None: saturated
    gap_ms: float | None  # mean gap
    slow_gap_ms: float | None  # a gap with a prefill chunk or a join stall in it
    running: float | None  # sequences per decode-capable instance
    capacity: float | None  # the most it can hold (KV cache, max_num_seqs)
    attainment: dict[str, float]  # ITL attainment under each judgement (TTFT apart)
    limit: str  # what binds: "-", "prefill (TTFT)", "decode (ITL)", "KV cache", "max_num_seqs", ...


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted behaviour at the asked rate, and its goodput under each judgement."""

    candidate: Candidate
    goodput_rps: float  # under the run's judgement
    goodput: dict[str, float]
    ttft_ms: float | None
    itl_ms: float | None  # the run's judgement at the asked rate
    running: float | None
    capacity: float | None
    meets_slo: bool
    bottleneck: str

    @property
    def prefill(self) -> Shape | None:
        """The prefill role (disaggregated only)."""
        return self.candidate.prefill

    @property
    def decode(self) -> Shape | None:
        """The decode role (disaggregated only)."""
        return self.candidate.decode

    @property
    def layout(self) -> str:
        """colocated | disaggregated."""
        return self.candidate.layout


def _touched(p: Profile, tokens: float) -> float:
    """The share of the routed experts a step of `tokens` tokens reads (1 for a dense model)."""
    return experts_touched(p.experts, p.experts_per_token, tokens)


def _eff(tp: int, factor: float = 0.9) -> float:
    return float(tp * factor ** math.log2(tp))


def sim_profile(settings: Settings) -> Profile:
    """The simulated engine's time model as a profile (its KV pool: num_blocks x block_size per engine)."""
    sim = settings.engine.sim
    tokens = float(sim.num_blocks * sim.block_size)
    return Profile(sim.prefill_us_per_token, sim.decode_step_ms, sim.decode_step_ms_per_seq,
                   settings.decode.max_num_seqs or 256, "the simulated engine's time model (settings engine.sim)",
                   prefill_tp_factor=0.5, decode_tp_factor=0.5, transfer_us_per_token=1.0,
                   kv_tokens_per_gpu=lambda tp: tokens / tp, default_budget=2048, block_size=sim.block_size)


def gpu_profile(settings: Settings, inventory: Inventory, model: ModelShape, block_size: int,
                cross_layer: bool = True) -> Profile:
    """The calibrated constants on this node's accelerator, scaled to `model` (module constants say where each
    comes from); the hand-off as the connector renders it (`block_size`, one descriptor per block when
    `cross_layer`) at the costs its module states."""
    gpu = next((g for g in inventory.gpus if _usable(g)), None)
    name = gpu.name if gpu else "no GPU"
    acc = accelerator_of(name)
    hw = acc or nearest_accelerator(gpu.vendor if gpu else "nvidia", gpu.memory_total_mib if gpu else 143_771)
    mem = (gpu.memory_total_mib if gpu else 143_771) * 2**20
    util = settings.decode.gpu_memory_utilization or 0.9
    kvb = model.kv_bytes_per_token
    linear, attention = model.prefill_flops
    weight_tbps = hw.hbm_tbps * hw.weight_share
    gemm_tflops = hw.fp8_tflops * hw.fp8_gemm_share if model.fp8_gemm else hw.bf16_tflops * hw.gemm_share

    def kv_tokens(tp: int) -> float:
        return max(0.0, mem * util - model.weight_bytes / tp - H200_RESERVE_GIB * GIB) / kvb

    experts = model.bytes_of(model.expert_params)  # MoE: the routed experts' bytes (0: dense)
    routing = model.layers * H200_MOE_US_PER_LAYER / 1000 if experts else 0.0
    platform = platform_of(inventory)
    connector_name = resolve_name(disaggregated_name(settings.connector.name), platform)
    connector = get_connector(connector_name)
    facts = connector.handoff_facts(platform, cross_layer, settings.connector.own(connector_name))
    what = f"{hw.name} profile" if acc else f"{hw.name} profile on {name} (no profile for it: the nearest by memory)"
    if hw.calibrated:
        how = f"calibrated on {hw.calibrated}"
    else:
        carried = (f"the {hw.carried_from}'s measured shares of the peaks" if hw.carried_from
                   else "assumed shares of the peaks")
        how = (f"NOT calibrated on this hardware (public peaks x {carried}): each band is the calibrated "
               f"model's x {hw.band[0]:g}-{hw.band[1]:g}; the calibration command is below")
    terms = (f"; weights {model.quantization.upper()}" if model.quantization else "") + (
        "; MoE terms from 1 x H200 (Qwen3-30B-A3B shape)" if experts else "")
    return Profile(
        prefill_us_per_token=linear / (gemm_tflops * 1e12) * 1e6,
        decode_step_ms=(model.streamed_bytes - experts) / (weight_tbps * 1e12) * 1e3 + routing,
        expert_step_ms=experts / (weight_tbps * 1e12) * 1e3, experts=model.experts,
        experts_per_token=model.experts_per_token,
        mixed_floor_ms=model.layers * H200_MOE_MIXED_US_PER_LAYER / 1000 if experts else 0.0,
        graph_tokens=_graph_tokens([*settings.colocated.extra_args, *settings.decode.extra_args]),
        decode_step_ms_per_seq=0.0,
        max_num_seqs=settings.decode.max_num_seqs or VLLM_GPU_DEFAULT_MAX_NUM_SEQS,
        colocated_max_num_seqs=settings.colocated.max_num_seqs or VLLM_GPU_DEFAULT_MAX_NUM_SEQS,
        source=f"{what}, {how}; scaled by config.json{terms}",
        prefill_tp_factor=H200_PREFILL_TP_FACTOR, decode_tp_factor=H200_DECODE_TP_FACTOR,
        kv_read_tbps=hw.hbm_tbps * hw.kv_share, ttft_overhead_ms=H200_TTFT_OVERHEAD_MS,
        prefill_us_per_context_token=attention / (hw.bf16_tflops * hw.gemm_share * 1e12) * 1e6,
        chunk_overlap=H200_MOE_CHUNK_OVERLAP if experts else H200_CHUNK_OVERLAP,
        post_ms=facts.post_ms if facts else 0.0,
        post_us_per_descriptor=facts.post_us_per_descriptor if facts else 0.0,
        transfer_us_per_descriptor=facts.transfer_us_per_descriptor if facts else 0.0,
        link_gbps=facts.link_gbps if facts else None,
        join_us_per_prompt_token=H200_JOIN_US_PER_PROMPT_TOKEN,
        kv_bytes_per_token=kvb, layers=model.layers, block_size=block_size,
        descriptors=facts.descriptors if facts else "layer-block",
        post_on_decode=settings.connector.mode != "write",
        write_overlaps_prefill=bool(facts and facts.write_overlaps_prefill),
        handoff_source=facts.source if facts else "",
        calibrated=bool(hw.calibrated), band=hw.band,
        kv_tokens_per_gpu=kv_tokens, default_budget=VLLM_GPU_DEFAULT_BUDGET)


def bench_profile(path: Path, cand: Candidate, fallback: Profile) -> Profile:
    """The fallback profile fitted to a `pdctl bench` result of deployment `cand` (its lowest rate): the prefill
    compute and the decode step scaled by measured over predicted, at that rate and prompt length. The shares
    move, the model's shape stays (attention, the TTFT outside the engine, KV reads), so the fit carries to
    other prompt and output lengths; what it cannot measure (hand-off, KV capacity, TP) stays the fallback's."""
    from appliance.bench.results import read_result

    result = read_result(path)
    rates = [r for s in result.shapes for r in s.rates if r.requests]
    if not rates:
        raise PdctlError(f"{path} holds no measured requests", fix="run `pdctl bench` first, or drop --profile")
    low = min(rates, key=lambda r: r.rate)
    ok = [q for q in low.requests if q.error is None and q.chunk_times_s and q.prompt_tokens]
    if not ok:
        raise PdctlError(f"{path}: no successful request with timings at rate {low.rate}")
    prompt = round(statistics.median(q.prompt_tokens or 0 for q in ok))
    output = result.workload.output_len
    ttft_ms = statistics.median(q.chunk_times_s[0] for q in ok) * 1000
    gaps = [b - a for q in ok for a, b in zip(q.chunk_times_s, q.chunk_times_s[1:], strict=False)]
    gap_ms = statistics.median(gaps) * 1000 if gaps else None
    # the TTFT of a lone request (no queue) and the mean gap at the run's rate, as the fallback predicts them
    alone = state(fallback, cand, 1e-6, prompt, output, 1e9)
    at_rate = state(fallback, cand, low.rate, prompt, output, 1e9)
    if alone.ttft_ms is None or at_rate.gap_ms is None:
        raise PdctlError(f"{path}: the profile saturates at rate {low.rate} ({prompt} + {output} tokens)",
                         fix="calibrate with the command `pdctl plan --check` prints")
    inside = alone.ttft_ms - fallback.ttft_overhead_ms
    prefill = max(0.05, (ttft_ms - fallback.ttft_overhead_ms) / inside) if inside > 0 else 1.0
    decode = gap_ms / at_rate.gap_ms if gap_ms else 1.0
    return replace(fallback, prefill_us_per_token=fallback.prefill_us_per_token * prefill,
                   prefill_us_per_context_token=fallback.prefill_us_per_context_token * prefill,
                   decode_step_ms=fallback.decode_step_ms * decode, expert_step_ms=fallback.expert_step_ms * decode,
                   kv_read_tbps=fallback.kv_read_tbps / decode if fallback.kv_read_tbps else None,
                   calibrated=True, band=(1.0, 1.0),  # the prefill and the step, the bulk of every figure, measured
                   source=(f"pdctl bench result {path}: prefill x{prefill:.2f}, decode step x{decode:.2f} of the "
                           f"uncalibrated profile's ({prompt}-token TTFT {ttft_ms:.0f} ms, median gap "
                           f"{gap_ms or 0:.1f} ms at {low.rate:g} req/s); the rest from {fallback.source}"))


def handoff_of(settings: Settings, inventory: Inventory) -> tuple[int, bool]:
    """The KV block size and cross-layer layout the disaggregated plan renders (its decode's --block-size,
    kv_connector_extra_config.enable_cross_layers_blocks and V1 model runner), else vLLM's (16, per layer)."""
    if settings.engine.kind == "sim":
        return settings.engine.sim.block_size, False
    try:
        data = settings.model_dump()
        data["connector"]["name"] = disaggregated_name(data["connector"]["name"])
        deployed = plan(Settings.model_validate(data), inventory)
    except (PdctlError, ValueError):
        return VLLM_DEFAULT_BLOCK_SIZE, False
    block, cross = VLLM_DEFAULT_BLOCK_SIZE, False
    for inst in deployed.role_instances("decode"):
        argv = inst.argv
        if "--block-size" in argv:
            block = int(argv[argv.index("--block-size") + 1])
        if "--kv-transfer-config" in argv:
            kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            asked = str((kv.get("kv_connector_extra_config") or {}).get("enable_cross_layers_blocks")).lower()
            # vLLM 0.24 allocates cross-layer blocks only in its V1 model runner (the connector renders it)
            cross = asked == "true" and inst.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    return block, cross


def default_profile(settings: Settings, inventory: Inventory, model: ModelShape | None) -> Profile:
    """The sim engine's time model, or (real vLLM, a readable config.json) the node's accelerator profile; the
    profile's source says why when a real-vLLM node gets the simulated one."""
    if settings.engine.kind == "sim":
        return sim_profile(settings)
    if model is None:
        prof = sim_profile(settings)
        what = "the embedded tiny model" if settings.model.path == EMBEDDED_MODEL else repr(settings.model.path)
        why = (f"; not the accelerator's profile, which sizes its costs from the model's config.json, and model.path "
               f"is {what}, which has none readable here (point model.path at the served model's directory)")
        return replace(prof, source=prof.source + why)
    return gpu_profile(settings, inventory, model, *handoff_of(settings, inventory))


# ---- the model --------------------------------------------------------------------------------------------

def _poisson_cdf(m: int, lam: float) -> float:
    if lam <= 0:
        return 1.0
    term = total = math.exp(-lam)
    for k in range(1, m + 1):
        term *= lam / k
        total += term
    return min(1.0, total)


def _tolerated(judgement: str, gaps: int, gap: float, slow: float, slo_ms: float) -> int:
    """Slow gaps a request may have and still pass: `max` none; `p99` those above numpy's 99th-percentile
    rank (linear interpolation: one more when the interpolated value stays under the target)."""
    if judgement == "max" or gaps < 2:
        return 0
    pos = (gaps - 1) * 0.99
    lo = math.floor(pos)
    edge = gap + (pos - lo) * (slow - gap) <= slo_ms  # only the rank above lo is slow
    return gaps - lo - (1 if edge else 2)


def _itl_attainment(judgement: str, gap: float, slows: list[float], q: float, output_len: int, slo_ms: float) -> float:
    """ITL attainment under `judgement`; `slows`: the slow steps a request meets, equally often (a prompt's
    chunk steps, each its own size), `q`: the share of its gaps that are one of them."""
    if judgement == "mean":
        return 1.0 if gap <= slo_ms else 0.0
    if gap > slo_ms:
        return 0.0
    # The slow steps are not all alike (chunks of two prompts, contexts, the GPU's own variation): the share of
    # them over the target, each one's length lognormal around the modelled one
    over = sum(runsim.over_target(x, slo_ms, SLOW_GAP_SPREAD) for x in slows) / len(slows)
    slow = max(slows)
    if over < 1e-4:
        return 1.0
    gaps = max(0, output_len - 1)
    return _poisson_cdf(_tolerated(judgement, gaps, gap, max(slow, slo_ms * 1.0001), slo_ms), min(1.0, q) * gaps * over)


def _decode(rate: float, output_len: int, base: Callable[[float], float], per_seq: float,
            stall: float) -> tuple[float, float] | None:
    """(mean gap ms, running sequences) of a decoding engine at `rate` whose time share `stall` goes to
    other work (prefill chunks, join stalls): n = rate x O x gap, gap = (base(n) + per_seq x n) / (1 - stall).
    base(n) is the step's weight streaming: constant for a dense model, growing (concave, bounded by
    base(inf)) with the experts n tokens visit for an MoE one; so the fixed point is unique, found by
    bisection under the bound base(inf) gives."""
    free = 1.0 - stall
    if free <= 0:
        return None
    a = rate * output_len / 1000 / free
    if a * per_seq >= 1:
        return None
    lo, hi = 0.0, a * base(math.inf) / (1 - a * per_seq)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if a * (base(mid) + per_seq * mid) > mid else (lo, mid)
    n = hi
    return (base(n) + per_seq * n) / free, n


def _wait(util: float, service_ms: float) -> float | None:
    """M/D/1 mean wait; None when saturated."""
    return None if util >= 1 else util / (2 * (1 - util)) * service_ms


def descriptors(p: Profile, input_len: int) -> int:
    """Descriptors one hand-off posts (per rank): one per block (cross-layer), per block x layer x K/V, or (a
    request's contiguous blocks merged) per layer x K/V."""
    blocks = math.ceil(input_len / p.block_size)
    return {"block": blocks, "layer": p.layers * 2}.get(p.descriptors, p.layers * 2 * blocks)


def handoff(p: Profile, input_len: int, ranks: int = 1) -> tuple[float, float]:
    """(post ms, transfer ms) of one prompt's KV hand-off; each of `ranks` TP ranks moves its share at once."""
    d = descriptors(p, input_len)
    post = p.post_ms + d * p.post_us_per_descriptor / 1000 if (p.post_ms or p.post_us_per_descriptor) else 0.0
    transfer = d * p.transfer_us_per_descriptor / 1000 + input_len * p.transfer_us_per_token / 1000
    if p.link_gbps and p.kv_bytes_per_token:
        transfer += input_len * p.kv_bytes_per_token / ranks / (p.link_gbps * 1e9) * 1000
    return post, transfer


def _compute_ms(p: Profile, tokens: float, context: float, tp: int) -> float:
    """Prefill compute of `tokens` prompt tokens attending to `context` tokens on average, at TP `tp`."""
    us = tokens * (p.prefill_us_per_token + context * p.prefill_us_per_context_token)
    return us / 1000 / _eff(tp, p.prefill_tp_factor)


def _saturated(capacity: float, limit: str) -> State:
    return State(None, None, None, None, capacity, {j: 0.0 for j in JUDGEMENTS}, limit)


@dataclass(frozen=True)
class _Engine:
    """A candidate's decode-capable engine (colocated, or the decode role), per instance: its step costs."""

    tp: int
    dec_eff: float
    max_num_seqs: int
    graph_tokens: int  # its largest CUDA graph (tokens per step): a larger MoE step runs eagerly
    per_seq: float  # each running sequence's KV read, ms per step
    capacity: float  # the most running sequences it holds (KV cache, max_num_seqs)
    base: Callable[[float], float]  # a step of `tokens` tokens: the weights it streams (MoE: the experts visited)

    def step(self, n: float) -> float:
        """A decode step of n running sequences."""
        return self.base(n) + self.per_seq * n


def _engine(p: Profile, cand: Candidate, input_len: int, output_len: int) -> _Engine:
    context = input_len + output_len / 2  # tokens a running sequence holds, on average
    per_seq_gpu = p.decode_step_ms_per_seq + (
        context * p.kv_bytes_per_token / (p.kv_read_tbps * 1e12) * 1e3 if p.kv_read_tbps and p.kv_bytes_per_token else 0.0)
    role = cand.colocated if cand.colocated is not None else cand.decode
    assert role is not None
    dec_eff = _eff(role.tp, p.decode_tp_factor)

    def base(tokens: float) -> float:
        # The routed experts are cut evenly across the ranks (expert parallel: E / TP whole experts a rank;
        # without it, 1 / TP of each expert): each rank streams its share of the experts its step visits, at
        # 1 / TP. The dense factor (all-reduces, launches, measured on a dense model) stays on the rest.
        return p.decode_step_ms / dec_eff + p.expert_step_ms * _touched(p, tokens) / role.tp
    seqs = (p.colocated_max_num_seqs or p.max_num_seqs) if cand.colocated is not None else p.max_num_seqs
    kv_tokens = p.kv_tokens_per_gpu(role.tp)
    capacity = min(seqs, kv_tokens * role.tp / context) if kv_tokens is not None else float(seqs)
    budget = (cand.budget or p.default_budget) if cand.colocated is not None else p.default_budget
    graph = p.graph_tokens or _default_graph_tokens(seqs, budget)
    return _Engine(role.tp, dec_eff, seqs, graph, per_seq_gpu / dec_eff, capacity, base)


def _chunk_extra(p: Profile, eng: _Engine, n: float, c: int, start: int) -> float:
    """What a prompt chunk of c tokens (prompt tokens start..start+c, attending to what precedes them) adds to
    a decode step of n running sequences: it streams the weights its n + c tokens visit, and its compute hides
    under a share of that; an MoE step larger than the largest CUDA graph runs eagerly (the floor)."""
    full = eng.base(n + c)
    extra = full - eng.base(n) + max(0.0, _compute_ms(p, c, start + c / 2, eng.tp) - p.chunk_overlap * full)
    if n + c > eng.graph_tokens and p.mixed_floor_ms:
        extra = max(extra, p.mixed_floor_ms - eng.step(n))
    return extra


def _prefill_fits(p: Profile, cand: Candidate, input_len: int) -> bool:
    """Whether a disaggregated candidate's prefill instance holds its share of the weights and one prompt's KV."""
    pre = cand.prefill
    if pre is None:
        return True
    tokens = p.kv_tokens_per_gpu(pre.tp)
    return tokens is None or tokens * pre.tp >= input_len


def _prefill_side(p: Profile, cand: Candidate, eng: _Engine, input_len: int) -> tuple[float, float, float]:
    """A disaggregated candidate's prefill service per prompt, the hand-off's transfer after it, and the stall a
    joining request puts on the decode's step (ms)."""
    pre = cand.prefill
    assert pre is not None
    post, transfer = handoff(p, input_len, pre.tp)
    compute = _compute_ms(p, input_len, input_len / 2, pre.tp)
    if p.experts:
        # An MoE prompt step also streams the experts its tokens visit (each rank its share), most of it not
        # hidden under the compute (the 8000-token step measured 129 ms on the H200: module constants); a dense
        # one is compute-bound, its weights folded into the calibrated prefill rate.
        experts = p.expert_step_ms * _touched(p, input_len) / pre.tp
        compute = experts + max(0.0, compute - p.chunk_overlap * experts)
    if p.write_overlaps_prefill and not p.post_on_decode:
        # pushed layer by layer while the prefill runs: what is left after it is the last layer's share, or
        # the part the link could not keep up with
        transfer = max(transfer / p.layers, transfer - compute)
    service = compute + (0.0 if p.post_on_decode else post)
    stall = (post if p.post_on_decode else 0.0) + input_len * p.join_us_per_prompt_token / 1000 / eng.dec_eff
    return service, transfer, stall


def state(p: Profile, cand: Candidate, rate: float, input_len: int, output_len: int, itl_slo_ms: float) -> State:
    """A candidate's TTFT p90, gaps, occupancy and ITL attainment at `rate` (module docstring)."""
    eng = _engine(p, cand, input_len, output_len)
    role = cand.colocated if cand.colocated is not None else cand.decode
    assert role is not None
    r = rate / role.instances
    base, per_seq, capacity = eng.base, eng.per_seq, eng.capacity
    if cand.colocated is not None:
        budget = cand.budget or p.default_budget

        def chunked(n: float) -> tuple[int, float, list[float], tuple[float, float] | None] | None:
            """With n running: the prompt's chunks, their mean and each one's extra over a decode step, and the
            engine's (gap, running) that follow (None inside: it cannot keep up); None: no room for a chunk."""
            chunk = min(input_len, budget - math.ceil(n))  # running decode tokens take their share of the budget
            if chunk < 1:
                return None
            chunks = math.ceil(input_len / chunk)
            # The prompt is cut into full chunks and a shorter last one, each attending to what precedes it:
            # the slowest is not necessarily the last.
            extras = [_chunk_extra(p, eng, n, min(chunk, input_len - i * chunk), i * chunk) for i in range(chunks)]
            extra = sum(extras) / chunks
            return chunks, extra, extras, _decode(r, output_len, base, per_seq, r * chunks * extra / 1000)

        # The running count n is a fixed point: n running -> chunks -> the engine's time share -> n. The map
        # falls with n for an MoE model (the chunk's experts are read anyway by more running tokens) and jumps
        # with ceil(n): iterating it oscillates, so bisect on where it crosses n.
        lo, hi = 0.0, float(eng.max_num_seqs)
        for _ in range(40):
            mid = (lo + hi) / 2
            at = chunked(mid)
            if at is None:
                hi = mid
            elif at[3] is None or at[3][1] > mid:
                lo = mid
            else:
                hi = mid
        found = chunked(hi)
        if found is None:
            return _saturated(capacity, "chunk budget")
        chunks, extra, extras, solved = found
        if solved is None:
            return _saturated(capacity, "engine throughput")
        gap, n = solved
        step = eng.step(n)
        service = chunks * (step + extra)
        share = r * chunks * gap / 1000  # of the engine's steps that carry a prompt chunk
        wait = _wait(share, service)
        ttft = None if wait is None else p.ttft_overhead_ms + service + 2.3 * wait
        slows, q = [step + e for e in extras], share  # the judgements see every chunk step
    else:
        pre = cand.prefill
        assert pre is not None
        if not _prefill_fits(p, cand, input_len):
            return _saturated(capacity, "prefill memory")
        service, transfer, stall = _prefill_side(p, cand, eng, input_len)
        wait = _wait(rate / pre.instances * service / 1000, service)
        solved = _decode(r, output_len, base, per_seq, r * stall / 1000)
        if solved is None:
            return _saturated(capacity, "decode throughput")
        gap, n = solved
        step = eng.step(n)
        ttft = None if wait is None else p.ttft_overhead_ms + service + 2.3 * wait + transfer + step
        slows, q = [step + stall], r * gap / 1000
    att = {j: _itl_attainment(j, gap, slows, q, output_len, itl_slo_ms) for j in JUDGEMENTS}
    # the bound that binds: the KV cache, or the engine's max_num_seqs when that is the smaller
    limit = "-" if n <= capacity else "max_num_seqs" if capacity >= eng.max_num_seqs else "KV cache"
    return State(ttft, gap, max(slows), n, capacity, att, limit)


# ---- a finite run: N requests, every one judged (appliance/runsim.py) ---------------------------------------

FINITE_SEEDS = 4  # arrival draws averaged: a run of 100 requests is one draw, its attainment noisy by +-5 %


def finite_attainment(p: Profile, cand: Candidate, rate: float, input_len: int, output_len: int, ttft_slo_ms: float,
                      itl_slo_ms: float, requests: int, seeds: int = FINITE_SEEDS) -> dict[str, float]:
    """The share of a run's `requests` requests (Poisson arrivals at `rate`, every one judged) that meet both
    SLOs, under each judgement, averaged over `seeds` arrival draws; the requests go round the instances."""
    eng = _engine(p, cand, input_len, output_len)
    role = cand.colocated if cand.colocated is not None else cand.decode
    assert role is not None
    if eng.capacity < 1 or not _prefill_fits(p, cand, input_len):
        return {j: 0.0 for j in JUDGEMENTS}
    instances = role.instances
    gaps = max(0, output_len - 1)
    total = {j: 0.0 for j in JUDGEMENTS}
    for seed in range(seeds):
        arrive = [t / rate for t in runsim.unit_arrivals(requests, seed)]
        # the proxy sends the requests round the instances of a role: instance k gets requests k, k + I, ...
        if cand.colocated is not None:
            budget = cand.budget or p.default_budget
            served = [x for k in range(instances) for x in runsim.colocated(
                arrive[k::instances], input_len, output_len, budget, eng.capacity, eng.step,
                lambda n, c, start: _chunk_extra(p, eng, n, c, start), p.ttft_overhead_ms, itl_slo_ms, SLOW_GAP_SPREAD)]
        else:
            pre = cand.prefill
            assert pre is not None
            service, transfer, stall = _prefill_side(p, cand, eng, input_len)
            ready = runsim.prefilled(arrive, service, pre.instances, transfer)
            served = [x for k in range(instances) for x in runsim.disaggregated(
                arrive[k::instances], ready[k::instances], output_len, eng.capacity, eng.step, stall,
                p.ttft_overhead_ms, itl_slo_ms, SLOW_GAP_SPREAD)]
        for j in JUDGEMENTS:
            ok = 0.0
            for s in served:
                if s.ttft_ms > ttft_slo_ms:
                    continue
                if j == "mean":
                    ok += s.mean_gap_ms <= itl_slo_ms
                else:
                    ok += _poisson_cdf(_tolerated(j, gaps, s.mean_gap_ms, itl_slo_ms * 1.0001, itl_slo_ms), s.slow_gaps)
            total[j] += ok / len(served)
    return {j: v / seeds for j, v in total.items()}


def conditional_threshold(p: Profile, decode_tp: int, itl_slo_ms: float, spread: float) -> tuple[int, str]:
    """The proxy's decode_only_below for a decode instance at TP `decode_tp` whose steps vary by `spread`
    (plan.decode_only_below, plan.step_spread), and why."""
    eff = _eff(decode_tp, p.decode_tp_factor)
    step = p.decode_step_ms / eff + p.expert_step_ms / decode_tp + p.decode_step_ms_per_seq
    per_token = p.prefill_us_per_token / _eff(decode_tp, p.prefill_tp_factor)
    tokens = decode_only_below(step, per_token, itl_slo_ms, spread)
    return tokens, (f"a prompt below it, prefilled in one decode step ({step:.1f} ms + {per_token:.1f} us per token at "
                    f"TP{decode_tp}), keeps that step under the ITL target ({itl_slo_ms:g} ms) in "
                    f"{1 - SLOW_STEP_SHARE:.0%} of such steps; the proxy sends a decode fewer such tokens per target")


def decode_step_figures(p: Profile, decode_tp: int, input_len: int, output_len: int) -> tuple[float, float]:
    """The proxy's `decode_step` for a decode instance at TP `decode_tp` (docs/routing.md): what each running
    sequence of `input_len` + `output_len` / 2 tokens adds to its step (ms), and its prefill cost per prompt token
    (us); the conditional room shrinks by the first over the second for every leg the decode runs."""
    eng = _engine(p, Candidate("disaggregated", prefill=Shape(1, 1), decode=Shape(1, decode_tp)), input_len, output_len)
    return eng.per_seq, p.prefill_us_per_token / _eff(decode_tp, p.prefill_tp_factor)


def _meets(s: State, judgement: str, ttft_slo_ms: float, target: float) -> bool:
    return (s.ttft_ms is not None and s.ttft_ms <= ttft_slo_ms and s.limit == "-"
            and s.attainment[judgement] >= target)


def _highest(ok: Callable[[float], bool], halvings: int = 40) -> float:
    """The highest rate for which ok(rate) holds (bracketed by doubling from 1 req/s, then bisected)."""
    lo, hi = 0.0, 1.0
    if not ok(1e-6):
        return 0.0
    while ok(hi) and hi < 1e5:
        lo, hi = hi, hi * 2
    for _ in range(halvings):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def goodput(p: Profile, cand: Candidate, input_len: int, output_len: int, ttft_slo_ms: float, itl_slo_ms: float,
            judgement: str, target: float = 0.9, requests: int | None = None) -> float:
    """The highest rate at which the candidate meets both SLOs under `judgement` (0 when none does): in the
    steady state, or (`requests`) in a run of that many requests, every one judged."""
    return goodputs(p, cand, input_len, output_len, ttft_slo_ms, itl_slo_ms, target, requests, (judgement,))[judgement]


def goodputs(p: Profile, cand: Candidate, input_len: int, output_len: int, ttft_slo_ms: float, itl_slo_ms: float,
             target: float = 0.9, requests: int | None = None,
             judgements: tuple[str, ...] = JUDGEMENTS) -> dict[str, float]:
    """goodput under each of `judgements` (a finite run is simulated once per rate for all of them)."""
    if requests is None:
        def steady(j: str) -> Callable[[float], bool]:
            return lambda rate: _meets(state(p, cand, rate, input_len, output_len, itl_slo_ms), j, ttft_slo_ms, target)
        return {j: _highest(steady(j)) for j in judgements}
    memo: dict[float, dict[str, float]] = {}

    def attained(rate: float) -> dict[str, float]:
        if rate not in memo:
            memo[rate] = finite_attainment(p, cand, rate, input_len, output_len, ttft_slo_ms, itl_slo_ms, requests)
        return memo[rate]

    def finite(j: str) -> Callable[[float], bool]:
        return lambda rate: attained(rate)[j] >= target
    return {j: _highest(finite(j), halvings=14) for j in judgements}


def predict(p: Profile, cand: Candidate, rate: float, input_len: int, output_len: int, settings: Settings,
            requests: int | None = None) -> Prediction:
    """One candidate at `rate`, and its goodput under every judgement (`requests`: in a run of that many)."""
    slo = settings.slo
    s = state(p, cand, rate, input_len, output_len, slo.itl_ms)
    good = goodputs(p, cand, input_len, output_len, slo.ttft_ms, slo.itl_ms, slo.attainment, requests)
    j = slo.itl_judgement
    itl = None if s.gap_ms is None else s.gap_ms if j == "mean" else s.slow_gap_ms
    if requests is None:
        meets = _meets(s, j, slo.ttft_ms, slo.attainment)
    else:
        meets = finite_attainment(p, cand, rate, input_len, output_len, slo.ttft_ms, slo.itl_ms, requests)[j] >= slo.attainment
    # what caps the goodput: the first bound the model finds broken just above it (at the asked rate when the
    # steady state finds none there, as a finite run's ceiling may)
    why = _binding(state(p, cand, good[j] * 1.01 + 1e-6, input_len, output_len, slo.itl_ms), slo, j)
    if why == "-" and not meets:
        why = _binding(s, slo, j)
    return Prediction(cand, good[j], good, s.ttft_ms, itl, s.running, s.capacity, meets, why)


def _binding(s: State, slo: SloSettings, judgement: str) -> str:
    """Which bound state `s` breaks: a capacity the model computes, the TTFT SLO, the ITL SLO, or none ("-")."""
    if s.limit != "-":
        return s.limit
    if s.ttft_ms is None or s.ttft_ms > slo.ttft_ms:
        return "prefill (TTFT)"
    return f"decode (ITL {judgement})" if s.attainment[judgement] < slo.attainment else "-"


# ---- candidates ----------------------------------------------------------------------------------------

def _shapes(gpus: int, heads: Heads | None) -> list[Shape]:
    return [Shape(gpus // tp, tp) for tp in TP_SIZES
            if tp <= gpus and gpus % tp == 0 and (heads is None or heads.tp_problem(tp) is None)]


def _accepted(settings: Settings, overrides: dict[str, Any]) -> Settings | None:
    data = settings.model_dump()
    for key, values in overrides.items():
        if isinstance(data.get(key), dict) and isinstance(values, dict):
            data[key].update(values)
        else:
            data[key] = values
    try:
        return Settings.model_validate(data)
    except ValueError:
        return None


def candidates(settings: Settings, inventory: Inventory, heads: Heads | None = None) -> list[Candidate]:
    """Every colocated shape (x budgets) and P:D split on the usable GPUs that the planner accepts (and,
    given the model's `heads`, that vLLM can start)."""
    usable = sum(1 for g in inventory.gpus if _usable(g))
    out: list[Candidate] = []
    for shape in _shapes(usable, heads):
        s = _accepted(settings, {"connector": {"name": "none"}, "colocated": {
            "gpu_count": None, "gpus": None, "instances": shape.instances, "tp": shape.tp, "dp": 1}})
        if s is not None and _plans(s, inventory):
            out += [Candidate("colocated", colocated=shape, budget=b) for b in (None, *BUDGETS)]
    for p_gpus in range(1, usable):
        for pre in _shapes(p_gpus, heads):
            for dec in _shapes(usable - p_gpus, heads):
                roles = {role: {"gpu_count": None, "gpus": None, "instances": sh.instances, "tp": sh.tp, "dp": 1}
                         for role, sh in (("prefill", pre), ("decode", dec))}
                s = _accepted(settings, {**roles, "connector": {"name": disaggregated_name(settings.connector.name)}})
                if s is not None and _plans(s, inventory):
                    out.append(Candidate("disaggregated", prefill=pre, decode=dec))
    return out


def _plans(settings: Settings, inventory: Inventory) -> bool:
    try:
        plan(settings, inventory)
    except (PdctlError, ValueError):
        return False
    return True


def suggest(settings: Settings, inventory: Inventory, profile: Profile, input_len: int, output_len: int,
            rate: float, heads: Heads | None = None, requests: int | None = None) -> list[Prediction]:
    """Colocated shapes and splits ranked together: meeting the SLOs at `rate` first, then by predicted
    goodput under the run's judgement, then fewer instances.

    `heads`: the model's head counts when known; shapes whose TP the model cannot take are left out."""
    if not inventory.gpus:
        raise PdctlError("this node has no GPUs to split", fix="plan for a GPU node with --inventory sim:mi300x-8")
    preds = [predict(profile, c, rate, input_len, output_len, settings, requests)
             for c in candidates(settings, inventory, heads)]
    if not preds:
        why = f" for a model with {heads.attention} attention heads" if heads else ""
        raise PdctlError(f"the planner accepts no colocated shape or prefill/decode split on this inventory{why}")

    def instances(x: Prediction) -> int:
        c = x.candidate
        return c.colocated.instances if c.colocated else (c.prefill.instances + c.decode.instances)  # type: ignore[union-attr]

    return sorted(preds, key=lambda x: (not x.meets_slo, -round(x.goodput_rps, 6), instances(x)))
