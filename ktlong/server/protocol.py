"""The OpenAI API's shapes: request bodies checked into a `Job`, errors as the API writes them,
and the response and stream-chunk objects. No model code here; text becomes token ids in
`Prompting` (the model's tokenizer and chat template)."""

from __future__ import annotations

import itertools
import json
import secrets
import time
import uuid
from dataclasses import dataclass

from ktlong.chat.constrained import ANY_OBJECT, json_grammar
from ktlong.chat.logprobs import MAX_TOP
from ktlong.errors import KtlongError
from ktlong.gguf.chat_template import ChatTemplate
from ktlong.gguf.text_cache import TextCache
from ktlong.gguf.tokenizer import GGUFTokenizer
from ktlong.server.prompt_ids import CHARS_PER_TOKEN_CHECKED, count_tokens, defused, encode_messages
from ktlong.server.tool_calls import ToolFormat, tool_format

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 1024  # logit_bias entries a request may hold


class ApiError(Exception):
    """An error the client gets as {"error": {...}} with an HTTP status; the message says what to change."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Job:
    """One generation, checked: everything the worker needs and nothing from the request besides."""
    kind: str  # chat | completion
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    include_usage: bool
    progress: bool = False  # stream prefill progress events (return_progress)
    logprobs: int | None = None  # each token's logprob and this many alternatives; None: none
    tools: ToolFormat | None = None  # read the answer's tool calls in this format
    tool_names: tuple[str, ...] = ()  # the functions it may call
    forced: str = ""  # the opening of a call the prompt ends with (tool_choice required or named)
    parallel_calls: bool = True  # false: the first call only (parallel_tool_calls)
    grammar: str | None = None  # llguidance grammar the answer keeps to (response_format json_object, json_schema)


@dataclass(frozen=True)
class Defaults:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float


def _number(body: dict, name: str, default, low: float, high: float, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"'{name}' must be a number, not {type(value).__name__}.")
    if value < low or (low_open and value == low) or value > high:
        lower = f"above {low}" if low_open else f"at least {low}"
        raise bad(name, f"'{name}' is {value}; it must be {lower} and at most {high}.")
    return float(value)


def _integer(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, not {type(value).__name__}.")
    if value < low or (high is not None and value > high):
        raise bad(name, f"'{name}' is {value}; it must be at least {low}"
                  + (f" and at most {high}." if high is not None else "."))
    return value


# the request fields this server reads; "user", "metadata", "store" and "service_tier" change
# nothing about an answer, so they are taken and left aside
PARAMETERS = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
              "top_k", "seed", "stop", "logprobs", "n", "presence_penalty", "frequency_penalty", "logit_bias",
              "best_of", "echo", "return_progress", "user", "metadata", "store", "service_tier"}
CHAT_PARAMETERS = PARAMETERS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                                "top_logprobs"}
COMPLETION_PARAMETERS = PARAMETERS | {"prompt"}


def _refuse_unsupported(body: dict, known: set[str]):
    """Options this server does not implement are refused, not silently ignored: any field it
    does not read (off values aside: null, false, an empty list or object), and values of the
    ones it reads only in part."""
    for name, value in body.items():
        if name not in known and value not in (None, False, [], {}):
            raise bad(name[:60], f"'{name[:60]}' is not supported by this server; leave it out.")
    if _integer(body, "n", 1, 1) != 1:
        raise bad("n", "'n' must be 1: this server generates one choice per request.")
    if body.get("echo"):
        raise bad("echo", "'echo' is not supported by this server; leave it out.")
    if _integer(body, "best_of", 1, 1) != 1:
        raise bad("best_of", "'best_of' must be 1 here.")


def _logit_bias(body: dict, vocab: int) -> dict[int, float]:
    """logit_bias: {"token id": a value from -100 to 100}, at most MAX_LOGIT_BIAS of them."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    shape = (f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS:,} \"token id\": value pairs, each id "
             f"from 0 to {vocab - 1} and each value from -100 to 100.")
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", shape)
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdecimal() and len(key) <= 12 else -1
        if not (0 <= token < vocab and isinstance(value, (int, float)) and not isinstance(value, bool)
                and -100 <= value <= 100):  # NaN fails the comparison too
            raise bad("logit_bias", shape)
        out[token] = float(value)
    return out


def _seed(body: dict) -> int:
    """The request's seed (0 included), or without one a fresh draw."""
    seed = _integer(body, "seed", None, 0, 2**63 - 1)
    return secrets.randbits(63) if seed is None else seed


def _logprobs(body: dict, kind: str) -> int | None:
    """Chat: logprobs true|false and top_logprobs 0..20; completions: logprobs 0..20 (null: off)
    -> the alternatives asked for, or None."""
    if kind == "completion":
        return _integer(body, "logprobs", None, 0, MAX_TOP)
    on = body.get("logprobs", False)
    if on is None:
        on = False
    if not isinstance(on, bool):
        raise bad("logprobs", "'logprobs' must be true or false.")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP)
    if top is not None and not on:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    return (top or 0) if on else None


def logprobs_body(kind: str, entries: list, token_text, offset: int = 0) -> dict:
    """Token logprobs (chat.logprobs.TokenLogprob) as the OpenAI API writes them: chat's content
    list, or completions' tokens / token_logprobs / top_logprobs / text_offset (offset: where the
    first entry's text starts in the answer)."""
    if kind == "chat":
        item = lambda token, lp: {"token": token_text(token), "logprob": lp,
                                  "bytes": list(token_text(token).encode("utf-8"))}
        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    texts = [token_text(e.token) for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else []
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > MAX_STOP_STRINGS):
        raise bad("stop", f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them.")
    return tuple(stop)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", "'stream' must be true or false.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options", "'stream_options' must be an object like {\"include_usage\": true}.")
    return stream, bool(options.get("include_usage", False))


def check_model(body: dict, model_id: str):
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"'model' is required; this server serves '{model_id}'.")
    if model != model_id:
        raise ApiError(404, f"The model '{model[:200]}' does not exist here; this server serves '{model_id}'.",
                       "model", "model_not_found")


def message_text(message, i: int) -> tuple[str, str]:
    """(role, text) of one chat message; text parts are joined, anything else refused."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(where, f"'{where}' must be an object with 'role' and 'content'.")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}.")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}.content", f"'{where}.content' may hold only text parts "
                          "({\"type\": \"text\", \"text\": ...}).")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(f"{where}.content", f"'{where}.content' must be a string.")
    return ("system" if role == "developer" else role), content


def _response_grammar(body: dict, tokenizer: GGUFTokenizer) -> str | None:
    """The grammar of response_format: none for text, any JSON object for json_object, the
    schema's answers for json_schema (strict or not: it is always enforced)."""
    fmt = body.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    if kind == "json_object":
        schema = ANY_OBJECT
    elif isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
        schema = spec.get("schema", ANY_OBJECT)
    else:
        raise bad("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}.")
    try:
        return json_grammar(schema, tokenizer)
    except KtlongError as e:
        raise bad("response_format", str(e)) from None


def _is_tool(tool) -> bool:
    f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    return isinstance(f, dict) and isinstance(f.get("name"), str) and bool(f["name"]) and \
        isinstance(f.get("parameters", {}), dict) and isinstance(f.get("description", ""), str)


def tool_fields(message: dict, rendered: dict, i: int) -> dict:
    """rendered with an assistant message's tool calls (their arguments as objects, which
    templates write with tojson) and a tool message's call id."""
    where = f"messages[{i}]"
    if rendered["role"] == "tool" and isinstance(message.get("tool_call_id"), str):
        rendered["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls") if rendered["role"] == "assistant" else None
    if not calls:
        return rendered
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        f = call.get("function") if isinstance(call, dict) else None
        try:
            arguments = json.loads(f["arguments"]) if isinstance(f, dict) and isinstance(f.get("arguments"), str) else None
        except json.JSONDecodeError:
            arguments = None
        if not (isinstance(f.get("name") if f else None, str) and isinstance(arguments, dict)):
            raise bad(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list of {{\"id\", \"type\": \"function\", "
                      "\"function\": {\"name\", \"arguments\": a JSON object as a string}}.")
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": f["name"], "arguments": arguments}})
    return {**rendered, "tool_calls": out}


class Prompting:
    """Requests to token ids, with the model's tokenizer and chat template."""

    def __init__(self, tokenizer: GGUFTokenizer, template: ChatTemplate, system_prompt: str,
                 max_seq_len: int, defaults: Defaults):
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.max_seq_len, self.defaults = max_seq_len, defaults
        self.longest_token = max(len(t) for t in tokenizer.tokens)
        self.tool_format = tool_format(template.source)
        self.texts = TextCache(tokenizer, max_ids=max_seq_len)  # a document asked about again is not encoded again

    def chat_job(self, body: dict) -> Job:
        fmt, forced, tools = self._tools(body)
        ids = self.chat_ids(body, tools)
        if forced:  # the call the prompt opens, its markers as the template's tokens
            name = tools[0]["function"]["name"] if len(tools) == 1 else ""
            named = forced.rfind(json.dumps(name)) if defused(self.tokenizer, name) != name else -1
            if named < 0:  # encoded whole, as the template's text would be
                ids += self.tokenizer.encode(forced, add_bos=False)
            else:  # a name holding a special token's name: that part is text
                ids += self.tokenizer.encode(forced[:named], add_bos=False)
                ids += self.tokenizer.encode(forced[named:], add_bos=False, parse_special=False)
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise bad("parallel_tool_calls", "'parallel_tool_calls' must be true or false.")
        names = tuple(t["function"]["name"] for t in tools or ())
        return self._job("chat", ids, body, "messages", fmt, forced, parallel, names)

    def completion_job(self, body: dict) -> Job:
        if body.get("tools") or body.get("tool_choice"):
            raise bad("tools", "Tools are for /v1/chat/completions; leave 'tools' out of a completion.")
        if body.get("response_format") not in (None, {"type": "text"}):
            raise bad("response_format", "'response_format' is for /v1/chat/completions; leave it out of a completion.")
        return self._job("completion", self.completion_ids(body), body, "prompt")

    def token_ids(self, body: dict) -> list[int]:
        """/tokenize: a chat request's messages (and tools) as the template renders them (with the
        assistant's turn opened, as a chat completion sends them), or a completion's prompt."""
        return self.chat_ids(body, self._tools(body)[2]) if "messages" in body else self.completion_ids(body)

    def chat_ids(self, body: dict, tools: list | None = None) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "'messages' is required: a non-empty list of {\"role\", \"content\"} objects.")
        turns = [message_text(m, i) for i, m in enumerate(messages)]
        self._check_length([c for _, c in turns], "messages")
        rendered = [tool_fields(m, {"role": r, "content": c}, i) for i, (m, (r, c)) in enumerate(zip(messages, turns))]
        if self.system_prompt and turns[0][0] != "system":
            rendered.insert(0, {"role": "system", "content": self.system_prompt})
        return encode_messages(self.tokenizer, self.template, rendered, tools, self.texts)

    def _tools(self, body: dict) -> tuple[ToolFormat | None, str, list | None]:
        """(the format the answer's calls are read in, the opening of a forced call, the tools
        the template renders) from 'tools' and 'tool_choice'."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if not tools:
            if choice not in (None, "none", "auto"):
                raise bad("tool_choice", "'tool_choice' needs 'tools'.")
            return None, "", None
        if not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
            raise bad("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                      "\"description\": ..., \"parameters\": {JSON schema}}}.")
        if choice == "none":
            return None, "", None
        if self.tool_format is None:
            raise bad("tools", "This model's chat template has no tool support; leave 'tools' out, or serve a "
                      "model whose template renders tools.")
        names = [t["function"]["name"] for t in tools]
        if choice in (None, "auto"):
            return self.tool_format, "", tools
        if choice == "required":
            return self.tool_format, self.tool_format.forced(None), tools
        named = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
            choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
        if named not in names:
            raise bad("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                      "\"function\": {\"name\": NAME}} naming one of 'tools'.")
        return self.tool_format, self.tool_format.forced(named), [t for t in tools if t["function"]["name"] == named]

    def completion_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_length([prompt], "prompt")
            ids = self.tokenizer.encode(prompt, parse_special=False)
        elif (isinstance(prompt, list) and prompt and
              all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            vocab = len(self.tokenizer.tokens)
            if not all(0 <= t < vocab for t in prompt):
                raise bad("prompt", f"'prompt' holds a token id outside the vocabulary (0 to {vocab - 1}).")
            ids = list(prompt)
        else:
            raise bad("prompt", "'prompt' is required: a string, a list of one string, or a list of token ids.")
        if not ids:
            raise bad("prompt", "'prompt' is empty.")
        return ids

    def detokenize(self, body: dict) -> str:
        """/detokenize: {"tokens": [ids]} -> their text."""
        tokens = body.get("tokens")
        vocab = len(self.tokenizer.tokens)
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise bad("tokens", "'tokens' is required: a list of token ids.")
        if not all(0 <= t < vocab for t in tokens):
            raise bad("tokens", f"'tokens' holds a token id outside the vocabulary (0 to {vocab - 1}).")
        return self.tokenizer.decode(tokens)

    def _check_length(self, texts: list[str], param: str):
        """Refuse, before tokenizing them whole, texts that hold more tokens than max_seq_len:
        more characters than max_seq_len of the vocabulary's longest token, or, where they are
        longer than real text of max_seq_len tokens would be, tokens counted a piece at a time
        until there are too many (so a refusal costs at most max_seq_len tokens' work, and the
        event loop's other requests get the GIL between pieces)."""
        num_chars = sum(map(len, texts))
        too_long = bad(param, f"The prompt is {num_chars:,} characters, more than this server's max_seq_len of "
                       f"{self.max_seq_len:,} tokens can hold; shorten it.", "context_length_exceeded")
        if num_chars > self.max_seq_len * self.longest_token:
            raise too_long
        if num_chars > self.max_seq_len * CHARS_PER_TOKEN_CHECKED and \
                count_tokens(self.tokenizer, texts, self.max_seq_len) > self.max_seq_len:
            raise too_long

    def _job(self, kind: str, ids: list[int], body: dict, prompt_param: str, tools: ToolFormat | None = None,
             forced: str = "", parallel: bool = True, names: tuple[str, ...] = ()) -> Job:
        _refuse_unsupported(body, CHAT_PARAMETERS if kind == "chat" else COMPLETION_PARAMETERS)
        d = self.defaults
        if len(ids) >= self.max_seq_len:
            raise bad(prompt_param, f"The prompt is {len(ids):,} tokens but this server's max_seq_len is "
                      f"{self.max_seq_len:,}; shorten it, or restart the server with a larger --max_seq_len.",
                      "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _integer(body, name, d.max_tokens, 1)
        stream, include_usage = _stream(body)
        progress = body.get("return_progress", False)
        if not isinstance(progress, bool) or (progress and not stream):
            raise bad("return_progress", "'return_progress' must be true or false, and true needs 'stream': true.")
        return Job(kind=kind, prompt_ids=ids, max_tokens=max_tokens,
                   temperature=_number(body, "temperature", d.temperature, 0.0, 2.0),
                   top_p=_number(body, "top_p", d.top_p, 0.0, 1.0, low_open=True),
                   top_k=_integer(body, "top_k", d.top_k, 0),
                   seed=_seed(body),
                   presence_penalty=_number(body, "presence_penalty", d.presence_penalty, -2.0, 2.0),
                   frequency_penalty=_number(body, "frequency_penalty", d.frequency_penalty, -2.0, 2.0),
                   logit_bias=_logit_bias(body, len(self.tokenizer.tokens)),
                   stop=_stop(body), stream=stream, include_usage=include_usage, progress=progress,
                   logprobs=_logprobs(body, kind), tools=tools, tool_names=names, forced=forced,
                   parallel_calls=parallel, grammar=_response_grammar(body, self.tokenizer) if kind == "chat" else None)


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, cached_from: str | None) -> dict:
    """OpenAI's usage, and where the cached tokens came from: session (the conversation the
    session holds), dram or disk (ktlong/server/cache_store.py)."""
    details = {"cached_tokens": cached_tokens}
    if cached_from is not None:
        details["cached_from"] = cached_from
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}


def response(kind: str, rid: str, model_id: str, text: str, finish: str, use: dict,
             logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
    if kind == "chat":
        message = {"role": "assistant", "content": text if text or not tool_calls else None}
        if tool_calls:
            message["tool_calls"] = [call.body() for call in tool_calls]
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_id,
                "choices": [choice], "usage": use}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def chunk(kind: str, rid: str, model_id: str, text: str | None, finish: str | None, first: bool = False,
          use: dict | None = None, progress: dict | None = None, logprobs: dict | None = None,
          tool_calls: list | None = None) -> dict:
    """One server-sent event's object; with `use`, the closing usage chunk, with `progress` a
    prefill progress chunk (neither has choices)."""
    out = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
           "created": int(time.time()), "model": model_id}
    if use is not None:
        return {**out, "choices": [], "usage": use}
    if progress is not None:
        return {**out, "choices": [], "prompt_progress": progress}
    if kind == "chat":
        delta = ({"role": "assistant", "content": text or ""} if first else
                 ({"content": text} if text else {}))
        if tool_calls:
            delta["tool_calls"] = [call.body(i) for i, call in enumerate(tool_calls)]
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    return out
