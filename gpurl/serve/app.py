"""The HTTP layer: thin Starlette-based FastAPI routes over `gpurl.serve.api`, and a
uvicorn server on 127.0.0.1 run on a thread of its own (`Server`).

Every request must carry `Authorization: Bearer <key>`: the server's key (`gpurl serve`)
or, on a training gateway, the key of the session its URL names (`/s/<id>/v1/...`), so no
agent reads or writes another's session and an outsider is refused. Errors are OpenAI's
error objects: 400 for a malformed body or an unservable call, 401 for a wrong key, 404 for
an unknown route or session, 413 for a body over `MAX_BODY`, 422 for a body that does not
fit the schema.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
from typing import Any, Awaitable, Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from gpurl.serve import api
from gpurl.serve.chat import RequestError
from gpurl.serve.schemas import ChatRequest, CompletionRequest, error_body

MAX_BODY = 8 << 20  # bytes of a request body at most


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def build_app(gw: api.Gateway, key: str | None,
              on_error: Callable[[api.SessionState, str], None] | None = None) -> FastAPI:
    """The routes over `gw`. `key`: the server's API key (None: a training gateway, whose
    routes are each session's, `/s/<id>/v1/...`, and whose sessions' keys are checked
    instead). `on_error(session, reason)` hears of a session's refused call."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def authorized(request: Request) -> api.SessionState | None:
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        sid = request.path_params.get("sid")
        if sid is not None:
            return gw.session(sid, token)
        if key is None or not hmac.compare_digest(token.encode(), key.encode()):
            raise RequestError("incorrect API key", status=401, code="invalid_api_key")
        return None

    async def parsed(request: Request, schema: type[BaseModel]) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            raise RequestError(f"the body is over {MAX_BODY} bytes", status=413)
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise RequestError(f"the body is over {MAX_BODY} bytes", status=413)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise RequestError("the body must be a JSON object")
        return schema.model_validate(data)

    def route(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
        async def handler(request: Request) -> Any:
            state = None
            try:
                state = authorized(request)
                return await fn(request, state)
            except RequestError as e:
                if state is not None and on_error is not None:
                    on_error(state, str(e))
                kind = "authentication_error" if e.status == 401 else "invalid_request_error"
                return _error(e.status, str(e), kind, e.param, e.code)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first.get("loc", ()))
                return _error(422, f"{where}: {first.get('msg')}", param=where or None)
        handler.__name__ = fn.__name__
        return handler

    # `gpurl serve`: /v1/...; a training gateway: each session's /s/<id>/v1/...
    base = "/v1" if key is not None else "/s/{sid}/v1"

    @app.get(f"{base}/models")
    @route
    async def models(request: Request, state: Any) -> Any:
        return gw.models()

    async def completed(request: Request, state: Any, schema: type, make_call: Callable,
                        events: Callable, respond: Callable) -> Any:
        """A chat or text completion call: its response, or its server-sent events."""
        body = await parsed(request, schema)
        call = make_call(gw, body, state)
        if body.stream:
            return StreamingResponse(events(gw, body, call, state), media_type="text/event-stream")
        return respond(gw, body, call, await api.run_call(gw, call), state)

    @app.post(f"{base}/chat/completions")
    @route
    async def chat(request: Request, state: Any) -> Any:
        return await completed(request, state, ChatRequest, api.chat_call, api.chat_events,
                               api.chat_response)

    @app.post(f"{base}/completions")
    @route
    async def completions(request: Request, state: Any) -> Any:
        return await completed(request, state, CompletionRequest, api.completion_call,
                               api.completion_events, api.completion_response)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return _error(exc.status_code, message)

    return app


class Server:
    """uvicorn on 127.0.0.1 (a free port unless `port`), on a thread of its own with its
    own event loop; `url` is its base URL (`.../v1`)."""

    def __init__(self, app: FastAPI, port: int = 0, host: str = "127.0.0.1"):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpurl-gateway")

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.socket]))

    def start(self) -> "Server":
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            self._thread.join(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.socket.close()
