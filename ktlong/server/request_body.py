"""A request's body, read within its bounds: its size by the tokens max_seq_len could hold, its
arrival by a time-out and by a cap on the bytes all unfinished bodies hold together, its JSON
by depth; refused with an OpenAI-shaped 4xx (or a 503) in one sentence otherwise."""

from __future__ import annotations

import asyncio
import json
import re

from starlette.requests import ClientDisconnect, Request

from ktlong.server.protocol import ApiError

# a surrogate's escape in a JSON body: once the bytes are decoded as strict UTF-8, the one way
# text that is not Unicode gets in; re-encoding a 470 KB body to check costs more than this scan
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# JSON bytes a prompt token may take (escaped text runs to 6 bytes a character), and room for
# the rest of a request: a body past max_seq_len of them cannot fit and is refused as it arrives
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_BESIDES = 1 << 20
MAX_DEPTH = 64  # JSON schemas of tools and answers nest a dozen levels; every reader below may recurse


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class BodyLimits:
    """What request bodies may cost while they arrive: max_bytes for one body (the tokens
    max_seq_len could hold), max_in_flight for all the unfinished ones together, and a body
    that sends nothing for timeout seconds is dropped."""

    def __init__(self, max_bytes: int, max_in_flight: int, timeout: float):
        self.max_bytes, self.max_in_flight, self.timeout = max_bytes, max_in_flight, timeout
        self.in_flight = 0  # bytes held by bodies still arriving (the event loop's thread only)

    async def read(self, request: Request) -> bytes:
        held, parts = 0, []
        chunks = request.stream().__aiter__()
        try:
            while True:
                try:
                    part = await asyncio.wait_for(chunks.__anext__(), self.timeout)
                except StopAsyncIteration:
                    return b"".join(parts)
                except asyncio.TimeoutError:
                    raise ApiError(408, f"The request body stopped arriving for {self.timeout:g} s; send it "
                                   "whole, without pauses.", code="body_timeout") from None
                except ClientDisconnect:  # nobody to answer; the 499 is for the log
                    raise ApiError(499, "The client disconnected while sending its request.") from None
                if held + len(part) > self.max_bytes:
                    raise ApiError(413, f"The request body is larger than {self.max_bytes / 2**20:.1f} MiB, more "
                                   "than this server's max_seq_len can hold; send less.")
                if self.in_flight + len(part) > self.max_in_flight:
                    raise ApiError(503, "The server holds too many unfinished request bodies; retry later.",
                                   code="server_busy", kind="server_error")
                held += len(part)
                self.in_flight += len(part)
                parts.append(part)
        finally:
            self.in_flight -= held


async def read_json(request: Request, limits: BodyLimits) -> dict:
    """The body as a JSON object (read within `limits`), refused (4xx) when it is not JSON,
    holds NaN or Infinity, nests too deep, or holds text that is not Unicode."""
    raw = await limits.read(request)
    try:
        text = raw.decode("utf-8")  # strict: no surrogates (json.loads would let them pass)
        body = json.loads(text, parse_constant=_no_constant)
        if SURROGATE_ESCAPE.search(text):  # a lone surrogate (\ud800) fails here
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ApiError(400, "The request body nests too deep; send a flatter JSON object.") from None
    except UnicodeDecodeError:
        raise ApiError(400, "The request body is not UTF-8; send the JSON encoded as UTF-8.") from None
    except UnicodeEncodeError:
        raise ApiError(400, "The request body holds text that is not Unicode (a lone surrogate escape); "
                       "send valid UTF-8.") from None
    except ValueError as e:  # invalid JSON, NaN or Infinity, an integer of thousands of digits
        raise ApiError(400, f"The request body is not valid JSON ({str(e)[:200]}).") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    if nesting(body) > MAX_DEPTH:
        raise ApiError(400, f"The request body nests deeper than {MAX_DEPTH} levels; send a flatter JSON object.")
    return body


def nesting(value) -> int:
    """How deep JSON containers nest in value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                        if isinstance(child, (dict, list)))
    return deepest
