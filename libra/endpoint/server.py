"""The HTTP server (aiohttp, on the job's event loop): OpenAI's routes and Libra's session routes.

    GET  /v1/models
    POST /v1/chat/completions                 messages, tools, tool_choice, n, temperature, top_p,
                                              max_tokens / max_completion_tokens, stop, seed,
                                              logprobs, stream (+ stream_options.include_usage)
    POST /v1/completions                      prompt (text or token ids), the same sampling fields
    POST /v1/libra/sessions/{id}/reward       {"reward": float}: the session's reward
    GET  /v1/libra/sessions/{id}              the session's segments (trajectory ids, tokens, outcomes)
    DELETE /v1/libra/sessions/{id}            closes a session the job did not open (the job
                                              closes its own when their agent returns)
    GET  /health                              no token needed

Every other route needs `Authorization: Bearer <the run's token>` (the gRPC API's), refused with
401 before the body is read; with the control plane's TLS certificate (`control.tls_cert_file`)
it serves HTTPS only. Errors are OpenAI's error object with the status that fits: 400 a
bad request (naming the field), 401, 404, 429 no room for another session, 503 no rollout
instance, 500 anything else. A stream is sent once the turn has ended (a chunk per part of the
reply, not per token).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import ssl
import time

from aiohttp import web

from libra.endpoint import responses
from libra.endpoint.messages import RequestError
from libra.endpoint.requests import parse_chat, parse_completion, session_of
from libra.endpoint.service import EndpointService, SessionClosed, Unavailable
from libra.endpoint.sessions import SessionLimit

logger = logging.getLogger(__name__)

_MAX_BODY_BYTES = 64 << 20
"""Long agent contexts: a 128k-token conversation is a few MB of JSON."""
_IDLE_CHECK_S = 30.0


class OpenAIEndpoint:
    def __init__(
        self,
        service: EndpointService,
        token: str,
        host: str,
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ):
        if not token:
            raise ValueError("the endpoint needs the run's bearer token")
        self.service = service
        self._token = token.encode()
        self._host, self._port, self._ssl = host, port, ssl_context
        self.model = service.config.served_model_name
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._idle_task: asyncio.Task | None = None
        self.url = ""
        """`http://host:port/v1`, once started."""

    async def start(self) -> OpenAIEndpoint:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=_MAX_BODY_BYTES)
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.post("/v1/libra/sessions/{session_id}/reward", self._reward),
                web.get("/v1/libra/sessions/{session_id}", self._session),
                web.delete("/v1/libra/sessions/{session_id}", self._close_session),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, ssl_context=self._ssl)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self._ssl else 'http'}://{self._host}:{port}/v1"
        self._idle_task = asyncio.create_task(self._close_idle())
        logger.info("OpenAI-compatible endpoint at %s", self.url)
        return self

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _close_idle(self) -> None:
        while True:
            await asyncio.sleep(min(_IDLE_CHECK_S, self.service.config.session_idle_s))
            try:
                closed = await self.service.close_idle()
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("closing idle endpoint sessions failed")
                continue
            if closed:
                logger.info("closed %d idle endpoint sessions", closed)

    # -- middleware --------------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path != "/health":
            header = request.headers.get("Authorization", "")
            bearer = header[len("Bearer ") :].encode() if header.startswith("Bearer ") else b""
            if not bearer or not hmac.compare_digest(bearer, self._token):
                reason = "invalid bearer token" if bearer else "missing bearer token"
                return _error(reason, "authentication_error", 401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as e:
            return _error(e.reason, "invalid_request_error", e.status)
        except RequestError as e:
            return _error(str(e), "invalid_request_error", 400)
        except SessionLimit as e:
            return _error(str(e), "rate_limit_error", 429)
        except SessionClosed as e:
            return _error(str(e), "invalid_request_error", 404)
        except Unavailable as e:
            return _error(f"no rollout instance could take the turn: {e}", "service_unavailable", 503)
        except Exception as e:  # noqa: BLE001 - a failed call answers with an error, the server goes on
            logger.exception("endpoint call %s failed", request.path)
            return _error(f"{type(e).__name__}: {e}", "server_error", 500)

    # -- routes ------------------------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response(responses.models(self.model, self._created))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(
            request, parse_chat, self.service.chat, responses.chat_completion, responses.chat_chunks
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(
            request,
            parse_completion,
            self.service.complete,
            responses.completion,
            responses.completion_chunks,
        )

    async def _serve(self, request: web.Request, parse, serve, body_of, chunks_of) -> web.StreamResponse:
        """Parses the call, serves it on its session, answers with a body or a stream."""
        body = await _json(request)
        call = parse(body, self.service.config.max_n)
        served = await serve(session_of(request.headers, body), call)
        tokenizer, logprobs = self.service.renderer.tokenizer, call.sampling.logprobs
        if call.stream:
            return await _stream(
                request, chunks_of(served, self.model, tokenizer, logprobs, call.include_usage)
            )
        return web.json_response(body_of(served, self.model, tokenizer, logprobs))

    async def _reward(self, request: web.Request) -> web.Response:
        body = await _json(request)
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RequestError("'reward' must be a finite number")
        session_id = request.match_info["session_id"]
        try:
            self.service.set_reward(session_id, float(reward))
        except KeyError:
            return _error(f"no open session {session_id!r}", "invalid_request_error", 404)
        return web.json_response({"session_id": session_id, "reward": float(reward)})

    async def _session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        session = self.service.sessions.lookup(session_id)
        if session is None:
            return _error(f"no open session {session_id!r}", "invalid_request_error", 404)
        segments = [
            {
                "trajectory_id": s.trajectory.trajectory_id,
                "reason": s.reason,
                "outcome": s.trajectory.outcome.value,
                "prompt_token_ids": s.trajectory.prompt_token_ids,
                "response_token_ids": s.trajectory.response_token_ids,
                "loss_mask": s.trajectory.loss_mask,
            }
            for s in session.segments
        ]
        return web.json_response(
            {
                "session_id": session_id,
                "trained": session.trained,
                "reward": session.reward,
                "segments": segments,
            }
        )

    async def _close_session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        session = self.service.sessions.lookup(session_id)
        if session is None:
            return _error(f"no open session {session_id!r}", "invalid_request_error", 404)
        if session.trained:
            return _error(
                f"session {session_id!r} is the job's: it is closed (and trained on) when its agent returns",
                "invalid_request_error",
                409,
            )
        segments = await self.service.close_session(session_id)
        return web.json_response({"session_id": session_id, "closed": True, "segments": len(segments)})


async def _json(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not JSON ({e})") from None


async def _stream(request: web.Request, chunks) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(message: str, kind: str, status: int) -> web.Response:
    return web.json_response(responses.error(message, kind, status), status=status)


def tls_context(cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """The server side of the control plane's TLS setting (None: plain HTTP)."""
    if not cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context
