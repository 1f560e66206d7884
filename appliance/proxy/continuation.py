"""A stream that survives its engine: when a decode leg dies mid-stream, the proxy sends the prompt and the tokens it
has relayed to another leg as a continuation and keeps streaming to the client on the same response.

The proxy asks the engine for each chunk's token ids (vLLM's `return_token_ids`: the prompt's ids on the first
chunk, each chunk's generated ids), keeps them, and strips them from what it relays unless the client asked for
them; text alone would not do (re-tokenizing text is not token-exact). A continuation is a /v1/completions request
whose `prompt` is the prompt's ids followed by the generated ones (token ids: no second BOS), its `max_tokens`
lowered by the tokens sent, its sampling kept; its completion chunks reach the client in the client's format (a
chat chunk or a completion chunk, with the first leg's id, created and model) and its usage counts the request as
the client sees it. `plan` says which requests can be continued and why not; `Tracker` is the shell around one
stream.

A token whose bytes do not complete a character comes with no text: vLLM's detokenizer (tokenizers' DecodeStream)
holds its bytes back until a later token completes it. Primed with a prompt whose text ends in such bytes, the
DecodeStream's first step returns the whole prompt's text (tokenizers 0.23: DecodeStream(ids=...).step), so a
continuation's prompt leaves the generated tokens that came with no text out; it generates them again (under greedy
decoding the same ones) and the proxy passes on their text, not their ids, which the client has.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from appliance.proxy.upstream import Unchunked

CONTINUE_PATH = "/v1/completions"

# What a continuation keeps of the client's body: sampling and limits that mean the same on a prompt of token ids.
_KEPT = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "stop_token_ids",
         "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids",
         "bad_words", "cache_salt", "priority", "user")
# What the engine's prompt (token ids now) has made of these already, or what a stream without them carries alike.
_SPENT = ("prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
          "n", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
          "documents", "reasoning_effort", "add_special_tokens", "tool_choice", "tools", "echo", "logprobs",
          "top_logprobs", "return_token_ids", "include_stop_str_in_output", "stop", "presence_penalty",
          "frequency_penalty", "parallel_tool_calls", "request_id", "kv_transfer_params", "response_format",
          "truncate_prompt_tokens")


def plan(path: str, body: dict[str, Any]) -> str | None:
    """Why a streamed request to `path` cannot be continued on another engine leg, or None when it can."""
    if body.get("n") not in (None, 1):
        return "n"
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        prompt = body.get("prompt")
        one = isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))
        if not one or not prompt:
            return "batch"
        if body.get("echo") or body.get("suffix"):
            return "echo"
    elif body.get("echo"):
        return "echo"
    logprobs = body.get("logprobs")  # chat: a boolean; completions: how many (0 too: the sampled token's)
    if (logprobs is not None and logprobs is not False) or body.get("prompt_logprobs") is not None:
        return "logprobs"  # the top logprobs of tokens already sent cannot be reproduced
    if body.get("stop"):
        return "stop_strings"  # the engine holds text back while a stop string may begin: not all of it was sent
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "penalties"  # they count generated tokens only, which a continuation's prompt holds
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"  # a tool-call parser's state is the first engine's
    form = body.get("response_format")
    if (isinstance(form, dict) and form.get("type") not in (None, "text")) or any(body.get(k) for k in (
            "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")):
        return "structured_output"  # a grammar's state would start over at the continuation's prompt
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "parameters"
    if any(k not in _KEPT and k not in _SPENT for k in body):
        return "parameters"  # a field pdctl cannot tell is safe to keep or drop
    return None


def continuation_body(body: dict[str, Any], prompt: list[int], generated: list[int]) -> dict[str, Any] | None:
    """The /v1/completions body that continues `body`'s stream after `generated`; None when nothing is left to
    generate (its token limit reached)."""
    out = {k: body[k] for k in _KEPT if k in body}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if limit - len(generated) <= 0:
            return None
        out["max_tokens"] = limit - len(generated)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, body["min_tokens"] - len(generated))
    out.update(prompt=prompt + generated, stream=True, return_token_ids=True,
               stream_options={"include_usage": True})
    return out


def _dump(obj: Any) -> bytes:
    # vLLM's own spelling (pydantic's model_dump_json): no spaces, characters as they are
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class Tracker:
    """One continuable stream: reads the engine's chunked SSE body as the connection relays it, keeps the prompt's
    and the generated token ids, and writes whole events (framed as chunks unless `framed` is off) to the client
    through `write`, rewritten where the client's format asks for it."""

    def __init__(self, path: str, body: dict[str, Any], why: str | None) -> None:
        self.why = why  # why it cannot be continued (plan), or None
        self.chat = path.endswith("/chat/completions")
        self.body = body
        self.wants_ids = body.get("return_token_ids") is True
        options = body.get("stream_options")
        self.wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        # the last generated tokens whose text the engine held back (the module's docstring): a continuation's
        # prompt leaves them out, and the first `regenerate` tokens it generates are theirs, sent already
        self.held = 0
        self.regenerate = 0
        self.head: dict[str, Any] = {}  # the first leg's id, object, created and model
        self.index = 0  # the client's choice index
        self.finished = False  # a finish_reason was relayed
        self.done = False  # [DONE] was relayed
        # an error event the engine sent after tokens, held back with the [DONE] after it: the leg is cut
        self.engine_error: dict[str, Any] | None = None
        self.continued = 0  # continuations so far; their chunks are completion chunks to translate
        self.write: Callable[[bytes], None] = lambda data: None
        self.framed = True
        self._events = bytearray()  # SSE data not yet a whole event
        self.feed: Callable[[bytes], None] = Unchunked(self._take).write  # the engine's body, framing stripped

    def engine_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """A leg's body with the token ids asked for."""
        return body if body.get("return_token_ids") is True else {**body, "return_token_ids": True}

    def sink(self, write: Callable[[bytes], None], framed: bool) -> Callable[[bytes], None]:
        """The writer a leg's connection relays its chunked body to (a new leg starts at a chunk boundary)."""
        self.write, self.framed = write, framed
        self.engine_error = None
        self._events.clear()
        self.feed = Unchunked(self._take).write
        return self.feed

    def _take(self, data: bytes) -> None:
        """The next data of the engine's body; write each event that is whole."""
        events = self._events
        if not events and data.find(b"\n\n") == len(data) - 2 >= 0:
            # one whole event, an engine's usual chunk: no copy through the buffer
            kept = self._event(data[:-2])
            if kept is not None:
                self._emit(kept + b"\n\n")
            return
        events += data
        out = []
        while (end := events.find(b"\n\n")) >= 0:
            event = bytes(events[:end])
            del events[: end + 2]
            kept = self._event(event)
            if kept is not None:
                out.append(kept + b"\n\n")
        if out:
            self._emit(b"".join(out))

    def _emit(self, data: bytes) -> None:
        self.write(b"%x\r\n%b\r\n" % (len(data), data) if self.framed else data)

    def _event(self, event: bytes) -> bytes | None:
        """One SSE event as the client gets it, or None to leave it out."""
        if not self.continued and self.head:
            fast = self._token_event(event)
            if fast is not None:
                return fast
        if not event.startswith(b"data: "):
            return event
        payload = event[6:]
        if payload == b"[DONE]":
            if self.engine_error is not None:
                return None
            self.done = True
            return event
        try:
            obj = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        if "error" in obj:
            if self.prompt is None or self.finished:
                return event
            self.engine_error = obj  # vLLM's stream generator on an exception (its engine core died): then [DONE]
            return None
        if self.continued:
            chunk = self._translated(obj)
            return None if chunk is None else b"data: " + _dump(chunk)
        return self._first_leg(obj, event)

    def _token_event(self, event: bytes) -> bytes | None:
        """A first leg's token chunk as vLLM spells it (one choice, not the last, its ids at the end), read and
        rewritten without parsing its JSON: a few byte searches where json.loads and json.dumps took most of the
        relay's CPU per token (benchmarks/proxy_bench.py --sections cpu); None for any other event."""
        at = event.rfind(b'"token_ids":[')
        # a completion chunk has no delta (and a string's quotes are escaped): its search is a chat chunk's alone
        if at < 0 or b'"finish_reason":null' not in event or b'"prompt_token_ids":[' in event \
                or (self.chat and b'"delta":{}' in event) or event.count(b'"index":') != 1:
            return None
        end = event.find(b"]", at)
        raw = event[at + 13 : end]
        count = raw.count(b",") + 1 if raw else 0
        try:
            if count == 1:
                self.generated.append(int(raw))  # a token a chunk: no list made (nor collected) per token
            elif count:
                self.generated += [int(t) for t in raw.split(b",")]
        except ValueError:
            return None
        if count:
            self.held = self.held + count if (b'"content":""' if self.chat else b'"text":""') in event else 0
        return event if self.wants_ids else event[: at + 12] + b"null" + event[end + 1 :]

    def _first_leg(self, obj: dict[str, Any], event: bytes) -> bytes | None:
        """An event of the first leg: the client's own format; the token ids kept, and left out unless asked."""
        changed = False
        if not self.head:
            self.head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        if "prompt_token_ids" in obj:  # chat: on the first chunk
            self.prompt = obj["prompt_token_ids"] if self.prompt is None else self.prompt
            if not self.wants_ids and obj["prompt_token_ids"] is not None:
                obj["prompt_token_ids"] = None  # vLLM's own value when they were not asked for
                changed = True
        choices = obj.get("choices")
        drop = False
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            self.index = choice.get("index", 0)
            if choice.get("prompt_token_ids") is not None and self.prompt is None:  # completions: the first chunk
                self.prompt = choice["prompt_token_ids"]
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.generated += ids
                text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                self._hold(ids, text)
            if choice.get("finish_reason") is not None:
                self.finished = True
            if not self.wants_ids:
                for key in ("token_ids", "prompt_token_ids"):
                    if choice.get(key) is not None:
                        choice[key] = None  # vLLM's own value when they were not asked for
                        changed = True
                # vLLM sends a chat chunk without a delta only because token ids were asked for (chat serving's
                # "if delta_message is None" branch): the client would not have had it
                drop = drop or (self.chat and choice.get("delta") == {} and choice.get("finish_reason") is None
                                and choice.get("logprobs") is None)
        if drop and isinstance(choices, list) and len(choices) == 1 and "usage" not in obj:
            return None
        return b"data: " + _dump(obj) if changed else event

    def _translated(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's completion chunk as the client's next chunk; None for one it would not have had."""
        choices = obj.get("choices")
        if not choices:
            usage = obj.get("usage")
            if not self.wants_usage or not isinstance(usage, dict) or self.prompt is None:
                return None
            prompt, completion = len(self.prompt), len(self.generated)
            return self._tail(obj, {**self.head, "choices": [],
                                    "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                              "completion_tokens": completion}})
        choice = choices[0]
        ids = choice.get("token_ids") or []
        if self.regenerate:  # the held tokens again: the client has their ids, and their text comes with the next
            again = min(self.regenerate, len(ids))
            ids, self.regenerate = ids[again:], self.regenerate - again
        self.generated += ids
        self._hold(ids, choice.get("text"))
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finished = True
        text = choice.get("text") or ""
        if not text and not ids and finish is None:
            return None
        # the chunks vLLM's chat and completions send (vllm/entrypoints/openai/*/serving.py), field for field
        out: dict[str, Any]
        if self.chat:
            out = {"index": self.index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                out["stop_reason"] = choice.get("stop_reason")
        else:
            out = {"index": self.index, "text": text, "logprobs": None, "finish_reason": finish,
                   "stop_reason": choice.get("stop_reason"), "prompt_token_ids": None}
        out["token_ids"] = ids if self.wants_ids else None
        return self._tail(obj, {**self.head, "choices": [out]})

    @staticmethod
    def _tail(obj: dict[str, Any], chunk: dict[str, Any]) -> dict[str, Any]:
        if "system_fingerprint" in obj:
            chunk["system_fingerprint"] = obj["system_fingerprint"]
        return chunk

    def _hold(self, ids: list[int], text: str | None) -> None:
        if ids:
            self.held = 0 if text else self.held + len(ids)

    def answered(self, answer: dict[str, Any]) -> None:
        """Write the rest of the stream from a continuation's whole answer (its prefill leg's one token ended it: the
        last token max_tokens allowed, or a stop), as the chunks its stream would have sent."""
        choices = answer.get("choices")
        events = [{"choices": choices[:1]}] if isinstance(choices, list) and choices else []
        if isinstance(answer.get("usage"), dict):
            events.append({"choices": [], "usage": answer["usage"]})
        self._take(b"".join(b"data: " + _dump(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n")

    def resume(self) -> list[int]:
        """The generated tokens a continuation's prompt carries (all but the held ones, which it generates again)."""
        self.continued += 1
        self.regenerate = self.held
        return self.generated[: len(self.generated) - self.held]

    def why_not(self, limit: int) -> str | None:
        """Why the stream, cut now, cannot be continued (`limit`: continuations allowed), or None."""
        if self.finished or self.done:
            return "finished"
        if self.prompt is None:
            return "no_token_ids"  # the engine did not send them (e.g. a reasoning parser hides them)
        if self.continued >= limit:
            return "limit"
        return None
