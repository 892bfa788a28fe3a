"""The OpenAI-compatible HTTP API, served by the gateway process beside its gRPC API.

One path: every handler calls the same `GatewayCore` as the gRPC servicer (validation, stops,
sessions, admission and limits are the core's), so this module only converts HTTP to domain
types and back. Starlette routes the requests and uvicorn serves them, on their own thread and
event loop; a request's generation runs on a thread of its own (the core's calls block), and
hands its chunks to the event loop. A client that disconnects closes its link exactly as a gRPC
client leaving does: its observer detaches, and a run nobody observes any more is interrupted.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming as
server-sent events), GET /health (always open) and GET /metrics (the gateway's Prometheus
registry). With a client token configured, every other endpoint needs `Authorization: Bearer`.
A body larger than the gateway's message bound is refused (413) before it is read whole. Chat
renders the checkpoint's template, or the gateway's `--chat-template` file when it has one.
An error is OpenAI's error body, its `param` the field the message starts with.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import ssl
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

import uvicorn
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specinfer.chat_template import ChatRenderer, ChatTemplate
from services.gateway.core import CallContext, GatewayCore
from services.gateway.openai_schema import (
    ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs, envelope, error_body, finish_reason,
    parse_body, speculation_metrics, usage,
)
from services.gateway.runs import Chunk
from services.gateway.telemetry import GatewayMetrics
from services.gateway.validation import NewRequest
from specinfer.errors import BindError, CapacityError, NotFoundError, UserError
from specinfer.limits import MAX_METADATA_BYTES
from specinfer.logprobs import TokenLogprob
from specinfer.serving.grpc_server import status_for
from specinfer.serving.security import ServerSecurity
from specinfer.serving.tracing import outgoing_metadata
from specinfer.stats import GenerationStats

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answer without a token
# gRPC status (the one exception mapping, `status_for`) -> HTTP status and OpenAI error type
HTTP_STATUS = {"INVALID_ARGUMENT": (400, "invalid_request_error"), "NOT_FOUND": (404, "not_found_error"),
               "RESOURCE_EXHAUSTED": (429, "rate_limit_error"), "UNAVAILABLE": (503, "service_unavailable"),
               "DEADLINE_EXCEEDED": (504, "timeout_error"), "UNAUTHENTICATED": (401, "authentication_error"),
               "CANCELLED": (499, "cancelled")}
CLIENT_CLOSED = 499  # counted for a client that left before its response ended
# HTTP outcomes are counted under the gRPC code names, so one dashboard reads both APIs
CODE_NAMES = {200: "OK", 500: "INTERNAL", **{status: name for name, (status, _) in HTTP_STATUS.items()}}


# ---- a request's link to its client, and its generation thread -------------------------------
class HttpLink:
    """What `GatewayCore` needs of a client (core.ClientLink): whether it is still there, and
    callbacks to run when its request ends, normally or because it disconnected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._is_active = True

    def is_active(self) -> bool:
        return self._is_active

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._is_active:
                return False
            self._callbacks.append(callback)
            return True

    def close(self) -> None:
        with self._lock:
            if not self._is_active:
                return
            self._is_active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


_END = object()


class _Pump:
    """Runs a request's chunk iterator on its own thread and hands the chunks to the event loop.
    The iterator ends on its own once the link is closed (the core polls it)."""

    def __init__(self, make: Callable[[], Iterator[Chunk]]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        threading.Thread(target=self._run, args=(make,), name="http-request", daemon=True).start()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: the server is gone
            pass

    def _run(self, make: Callable[[], Iterator[Chunk]]) -> None:
        try:
            for chunk in make():
                self._put(chunk)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's coroutine
            self._put(exc)
        else:
            self._put(_END)

    async def next(self) -> Chunk | None:
        """The next chunk; None at the end; raises what the request raised."""
        item = await self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


async def _watch_disconnect(receive: Callable[[], Awaitable[dict]], link: HttpLink) -> None:
    """Closes the link when the client disconnects (cancelled once the response has ended)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a connection that broke is a client gone too
        pass
    link.close()


# ---- errors ---------------------------------------------------------------------------------
def error_response(exc: BaseException) -> JSONResponse:
    """An OpenAI-shaped error with the HTTP status of the exception's gRPC status."""
    if isinstance(exc, _HttpError):
        return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code), exc.status)
    code, message = status_for(exc)
    status, error_type = HTTP_STATUS.get(code.name, (500, "server_error"))
    if status == 500:
        log.error("HTTP request failed: %s", message, exc_info=exc)
    param = None
    if isinstance(exc, (UserError, NotFoundError)):
        # the field a message starts with; the verifier's own refusals (a schema that does not
        # compile, a token outside the vocabulary) come back as "verifier: <field>: ..."
        head = message.removeprefix("verifier: ").split(":", 1)[0].removeprefix("sampling.")
        param = head if head and " " not in head else None
    headers = None
    if isinstance(exc, CapacityError) and exc.retry_after_whole_s is not None:
        headers = {"Retry-After": str(exc.retry_after_whole_s)}
    return JSONResponse(error_body(message, error_type, param, "model_not_found" if param == "model" else None),
                        status, headers=headers)


@dataclass
class _HttpError(Exception):
    status: int
    message: str
    error_type: str
    param: str | None = None
    code: str | None = None


# ---- the ASGI guard: token and body size, before any route runs -------------------------------
class _Guard:
    """Checks the bearer token (all paths but /health) and bounds the request body: a declared
    length over the bound is refused at once, a chunked body as soon as it passes the bound."""

    def __init__(self, app, token: str | None, max_body_bytes: int):
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                message = "invalid bearer token" if given else "missing bearer token (Authorization header)"
                return await self._refuse(scope, receive, send, 401, message, "authentication_error",
                                          "invalid_api_key")
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._refuse(scope, receive, send, 413, self._too_large(), "invalid_request_error",
                                      "body_too_large")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                return await self._refuse(scope, receive, send, 413, self._too_large(), "invalid_request_error",
                                          "body_too_large")
            if not message.get("more_body"):
                break
        body, is_replayed = b"".join(parts), False

        async def replay():
            nonlocal is_replayed
            if is_replayed:
                return await receive()
            is_replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes"

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str, error_type: str, code: str):
        await JSONResponse(error_body(message, error_type, None, code), status)(scope, receive, send)


# ---- the API ------------------------------------------------------------------------------------
class _Exchange:
    """One HTTP request's span and its outcome counted in the gateway's request metrics."""

    def __init__(self, api: "OpenAIApi", request: Request, route: str):
        self.api, self.route, self.started = api, route, time.monotonic()
        carrier = {k: v for k, v in request.headers.items()}
        self.span = api.tracer.start_span("gateway.generate", context=propagate.extract(carrier),
                                          kind=trace.SpanKind.SERVER, attributes={"http.route": route})
        with trace.use_span(self.span, end_on_exit=False):
            self.metadata = tuple(outgoing_metadata())
        self._is_done = False

    def call(self, link: HttpLink) -> CallContext:
        span = self.span
        return CallContext(link, self.api.deadline_s, self.metadata, lambda name, attrs: span.add_event(name, attrs),
                           self.started)

    def finish(self, status: int, exc: BaseException | None = None) -> None:
        if self._is_done:
            return
        self._is_done = True
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
        self.span.set_attribute("http.status_code", status)
        self.span.end()
        method = f"HTTP {self.route}"
        self.api.metrics.requests.labels(method, CODE_NAMES.get(status, "UNKNOWN")).inc()
        self.api.metrics.request_latency.labels(method).observe(time.monotonic() - self.started)


class _Reply:
    """Turns one request's chunks into OpenAI's shapes: a choice per sample (`Chunk.index`), with
    its text, logprobs (when asked for) and finish reason, and the usage of all samples."""

    def __init__(self, api: "OpenAIApi", req, kind: str):
        self.api, self.kind, self.is_chat = api, kind, kind == "chat.completion"
        self.num_samples = req.n
        self.wants_logprobs = req.num_top_logprobs is not None
        self.request_id = ""
        self.text: dict[int, list[str]] = defaultdict(list)
        self.logprobs: dict[int, list[TokenLogprob]] = defaultdict(list)
        self.token_chars: dict[int, int] = defaultdict(int)  # decoded characters of the tokens so far
        self.space = ""
        self.finish: dict[int, str] = {}
        self.stats: dict[int, GenerationStats | None] = {}

    def decode(self, token_id: int) -> str:
        return self.api.core.tokenizer.decode([token_id])

    def add(self, chunk: Chunk) -> None:
        if not self.request_id:
            self.request_id = chunk.group_id or chunk.request_id
        i = chunk.index
        self.text[i].append(chunk.text_delta)
        self.logprobs[i].extend(chunk.logprobs)
        self.space = chunk.logprob_space or self.space
        if chunk.is_done:
            self.finish[i], self.stats[i] = chunk.finish_reason, chunk.stats

    def _logprobs_json(self, index: int, logprobs: list[TokenLogprob], space: str) -> dict | None:
        if not self.wants_logprobs:
            return None
        if self.is_chat:
            return chat_logprobs(logprobs, self.decode, space)
        out = completion_logprobs(logprobs, self.decode, self.token_chars[index], space)
        self.token_chars[index] += sum(len(t) for t in out["tokens"])
        return out

    def usage(self) -> dict:
        return usage([self.stats.get(i) for i in sorted(self.stats)])

    def metrics(self) -> dict | list | None:
        """Our speculation statistics: one object, or one per choice when n > 1."""
        per_choice = [speculation_metrics(self.stats.get(i)) for i in sorted(self.stats)]
        return per_choice[0] if len(per_choice) == 1 else per_choice or None

    # -- a whole response ----------------------------------------------------------------------
    def response(self) -> dict:
        out = envelope(self.kind, self.request_id, self.api.model_name)
        out["choices"] = [self._choice(i) for i in sorted(self.text)]
        out["usage"], out["metrics"] = self.usage(), self.metrics()
        return out

    def _choice(self, i: int) -> dict:
        text, reason = "".join(self.text[i]), finish_reason(self.finish.get(i, ""))
        logprobs = self._logprobs_json(i, self.logprobs[i], self.space)
        if self.is_chat:
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}

    # -- stream chunks -------------------------------------------------------------------------
    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def role_chunks(self, created: int) -> list[dict]:
        """Chat streams open every choice with the assistant's role."""
        if not self.is_chat:
            return []
        return [self._stream_chunk(created, i, {"role": "assistant", "content": ""}, None, None)
                for i in range(self.num_samples)]

    def stream_chunk(self, chunk: Chunk, created: int) -> dict | None:
        """The event for one chunk of progress; None when it carries nothing to send."""
        has_logprobs = self.wants_logprobs and bool(chunk.logprobs)
        if not (chunk.text_delta or chunk.is_done or has_logprobs):
            return None
        logprobs = self._logprobs_json(chunk.index, list(chunk.logprobs), chunk.logprob_space or self.space)
        reason = finish_reason(chunk.finish_reason) if chunk.is_done else None
        body = self._stream_chunk(created, chunk.index, chunk.text_delta, logprobs, reason)
        if chunk.is_done:
            body["metrics"] = speculation_metrics(chunk.stats)
        return body

    def usage_chunk(self, created: int) -> dict:
        body = envelope(self.chunk_kind, self.request_id, self.api.model_name, created)
        body.update(choices=[], usage=self.usage())
        return body

    def _stream_chunk(self, created: int, index: int, content, logprobs: dict | None, reason: str | None) -> dict:
        body = envelope(self.chunk_kind, self.request_id, self.api.model_name, created)
        if self.is_chat:
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}
        body["choices"] = [choice]
        return body


class OpenAIApi:
    def __init__(self, core: GatewayCore, model_name: str, renderer: ChatRenderer, tracer: trace.Tracer,
                 metrics: GatewayMetrics, registry: CollectorRegistry, deadline_s: float):
        self.core, self.model_name, self.renderer = core, model_name, renderer
        self.tracer, self.metrics, self.registry, self.deadline_s = tracer, metrics, registry, deadline_s
        self.created = int(time.time())
        self.is_draining = False

    def app(self, token: str | None, max_body_bytes: int) -> Any:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        handlers = {404: self._not_found, 405: self._not_allowed}
        return _Guard(Starlette(routes=routes, exception_handlers=handlers), token, max_body_bytes)

    # -- plain endpoints ---------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specinfer"}]})

    async def health(self, request: Request) -> Response:
        if self.is_draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    @staticmethod
    async def _not_found(request: Request, exc) -> Response:
        return error_response(_HttpError(404, f"no route {request.url.path}", "not_found_error"))

    @staticmethod
    async def _not_allowed(request: Request, exc) -> Response:
        return error_response(_HttpError(405, f"{request.method} is not allowed on {request.url.path}",
                                         "invalid_request_error"))

    # -- generation --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", self._completion_request, "text_completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", self._chat_request, "chat.completion")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise NotFoundError(f"model: the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)")

    def _completion_request(self, body: bytes) -> tuple[Any, Callable[[], NewRequest]]:
        req = parse_body(CompletionRequest, body)
        self._check_model(req.model)
        params = req.generation_params()
        return req, lambda: NewRequest(req.prompt_text, params)

    def _chat_request(self, body: bytes) -> tuple[Any, Callable[[], NewRequest]]:
        req = parse_body(ChatCompletionRequest, body)
        self._check_model(req.model)
        params = req.chat_params()
        messages = [m.as_template_input() for m in req.messages]
        if self.renderer.template is None:
            self.renderer.render(messages)  # raises the no-template error before any work
        return req, lambda: NewRequest(self.renderer.render(messages), params)

    async def _generate(self, request: Request, route: str, parse, kind: str) -> Response:
        exchange = _Exchange(self, request, route)
        link = HttpLink()
        watcher = None
        try:
            req, new_request = parse(await request.body())
            call = exchange.call(link)
            pump = _Pump(lambda: self.core.generate(new_request(), call))
            watcher = asyncio.ensure_future(_watch_disconnect(request.receive, link))
            first = await self._first_output(pump)
        except BaseException as exc:
            link.close()
            if watcher is not None:
                watcher.cancel()
            response = error_response(exc) if isinstance(exc, Exception) else Response(status_code=CLIENT_CLOSED)
            exchange.finish(response.status_code, exc)
            if not isinstance(exc, Exception):
                raise
            return response
        reply = _Reply(self, req, kind)
        if first:
            exchange.span.set_attribute("request_id", first[0].request_id)
        if req.stream:
            events = self._events(pump, first, req, reply, link, watcher, exchange)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            for chunk in first:
                reply.add(chunk)
            while (chunk := await pump.next()) is not None:
                reply.add(chunk)
            response = JSONResponse(reply.response()) if link.is_active() else Response(status_code=CLIENT_CLOSED)
        except Exception as exc:  # noqa: BLE001 - the request's own failure, as its HTTP status
            response = error_response(exc)
            exchange.finish(response.status_code, exc)
        except BaseException:
            exchange.finish(CLIENT_CLOSED)
            raise
        finally:
            link.close()
            watcher.cancel()
        exchange.finish(response.status_code)
        return response

    @staticmethod
    async def _first_output(pump: _Pump) -> list[Chunk]:
        """The chunks up to the request's first output (or its end): an error before that is the
        response's HTTP status; after it, the status (200) has been sent."""
        chunks = []
        while True:
            chunk = await pump.next()
            if chunk is None:
                return chunks
            chunks.append(chunk)
            if chunk.token_ids or chunk.text_delta or chunk.is_done:
                return chunks

    async def _events(self, pump: _Pump, first: list[Chunk], req, reply: _Reply, link: HttpLink,
                      watcher: asyncio.Future, exchange: _Exchange):
        """Server-sent events: one `data:` line per chunk of output, then `data: [DONE]`; with
        stream_options.include_usage, every chunk has "usage": null and a last one the usage."""
        created = int(time.time())
        status, error = CLIENT_CLOSED, None
        try:
            for chunk in first:
                reply.add(chunk)  # the header chunks: the request's id
            bodies = reply.role_chunks(created) + [reply.stream_chunk(c, created) for c in first]
            while True:
                for body in bodies:
                    if body is not None:
                        if req.include_usage:
                            body["usage"] = None
                        yield _sse(body)
                chunk = await pump.next()
                if chunk is None:
                    break
                reply.add(chunk)
                bodies = [reply.stream_chunk(chunk, created)]
            if req.include_usage:
                yield _sse(reply.usage_chunk(created))
            yield "data: [DONE]\n\n"
            status = 200
        except Exception as exc:  # noqa: BLE001 - after the headers: the error is the stream's last event
            response = error_response(exc)
            status, error = response.status_code, exc
            yield f"data: {response.body.decode()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            link.close()
            watcher.cancel()
            exchange.finish(status, error)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


# ---- the server ---------------------------------------------------------------------------------
class HttpServer:
    """uvicorn serving the API on its own thread and event loop, on a socket bound up front (so a
    taken port fails start-up at once, and port 0 picks a free one)."""

    def __init__(self, api: OpenAIApi, host: str, port: int, security: ServerSecurity, max_body_bytes: int,
                 grace_s: float, max_connections: int):
        self.api = api
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise BindError("HTTP API", host, port, exc.strerror or str(exc)) from None
        self.port = self._sock.getsockname()[1]
        tls = {}
        if security.is_tls:
            tls = {"ssl_certfile": str(security.tls_cert), "ssl_keyfile": str(security.tls_key)}
            if security.tls_client_ca:
                tls.update(ssl_ca_certs=str(security.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(api.app(security.token, max_body_bytes), http="h11", lifespan="off",
                                log_config=None, access_log=False, timeout_graceful_shutdown=max(0.5, grace_s),
                                limit_concurrency=max_connections, h11_max_incomplete_event_size=MAX_METADATA_BYTES,
                                **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="http-api", daemon=True)

    def _serve(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError("the HTTP API did not start")
            time.sleep(0.01)

    def begin_stop(self) -> None:
        """Stops taking requests (/health answers 503); requests in progress get the grace period
        to end, alongside the gRPC API's drain."""
        self.api.is_draining = True
        self._server.should_exit = True

    def stop(self) -> None:
        """Stops (if not begun already) and waits for the server to end."""
        self.begin_stop()
        self._thread.join(self._server.config.timeout_graceful_shutdown + 5.0)
        self._sock.close()


def start_http(core: GatewayCore, tracer: trace.Tracer, metrics: GatewayMetrics, registry: CollectorRegistry,
               port: int) -> HttpServer:
    """Starts the HTTP API of a gateway on `port` (its host, security and limits are the gRPC API's)."""
    cfg = core.cfg
    if cfg.chat_template is not None:
        template = ChatTemplate.from_file(cfg.chat_template, cfg.model_dir)
    else:
        template = ChatTemplate.from_dir(cfg.model_dir)
    renderer = ChatRenderer(template)
    api = OpenAIApi(core, cfg.model_dir.name, renderer, tracer, metrics, registry, cfg.default_deadline_s)
    server = HttpServer(api, cfg.host, port, cfg.server_security, cfg.max_message_bytes, cfg.grace_s,
                        cfg.num_server_workers)
    server.start()
    log.info("serving the OpenAI-compatible HTTP API on %s:%d", cfg.host, server.port)
    return server
