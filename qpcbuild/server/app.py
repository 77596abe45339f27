"""The OpenAI-compatible HTTP surface: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, on Starlette.

Why Starlette (+ uvicorn): it is the ASGI toolkit FastAPI itself is built on, small and well kept;
what FastAPI would add (OpenAPI pages, automatic validation) is either not needed or has to be
replaced anyway, since errors must come back in OpenAI's JSON shape, not FastAPI's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..backend_api import HOST_BACKEND
from ..errors import QpcbuildError
from ..runtime.chat import NoChatTemplate
from ..runtime.loader import Generator
from ..runtime.sampling import SamplingParams
from .access import RequestLog, ServerLog
from .detokenize import Detokenizer
from .metrics import ServerMetrics, openai_finish_reason, serve_disaggregated
from .schema import BadRequest, ChatRequest, CompletionRequest, parse_request
from .worker import EngineWorker, Job

log = logging.getLogger("qpcbuild.server")
MAX_BODY = 4 << 20
BODY_TIMEOUT = 30.0  # seconds for a whole request body to arrive (a stalled client gets 408)
RETRY_AFTER_S = 2  # a 503's Retry-After while the prefill worker restarts (it loads in seconds)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


# An absolute path (not part of a URL): clients are not told where the server keeps its files.
_SERVER_PATH = re.compile(r"(?<![\w:/.~-])/[^\s'\":;,()]+")


class ApiError(Exception):
    """An OpenAI-shaped error. Messages that may quote the server's files are scrubbed of paths;
    `scrub=False` is for messages built only from what the client sent (its own route)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, scrub: bool = True,
                 retry_after: int | None = None):
        if scrub:
            message = _SERVER_PATH.sub("<server path>", message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}}, self.status,
                            headers=headers)


def unavailable_error(message: str, retry: bool = True) -> ApiError:
    """503: a part of the server is being replaced (retry shortly) or could not be."""
    return ApiError(503, message, type_="service_unavailable", code="prefill_unavailable",
                    retry_after=RETRY_AFTER_S if retry else None)


class _Stream:
    """Tokens of one request, handed from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def listener(self, job: Job, ids: list[int], done: bool) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (list(ids), done))

    async def next(self) -> tuple[list[int], bool]:
        """Everything the engine sent since the last call: one text update per wake-up."""
        ids, done = await self.queue.get()
        while not done and not self.queue.empty():
            more, done = self.queue.get_nowait()
            ids += more
        return ids, done


# Over 80 lines: the routes are closures over one engine worker, its metrics and the model's
# limits; each handler below is short and named for its route.
def build_app(gen: Generator, model_name: str,
              server_log: ServerLog | None = None) -> Starlette:
    metrics: ServerMetrics | None = None
    worker: EngineWorker | None = None
    ctx_len = gen.decoder.ctx_len

    def on_finish(job: Job) -> None:
        if metrics is not None and job.error is None:
            metrics.record(job.row)

    worker = EngineWorker(gen, on_finish)
    metrics = ServerMetrics(model_name, lambda: worker.running, lambda: worker.waiting)
    prefill = serve_disaggregated(gen, metrics)

    def refuse_while_unavailable() -> None:
        refused = prefill.unavailable() if prefill is not None else None
        if refused is not None:
            raise unavailable_error(str(refused), refused.retry)

    async def body_of(request: Request, schema):
        try:
            raw = await asyncio.wait_for(_read_body(request), BODY_TIMEOUT)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s") \
                from None
        try:
            req = await asyncio.to_thread(parse_request, raw, schema)
        except BadRequest as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        if req.model != model_name:
            raise ApiError(404, f"the model '{req.model}' does not exist; this server serves "
                           f"'{model_name}'", param="model", code="model_not_found")
        return req

    def prompt_ids(req, chat: bool) -> list[list[int]]:
        try:
            if chat:
                messages = [{"role": m.role, "content": m.text()} for m in req.messages]
                return [gen.chat_prompt(messages)]
            return [gen.encode(p) for p in req.prompt]
        except NoChatTemplate:  # the CLI's wording names --chat; a client needs the route
            raise ApiError(400, f"the model '{model_name}' has no chat template, so "
                           "/v1/chat/completions cannot render `messages`; send the text as "
                           "`prompt` to /v1/completions", param="messages", scrub=False) from None
        except (QpcbuildError, ValueError) as exc:
            raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None

    def budget(req, ids: list[int]) -> int:
        if len(ids) >= ctx_len:
            raise ApiError(400, f"This model's maximum context length is {ctx_len} tokens; the "
                           f"prompt has {len(ids)}", param="prompt", code="context_length_exceeded")
        room = ctx_len - len(ids)
        if req.limit is not None and req.limit > room:
            raise ApiError(400, f"This model's maximum context length is {ctx_len} tokens. "
                           f"However, you requested {len(ids) + req.limit} tokens ({len(ids)} "
                           f"in the prompt, {req.limit} for the completion)",
                           param="max_tokens", code="context_length_exceeded")
        return req.limit or room

    def sampling(req) -> SamplingParams:
        return SamplingParams(req.temperature, req.top_k, req.top_p, req.seed)

    async def generate(request: Request, chat: bool):
        req = await body_of(request, ChatRequest if chat else CompletionRequest)
        refuse_while_unavailable()  # at once, rather than queued behind a restart
        all_ids = await asyncio.to_thread(prompt_ids, req, chat)  # tokenizing is CPU work
        limits = [budget(req, ids) for ids in all_ids]
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop) for _ in all_ids]
        jobs = [worker.submit(ids, n, sampling(req), s.listener)
                for ids, n, s in zip(all_ids, limits, streams)]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:  # Starlette ends the stream when the client leaves; sse() frees the slots
            return StreamingResponse(sse(request, req, chat, rid, created, jobs, streams),
                                     media_type="text/event-stream")
        work = asyncio.ensure_future(collect_all(jobs, streams, req.stop))
        gone = asyncio.ensure_future(_hung_up(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: stop generating for nobody
                raise asyncio.CancelledError
            results = work.result()
        finally:
            gone.cancel()
            work.cancel()
            for job in jobs:  # a no-op for finished jobs
                job.cancel()
        texts, reasons = [t for t, _ in results], [r for _, r in results]
        usage = _usage(jobs)
        request.state.tokens = (usage["prompt_tokens"], usage["completion_tokens"])
        if chat:
            choices = [{"index": 0, "message": {"role": "assistant", "content": texts[0]},
                        "finish_reason": reasons[0], "logprobs": None}]
        else:
            choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": None}
                       for i, (t, r) in enumerate(zip(texts, reasons))]
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else
                             "text_completion", "created": created, "model": model_name,
                             "choices": choices, "usage": usage,
                             "metrics": request_metrics(jobs, max(gen.ks))})

    async def collect_all(jobs: list[Job], streams: list[_Stream], stops: list[str]):
        return [await collect(job, stream, stops) for job, stream in zip(jobs, streams)]

    async def collect(job: Job, stream: _Stream, stops: list[str]):
        detok, parts = Detokenizer(gen, stops), []
        while True:
            ids, done = await stream.next()
            parts.append(await asyncio.to_thread(detok.feed, ids, done))
            if detok.stopped and not done:
                job.cancel("stop")
            if done or detok.stopped:
                _check(job)
                reason = "stop" if detok.stopped else openai_finish_reason(job.row.finish_reason)
                return "".join(parts), reason

    async def sse(request, req, chat, rid, created, jobs, streams):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, text, reason, first=False):
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            return _event({"id": rid, "object": obj, "created": created, "model": model_name,
                           "choices": [choice]})

        try:
            for i, (job, stream) in enumerate(zip(jobs, streams)):
                detok = Detokenizer(gen, req.stop)
                if chat:
                    yield chunk(i, "", None, first=True)
                while True:
                    ids, done = await stream.next()
                    text = await asyncio.to_thread(detok.feed, ids, done)
                    if detok.stopped and not done:
                        job.cancel("stop")
                    if done or detok.stopped:
                        if job.error:
                            kind = "service_unavailable" if job.row.unavailable else \
                                "server_error"
                            yield _event({"error": {"message": job.error, "type": kind,
                                                    "param": None, "code": None}})
                            return
                        reason = "stop" if detok.stopped else \
                            openai_finish_reason(job.row.finish_reason)
                        yield chunk(i, text, reason)
                        break
                    if text:
                        yield chunk(i, text, None)
            if req.include_usage:
                yield _event({"id": rid, "object": obj, "created": created, "model": model_name,
                              "choices": [], "usage": _usage(jobs)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away, or we are done: either way free the slots
            for job in jobs:
                job.cancel()
            usage = _usage(jobs)
            request.state.tokens = (usage["prompt_tokens"], usage["completion_tokens"])

    def _check(job: Job) -> None:
        if job.row.unavailable:
            raise unavailable_error(job.row.unavailable)
        if job.error:
            raise ApiError(500, f"generation failed: {job.error}", type_="server_error")

    async def completions(request: Request):
        return await guarded(request, chat=False)

    async def chat_completions(request: Request):
        return await guarded(request, chat=True)

    async def guarded(request: Request, chat: bool):
        try:
            return await generate(request, chat)
        except ApiError as exc:
            return exc.response()
        except asyncio.CancelledError:
            return Response(status_code=499)
        except Exception:  # never a traceback to the client
            log.exception("request failed")
            return ApiError(500, "internal error (see the server log)", "server_error").response()

    # The model card says which weights answer: an int8/int4 target is not the float32 model.
    card: dict = {"id": model_name, "object": "model", "created": 0, "owned_by": "qpcbuild",
                  "max_model_len": ctx_len}
    if gen.backend == HOST_BACKEND:
        card["target_weights"] = gen.manifest.target.matmul_weights()
        note = gen.manifest.target_weights_label()
        if note:
            card["note"] = note

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request):
        refused = prefill.unavailable() if prefill is not None else None
        if refused is not None:  # a load balancer sends the traffic elsewhere meanwhile
            return unavailable_error(str(refused), refused.retry).response()
        return Response(status_code=200)

    async def prometheus(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # The gate may switch in a request's last step, after that request was counted: the
        # switches are brought up to date when they are read instead.
        metrics.record_switches(gen.decoder.gate().switches)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc):
        # The client's own route as sent (cut short), never scrubbed as if a server path; a
        # 405 names the methods the route takes.
        status = getattr(exc, "status_code", 404)
        route = (request.scope.get("raw_path", b"").decode("latin-1") or request.url.path)[:200]
        allowed = (getattr(exc, "headers", None) or {}).get("Allow", "")
        why = f"method not allowed (this route takes {allowed})" if status == 405 else \
            f"not found (routes: {', '.join(ROUTES)})"
        return ApiError(status, f"{request.method} {route}: {why}", scrub=False).response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        reporter = asyncio.ensure_future(server_log.report(worker, metrics)) \
            if server_log is not None else None
        yield
        if reporter is not None:
            reporter.cancel()
        worker.close()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan,
        middleware=[Middleware(RequestLog, log=server_log)] if server_log else None)
    app.state.worker, app.state.metrics = worker, metrics
    return app


async def _read_body(request: Request) -> bytes:
    """The body, refused as soon as it passes MAX_BODY (not after buffering all of it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _hung_up(request: Request) -> None:
    """Returns when the client closes the connection. Once the body has been read, the server's
    next ASGI message for this request is the disconnect (or nothing, until the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def request_metrics(jobs: list[Job], k_max: int) -> dict[str, Any] | None:
    """vLLM's per-request `metrics.speculative_decoding` (one sequence per request, else null,
    as vLLM), with the per-position counts and the gate's steps beside it."""
    if len(jobs) != 1:
        return None
    st = jobs[0].row.stats
    hist = (st.accepted_histogram + [0] * (k_max + 1))[:max(k_max + 1,
                                                            len(st.accepted_histogram))]
    return {"speculative_decoding": {
        "mean_acceptance_length": st.mean_acceptance_length,
        "draft_acceptance_rate": st.acceptance_rate,
        "acceptance_histogram": hist, "num_spec_steps": st.num_drafts,
        "num_accepted_draft_tokens": st.num_accepted_tokens,
        "num_draft_tokens": st.num_draft_tokens, "num_spec_tokens": k_max,
        "num_accepted_tokens_per_pos": list(st.accepted_per_pos),
        "steps_with_speculation": st.spec_steps,
        "steps_without_speculation": st.plain_steps}}


def _usage(jobs: list[Job]) -> dict[str, int]:
    prompt = sum(len(j.row.prompt) for j in jobs)
    completion = sum(j.row.stats.new_tokens for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
