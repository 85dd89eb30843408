"""The HTTP side (Starlette): routes, the API key, JSON in, JSON or server-sent events out, and
every failure as an OpenAI-shaped error. Generation itself happens on the worker's thread."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ktlong.server.metrics import CONTENT_TYPE
from ktlong.server.cache_store import Busy
from ktlong.session.cache_records import CacheFileError
from ktlong.chat.logprobs import TokenLogprob
from ktlong.server.protocol import ApiError, Prompting, check_model, chunk, logprobs_body, new_id, response, usage
from ktlong.server.request_body import BODY_BYTES_BESIDES, BODY_BYTES_PER_TOKEN, BodyLimits, read_json
from ktlong.server.reply import Outcome, Progress, Ticket, ToolCalls
from ktlong.server.worker import QueueFull, Worker

def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def watch_disconnect(request: Request, ticket: Ticket):
    """Cancel the ticket when the client goes away (the body has been read: what comes next is
    the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.cancel()
            return


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, the connection stays busy


def build_app(worker: Worker, prompting: Prompting, model_id: str, api_key: str = "",
              keepalive_seconds: float = 5.0, body_timeout_seconds: float = 30.0) -> Starlette:
    created = int(time.time())

    def check_key(request: Request):
        if not api_key:
            return
        sent = request.headers.get("authorization", "")
        scheme, _, token = sent.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "Missing or wrong API key; send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, **worker.status()})

    token_text = lambda token: prompting.tokenizer.decode([token])  # a token's own text, as it would print
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "ktlong",
            "max_model_len": prompting.max_seq_len}
    max_body = prompting.max_seq_len * BODY_BYTES_PER_TOKEN + BODY_BYTES_BESIDES
    # unfinished bodies together: two of the largest, or dozens of long documents of real text
    limits = BodyLimits(max_body, 2 * max_body, body_timeout_seconds)

    async def models(request: Request):
        check_key(request)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request):
        check_key(request)
        if request.path_params["model"] != model_id:
            raise ApiError(404, f"The model '{request.path_params['model'][:200]}' does not exist here; this "
                           f"server serves '{model_id}'.", "model", "model_not_found")
        return JSONResponse(card)

    async def complete(request: Request, kind: str):
        check_key(request)
        body = await read_json(request, limits)
        check_model(body, model_id)
        make = prompting.chat_job if kind == "chat" else prompting.completion_job
        job = await run_in_threadpool(make, body)  # a long document takes a while to tokenize
        try:
            ticket = worker.submit(job, asyncio.get_running_loop())
        except QueueFull:
            raise ApiError(429, f"The server is busy: {worker.queue_size} request(s) are already waiting; "
                           "retry later.", code="queue_full", kind="rate_limit_error") from None
        rid = new_id(kind)
        if job.stream:
            return StreamingResponse(stream(request, ticket, kind, rid, job.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(watch_disconnect(request, ticket))
        pieces, logprobs, calls = [], [], None
        try:
            while True:
                getting = asyncio.ensure_future(ticket.events.get())
                await asyncio.wait({getting, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():  # the client left: nobody to answer
                    getting.cancel()
                    return Response(status_code=499)
                if isinstance(event := getting.result(), (Outcome, ApiError)):
                    break
                if isinstance(event, TokenLogprob):
                    logprobs.append(event)
                elif isinstance(event, ToolCalls):
                    calls = event.calls
                else:
                    pieces.append(event)
        finally:
            watcher.cancel()
            ticket.cancel()  # no-op when finished; stops the worker when this handler was cancelled
        if isinstance(event, ApiError):
            raise event
        use = usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens, event.cached_from)
        body_logprobs = logprobs_body(kind, logprobs, token_text) if job.logprobs is not None else None
        return JSONResponse(response(kind, rid, model_id, "".join(pieces), event.finish_reason, use, body_logprobs,
                                     calls))

    async def stream(request: Request, ticket: Ticket, kind: str, rid: str, include_usage: bool):
        watcher = asyncio.create_task(watch_disconnect(request, ticket))
        offset = 0  # completions: where the next token's text starts in the answer
        try:
            if kind == "chat":
                yield sse(chunk(kind, rid, model_id, "", None, first=True))
            while True:
                getting = asyncio.ensure_future(ticket.events.get())
                try:
                    done, _ = await asyncio.wait({getting}, timeout=keepalive_seconds)
                finally:
                    if not getting.done():  # a get cancelled before it took an event leaves it queued
                        getting.cancel()
                if not done:  # nothing yet (a long prefill): show the connection alive
                    yield KEEPALIVE
                    continue
                event = getting.result()
                if isinstance(event, ApiError):
                    yield sse(event.body())
                    break
                if isinstance(event, TokenLogprob):
                    yield sse(chunk(kind, rid, model_id, None, None,
                                    logprobs=logprobs_body(kind, [event], token_text, offset)))
                    offset += len(token_text(event.token))
                    continue
                if isinstance(event, ToolCalls):
                    yield sse(chunk(kind, rid, model_id, None, None, tool_calls=event.calls))
                    continue
                if isinstance(event, Progress):
                    yield sse(chunk(kind, rid, model_id, None, None, progress={
                        "done": event.done, "total": event.total, "elapsed_seconds": round(event.elapsed, 3)}))
                    continue
                if isinstance(event, Outcome):
                    yield sse(chunk(kind, rid, model_id, None, event.finish_reason))
                    if include_usage:
                        yield sse(chunk(kind, rid, model_id, None, None, use=usage(
                            event.prompt_tokens, event.completion_tokens, event.cached_tokens, event.cached_from)))
                    break
                yield sse(chunk(kind, rid, model_id, event, None))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            ticket.cancel()

    async def tokenize(request: Request):
        check_key(request)
        body = await read_json(request, limits)
        ids = await run_in_threadpool(prompting.token_ids, body)
        return JSONResponse({"count": len(ids), "max_model_len": prompting.max_seq_len, "tokens": ids})

    async def detokenize(request: Request):
        check_key(request)
        body = await read_json(request, limits)
        return JSONResponse({"prompt": prompting.detokenize(body)})

    def cache_store():
        store = worker.store
        if store is None:
            raise ApiError(404, "This server keeps no cache of conversations: it needs --mode long_context and a "
                           "model without sliding-window layers.", code="no_cache_store")
        return store

    async def cache_list(request: Request):
        check_key(request)
        listing = await run_in_threadpool(cache_store().listing)  # waits while a spill holds the index
        return JSONResponse({"object": "list", "data": listing})

    async def cache_entry(request: Request):
        """POST /cache/{id}/save or /restore, DELETE /cache/{id}: on the worker's thread, after
        the generation that runs."""
        check_key(request)
        store, entry_id = cache_store(), request.path_params["id"]
        action = "erase" if request.method == "DELETE" else request.path_params["action"]
        if action not in ("save", "restore") and request.method == "POST":
            raise ApiError(404, "No such endpoint: POST /cache/{id}/save or /cache/{id}/restore, DELETE /cache/{id}.")
        try:
            result = await asyncio.wrap_future(worker.call(getattr(store, action), entry_id))
        except KeyError:
            raise ApiError(404, f"There is no cached conversation '{entry_id[:40]}'; GET /cache lists them.",
                           code="cache_entry_not_found") from None
        except Busy as e:
            raise ApiError(409, str(e), code="cache_entry_busy") from None
        except CacheFileError as e:
            raise ApiError(400, str(e), code="cache_error") from None
        return JSONResponse(result if result is not None else {"id": entry_id, "deleted": True})

    async def metrics(request: Request):
        check_key(request)  # its counts and byte totals describe the traffic; scrapers send the key
        return Response(worker.metrics.render(), media_type=CONTENT_TYPE)

    async def chat(request: Request):
        return await complete(request, "chat")

    async def completions(request: Request):
        return await complete(request, "completion")

    async def api_error(request: Request, e: ApiError):
        return error_response(e)

    async def http_error(request: Request, e: HTTPException):
        message = "No such endpoint." if e.status_code == 404 else str(e.detail)
        return error_response(ApiError(e.status_code, message))

    async def server_error(request: Request, e: Exception):
        return error_response(ApiError(500, "The server failed; its log has the details.", kind="server_error"))

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", model, methods=["GET"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/metrics", metrics, methods=["GET"]), Route("/cache", cache_list, methods=["GET"]),
              Route("/cache/{id}/{action}", cache_entry, methods=["POST"]),
              Route("/cache/{id}", cache_entry, methods=["DELETE"])]
    handlers = {ApiError: api_error, HTTPException: http_error, Exception: server_error}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.worker = worker  # the command stops it on a signal, before uvicorn waits for the streams
    return app
