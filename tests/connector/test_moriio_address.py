"""MORI-IO's peer address has one parser: what the proxy's registration listener refuses, the simulated engine
refuses too (they had two parsers with different rules), and spellings of one address are one address."""

from __future__ import annotations

import pytest

from appliance.connector.moriio.address import PeerAddress, parse_zmq_address, zmq_address
from appliance.connector.moriio.registration import RegistrationError, normalize_registration
from appliance.connector.moriio.sim import peer_address_from_request_id
from appliance.connector.sim import BadKVParams

BAD = [
    "host:10.0.0.1,handshake:0,notify:6105",  # port 0
    "host:10.0.0.1,handshake:6301,notify:70000",  # beyond 65535
    "host:engine.example,handshake:6301,notify:6105",  # not an IP address
    "host: 10.0.0.1,handshake:6301,notify:6105",  # spaces
    "host:10.0.0.1,handshake:6301,notify:6105,extra:1",  # more than the three pairs
    "notify:6105,handshake:6301,host:10.0.0.1",  # another order
    "host:10.0.0.1,handshake:+6301,notify:6105",
]


@pytest.mark.parametrize("address", BAD)
def test_every_side_refuses_the_same_addresses(address: str) -> None:
    with pytest.raises(ValueError):
        parse_zmq_address(address)
    with pytest.raises(RegistrationError, match="zmq_address"):
        normalize_registration({"type": "P", "http_address": "10.0.0.1:20005", "zmq_address": address,
                                "transfer_mode": "READ"})
    request_id = f"___prefill_addr_{address}___decode_addr_{address}_{'0' * 32}"
    with pytest.raises(BadKVParams, match="malformed MoRIIO zmq_address"):
        peer_address_from_request_id(request_id, "prefill")


def test_spellings_of_one_address_are_one_address() -> None:
    assert parse_zmq_address(zmq_address("::ffff:127.0.0.1", 6301, 6105)) == PeerAddress("127.0.0.1", 6301, 6105)
    assert parse_zmq_address("host:0:0::1,handshake:7301,notify:7501") == PeerAddress("::1", 7301, 7501)
