"""Test doubles for the gateway: a tiny tokenizer, a fake verifier on a real grpc.aio
server, and a live uvicorn gateway in a background thread.

The fake verifier answers every Generate with a fixed reply (the tokens of REPLY_TEXT,
then EOS; or what its `reply_for` hook scripts for that request), a few tokens per
response like accepted drafts, and records the requests it saw and the calls that were
cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpc
import openai
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway import GatewayConfig, VerifierClient, create_app
from specdec.rpc.grpc_status import PARAM_METADATA_KEY
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

# "é", "ï", "—" and "😀" never occur in the training text, so they stay split into bytes.
REPLY_TEXT = "Hello world! The café is naïve — 😀 fine. Hello again, world."
MAX_MODEL_LEN = 256
NUM_SPECULATIVE_TOKENS = 3
SERVED_MODEL = "tiny-model"
_CORPUS = [
    "Hello world! Hello again, world. The cafe is naive and fine.",
    "system user assistant You are a helpful assistant. What is the answer?",
    "the quick brown fox jumps over the lazy dog 0123456789",
] * 20
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in milliseconds on a fixed text (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MAX_NUM_SEQS = 8


def fake_logprob(token_id: int, num_top: int) -> specdec_pb2.TokenLogprob:
    """A made-up but well-formed entry: the token first in its top list, then its
    neighbours, log-probabilities descending."""
    logprob = -0.25 - (token_id % 5) / 10
    top_ids = [token_id] + [(token_id + offset) % 400 for offset in range(1, num_top)]
    return specdec_pb2.TokenLogprob(logprob=logprob, top_token_ids=top_ids[:num_top],
                                    top_logprobs=[logprob - i for i in range(num_top)])


class FakeVerifier(specdec_pb2_grpc.VerifierServicer):
    """Replies with `reply_token_ids` + EOS (cycling when ignore_eos) up to max_tokens."""

    # Tokens per response, cycled: multi-byte characters end up split across responses.
    STEP_SIZES = (1, 3, 2, 4)

    def __init__(self, reply_token_ids: list[int], eos_token_id: int) -> None:
        self.reply_token_ids = list(reply_token_ids)
        self.eos_token_id = eos_token_id
        self.delay_s = 0.0
        self.info_delay_s = 0.0  # GetInfo waits this long: a verifier busy with a forward
        self.abort_code: grpc.StatusCode | None = None
        self.abort_param: str | None = None  # the field the abort names (as abort_with does)
        self.requests: list[specdec_pb2.GenerateRequest] = []
        self.cancelled_ids: list[str] = []
        self.completed_ids: list[str] = []
        # When set and it returns token ids, a request gets those instead of the fixed reply:
        # a test scripts an answer per request (one that satisfies the request's grammar, a
        # Hermes tool call); the fake enforces no grammar itself.
        self.reply_for: Callable[[specdec_pb2.GenerateRequest], list[int] | None] | None = None

    async def GetInfo(self, request: Any, context: Any) -> specdec_pb2.VerifierInfo:
        await asyncio.sleep(self.info_delay_s)
        return specdec_pb2.VerifierInfo(
            model_name="tiny-model", max_model_len=MAX_MODEL_LEN, vocab_size=400,
            eos_token_ids=[self.eos_token_id], speculative_method="ngram",
            num_speculative_tokens=NUM_SPECULATIVE_TOKENS, max_num_seqs=MAX_NUM_SEQS, deterministic=True)

    async def Generate(self, request: specdec_pb2.GenerateRequest, context: Any):
        self.requests.append(request)
        if self.abort_code is not None:
            metadata = ((PARAM_METADATA_KEY, self.abort_param),) if self.abort_param else ()
            await context.abort(self.abort_code, "fake verifier failure",
                                trailing_metadata=metadata)
        scripted = self.reply_for(request) if self.reply_for is not None else None
        reply = self.reply_token_ids if scripted is None else list(scripted)
        script = reply + ([] if request.sampling.ignore_eos else [self.eos_token_id])
        max_tokens = request.sampling.max_tokens
        stop_ids = set(request.sampling.stop_token_ids)
        stats = specdec_pb2.SpeculationStats(
            accepted_per_position=[0] * NUM_SPECULATIVE_TOKENS)
        emitted = 0
        step = 0
        try:
            while True:
                size = self.STEP_SIZES[step % len(self.STEP_SIZES)]
                token_ids = []
                finish = specdec_pb2.FINISH_REASON_UNSPECIFIED
                while len(token_ids) < size:
                    token_id = script[emitted % len(script)]
                    token_ids.append(token_id)
                    emitted += 1
                    if token_id == self.eos_token_id or token_id in stop_ids:
                        finish = specdec_pb2.FINISH_REASON_STOP
                        break
                    if emitted >= max_tokens:
                        finish = specdec_pb2.FINISH_REASON_LENGTH
                        break
                # As if the first len-1 tokens were accepted drafts of a k=3 proposal.
                stats.num_drafts += 1
                stats.num_draft_tokens += NUM_SPECULATIVE_TOKENS
                stats.num_accepted_tokens += len(token_ids) - 1
                for position in range(len(token_ids) - 1):
                    stats.accepted_per_position[position] += 1
                response = specdec_pb2.GenerateResponse(
                    token_ids=token_ids, finish_reason=finish, speculation=stats)
                if request.sampling.HasField("logprobs"):
                    response.logprobs.extend(fake_logprob(token_id, request.sampling.logprobs)
                                             for token_id in token_ids)
                if finish != specdec_pb2.FINISH_REASON_UNSPECIFIED:
                    response.usage.prompt_tokens = len(request.prompt_token_ids)
                    response.usage.completion_tokens = emitted
                    yield response
                    self.completed_ids.append(request.request_id)
                    return
                yield response
                step += 1
                await asyncio.sleep(self.delay_s)
        except (asyncio.CancelledError, GeneratorExit):
            # A cancel that finds the handler waiting on a write (the client stopped reading
            # and flow control holds the stream) closes the generator instead of throwing
            # CancelledError into it.
            self.cancelled_ids.append(request.request_id)
            raise

    def wait_cancelled(self, request_id: str, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if request_id in self.cancelled_ids:
                return True
            time.sleep(0.01)
        return False


class BackgroundLoop:
    """An asyncio loop in a daemon thread; `run` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class FakeVerifierServer:
    """A real grpc.aio server for FakeVerifier; can be stopped and restarted on its port."""

    def __init__(self, servicer: FakeVerifier, port: int | None = None) -> None:
        self.servicer = servicer
        self.port = port or free_port()
        self._loop = BackgroundLoop()
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        async def start() -> grpc.aio.Server:
            server = grpc.aio.server()
            specdec_pb2_grpc.add_VerifierServicer_to_server(self.servicer, server)
            server.add_insecure_port(self.address)
            await server.start()
            return server

        self._server = self._loop.run(start())

    def stop(self) -> None:
        if self._server is not None:
            self._loop.run(self._server.stop(grace=None))
            self._server = None

    def close(self) -> None:
        self.stop()
        self._loop.close()


class LiveGateway:
    """The gateway app served by uvicorn on a free port in a background thread."""

    def __init__(self, config: GatewayConfig, tokenizer: Any,
                 verifier_client: VerifierClient | None = None) -> None:
        self.app = create_app(config, tokenizer, verifier_client)
        self.port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning",
            timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def gateway_config(*addresses: str, **overrides: Any) -> GatewayConfig:
    return GatewayConfig(model="/fake/tiny-model", served_model_name=SERVED_MODEL,
                         verifier_addresses=addresses, **overrides)


@contextlib.contextmanager
def live_gateway(tokenizer: Any, servicer: FakeVerifier | None = None,
                 **config: Any) -> Iterator[tuple[LiveGateway, FakeVerifier]]:
    """A fake verifier (`servicer`; by default one replying REPLY_TEXT) on a real gRPC server,
    and a live gateway in front of it configured by gateway_config(**config). Both are
    stopped on exit."""
    if servicer is None:
        servicer = FakeVerifier(tokenizer.encode(REPLY_TEXT, add_special_tokens=False),
                                tokenizer.eos_token_id)
    server = FakeVerifierServer(servicer)
    server.start()
    try:
        gateway = LiveGateway(gateway_config(server.address, **config), tokenizer)
        gateway.start()
        try:
            yield gateway, servicer
        finally:
            gateway.stop()
    finally:
        server.close()


def openai_client(gateway: LiveGateway, **options: Any) -> openai.OpenAI:
    """The official client on `gateway`, with no retries to hide a failure."""
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0,
                         **options)
