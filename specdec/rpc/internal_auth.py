"""The services authenticate each other: one shared token on every internal gRPC call.

The gateway sends it to the verifiers, the verifier to its drafters, as the metadata
`x-specdec-internal-token`. The verifier and every drafter check it (in constant time)
on every method except the standard health check, which orchestrators probe without
credentials; a missing or wrong token is UNAUTHENTICATED.

The token never comes from argv (`ps` shows argv to every local user). Where it comes
from, first match wins:

1. `--internal-token-file PATH`
2. `$SPECDEC_INTERNAL_TOKEN_FILE` (a path; e.g. a compose secret, /run/secrets/...)
3. `$SPECDEC_INTERNAL_TOKEN` (the value itself)

Surrounding whitespace is stripped; a token shorter than MIN_TOKEN_CHARS or with
characters gRPC metadata cannot carry is refused at start-up. `python -m specdec serve`
makes a random one for its children. A server that binds a non-loopback address refuses
to start without a token unless told `--insecure-no-internal-token`.

mTLS (specdec.rpc.tls) composes with it: TLS authenticates the hosts and keeps the token
secret on the wire, the token authenticates the caller as one of ours.

The gateway's API key is read here too (`load_api_key`), so that it can also come from
the environment or a file rather than argv.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

METADATA_KEY = "x-specdec-internal-token"
TOKEN_ENV = "SPECDEC_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "SPECDEC_INTERNAL_TOKEN_FILE"
API_KEY_ENV = "SPECDEC_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's name for the same thing
MIN_TOKEN_CHARS = 16
# Orchestrators (compose, Kubernetes) probe health without credentials.
_UNCHECKED_PREFIX = "/grpc.health.v1.Health/"
# Names the metadata key, never a value.
REFUSAL_DETAILS = f"missing or wrong internal token (gRPC metadata {METADATA_KEY})"
_REFUSAL_LOG_INTERVAL_S = 10.0


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe), as the launcher gives its children."""
    return secrets.token_urlsafe(32)


def load_internal_token(file_flag: str | None) -> str | None:
    """The internal token from --internal-token-file, $SPECDEC_INTERNAL_TOKEN_FILE or
    $SPECDEC_INTERNAL_TOKEN (first match wins); None when none is set.

    A set but empty, short or non-ASCII token is a ConfigError naming where it came from.
    """
    if file_flag is not None:
        return _checked_token(read_secret_file(file_flag, "--internal-token-file",
                                               "internal_token_file"),
                              f"--internal-token-file {file_flag!r}", "internal_token_file")
    path = os.environ.get(TOKEN_FILE_ENV)
    if path is not None:
        source = f"${TOKEN_FILE_ENV} ({path!r})"
        return _checked_token(read_secret_file(path, f"${TOKEN_FILE_ENV}", "internal_token_file"),
                              source, "internal_token_file")
    value = os.environ.get(TOKEN_ENV)
    if value is not None:
        return _checked_token(value, f"${TOKEN_ENV}", "internal_token")
    return None


def _checked_token(value: str, source: str, param: str) -> str:
    token = value.strip()
    if len(token) < MIN_TOKEN_CHARS:
        # The length only: never echo (part of) a secret.
        raise ConfigError(f"the internal token from {source} has {len(token)} characters; it "
                          f"needs at least {MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; "
                          "print(secrets.token_urlsafe(32))'`)", param=param)
    if not all(" " <= char <= "~" for char in token):
        raise ConfigError(f"the internal token from {source} must be printable ASCII (gRPC "
                          "metadata carries nothing else)", param=param)
    return token


def read_secret_file(path: str, flag: str, param: str) -> str:
    """The text of a secret file, stripped; ConfigError naming `flag` when unreadable."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path!r}: no such file", param=param)
    try:
        return file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot read it ({exc.strerror})",
                          param=param) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path!r} is not UTF-8 text", param=param) from None


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """--api-key and --api-key-file (the gateway's, and the launcher's for its gateway)."""
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*. Kept for vLLM "
                             "parity, but argv is visible to every local user (ps): prefer "
                             "--api-key-file or the environment. First match wins: --api-key, "
                             "--api-key-file, $SPECDEC_API_KEY, $VLLM_API_KEY; none: no key. "
                             "The launcher gives it to its gateway in the environment, never "
                             "in its argv")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="file holding the API key (see --api-key)")


def load_api_key(flag_value: str | None, file_flag: str | None) -> str | None:
    """The gateway's API key: --api-key, else --api-key-file, else $SPECDEC_API_KEY, else
    $VLLM_API_KEY; None (no key required) when none is set."""
    if flag_value is not None and file_flag is not None:
        raise ConfigError("give either --api-key or --api-key-file, not both", param="api_key")
    if flag_value is not None:
        key, source = flag_value.strip(), "--api-key"
    elif file_flag is not None:
        key, source = read_secret_file(file_flag, "--api-key-file", "api_key_file"), \
            f"--api-key-file {file_flag!r}"
    else:
        for name in (API_KEY_ENV, VLLM_API_KEY_ENV):
            value = os.environ.get(name)
            if value:  # set but empty: unset, as vLLM reads it
                return value.strip() or None
        return None
    if not key:
        raise ConfigError(f"the API key from {source} is empty", param="api_key")
    return key


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IP literals; any other name counts as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_server_token(token: str | None, host: str, insecure: bool, *,
                       tls_enabled: bool = False) -> None:
    """Refuses to serve a non-loopback `host` without a token unless `insecure`."""
    if token is not None:
        if not tls_enabled and not is_loopback(host):
            # INFO: a private network (compose's) is the usual place for this.
            logger.info("the internal token travels in the clear on %s: give the services "
                        "--grpc-tls-* flags when the network between them is not trusted", host)
        return
    if is_loopback(host):
        logger.warning("no internal token (--internal-token-file or $%s): any local process "
                       "can call this service", TOKEN_ENV)
        return
    if not insecure:
        raise ConfigError(f"--host {host} is reachable from other hosts but no internal token "
                          f"is set: give --internal-token-file PATH or ${TOKEN_ENV} (the same "
                          "on every service), or --insecure-no-internal-token to serve open",
                          param="internal_token_file")
    logger.warning("--insecure-no-internal-token: anyone who can reach %s can call this "
                   "service", host)


def add_internal_auth_args(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """--internal-token-file, and for a gRPC server --insecure-no-internal-token and
    --enable-reflection."""
    group = parser.add_argument_group("internal authentication")
    group.add_argument("--internal-token-file", default=None, metavar="PATH",
                       help="file holding the token the services share (sent and checked as "
                            f"gRPC metadata {METADATA_KEY}). First match wins: this flag, "
                            f"${TOKEN_FILE_ENV} (a path), ${TOKEN_ENV} (the value); never "
                            f"argv. At least {MIN_TOKEN_CHARS} characters")
    if server:
        group.add_argument("--insecure-no-internal-token", action="store_true",
                           help="serve a non-loopback --host without an internal token "
                                "(anyone who reaches the port can call it)")
        group.add_argument("--enable-reflection", action="store_true",
                           help="serve gRPC reflection (off by default; it tells any caller "
                                "the services' schema)")


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health check unless it carries the token."""

    def __init__(self, token: str) -> None:
        # Digests of equal length: compare_digest then leaks not even the token's length.
        self._digest = hashlib.sha256(token.encode()).digest()
        self._last_log_at = float("-inf")
        self._num_unlogged = 0

    def authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY and isinstance(value, str):
                return hmac.compare_digest(hashlib.sha256(value.encode()).digest(),
                                           self._digest)
        return False

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(_UNCHECKED_PREFIX) or self.authorized(details.invocation_metadata):
            return await continuation(details)

        # A stream-stream handler aborts before reading any request, whatever the method's
        # arity (an unknown method too: the caller learns nothing about what exists). No
        # deserializer: an unauthenticated caller's bytes are never parsed.
        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
            self._log_refusal(method, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL_DETAILS)

        return grpc.stream_stream_rpc_method_handler(refuse)

    def _log_refusal(self, method: str, peer: str) -> None:
        now = time.monotonic()
        if now - self._last_log_at < _REFUSAL_LOG_INTERVAL_S:
            self._num_unlogged += 1
            return
        unlogged = (f" (and {self._num_unlogged} more since the last warning)"
                    if self._num_unlogged else "")
        self._last_log_at, self._num_unlogged = now, 0
        logger.warning("refused %s from %s: missing or wrong internal token%s", method, peer,
                       unlogged)


class _AddToken:
    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*((key, value) for key, value in (details.metadata or ())
                                       if key != METADATA_KEY), (METADATA_KEY, self._token))
        return details._replace(metadata=metadata)


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      requests: Any) -> Any:
        return await continuation(self._with_token(details), requests)


def client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the token to the metadata of every call, of every arity.

    One per arity: a grpc.aio channel files each interceptor under the first arity it
    implements. Interceptors rather than call credentials: gRPC sends call credentials
    over TLS channels only, and the services also talk in the clear on loopback.
    """
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
