"""grpc.aio client for one or more verifiers.

Round-robin over healthy verifiers. A verifier is healthy when its health service says
SERVING and `GetInfo` answered with the gateway's own tokenizer fingerprint. A background
task re-probes every verifier each `reprobe_interval_s`, so `/health` answers from that
state: a flood of health checks costs the verifiers nothing. A verifier serving another
tokenizer is never used (its token ids would decode to other text); it is logged once.

A verifier is marked down on evidence only: a refused or lost connection (UNAVAILABLE, on a
probe or a call), a health answer NOT_SERVING, a probe failing otherwise. A probe that runs
out of time is not evidence: a verifier answers probes on the loop that runs its forwards,
so under load probes queue behind a busy engine. Only when probes keep timing out and
nothing else came back from it (no response on any call) for `silent_down_s` is it taken
for hung. Probes go one at a time per verifier; requests never send their own: while no
verifier is healthy, a request waits for the probe in flight (or starts the one probe that
all waiting requests share).

A Generate call that fails before any token was read moves once to another healthy
verifier (gateway.generation_stream). Addresses appear in logs only: clients and
`/health` see replica names ("verifier-0").

Each `--verifier` name is resolved at start and every `resolve_interval_s`, one endpoint
per address ("verifier-0.1" in `/health`): see gateway.verifier_targets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import UNAVAILABLE_MESSAGE
from gateway.generation_stream import GenerationStream
from gateway.verifier_targets import (
    Resolver,
    VerifierEndpoint,
    VerifierTarget,
    resolve_ips,
)
from specdec.errors import UnavailableError
from specdec.rpc.grpc_server import CHANNEL_OPTIONS
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
        self._resolve_interval_s = resolve_interval_s
        self._resolver = resolver
        self._targets: list[VerifierTarget] = []
        # Endpoints gone from DNS whose channel closes once their streams end.
        self._retired: set[VerifierEndpoint] = set()
        self._tls = tls  # None or no --grpc-tls-ca: plain channels
        self._internal_token = internal_token  # sent on every call (specdec.rpc.internal_auth)
        self._endpoints: list[VerifierEndpoint] = []
        self._next_index = 0
        self._background: set[asyncio.Task] = set()
        # The gateway's own tokenizer; None (or a verifier reporting none): not compared.
        self._tokenizer_fingerprint: str | None = None

    def expect_tokenizer(self, fingerprint: str | None) -> None:
        """Verifiers whose GetInfo reports another tokenizer fingerprint are never used."""
        self._tokenizer_fingerprint = fingerprint or None

    async def start(self) -> None:
        self._endpoints = []
        self._targets = [VerifierTarget.parse(index, address)
                         for index, address in enumerate(self.addresses)]
        await self._resolve()
        await self.probe_all()
        if not any(e.healthy for e in self._endpoints):
            # The usual case when a whole stack starts at once: the verifier is still
            # loading. Info, not a warning; a verifier that goes down later is warned of.
            logger.info("no verifier serving yet at %s (%s); requests get 503 until one is",
                        ", ".join(self.addresses),
                        ", ".join(e.status for e in self._endpoints) or "none resolved")
        self._spawn(self._refresh_health())
        if any(target.resolvable for target in self._targets):
            self._spawn(self._resolve_periodically())

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for endpoint in [*self._endpoints, *self._retired]:
            await endpoint.channel.close()
        self._retired.clear()

    async def _resolve_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._resolve_interval_s)
            try:
                added = await self._resolve()
                await asyncio.gather(*(self._probe(endpoint) for endpoint in added))
            except Exception:  # a bug here must not end the re-resolution for good
                logger.exception("resolving the verifier addresses failed")

    async def _resolve(self) -> list[VerifierEndpoint]:
        """Reconciles the endpoints with what each --verifier resolves to now; returns the
        endpoints added (not probed yet)."""
        added: list[VerifierEndpoint] = []
        for target in self._targets:
            current = [e for e in self._endpoints if e.target == target.index]
            wanted = await target.wanted(self._resolver, [e.address for e in current])
            for endpoint in current:
                if endpoint.address not in wanted:
                    self._retire(target, endpoint)
            have = {endpoint.address for endpoint in current}
            for address in wanted:
                if address not in have:
                    added.append(self._open_endpoint(target, address))
        # /health lists them by name; a name follows its target's endpoint count.
        self._endpoints.sort(key=lambda e: (e.target, self._targets[e.target].slots[e.address]))
        for endpoint in self._endpoints:
            endpoint.name = self._targets[endpoint.target].name(endpoint.address)
        return added

    def _open_endpoint(self, target: VerifierTarget, address: str) -> VerifierEndpoint:
        options = [*_CHANNEL_OPTIONS, *target.channel_options(address, self._tls)]
        channel = open_channel(self._tls, address, options, internal_token=self._internal_token)
        target.add(address)
        endpoint = VerifierEndpoint(address, channel, specdec_pb2_grpc.VerifierStub(channel),
                                    target=target.index)
        self._endpoints.append(endpoint)
        if address != target.address:
            logger.info("verifier %s: adding replica %s", target.address, address)
        return endpoint

    def _retire(self, target: VerifierTarget, endpoint: VerifierEndpoint) -> None:
        """No new requests for endpoint; its channel closes once its streams have ended."""
        logger.info("verifier %s: %s is no longer one of its addresses", target.address,
                    endpoint.address)
        self._endpoints.remove(endpoint)
        del target.slots[endpoint.address]
        endpoint.healthy = False
        endpoint.status = "unreachable"
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
        if endpoint.probe_lock.locked():
            async with endpoint.probe_lock:
                return endpoint.healthy
        async with endpoint.probe_lock:
            return await self._probe_now(endpoint)

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
            if info.startup_phase:
                status = f"{STARTING}: {info.startup_phase}"
                if endpoint.status != status:
                    logger.info("verifier %s is %s", endpoint.address, status)
            else:
                status = "not_serving"
                if endpoint.healthy:
                    logger.warning("verifier %s is not serving (shutting down)", endpoint.address)
            endpoint.healthy = False
            endpoint.status = status
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
            silent_s = time.monotonic() - endpoint.last_alive_s
            if silent_s < self._silent_down_s:
                logger.debug("verifier %s is slow to answer probes (busy); still up",
                            endpoint.address)
                return True
            logger.warning("verifier %s answered nothing for %.0f s", endpoint.address,
                           silent_s)
        self.mark_down(endpoint, err)
        return False

    @staticmethod
    def alive(endpoint: VerifierEndpoint) -> None:
        endpoint.last_alive_s = time.monotonic()

    def _mark_up(self, endpoint: VerifierEndpoint, info: specdec_pb2.VerifierInfo) -> bool:
        expected = self._tokenizer_fingerprint
        if expected and info.tokenizer_fingerprint and info.tokenizer_fingerprint != expected:
            return self._mark_mismatch(endpoint, info, expected)
        if not endpoint.healthy:
            logger.info("verifier %s is up: model %s, max_model_len %d, speculation %s k=%d",
                        endpoint.address, info.model_name, info.max_model_len,
                        info.speculative_method or "off", info.num_speculative_tokens)
        endpoint.info = info
        endpoint.healthy = True
        endpoint.status = "serving"
        self.alive(endpoint)
        return True

    def _mark_mismatch(self, endpoint: VerifierEndpoint, info: specdec_pb2.VerifierInfo,
                       expected: str) -> bool:
        if endpoint.mismatch_logged != info.tokenizer_fingerprint:
            endpoint.mismatch_logged = info.tokenizer_fingerprint
            logger.error(
                "verifier %s serves another tokenizer (model %s, tokenizer fingerprint %s; "
                "the gateway's is %s): it gets no requests. Start the gateway with the "
                "verifier's --model.", endpoint.address, info.model_name,
                info.tokenizer_fingerprint, expected)
        endpoint.info = None
        endpoint.healthy = False
        endpoint.status = TOKENIZER_MISMATCH
        return False

    def mark_down(self, endpoint: VerifierEndpoint, err: grpc.aio.AioRpcError) -> None:
        if endpoint.healthy:
            logger.warning("verifier %s is down: %s", endpoint.address, err.code().name)
        endpoint.healthy = False
        endpoint.status = "unreachable"

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
        return {endpoint.name: endpoint.status for endpoint in self._endpoints}

    def problems(self) -> list[str]:
        """What an operator must fix, in words that name no path or address."""
        return [f"{endpoint.name}: tokenizer mismatch: it serves another tokenizer than the "
                "gateway's and gets no requests" for endpoint in self._endpoints
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
