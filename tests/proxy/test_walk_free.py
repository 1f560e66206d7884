"""The proxy holds each in-flight request's prompt while its tokens stream; as tuples, thousands of token ids
cost the garbage collector's full walks (which stall every relayed stream) nothing."""

from __future__ import annotations

import gc
import json

from appliance.proxy.body import walk_free


def test_token_id_prompts_leave_the_collectors_walk_and_serialize_the_same() -> None:
    ids = list(range(1000, 3000))
    batch = [list(range(5)), list(range(7))]
    mixed = ["text", 3, {"a": [1]}]
    for prompt in (ids, batch, mixed):
        assert json.dumps(walk_free(prompt)) == json.dumps(prompt)  # the engines get the same JSON array
    held = walk_free(ids), walk_free(batch)
    gc.collect()  # a tuple of numbers is untracked by the first collection it survives
    assert not gc.is_tracked(held[0]) and not gc.is_tracked(held[1][0])
    assert gc.is_tracked(ids)  # a list is walked element by element, every time
