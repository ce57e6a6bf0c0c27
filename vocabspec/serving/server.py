"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events), /v1/models and /health, on FastAPI + uvicorn.

Requests decode together (batch.py): up to `max_batch` at once, each in a slot with its own KV
cache of `window` tokens, joining and leaving between steps; each answer is exactly the one it
gets served alone (on torch's kernels with --allow-inexact, plain-decoding requests step as rows
of one forward, each answer its own up to rounding: torch_backend.py). More requests wait in
a bounded queue (503 when it is full). A streaming client that disconnects cancels its
generation at the next step, freeing its slot. Requests are bounded in size, in max_tokens and
in generation time.

No request can stop the server. Every field is bounded where it is parsed (integers and floats
to finite ranges, seeds to what the generator takes, top_k to the vocabulary), a body nested
past MAX_JSON_DEPTH or holding text that is not Unicode is refused, and every bad request gets a
4xx with an OpenAI error body (errors.py). A request that fails in the batch (its drafter
raises, it cannot start) ends alone with a 500 naming the failure; the requests beside it go
on. Should the decoding loop fail anyway, every request waiting gets an error and `serve` exits
non-zero at once. Before any route reads a request, guards.py checks who sent it: a Host naming
the loopback (when reached on it), a web page the operator allows, the API key where one is set,
a JSON body, read only up to its cap. /docs and /openapi.json are off unless asked for.

Every OpenAI field is either honoured or refused with a 400 naming it, never ignored:
logprobs / top_logprobs come from the target's own distribution of each emitted token (the
rows verification read, so speculation does not change them); a message's `name` goes to the
chat template; non-zero penalties, a logit_bias, tools (and tool turns), response formats other
than text, n or best_of above 1, echo and suffix are refused, as is any field this server does
not know. A completion's prompt parses special tokens' texts as llama.cpp's completion does
(`parse_special: false` keeps them text); a chat message's content is always text, and only its
template's markup becomes special tokens.
"""


import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .api import LanguageModel
from .errors import BadRequest, error_body
from ..decoding.batch import BatchLimits, Busy, Stopped
from ..decoding.generate import GenerationResult, TokenLogprob
from ..speculation.sampling import MIN_TEMPERATURE, SEED_MAX, SEED_MIN


@dataclass
class ServerLimits:
    max_request_bytes: int = 1_000_000  # a body past this gets 413 as it arrives (guards.py)
    max_tokens_cap: int = 2048          # largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_seconds: float = 300.0          # generation time per request
    max_queue: int = 64                 # requests waiting or running
    max_batch: int = 8                  # requests decoding at once
    window: int = 4096                  # KV cache tokens per decoding request (prompt + answer)
    tree_rows: int | None = None        # rows a step verifies over all requests (None: the cost rule, batch.py)
    # Who may use it (guards.py): the key every /v1/ route wants (None: none), the web pages
    # allowed to call it (CORS; "*": any), and whether /docs and /openapi.json are served.
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    docs: bool = False


def _shown(value) -> str:
    """A number as an error message quotes it: a 400-digit integer by its size."""
    if isinstance(value, int) and value.bit_length() > 100:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


def _number(body: dict, name: str, default, kind, low, high, low_open=False):
    """body[name] (or `default` when absent or null) as `kind`, within [low, high] (low_open:
    (low, high]); a 400 naming the field otherwise. Both bounds are finite, and checked before
    any conversion: Python compares an int of any size with a float exactly, while float()
    of a 400-digit integer overflows."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and isinstance(value, float) and not value.is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}", name)
    if value != value or (value <= low if low_open else value < low) or value > high:
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise BadRequest(f"'{name}' must be in {bounds}, got {_shown(value)}", name)
    return kind(value)


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
MAX_N = 128                      # OpenAI's bound for n (this server answers n=1 only)
MAX_BEST_OF = 20                 # and for best_of


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
    if _number(body, "best_of", 1, int, 1, MAX_BEST_OF) != 1:
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


MAX_NAME_CHARS = 64              # OpenAI's bound for a message's `name`
TOOL_FIELDS = {"tool_calls", "tool_call_id", "function_call"}


def chat_message(message, index: int) -> dict:
    """The message as the chat template takes it: role, text (content is a string or a list of
    text parts) and, where the client names its author, `name` (templates that have a use for
    one read it; the rest ignore it)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with role and content", "messages")
    role = message.get("role")
    if role in ("tool", "function") or TOOL_FIELDS & set(message):
        raise BadRequest(f"{where}: tool calling is not supported by this server (its requests "
                         "refuse 'tools'), so there are no tool calls or tool results to send back",
                         "messages")
    for key in message:
        if key not in ("role", "content", "name"):
            raise BadRequest(f"{where}: unsupported field {key!r}", "messages")
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
    out = {"role": "system" if role == "developer" else role, "content": content}
    if message.get("name") is not None:        # null: no name, as some clients send it
        name = message["name"]
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
            raise BadRequest(f"{where}: name must be a string of 1 to {MAX_NAME_CHARS} characters",
                             "messages")
        out["name"] = name
    return out


MAX_JSON_DEPTH = 64              # an OpenAI request nests a few levels; past this, a 400


def refuse_unreadable(body) -> None:
    """A 400 for a body nested past MAX_JSON_DEPTH, or naming the first field whose text is not
    Unicode: JSON's escapes can spell a lone surrogate ("\\ud800"), which no UTF-8 text, and no
    tokenizer, holds. One walk, without recursion (its depth is the client's to choose)."""
    stack = [(body, 0, None)]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the request body nests more than {MAX_JSON_DEPTH} levels deep", field)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest(f"'{field}' holds text that is not valid Unicode (a lone surrogate, "
                                 "\\ud800-\\udfff)", field) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(key, depth + 1, field or key), (item, depth + 1, field or key)]
        elif isinstance(value, list):
            stack += [(item, depth + 1, field) for item in value]


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
        """The request's prompt ids and generation parameters; a BadRequest naming the field at
        fault. Every number is bounded here, before anything is built from it."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        refuse_unreadable(body)
        refuse_unsupported(body, chat)
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise BadRequest(f"unknown model {model!r}; this server serves {self.model_name!r}",
                             "model", status=404)
        limits = self.limits
        max_tokens = _number(body, "max_tokens", limits.default_max_tokens, int, 1, limits.max_tokens_cap)
        if chat and "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", max_tokens, int, 1, limits.max_tokens_cap)
        temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise BadRequest(f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE}, 2.0], "
                             f"got {temperature}", "temperature")
        params = dict(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=_number(body, "top_p", 1.0, float, 0.0, 1.0, low_open=True),
            top_k=_number(body, "top_k", 0, int, 0, self.lm.engine.model.args.vocab_size),
            seed=_number(body, "seed", None, int, SEED_MIN, SEED_MAX),
            logprobs=requested_logprobs(body, chat),
        )
        if _number(body, "n", 1, int, 1, MAX_N) != 1:
            raise BadRequest("only n=1 is supported", "n")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                                 or not all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        params["stop"] = tuple(stop or ())
        ids = self.prompt_ids(body, chat)
        try:
            config = self.lm._config(**params)
            self.batch.check(ids, config)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt" if "prompt" in str(exc) else None) from exc
        return ids, params

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        """The prompt's token ids: the messages through the model's chat template (the tokenizer
        takes the messages, so it alone decides which text becomes special tokens), or the
        prompt's text."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects",
                                 "messages")
            messages = [chat_message(m, i) for i, m in enumerate(messages)]
            if not any(message["content"].strip() for message in messages):
                raise BadRequest("the messages are empty", "messages")
            if not self.lm.tokenizer.chat_template:
                raise BadRequest(f"{self.model_name} is a base model without a chat template: "
                                 "use /v1/completions", "messages")
            field, encode = "messages", lambda: self.lm.tokenizer.encode_chat(messages)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise BadRequest("'prompt' must be a string", "prompt")
            if not prompt.strip():
                raise BadRequest("the prompt is empty", "prompt")
            parse_special = body.get("parse_special") is not False
            field, encode = "prompt", lambda: self.lm.tokenizer.encode(prompt, parse_special=parse_special)
        try:
            return encode()
        except Exception as exc:    # the client's text: the template refused it (raise_exception), or the tokenizer
            raise BadRequest(f"the {field} cannot be tokenized: {exc}", field) from exc

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
        except (Busy, Stopped) as exc:
            raise BadRequest(str(exc), status=503) from exc
        return request.wait()


def failure(exc: Exception) -> BadRequest:
    """What a request whose generation raised is told: a refusal as it stands; 503 where the
    batch stopped under it; else a 500 naming the failure (its drafter's, say)."""
    if isinstance(exc, BadRequest):
        return exc
    if isinstance(exc, Stopped):
        return BadRequest(str(exc), status=503)
    return BadRequest(f"generation failed: {exc}", status=500)


def refuse_constant(name: str):
    """json.loads' hook for NaN and Infinity, which Python reads and JSON has no such thing as."""
    raise ValueError(f"{name} is not a JSON number")


def guard(app, limits: ServerLimits) -> None:
    """The checks before every route (guards.py), CORS for the origins allowed, and OpenAI error
    bodies for what FastAPI answers itself (an unknown route, a wrong method, a failure)."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from .guards import Guards

    app.add_middleware(Guards, max_body_bytes=limits.max_request_bytes, api_key=limits.api_key,
                       allowed_origins=tuple(limits.allowed_origins))
    if limits.allowed_origins:       # added last, so outermost: it answers the preflights
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"])

    async def http_error(request, exc: HTTPException):
        return JSONResponse(error_body(BadRequest(str(exc.detail), status=exc.status_code)),
                            status_code=exc.status_code, headers=exc.headers)

    async def server_error(request, exc: Exception):
        return JSONResponse(error_body(BadRequest(f"internal error: {type(exc).__name__}", status=500)),
                            status_code=500)

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)


def create_app(lm: LanguageModel, model_name: str, limits: ServerLimits | None = None,
               batch_thread: bool = True):
    """The FastAPI app. `batch_thread`: the batch steps on a thread of its own; else whoever
    serves the app steps it (`app.state.server.batch.run()`, as `serve` does on the main thread)."""
    from fastapi import FastAPI

    limits = limits or ServerLimits()
    docs = dict(docs_url="/docs", redoc_url=None, openapi_url="/openapi.json") if limits.docs else \
        dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="vocabspec", version="0.1", **docs)
    app.state.server = Server(lm, model_name, limits, batch_thread)
    # Endpoints find the server through the request, never in a closure: FastAPI caches what
    # it learns of each endpoint function for the life of the process, and a closure would keep
    # the model alive there after the app is gone.
    guard(app, limits)
    add_routes(app)
    return app


def add_routes(app) -> None:
    """/health, /v1/models, /v1/completions and /v1/chat/completions."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.get("/health")
    async def health(request: Request):
        server = request.app.state.server
        died = server.batch.died
        state = {"status": "ok" if died is None else "failed", "model": server.model_name,
                 "waiting": server.waiting, **server.counts}
        if died is not None:        # the decoding loop failed: nothing more will be answered
            return JSONResponse({**state, "error": repr(died)}, status_code=503)
        return state

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": request.app.state.server.model_name, "object": "model",
                                            "created": 0, "owned_by": "vocabspec"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)


def error_response(exc: BadRequest):
    """A refusal as its JSON response: the OpenAI error body, with the status it names."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(exc), status_code=exc.status)


async def read_json(request):
    """The request's body as JSON: UTF-8, at most MAX_JSON_DEPTH levels deep, with no NaN or
    Infinity; a BadRequest saying which it is not."""
    try:
        text = (await request.body()).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8")
    try:
        return json.loads(text, parse_constant=refuse_constant)
    except RecursionError:
        raise BadRequest(f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})")


async def complete(request, chat: bool):
    """A /v1/completions (chat: /v1/chat/completions) request: parsed and admitted, then
    answered whole or streamed as server-sent events."""
    server = request.app.state.server
    try:
        body = await read_json(request)
        ids, params = server.parse(body, chat)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", "stream")
        server.admit()
    except BadRequest as exc:
        return error_response(exc)
    reply = Reply(server, chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()),
                  params["logprobs"] is not None)
    cancel = threading.Event()
    if not stream:
        return await answer_whole(reply, ids, params, cancel)
    return answer_streamed(reply, ids, params, cancel)


@dataclass(frozen=True)
class Reply:
    """What every body of one request's answer names: the server, the kind of request, its id
    and creation time, and whether it asked for logprobs."""
    server: Server
    chat: bool
    rid: str
    created: int
    logprobs: bool

    @staticmethod
    def usage(result: GenerationResult) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
                "total_tokens": result.prompt_tokens + result.new_tokens,
                "speculative": {"mean_accept_len": round(result.mean_accept_len, 3),
                                "steps": len(result.steps),
                                "tokens_per_s": round(result.tokens_per_s, 2)}}

    @staticmethod
    def finish_reason(result: GenerationResult) -> str:
        return "length" if result.stop_reason in ("length", "time") else "stop"

    def logprobs_body(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        """OpenAI's logprobs object of `entries` (None where the request asked for none): chat's
        {"content": [...]}, or the completions' lists (text_offset counts characters from
        `offset`, where these tokens' text starts)."""
        if not self.logprobs:
            return None

        def text(token: int) -> str:
            return self.server.lm.tokenizer.decode([token], skip_special_tokens=False)

        if self.chat:
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

    def body(self, text: str | None, result=None, delta=None, logprobs: dict | None = None) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        if delta is not None:
            kind += ".chunk" if self.chat else ""
        choice: dict = {"index": 0, "finish_reason": self.finish_reason(result) if result else None}
        if self.chat:
            if delta is not None:
                choice["delta"] = delta
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text if text is not None else ""
        choice["logprobs"] = logprobs
        out = {"id": self.rid, "object": kind, "created": self.created, "model": self.server.model_name,
               "choices": [choice]}
        if result is not None:
            out["usage"] = self.usage(result)
        return out


async def answer_whole(reply: Reply, ids, params, cancel):
    """The answer as one body, once it is done."""
    server = reply.server
    result = None
    try:
        result = await asyncio.get_running_loop().run_in_executor(server.worker, server.run, ids, params, cancel)
    except Exception as exc:  # keep serving whatever one generation does
        return error_response(failure(exc))
    finally:
        server.release(result)
    return reply.body(result.text, result, logprobs=reply.logprobs_body(result.logprobs))


def answer_streamed(reply: Reply, ids, params, cancel):
    """The answer as server-sent events: each piece as it is decoded, then the final chunk."""
    from fastapi.responses import StreamingResponse

    server = reply.server
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_piece(piece: str, entries: list[TokenLogprob]):
        loop.call_soon_threadsafe(queue.put_nowait, ("piece", (piece, entries)))

    def work():
        result = None
        try:
            result = server.run(ids, params, cancel, on_piece)
            loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
        except Exception as exc:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", failure(exc)))
        finally:
            server.release(result)

    future = loop.run_in_executor(server.worker, work)
    return StreamingResponse(events(reply, queue, cancel, future), media_type="text/event-stream")


async def events(reply: Reply, queue: asyncio.Queue, cancel: threading.Event, future):
    """The events of a streamed answer from what its generation puts on `queue`; a client that
    goes away (the generator closed) cancels the generation."""
    streamed = ""        # text sent so far (text_offset of a completions chunk's tokens)
    counted = 0          # logprob entries sent so far
    try:
        if reply.chat:
            first = reply.body(None, delta={"role": "assistant", "content": ""})
            yield f"data: {json.dumps(first)}\n\n"
        while True:
            kind, value = await queue.get()
            if kind == "piece":
                piece, entries = value
                chunk = reply.body(piece, delta={"content": piece} if reply.chat else {},
                                   logprobs=reply.logprobs_body(entries, offset=len(streamed)))
                streamed += piece
                counted += len(entries)
                yield f"data: {json.dumps(chunk)}\n\n"
            elif kind == "done":
                final = reply.body("", value, delta={},
                                   logprobs=reply.logprobs_body(value.logprobs[counted:], offset=len(streamed)))
                yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                yield f"data: {json.dumps(error_body(value))}\n\n"
                return
    finally:
        cancel.set()   # a client that went away stops its generation at the next step
        await asyncio.shield(future)


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


# How long `serve` gives its HTTP thread, once stopping, to answer the requests in flight
# (each already has its answer or its error: the batch has stopped).
STOP_SECONDS = 10.0


class ServerFailed(RuntimeError):
    """`serve` stopped on its own: its decoding loop failed, or its HTTP server did."""


def serve(lm: LanguageModel, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          limits: ServerLimits | None = None) -> None:
    """Serve until interrupted: HTTP on a thread of its own, the batch's steps on this one
    (the process's main thread, where OpenMP runs the native engine at full speed: batch.py).
    Should the loop fail, every request it held has its error (BatchEngine.run); HTTP answers
    them and stops, and this raises ServerFailed at once (the CLI exits 1, for a supervisor to
    restart it), as it does when the HTTP server stops on its own (its port taken, say)."""
    app = create_app(lm, model_name, limits, batch_thread=False)
    http = HTTPThread(app, host, port, log_level="info")
    batch = app.state.server.batch
    try:
        batch.run(until=lambda: not http.thread.is_alive())
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        raise ServerFailed(f"the decoding loop failed: {exc!r}") from exc
    finally:
        stopped_itself = not http.thread.is_alive() and not http.server.should_exit
        http.stop(STOP_SECONDS)
        batch.close()
    if stopped_itself:
        raise ServerFailed(f"the HTTP server on {host}:{port} stopped (its log above says why)")
