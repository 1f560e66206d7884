"""Which prompt lengths each connector can hand over (ProxySide.length_possible), as read from vLLM 0.32's
connectors: lengths 0, 1, under one block, k*B and k*B+1 for the CPU's 128-token and the GPU's 16-token blocks.
The legal requests of tests/engine/pdctl_vllm.py send the same lengths, twice each (prefix hits), to real engines."""

from __future__ import annotations

import pytest

from appliance.connector import get_connector


def _lengths(block: int) -> list[int]:
    return [1, 2, block - 1, block, block + 1, block + 2, 2 * block, 2 * block + 1, 2 * block + 2, 3 * block + 1]


@pytest.mark.parametrize("block", [16, 128])
def test_example_connector_hands_over_only_lengths_its_store_and_lookup_agree_on(block: int) -> None:
    # stored under (L-1)//B*B, looked up under (L-2)//B*B: they agree from B+2 on, except at k*B+1
    example = get_connector("example").side("read")
    handoff = example.handoff()
    assert handoff is not None and handoff.lengths
    possible = {n for n in [0, *_lengths(block)] if example.length_possible(n, block)}
    assert possible == {block + 2, 2 * block, 2 * block + 2}


@pytest.mark.parametrize("name", ["nixl", "moriio"])
@pytest.mark.parametrize("block", [16, 128])
def test_nixl_and_moriio_hand_over_every_length(name: str, block: int) -> None:
    # their decode asks for what its own cache lacks, at least one token, whatever the length
    for mode in ("read", "write"):
        side = get_connector(name).side(mode)  # type: ignore[arg-type]
        handoff = side.handoff()
        assert handoff is not None and not handoff.lengths  # the proxy never counts a prompt's tokens for them
        assert all(side.length_possible(n, block) for n in _lengths(block))
