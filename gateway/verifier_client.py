"""grpc.aio client for one or more verifiers.

Round-robin over healthy verifiers. A verifier is healthy when its health service says
SERVING and `GetInfo` answered with the gateway's own tokenizer fingerprint. A background
task re-probes every verifier each `reprobe_interval_s`, so `/health` answers from that
state: a flood of health checks costs the verifiers nothing. A verifier serving another
tokenizer is never used (its token ids would decode to other text); it is logged once.

A verifier is marked down on evidence only (specdec.rpc.replica_health): a refused or lost
connection (UNAVAILABLE, on a probe or a call), a health answer NOT_SERVING, a probe
failing otherwise. A probe that runs out of time is not evidence: a verifier answers
probes on the loop that runs its forwards, so under load probes queue behind a busy
engine. Only when probes keep timing out and nothing else came back from it (no response
on any call) for `silent_down_s` is it taken for hung. Probes go one at a time per
verifier; requests never send their own: while no verifier is healthy, a request waits
for the probe in flight (or starts the one probe that all waiting requests share).

A Generate call that fails before any token was read moves once to another healthy
verifier (gateway.generation_stream). Addresses appear in logs only: clients and
`/health` see replica names ("verifier-0").

Each `--verifier` name is resolved at start and every `resolve_interval_s`, one endpoint
per address ("verifier-0.1" in `/health`): see specdec.rpc.replica_set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import UNAVAILABLE_MESSAGE
from gateway.generation_stream import GenerationStream
from gateway.verifier_endpoint import VerifierEndpoint
from specdec.errors import UnavailableError
from specdec.rpc.grpc_server import CHANNEL_OPTIONS
from specdec.rpc.replica_health import NOT_SERVING, model_mismatch
from specdec.rpc.replica_set import ChannelOptions, ReplicaSet, Resolver, resolve_ips
from specdec.rpc.tls import GrpcTlsConfig, open_channel
from specdec.v1 import specdec_pb2, specdec_pb2_grpc

logger = logging.getLogger(__name__)

_VERIFIER_SERVICE = specdec_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name

_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    # A restarted verifier is found within a second, not after grpc's 120 s max backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
TOKENIZER_MISMATCH = "tokenizer_mismatch"
# A verifier still starting: "starting: <its VerifierInfo.startup_phase>".
STARTING = "starting"
# How long the streams still open on an address gone from DNS may run before its channel
# closes under them (a replica being replaced drains its own requests meanwhile).
RETIRED_CLOSE_GRACE_S = 300.0
# How long a verifier whose probes time out may stay silent (no probe answered, no response
# read on any call) before it is taken for hung and marked down. Busy verifiers stream
# responses all along, so this only ever fires for one that stopped answering anything.
SILENT_DOWN_S = 30.0


class VerifierClient:
    """Clients of the verifiers at `addresses` ("host:port"). Start in the serving loop."""

    def __init__(self, addresses: Sequence[str], *, probe_timeout_s: float = 2.0,
                 reprobe_interval_s: float = 1.0, tls: GrpcTlsConfig | None = None,
                 internal_token: str | None = None, resolve_interval_s: float = 10.0,
                 resolver: Resolver = resolve_ips, silent_down_s: float = SILENT_DOWN_S,
                 ) -> None:
        if not addresses:
            raise ValueError("at least one verifier address is needed")
        self.addresses = tuple(addresses)
        self._probe_timeout_s = probe_timeout_s
        self._reprobe_interval_s = reprobe_interval_s
        self._silent_down_s = silent_down_s
        self._tls = tls  # None or no --grpc-tls-ca: plain channels
        self._internal_token = internal_token  # sent on every call (specdec.rpc.internal_auth)
        self._replicas = ReplicaSet("verifier", self.addresses, open_replica=self._open_endpoint,
                                    retire_replica=self._retire, tls=tls, resolver=resolver,
                                    resolve_interval_s=resolve_interval_s)
        # Endpoints gone from DNS whose channel closes once their streams end.
        self._retired: set[VerifierEndpoint] = set()
        self._next_index = 0
        self._background: set[asyncio.Task] = set()
        # The gateway's own tokenizer; None (or a verifier reporting none): not compared.
        self._tokenizer_fingerprint: str | None = None

    def expect_tokenizer(self, fingerprint: str | None) -> None:
        """Verifiers whose GetInfo reports another tokenizer fingerprint are never used."""
        self._tokenizer_fingerprint = fingerprint or None

    @property
    def _endpoints(self) -> list[VerifierEndpoint]:
        """Every verifier, by --verifier and slot."""
        return self._replicas.replicas

    async def start(self) -> None:
        await self._replicas.start(on_added=self._probe_added)
        await self.probe_all()
        if not self.serving:
            # The usual case when a whole stack starts at once: the verifier is still
            # loading. Info, not a warning; a verifier that goes down later is warned of.
            logger.info("no verifier serving yet at %s (%s); requests get 503 until one is",
                        ", ".join(self.addresses),
                        ", ".join(e.status for e in self._endpoints) or "none resolved")
        self._spawn(self._refresh_health())

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await self._replicas.close()
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for endpoint in [*self._endpoints, *self._retired]:
            await endpoint.channel.close()
        self._retired.clear()

    def _open_endpoint(self, address: str, options: ChannelOptions) -> VerifierEndpoint:
        channel = open_channel(self._tls, address, [*_CHANNEL_OPTIONS, *options],
                               internal_token=self._internal_token)
        return VerifierEndpoint(address, channel, specdec_pb2_grpc.VerifierStub(channel))

    async def _probe_added(self, endpoints: list[VerifierEndpoint]) -> None:
        await asyncio.gather(*(self._probe(endpoint) for endpoint in endpoints))

    async def _retire(self, endpoint: VerifierEndpoint) -> None:
        """No new requests for endpoint; its channel closes once its streams have ended."""
        endpoint.health.down()
        self._retired.add(endpoint)
        self._spawn(self._close_retired(endpoint))

    async def _close_retired(self, endpoint: VerifierEndpoint) -> None:
        await endpoint.channel.close(grace=RETIRED_CLOSE_GRACE_S)
        self._retired.discard(endpoint)

    async def _refresh_health(self) -> None:
        """Re-probes every verifier periodically: /health reads this state, never probes."""
        while True:
            await asyncio.sleep(self._reprobe_interval_s)
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not end the refresh for good
                logger.exception("verifier health refresh failed")

    async def _probe(self, endpoint: VerifierEndpoint) -> bool:
        """Probes endpoint, or waits for the probe of it already in flight; returns whether
        it is up."""
        return await endpoint.health.probe(lambda: self._probe_now(endpoint))

    async def _probe_now(self, endpoint: VerifierEndpoint) -> bool:
        try:
            health = await health_pb2_grpc.HealthStub(endpoint.channel).Check(
                health_pb2.HealthCheckRequest(service=_VERIFIER_SERVICE),
                timeout=self._probe_timeout_s)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            info = await endpoint.stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(),
                                               timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                return self._probe_failed(endpoint, err)
            # A verifier without the health service: GetInfo alone decides.
            return await self._probe_info_only(endpoint)
        if not serving:
            self._mark_not_serving(endpoint, info)
            return False
        return self._mark_up(endpoint, info)

    async def _probe_info_only(self, endpoint: VerifierEndpoint) -> bool:
        try:
            info = await endpoint.stub.GetInfo(specdec_pb2.GetVerifierInfoRequest(),
                                               timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            return self._probe_failed(endpoint, err)
        return self._mark_up(endpoint, info)

    def _probe_failed(self, endpoint: VerifierEndpoint, err: grpc.aio.AioRpcError) -> bool:
        """A probe's error: one that ran out of time leaves a healthy verifier up (busy)
        unless it has been silent for silent_down_s; anything else marks it down now.
        Returns whether it is still up."""
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and endpoint.healthy:
            if not endpoint.health.timeout_is_evidence(self._silent_down_s):
                logger.debug("verifier %s is slow to answer probes (busy); still up",
                             endpoint.address)
                return True
            logger.warning("verifier %s answered nothing for %.0f s", endpoint.address,
                           endpoint.health.silent_s())
        self.mark_down(endpoint, err)
        return False

    @staticmethod
    def alive(endpoint: VerifierEndpoint) -> None:
        endpoint.health.alive()

    @staticmethod
    def _mark_not_serving(endpoint: VerifierEndpoint, info: specdec_pb2.VerifierInfo) -> None:
        """Health said NOT_SERVING: still starting (GetInfo names its phase) or draining."""
        if info.startup_phase:
            status = f"{STARTING}: {info.startup_phase}"
            if endpoint.status != status:
                logger.info("verifier %s is %s", endpoint.address, status)
            endpoint.health.down(status)
        elif endpoint.health.down(NOT_SERVING):
            logger.warning("verifier %s is not serving (shutting down)", endpoint.address)

    def _mark_up(self, endpoint: VerifierEndpoint, info: specdec_pb2.VerifierInfo) -> bool:
        problems = model_mismatch(info, vocab_size=None,
                                  tokenizer_fingerprint=self._tokenizer_fingerprint,
                                  ours="gateway")
        if problems:
            return self._mark_mismatch(endpoint, info, "; ".join(problems))
        endpoint.info = info
        if endpoint.health.up():
            logger.info("verifier %s is up: model %s, max_model_len %d, speculation %s k=%d",
                        endpoint.address, info.model_name, info.max_model_len,
                        info.speculative_method or "off", info.num_speculative_tokens)
        return True

    @staticmethod
    def _mark_mismatch(endpoint: VerifierEndpoint, info: specdec_pb2.VerifierInfo,
                       problems: str) -> bool:
        if endpoint.health.refusal_is_new(problems):
            logger.error(
                "verifier %s serves another tokenizer (model %s: %s): it gets no requests. "
                "Start the gateway with the verifier's --model.", endpoint.address,
                info.model_name, problems)
        endpoint.info = None
        endpoint.health.down(TOKENIZER_MISMATCH)
        return False

    @staticmethod
    def mark_down(endpoint: VerifierEndpoint, err: grpc.aio.AioRpcError) -> None:
        if endpoint.health.down():
            logger.warning("verifier %s is down: %s", endpoint.address, err.code().name)

    async def probe_all(self) -> bool:
        """Probes every verifier now (joining a probe already in flight); True when at least
        one is up."""
        results = await asyncio.gather(*(self._probe(e) for e in self._endpoints))
        return any(results)

    @property
    def serving(self) -> bool:
        """Whether some verifier can take requests, as last probed."""
        return any(endpoint.healthy for endpoint in self._endpoints)

    @property
    def starting(self) -> bool:
        """Whether some verifier, as last probed, is still starting."""
        return any(endpoint.status.startswith(STARTING) for endpoint in self._endpoints)

    def statuses(self) -> dict[str, str]:
        """Each verifier's replica name and its last known status (no address)."""
        return {name: endpoint.status for name, endpoint in self._replicas.named()}

    def problems(self) -> list[str]:
        """What an operator must fix, in words that name no path or address."""
        return [f"{name}: tokenizer mismatch: it serves another tokenizer than the "
                "gateway's and gets no requests" for name, endpoint in self._replicas.named()
                if endpoint.status == TOKENIZER_MISMATCH]

    @property
    def deterministic(self) -> bool:
        """Whether every verifier that answered serves deterministically (false while none
        has: nothing is known yet). One that does not makes the answers depend on which
        verifier a request lands on."""
        infos = [endpoint.info for endpoint in self._endpoints
                 if endpoint.info is not None and not endpoint.info.startup_phase]  # a starting one says nothing yet
        return bool(infos) and all(info.deterministic for info in infos)

    @property
    def cached_info(self) -> specdec_pb2.VerifierInfo | None:
        for endpoint in self._endpoints:
            if endpoint.healthy and endpoint.info is not None:
                return endpoint.info
        return next((e.info for e in self._endpoints if e.info is not None), None)

    async def get_info(self) -> specdec_pb2.VerifierInfo:
        """The served model's facts; probes when no verifier has answered yet."""
        info = self.cached_info
        if info is None and await self.probe_all():
            info = self.cached_info
        if info is None:
            raise UnavailableError(UNAVAILABLE_MESSAGE)
        return info

    def next_healthy(self, exclude: Sequence[VerifierEndpoint],
                      prefer: str | None = None) -> VerifierEndpoint | None:
        """Round-robin: the next healthy verifier not in `exclude` (`prefer`, by address,
        when it is healthy and not excluded)."""
        if prefer is not None:
            for endpoint in self._endpoints:
                if (endpoint.address == prefer and endpoint.healthy
                        and all(endpoint is not e for e in exclude)):
                    return endpoint
        count = len(self._endpoints)
        for offset in range(count):
            index = (self._next_index + offset) % count
            endpoint = self._endpoints[index]
            if endpoint.healthy and all(endpoint is not e for e in exclude):
                self._next_index = index + 1
                return endpoint
        return None

    async def generate(self, request: specdec_pb2.GenerateRequest,
                       prefer: str | None = None) -> GenerationStream:
        """Starts Generate on a healthy verifier (`prefer` first, by address, when healthy)
        and waits for its first response.

        Raises the mapped domain error (UnavailableError when none is reachable).
        """
        if not self.serving:
            await self.probe_all()  # shared with the background task and other requests
        stream = GenerationStream(self, request, prefer)
        await stream.open()
        return stream
