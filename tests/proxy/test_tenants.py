"""Clients isolated from each other (issue 36, finding 4): several API keys by name, a vLLM cache_salt per key that
keeps their prefixes apart (in the engines and in the proxy's prefix affinity), /metrics behind the node's token,
and the route header only to a client that asks. A real proxy in front of fake engines on loopback sockets."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.errors import ConfigError
from appliance.proxy.app import Proxy
from appliance.proxy.tenants import load_tenants, read_keys
from tests.support.fake_engines import FakeEngine, backend, engines, proxy_config, running_proxy
from tests.support.httpclient import local, post
from tests.support.pdctl import pdctl, write_config
from tests.support.waiting import eventually

BLOCK = 16
GUESSES = 40
KEYS = {"victim": "victim-key-0123456789", "attacker": "attacker-key-0123456789"}
METRICS_TOKEN = "metrics-token-0123456789"
SALT_SECRET = "node-salt-secret-0123456789abcdef"


def _secret(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _files(tmp: Path) -> dict[str, str]:
    keys = "".join(f'{name} = "{key}"\n' for name, key in KEYS.items())
    return {"api_keys_file": _secret(tmp / "keys.toml", keys),
            "metrics_token_file": _secret(tmp / "metrics-token", METRICS_TOKEN + "\n"),
            "cache_salt_secret_file": _secret(tmp / "salt-secret", SALT_SECRET + "\n")}


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _prompt(n: int) -> str:
    # a victim's prompt: a long shared preamble and a secret of its own, several blocks of text each
    return f"account {n:04d} belongs to customer {n * 7919 % 10007:05d}; " * 8


async def _hit_tokens(port: int, headers: dict[str, str]) -> float | None:
    """The proxy's pdctl_proxy_prefix_hit_tokens_total summed over instances, as `headers` may read it (None:
    /metrics refused them)."""
    async with aiohttp.ClientSession() as s, s.get(local(port) + "/metrics", headers=headers) as r:
        if r.status != 200:
            return None
        text = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "pdctl_proxy_prefix_hit_tokens"
               for s in f.samples if s.name.endswith("_total"))


async def _complete(px: Proxy, prompt: str, key: str, **extra: Any) -> tuple[int, dict[str, str]]:
    status, raw, headers = await post(local(px.api_port), "/v1/completions",
                                      {"prompt": prompt, "max_tokens": 1, **extra}, headers=_bearer(key))
    assert status == 200, raw
    return status, headers


def _affinity(pair: list[FakeEngine], **overrides: Any) -> Any:
    return proxy_config("none", [backend("both-0", "both", pair[0]), backend("both-1", "both", pair[1])],
                        routing="prefix_affinity", block_size=BLOCK, **overrides)


async def _guess(px: Proxy, guess: str, reader: dict[str, str]) -> bool | None:
    """The attack of issue 36: send a guess with the attacker's key and read the prefix hit counter before and
    after with `reader`'s credentials; a right guess hits the victim's blocks. None: the counter was refused."""
    before = await _hit_tokens(px.api_port, reader)
    await _complete(px, guess, KEYS["attacker"])
    after = await _hit_tokens(px.api_port, reader)
    return None if before is None or after is None else after > before


def test_a_tenant_cannot_tell_which_prompts_another_sent(tmp_path: Path) -> None:
    """Issue 36's guessing attack, replayed: a victim sends 40 prompts, the attacker guesses 40 (half of them the
    victim's) and reads the prefix hit counter around each. Once 40 of 40 guesses were classified right from
    /metrics, which needed no credentials. Now the attacker's key does not open /metrics, and even the node's
    own counter (read with the metrics token) shows no hit for a right guess: the per-key cache salt keeps the
    victim's blocks out of the attacker's reach, while the victim's own repeats still hit."""
    async def scenario() -> None:
        async with engines("both", "both") as pair, running_proxy(_affinity(pair, **_files(tmp_path))) as px:
            await eventually(lambda: px.ready()[1]["both"] == 2, what="both healthy")
            for n in range(GUESSES):
                await _complete(px, _prompt(n), KEYS["victim"])
            guesses = [(_prompt(n) if n % 2 == 0 else _prompt(n + 1000), n % 2 == 0) for n in range(GUESSES)]
            # the attacker's own view: its key opens no counter
            assert await _guess(px, _prompt(5000), _bearer(KEYS["attacker"])) is None
            async with aiohttp.ClientSession() as s, s.get(local(px.api_port) + "/metrics") as r:
                assert r.status == 401
            # the node's view: no guess, right or wrong, hits anything
            operator = _bearer(METRICS_TOKEN)
            verdicts = [await _guess(px, guess, operator) for guess, _ in guesses]
            assert verdicts == [False] * GUESSES, sum(v == right for v, (_, right) in zip(verdicts, guesses, strict=True))
            # a tenant's own prefixes still hit: the salt is stable per key
            assert await _hit_tokens(px.api_port, operator) == 0
            before = await _hit_tokens(px.api_port, operator)
            await _complete(px, _prompt(3), KEYS["victim"])
            assert (await _hit_tokens(px.api_port, operator) or 0) > (before or 0)

    asyncio.run(scenario())


def test_each_key_carries_its_own_salt_and_a_client_salt_only_splits_it(tmp_path: Path) -> None:
    """The engines get cache_salt = HMAC(node secret, key name + client salt): distinct per key, stable across
    requests, a client's own salt combined (never used as it is); a salt vLLM would refuse is a 400 here."""
    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(
            proxy_config("none", [backend("both-0", "both", e)], **_files(tmp_path))
        ) as px:
            sent = [("victim", None), ("victim", None), ("attacker", None), ("attacker", "mine"), ("victim", "mine")]
            for name, salt in sent:
                extra = {} if salt is None else {"cache_salt": salt}
                await _complete(px, "hello", KEYS[name], **extra)
            got = [r["body"]["cache_salt"] for r in e.requests]
            expected = [hmac.new(SALT_SECRET.encode(), f"{name}\x00{salt or ''}".encode(), hashlib.sha256).hexdigest()
                        for name, salt in sent]
            assert got == expected and got[0] == got[1] and len(set(got[1:])) == 4
            for bad in ("", "a/b", "x" * 129, 7):
                status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                            {"prompt": "x", "cache_salt": bad}, headers=_bearer(KEYS["victim"]))
                assert status == 400 and b"cache_salt" in raw, (bad, raw)

    asyncio.run(scenario())


def test_salting_off_and_no_keys_leave_the_clients_salt_alone(tmp_path: Path) -> None:
    """tenant_cache_salt = false (one trusted tenant) and a proxy without keys forward a client's salt as sent."""
    async def scenario() -> None:
        files = _files(tmp_path)
        for overrides in ({**files, "tenant_cache_salt": False}, {}):
            async with engines("both") as (e,), running_proxy(
                proxy_config("none", [backend("both-0", "both", e)], **overrides)
            ) as px:
                status, raw, _ = await post(local(px.api_port), "/v1/completions",
                                            {"prompt": "x", "max_tokens": 1, "cache_salt": "mine"},
                                            headers=_bearer(KEYS["victim"]))
                assert status == 200, raw
                await post(local(px.api_port), "/v1/completions", {"prompt": "x", "max_tokens": 1},
                           headers=_bearer(KEYS["victim"]))
                assert [r["body"].get("cache_salt") for r in e.requests] == ["mine", None], overrides

    asyncio.run(scenario())


def test_keys_by_name_with_the_single_key_still_served(tmp_path: Path) -> None:
    """api_key_file's key keeps working beside the keys file's (as the tenant "default"); any other key, a
    key's prefix or no key at all is a 401."""
    single = _secret(tmp_path / "key", "single-key-0123456789\n")

    async def scenario() -> None:
        async with engines("both") as (e,), running_proxy(
            proxy_config("none", [backend("both-0", "both", e)], api_key_file=single, **_files(tmp_path))
        ) as px:
            for key in ("single-key-0123456789", *KEYS.values()):
                await _complete(px, "hi", key)
            for headers in ({}, _bearer("victim-key-012345678"), _bearer(KEYS["victim"] + "x"),
                            {"Authorization": KEYS["victim"]}, _bearer(METRICS_TOKEN)):
                status, _, _ = await post(local(px.api_port), "/v1/completions", {"prompt": "x"}, headers=headers)
                assert status == 401, headers
            assert len({r["body"]["cache_salt"] for r in e.requests}) == 3

    asyncio.run(scenario())


def test_the_route_header_only_when_asked_and_instances_only_to_a_key(tmp_path: Path) -> None:
    """x-pdctl-route answers only a client that sends it, about its own request; a client without a key (a proxy
    with no keys) learns the route's name, not the instances prefix affinity picked."""
    async def scenario() -> None:
        async with engines("both", "both") as pair:
            for overrides, key, expected in ((_files(tmp_path), KEYS["victim"], "colocated; both=both-"),
                                             ({}, None, "colocated")):
                async with running_proxy(_affinity(pair, **overrides)) as px:
                    await eventually(lambda px=px: px.ready()[1]["both"] == 2, what="both healthy")
                    auth = _bearer(key) if key else {}
                    body = {"prompt": "x", "max_tokens": 1}
                    status, _, headers = await post(local(px.api_port), "/v1/completions", body, headers=auth)
                    assert status == 200 and "x-pdctl-route" not in {h.lower() for h in headers}
                    status, _, headers = await post(local(px.api_port), "/v1/completions", body,
                                                    headers={**auth, "x-pdctl-route": "1"})
                    route = {k.lower(): v for k, v in headers.items()}["x-pdctl-route"]
                    assert status == 200 and route.startswith(expected) and (key or route == expected), route

    asyncio.run(scenario())


@pytest.mark.parametrize("text, problem", [
    ('a = "k1"\nb = "k1"\n', "same key"), ('"a b" = "k"\n', "must be 1-64"), ("a = 1\n", "non-empty string"),
    ("", "has no key"), ("a = \n", "cannot be read"), ('a = "  "\n', "non-empty string"),
])
def test_a_bad_keys_file_is_one_line(tmp_path: Path, text: str, problem: str) -> None:
    path = _secret(tmp_path / "keys.toml", text)
    with pytest.raises(ConfigError, match=problem) as info:
        read_keys(path)
    assert "\n" not in str(info.value)


def test_keys_file_others_may_change_is_refused(tmp_path: Path) -> None:
    """A keys file (or salt secret) that other users may write would let them add a key: refused, not warned."""
    path = tmp_path / "keys.toml"
    _secret(path, 'a = "k"\n')
    os.chmod(path, 0o620)
    with pytest.raises(ConfigError, match="may be changed by other users"):
        read_keys(str(path))
    os.chmod(path, 0o600)
    salt = tmp_path / "salt"
    _secret(salt, "s" * 32)
    os.chmod(salt, 0o602)
    with pytest.raises(ConfigError, match="may be changed by other users"):
        load_tenants(None, str(path), True, str(salt), None)


def test_pdctl_up_refuses_a_keys_file_the_proxy_would_refuse(tmp_path: Path) -> None:
    """A keys file other users may write (or a malformed one) fails `pdctl up` in one line before anything starts,
    rather than a proxy unit that fails at its start."""
    keys = tmp_path / "keys.toml"
    keys.write_text('alice = "k"\n')
    keys.chmod(0o666)
    cfg = write_config(tmp_path, tmp_path / "state", extra=f"api_keys_file = {json.dumps(str(keys))}\n")
    up = pdctl(cfg, "up", timeout=120)
    lines = [line for line in up.stderr.splitlines() if line.strip()]
    assert up.returncode != 0 and len(lines) == 1 and "may be changed by other users" in lines[0], up.stderr
    assert not (tmp_path / "state" / "proxy.json").exists()
