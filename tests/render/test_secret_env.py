"""Which environment variables pdctl keeps out of unit files and plan.json (render.templates.secret_env)."""

from __future__ import annotations

import pytest

from appliance.render import secret_env

SECRET = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "VLLM_API_KEY",
          "DB_PASSWORD", "MYTOKEN", "GOOGLE_APPLICATION_CREDENTIALS", "hf_token", "API_KEYS", "SECRETS_FILE"]
PLAIN = ["TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES", "VLLM_USE_V2_MODEL_RUNNER", "KEYBOARD_LAYOUT",
         "VLLM_NIXL_SIDE_CHANNEL_PORT", "UCX_TLS"]


@pytest.mark.parametrize("name", SECRET)
def test_credential_names_are_secret(name: str) -> None:
    plain, secret = secret_env({name: "v"})
    assert secret == {name: "v"} and plain == {}


@pytest.mark.parametrize("name", PLAIN)
def test_other_names_stay_in_the_unit(name: str) -> None:
    plain, secret = secret_env({name: "v"})
    assert plain == {name: "v"} and secret == {}
