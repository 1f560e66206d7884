"""How many tokens a request's prompt has, for routing (conditional disaggregation) and for connectors whose
hand-off depends on it (its Handoff.lengths). Pure: route.length asks an engine when the body does not settle it.

The proxy has no tokenizer. Token ids are counted; for a text prompt an upper bound comes from its UTF-8
length (a byte-level BPE or byte-fallback tokenizer spends at least one byte of text per token, plus the few
special tokens it adds), which settles short prompts for free; otherwise the decode instance's own
/tokenize counts it exactly: one more local round trip, on a connector whose hand-off crashes the engine otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# BOS, EOS and a SentencePiece prefix piece: more than any tokenizer adds to a completion prompt by itself
_SPECIAL_TOKENS = 3
# What vLLM 0.32's chat renders a prompt with besides the messages (ChatCompletionRequest.build_chat_params and
# render_chat, entrypoints/openai/chat_completion/protocol.py, renderers/online_renderer.py), as /tokenize takes
# it (TokenizeChatRequest, entrypoints/serve/tokenize/protocol.py): these as its own fields, and the rest
# (_TEMPLATE_KWARGS) only inside chat_template_kwargs; a field /tokenize does not know it ignores.
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "tools",
                "media_io_kwargs", "mm_processor_kwargs")
_TEMPLATE_KWARGS = ("documents", "reasoning_effort")
_UNSET = (None, "auto")  # values vLLM's merge_kwargs leaves out (renderers/params.py)


# the proxy holds a prompt list as a tuple (app.walk_free); a list is what JSON gives before that
_SEQUENCES = (list, tuple)


def known_length(path: str, body: Mapping[str, Any]) -> int | None:
    """The prompt's token count when the body settles it (token ids), else None."""
    prompt = body.get("prompt") if path.endswith("/completions") and "messages" not in body else None
    # The first item tells token ids from a batch: every request is routed by this, and checking each of
    # thousands of ids costs ~50 us. A list that mixes ids with anything else is the engine's 400 either way.
    if isinstance(prompt, _SEQUENCES) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return None


def shortest_length(path: str, body: Mapping[str, Any]) -> int | None:
    """The fewest tokens of any prompt the request holds, where the body settles it (token ids, or a batch of
    token-id lists); None when a prompt's length is not in the body (text, chat)."""
    prompt = body.get("prompt") if path.endswith("/completions") and "messages" not in body else None
    if not isinstance(prompt, _SEQUENCES) or not prompt:
        return None
    if isinstance(prompt[0], int):
        return len(prompt)
    if all(isinstance(item, _SEQUENCES) and item and isinstance(item[0], int) for item in prompt):
        return min(len(item) for item in prompt)
    return None


def engine_requests(path: str, body: Mapping[str, Any]) -> int:
    """How many engine requests vLLM makes of the request: n for each prompt of a batch (at least 1)."""
    n = body.get("n")
    samples = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompt = body.get("prompt") if path.endswith("/completions") and "messages" not in body else None
    batch = len(prompt) if isinstance(prompt, _SEQUENCES) and prompt and not isinstance(prompt[0], int) else 1
    return samples * batch


def most_tokens(path: str, body: Mapping[str, Any]) -> int | None:
    """At most how many tokens a single text prompt becomes, or None when no bound holds (chat templates)."""
    prompt = body.get("prompt")
    if "messages" in body or not isinstance(prompt, str):
        return None
    # surrogatepass: a lone surrogate counts its 3 bytes rather than raising (the body check refuses one anyway)
    return len(prompt.encode("utf-8", "surrogatepass")) + _SPECIAL_TOKENS


def tokenize_request(path: str, body: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The /tokenize body that counts the request's prompt, or None when it has no single prompt."""
    if "messages" in body:
        chat = {"model": model, "messages": body["messages"], **{k: body[k] for k in _CHAT_FIELDS if k in body}}
        kwargs = chat_template_kwargs(body)
        if kwargs is not None:
            chat["chat_template_kwargs"] = kwargs
        return chat
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        out: dict[str, Any] = {"model": model, "prompt": prompt}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    return None


def chat_template_kwargs(body: Mapping[str, Any]) -> Any:
    """The chat_template_kwargs vLLM's chat renders the request's template with, but for what /tokenize adds
    itself (the generation prompt flags); a value vLLM refuses is passed as it is (the count fails alike)."""
    own = body.get("chat_template_kwargs")
    if own is not None and not isinstance(own, Mapping):
        return own
    extra = {k: body.get(k) for k in _TEMPLATE_KWARGS}
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (own or {}):
        extra["enable_thinking"] = effort != "none"  # chat opts templates in or out of thinking by it
    merged = {**(own or {}), **{k: v for k, v in extra.items() if not _unset(v)}}
    return merged or own


def _unset(value: Any) -> bool:
    """Whether vLLM's merge_kwargs leaves this value out (compared by type: a list is never unset)."""
    return value is None or (isinstance(value, str) and value in _UNSET)
