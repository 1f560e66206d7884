"""What the proxy reads of a request's prompt before choosing a hand-off (appliance/proxy/prompts.py), on
bodies as the proxy holds them: prompt lists become tuples when the body is read (body.walk_free)."""

from __future__ import annotations

from typing import Any

from appliance.proxy.body import walk_free
from appliance.proxy.prompts import engine_requests, known_length


def _held(body: dict[str, Any]) -> dict[str, Any]:
    """The body as the proxy holds it after reading it."""
    return {**body, "prompt": walk_free(body["prompt"])} if isinstance(body.get("prompt"), list) else body


def test_token_ids_are_counted_as_the_proxy_holds_them() -> None:
    assert known_length("/v1/completions", _held({"prompt": [1, 2, 3]})) == 3
    assert known_length("/v1/completions", _held({"prompt": [[1, 2], [3]]})) is None  # a batch: no one length
    assert known_length("/v1/completions", {"prompt": "three words here"}) is None
    assert known_length("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) is None


def test_engine_requests_are_n_for_each_prompt_of_a_batch() -> None:
    path = "/v1/completions"
    assert engine_requests(path, _held({"prompt": "hi"})) == 1
    assert engine_requests(path, _held({"prompt": [1, 2, 3]})) == 1
    assert engine_requests(path, _held({"prompt": "hi", "n": 3})) == 3
    assert engine_requests(path, _held({"prompt": ["a", "b"]})) == 2
    assert engine_requests(path, _held({"prompt": [[1, 2], [3], [4]], "n": 2})) == 6
    assert engine_requests(path, _held({"prompt": "hi", "n": None})) == 1
    assert engine_requests("/v1/chat/completions", {"messages": [], "n": 2}) == 2
