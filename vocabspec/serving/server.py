"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events), /v1/models and /health, on FastAPI + uvicorn.

Requests decode together (batch.py): up to `max_batch` at once, each in a slot with its own KV
cache of `window` tokens, joining and leaving between steps; each answer is exactly the one it
gets served alone (on torch's kernels with --allow-inexact, plain-decoding requests step as rows
of one forward, each answer its own up to rounding: batched_decoding.py). More requests wait in a bounded queue (503 when it is full). A streaming
client that disconnects cancels its generation at the next step, freeing its slot. Requests are bounded in size, in max_tokens and in
generation time. Every bad request gets a 400 with an OpenAI-style error body, and the server
goes on serving. A request whose drafter fails (raises, or drafts a tree that cannot be
verified) ends with a 500 naming the failure; the requests decoding beside it go on.

Every OpenAI field is either honoured or refused with a 400 naming it, never ignored:
logprobs / top_logprobs come from the target's own distribution of each emitted token (the
rows verification read, so speculation does not change them); non-zero penalties, a
logit_bias, tools, response formats other than text, n or best_of above 1, echo and suffix are
refused, as is any field this server does not know. A completion's prompt parses special tokens'
texts as llama.cpp's completion does (`parse_special: false` keeps them text); a chat
message's content is always text, and only its template's markup becomes special tokens.
"""


import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .api import LanguageModel
from ..speculation.batch import BatchLimits, Busy
from ..speculation.generate import GenerationResult, TokenLogprob


@dataclass
class ServerLimits:
    max_request_bytes: int = 1_000_000
    max_tokens_cap: int = 2048          # largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_seconds: float = 300.0          # generation time per request
    max_queue: int = 64                 # requests waiting or running
    max_batch: int = 8                  # requests decoding at once
    window: int = 4096                  # KV cache tokens per decoding request (prompt + answer)
    tree_rows: int | None = None        # rows a step verifies over all requests (None: the cost rule, batch.py)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _number(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}", name)
    value = kind(value)
    if value != value or (low is not None and (value <= low if low_open else value < low)) \
            or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"'{name}' must be in {bounds}, got {value}", name)
    return value


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                 "stream_options", "user", "logprobs", "frequency_penalty", "presence_penalty",
                 "logit_bias"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                               "tool_choice", "functions", "function_call", "parallel_tool_calls",
                               "response_format"}
# parse_special: whether a prompt's special-token texts are those tokens (default true, as
# llama.cpp's completion); a chat's messages are text whatever it says, so chat refuses it.
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of", "parse_special"}
MAX_COMPLETION_LOGPROBS = 5      # OpenAI's bound for /v1/completions' integer `logprobs`
MAX_TOP_LOGPROBS = 20            # and for chat's top_logprobs


def refuse_unsupported(body: dict, chat: bool) -> None:
    """A 400 naming the first field that asks for something this server does not do."""
    for name in body:
        if name == "parse_special" and chat:
            raise BadRequest("'parse_special' applies to /v1/completions: a chat message's content "
                             "is always tokenized as text", name)
        if name not in (CHAT_FIELDS if chat else COMPLETION_FIELDS):
            raise BadRequest(f"unsupported field {name!r}", name)
    if body.get("parse_special") is not None and not isinstance(body["parse_special"], bool):
        raise BadRequest("'parse_special' must be true or false", "parse_special")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0.0, float, -2.0, 2.0) != 0.0:
            raise BadRequest(f"'{name}' is not supported (only 0): penalties would change the "
                             "target's distribution", name)
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported", "logit_bias")
    for name in ("tools", "functions"):
        if body.get(name):
            raise BadRequest(f"'{name}': tool calling is not supported", name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise BadRequest(f"'{name}': tool calling is not supported", name)
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise BadRequest("'response_format': only {\"type\": \"text\"} is supported", "response_format")
    if _number(body, "best_of", 1, int, 1, None) != 1:
        raise BadRequest("only best_of=1 is supported", "best_of")
    if body.get("echo") not in (None, False):
        raise BadRequest("'echo' is not supported", "echo")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("'suffix' is not supported", "suffix")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", "user")
    options = body.get("stream_options")
    if options is not None:
        # The last chunk of every stream carries the usage, so include_usage holds either way.
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise BadRequest("'stream_options' may hold only include_usage (true or false)", "stream_options")
        if body.get("stream") is not True:
            raise BadRequest("'stream_options' is only allowed with stream: true", "stream_options")


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to report per token (0: the token's own only), or None."""
    if chat:
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            raise BadRequest("'logprobs' must be true or false", "logprobs")
        top = _number(body, "top_logprobs", None, int, 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else None
    return _number(body, "logprobs", None, int, 0, MAX_COMPLETION_LOGPROBS)


def message_text(message, index: int) -> tuple[str, str]:
    """(role, text) of a chat message; content is a string or a list of text parts."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with role and content", "messages")
    for key in message:
        if key not in ("role", "content"):
            raise BadRequest(f"{where}: unsupported field {key!r}", "messages")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise BadRequest(f"{where}: role must be system, developer, user or assistant, got {role!r}",
                         "messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}.content[{j}]: only text parts "
                                 f"({{\"type\": \"text\", \"text\": ...}}) are supported, got {kind!r}",
                                 "messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise BadRequest(f"{where}: content must be a string or a list of text parts", "messages")
    return ("system" if role == "developer" else role), content


class Server:
    def __init__(self, lm: LanguageModel, model_name: str, limits: ServerLimits | None = None,
                 batch_thread: bool = True):
        self.lm = lm
        self.model_name = model_name
        self.limits = limits or ServerLimits()
        window = min(self.limits.window, lm.engine.model.args.max_seq_len)
        self.batch = lm.batch(BatchLimits(max_batch=self.limits.max_batch, max_waiting=self.limits.max_queue,
                                          window=window, tree_rows=self.limits.tree_rows), thread=batch_thread)
        # A thread per admitted request waits for its answer (they only wait: the batch decodes).
        self.worker = ThreadPoolExecutor(max_workers=self.limits.max_queue, thread_name_prefix="vocabspec-req")
        self.waiting = 0
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self.lock = threading.Lock()

    # ------------------------------------------------------------ requests -> generation

    def parse(self, body, chat: bool) -> tuple[list[int], dict]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        refuse_unsupported(body, chat)
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise BadRequest(f"unknown model {model!r}; this server serves {self.model_name!r}",
                             "model", status=404)
        limits = self.limits
        max_tokens = _number(body, "max_tokens", limits.default_max_tokens, int, 1, limits.max_tokens_cap)
        if chat and "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", max_tokens, int, 1, limits.max_tokens_cap)
        params = dict(
            max_new_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0, low_open=True),
            top_k=_number(body, "top_k", 0, int, 0, None),
            seed=_number(body, "seed", None, int, None, None),
            logprobs=requested_logprobs(body, chat),
        )
        if _number(body, "n", 1, int, 1, 1) != 1:
            raise BadRequest("only n=1 is supported", "n")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        params["stop"] = tuple(stop or ())
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects",
                                 "messages")
            messages = [message_text(m, i) for i, m in enumerate(messages)]
            if not any(text.strip() for _, text in messages):
                raise BadRequest("the messages are empty", "messages")
            if not self.lm.tokenizer.chat_template:
                raise BadRequest(f"{self.model_name} is a base model without a chat template: "
                                 "use /v1/completions", "messages")
            try:
                ids = self.lm.tokenizer.encode_chat([{"role": role, "content": text}
                                                     for role, text in messages])
            except ValueError as exc:        # the template refused the conversation
                raise BadRequest(str(exc), "messages") from exc
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise BadRequest("'prompt' must be a string", "prompt")
            if not prompt.strip():
                raise BadRequest("the prompt is empty", "prompt")
            ids = self.lm.tokenizer.encode(prompt, parse_special=body.get("parse_special") is not False)
        try:
            config = self.lm._config(**params)
            self.batch.check(ids, config)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt" if "prompt" in str(exc) else None) from exc
        return ids, params

    def admit(self) -> None:
        with self.lock:
            if self.waiting >= self.limits.max_queue:
                raise BadRequest("the server is busy; try again later", status=503)
            self.waiting += 1

    def release(self, result: GenerationResult | None) -> None:
        with self.lock:
            self.waiting -= 1
            if result is None:
                self.counts["failed"] += 1
            elif result.stop_reason == "cancelled":
                self.counts["cancelled"] += 1
            else:
                self.counts["served"] += 1

    def run(self, ids, params, cancel: threading.Event, on_piece=None) -> GenerationResult:
        """Blocking: runs on a request's thread while the batch decodes it."""
        config = self.lm._config(**params, cancel=cancel,
                                 deadline=time.monotonic() + self.limits.max_seconds)
        sent = 0

        def piece(text: str, result: GenerationResult) -> None:
            nonlocal sent
            entries = result.logprobs[sent:]
            sent += len(entries)
            on_piece(text, entries)

        try:
            request = self.batch.submit(ids, config, on_piece=piece if on_piece is not None else None)
        except Busy as exc:
            raise BadRequest(str(exc), status=503) from exc
        return request.wait()

    # ------------------------------------------------------------ responses

    def usage(self, result: GenerationResult) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
                "total_tokens": result.prompt_tokens + result.new_tokens,
                "speculative": {"mean_accept_len": round(result.mean_accept_len, 3),
                                "steps": len(result.steps),
                                "tokens_per_s": round(result.tokens_per_s, 2)}}

    @staticmethod
    def finish_reason(result: GenerationResult) -> str:
        return "length" if result.stop_reason in ("length", "time") else "stop"

    def logprobs_body(self, entries: list[TokenLogprob], chat: bool, offset: int = 0) -> dict:
        """OpenAI's logprobs object: chat's {"content": [...]}, or the completions' lists
        (text_offset counts characters from `offset`, where these tokens' text starts)."""
        def text(token: int) -> str:
            return self.lm.tokenizer.decode([token], skip_special_tokens=False)

        if chat:
            def item(token, logprob):
                piece = text(token)
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}
            return {"content": [{**item(e.token, e.logprob),
                                 "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
        tokens = [text(e.token) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def body(self, chat: bool, rid: str, created: int, text: str | None, result=None, delta=None,
             logprobs: dict | None = None) -> dict:
        kind = "chat.completion" if chat else "text_completion"
        if delta is not None:
            kind += ".chunk" if chat else ""
        choice: dict = {"index": 0, "finish_reason": self.finish_reason(result) if result else None}
        if chat:
            if delta is not None:
                choice["delta"] = delta
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text if text is not None else ""
        choice["logprobs"] = logprobs
        out = {"id": rid, "object": kind, "created": created, "model": self.model_name,
               "choices": [choice]}
        if result is not None:
            out["usage"] = self.usage(result)
        return out


def create_app(lm: LanguageModel, model_name: str, limits: ServerLimits | None = None,
               batch_thread: bool = True):
    """The FastAPI app. `batch_thread`: the batch steps on a thread of its own; else whoever
    serves the app steps it (`app.state.server.batch.run()`, as `serve` does on the main thread)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="vocabspec", version="0.1")
    app.state.server = Server(lm, model_name, limits, batch_thread)
    # Endpoints find the server through the request, never in a closure: FastAPI caches what
    # it learns of each endpoint function for the life of the process, and a closure would keep
    # the model alive there after the app is gone.

    def error(exc: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "server_busy" if exc.status == 503 else "server_error"
        return JSONResponse({"error": {"message": exc.message, "type": kind, "param": exc.param,
                                       "code": None}}, status_code=exc.status)

    async def read_json(request: Request):
        server = request.app.state.server
        raw = await request.body()
        if len(raw) > server.limits.max_request_bytes:
            raise BadRequest(f"request body over {server.limits.max_request_bytes} bytes", status=413)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("the request body is not valid UTF-8")
        try:
            return json.loads(text)
        except ValueError as exc:
            raise BadRequest(f"the request body is not valid JSON ({exc})")

    @app.get("/health")
    async def health(request: Request):
        server = request.app.state.server
        return {"status": "ok", "model": server.model_name, "waiting": server.waiting, **server.counts}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": request.app.state.server.model_name, "object": "model",
                                            "created": 0, "owned_by": "vocabspec"}]}

    async def complete(request: Request, chat: bool):
        server = request.app.state.server
        try:
            body = await read_json(request)
            ids, params = server.parse(body, chat)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest("'stream' must be true or false", "stream")
            server.admit()
        except BadRequest as exc:
            return error(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        if not stream:
            result = None
            try:
                result = await loop.run_in_executor(server.worker, server.run, ids, params, cancel)
            except BadRequest as exc:
                return error(exc)
            except Exception as exc:  # keep serving whatever one generation does
                return error(BadRequest(f"generation failed: {exc}", status=500))
            finally:
                server.release(result)
            logprobs = server.logprobs_body(result.logprobs, chat) \
                if params["logprobs"] is not None else None
            return server.body(chat, rid, created, result.text, result, logprobs=logprobs)

        queue: asyncio.Queue = asyncio.Queue()

        def on_piece(piece: str, entries: list[TokenLogprob]):
            loop.call_soon_threadsafe(queue.put_nowait, ("piece", (piece, entries)))

        def work():
            result = None
            try:
                result = server.run(ids, params, cancel, on_piece)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
            except Exception as exc:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", str(exc)))
            finally:
                server.release(result)

        future = loop.run_in_executor(server.worker, work)

        def chunk_logprobs(entries):
            if params["logprobs"] is None:
                return None
            return server.logprobs_body(entries, chat, offset=len(streamed))

        streamed = ""        # text sent so far (text_offset of a completions chunk's tokens)
        counted = 0          # logprob entries sent so far

        async def events():
            nonlocal streamed, counted
            try:
                if chat:
                    first = server.body(chat, rid, created, None, delta={"role": "assistant", "content": ""})
                    yield f"data: {json.dumps(first)}\n\n"
                while True:
                    kind, value = await queue.get()
                    if kind == "piece":
                        piece, entries = value
                        chunk = server.body(chat, rid, created, piece,
                                            delta={"content": piece} if chat else {},
                                            logprobs=chunk_logprobs(entries))
                        streamed += piece
                        counted += len(entries)
                        yield f"data: {json.dumps(chunk)}\n\n"
                    elif kind == "done":
                        final = server.body(chat, rid, created, "", value, delta={},
                                            logprobs=chunk_logprobs(value.logprobs[counted:]))
                        yield f"data: {json.dumps(final)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                        return
            finally:
                cancel.set()   # a client that went away stops its generation at the next step
                await asyncio.shield(future)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


def free_port() -> int:
    """A local TCP port free at the time of asking."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


class HTTPThread:
    """uvicorn serving `app` on a thread of its own, leaving the calling thread free to step the
    batch (`serve`, the serving benchmark, the tests). `port=None`: a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn

        port = free_port() if port is None else port
        self.base = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, name="vocabspec-http", daemon=True)
        self.thread.start()

    def wait_ready(self, seconds: float = 30.0) -> str:
        """Block until /health answers; the base URL (RuntimeError if the server died or is late)."""
        import httpx

        deadline = time.monotonic() + seconds
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health").status_code == 200:
                    return self.base
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the server at {self.base} did not start")

    def stop(self, seconds: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=seconds)


def serve(lm: LanguageModel, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          limits: ServerLimits | None = None) -> None:
    """Serve until interrupted: HTTP on a thread of its own, the batch's steps on this one
    (the process's main thread, where OpenMP runs the native engine at full speed: batch.py)."""
    app = create_app(lm, model_name, limits, batch_thread=False)
    http = HTTPThread(app, host, port, log_level="info")
    batch = app.state.server.batch
    try:
        batch.run(until=lambda: not http.thread.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        http.stop()
        batch.close()
