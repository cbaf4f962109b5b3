"""TLS for the gRPC links between services: flags, validation, credentials, channels.

Off by default: the services bind 127.0.0.1 and talk in the clear on loopback. Across
hosts, give every service the same flags:

- `--grpc-tls-cert` / `--grpc-tls-key`: this service's server certificate and key
  (verifier and drafter). With them the server accepts TLS only.
- `--grpc-tls-ca`: the CA bundle that verifies peers. A client (gateway -> verifier,
  verifier -> drafters) uses TLS once it is given and checks the server against it; a
  server given it requires client certificates signed by it (mutual TLS).
- `--grpc-tls-client-cert` / `--grpc-tls-client-key`: the certificate a client presents
  to a server that requires one.
- `--grpc-tls-server-name`: the name expected in the server certificate when connecting
  by an address it does not list (`grpc.ssl_target_name_override`).

Every file is read and checked at start-up; a bad one is a ConfigError naming its flag.
TLS composes with the internal token (specdec.rpc.internal_auth), which `open_channel` sends
on every call when given one.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.errors import ConfigError
from specdec.rpc.internal_auth import client_interceptors

logger = logging.getLogger(__name__)

_SERVER_FLAGS = ("grpc_tls_cert", "grpc_tls_key")
_CLIENT_FLAGS = ("grpc_tls_client_cert", "grpc_tls_client_key", "grpc_tls_server_name")


@dataclass(frozen=True)
class GrpcTlsConfig:
    """Paths of the PEM files (None = not given) and the expected server name."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for param, path in self._files():
            if path is not None:
                read_pem(path, param)
        _require_pair(self.cert_file, "grpc_tls_cert", self.key_file, "grpc_tls_key")
        _require_pair(self.client_cert_file, "grpc_tls_client_cert",
                      self.client_key_file, "grpc_tls_client_key")
        _check_key_pair(self.cert_file, "grpc_tls_cert", self.key_file, "grpc_tls_key")
        _check_key_pair(self.client_cert_file, "grpc_tls_client_cert",
                        self.client_key_file, "grpc_tls_client_key")
        if self.ca_file is not None:
            try:
                ssl.create_default_context(cafile=self.ca_file)
            except ssl.SSLError as exc:
                raise ConfigError(f"--grpc-tls-ca {self.ca_file!r} holds no valid CA "
                                  f"certificate ({exc.reason or exc})",
                                  param="grpc_tls_ca") from None
        if self.client_cert_file is not None and self.ca_file is None:
            raise ConfigError("--grpc-tls-client-cert needs --grpc-tls-ca (the CA that signed "
                              "the server's certificate)", param="grpc_tls_client_cert")
        if self.server_name is not None and (not self.server_name or self.ca_file is None):
            raise ConfigError("--grpc-tls-server-name needs a non-empty name and --grpc-tls-ca",
                              param="grpc_tls_server_name")

    def _files(self) -> list[tuple[str, str | None]]:
        return [("grpc_tls_cert", self.cert_file), ("grpc_tls_key", self.key_file),
                ("grpc_tls_ca", self.ca_file), ("grpc_tls_client_cert", self.client_cert_file),
                ("grpc_tls_client_key", self.client_key_file)]

    @property
    def server_enabled(self) -> bool:
        return self.cert_file is not None

    @property
    def client_enabled(self) -> bool:
        return self.ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for this service's server; None: serve in the clear."""
        if self.cert_file is None or self.key_file is None:
            return None
        root = read_pem(self.ca_file, "grpc_tls_ca") if self.ca_file is not None else None
        logger.info("gRPC server TLS: certificate %s%s", self.cert_file,
                    f", client certificates signed by {self.ca_file} required" if root else "")
        return grpc.ssl_server_credentials(
            [(read_pem(self.key_file, "grpc_tls_key"), read_pem(self.cert_file, "grpc_tls_cert"))],
            root_certificates=root, require_client_auth=root is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for this service's clients; None: connect in the clear."""
        if self.ca_file is None:
            return None
        client_key = client_cert = None
        if self.client_cert_file is not None and self.client_key_file is not None:
            client_key = read_pem(self.client_key_file, "grpc_tls_client_key")
            client_cert = read_pem(self.client_cert_file, "grpc_tls_client_cert")
        return grpc.ssl_channel_credentials(read_pem(self.ca_file, "grpc_tls_ca"),
                                            client_key, client_cert)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None or self.ca_file is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def open_channel(tls: GrpcTlsConfig | None, address: str,
                 options: Sequence[tuple[str, object]],
                 internal_token: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to address: TLS when `tls` configures a client side, else insecure.

    With `internal_token`, every call on it carries the token (specdec.rpc.internal_auth).
    """
    interceptors = client_interceptors(internal_token) if internal_token is not None else None
    if tls is None or (credentials := tls.channel_credentials()) is None:
        return grpc.aio.insecure_channel(address, options=list(options),
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials,
                                   options=[*options, *tls.channel_options()],
                                   interceptors=interceptors)


def read_pem(path: str, param: str) -> bytes:
    """The bytes of a PEM file; ConfigError naming --<param> when it is missing or not PEM."""
    flag = "--" + param.replace("_", "-")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path!r}: no such file", param=param)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot read it ({exc.strerror})", param=param) from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path!r} is not a PEM file", param=param)
    return data


def _require_pair(first: str | None, first_param: str, second: str | None,
                  second_param: str) -> None:
    if (first is None) != (second is None):
        given, missing = ((first_param, second_param) if first is not None
                          else (second_param, first_param))
        raise ConfigError(f"--{given.replace('_', '-')} needs --{missing.replace('_', '-')}",
                          param=missing)


def _check_key_pair(cert: str | None, cert_param: str, key: str | None, key_param: str,
                    ) -> None:
    """Python's ssl loads the pair as gRPC will; gRPC itself would only fail to bind."""
    if cert is None or key is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # A password callback: an encrypted key fails here instead of prompting.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise ConfigError(
            f"--{key_param.replace('_', '-')} {key!r} is not an unencrypted private key of "
            f"--{cert_param.replace('_', '-')} {cert!r} ({exc.reason or exc})",
            param=key_param) from None


def add_grpc_tls_args(parser: argparse.ArgumentParser, *, server: bool = True,
                      client: bool = True) -> None:
    """The TLS flags for a service with a gRPC server, gRPC clients, or both."""
    group = parser.add_argument_group("gRPC TLS (default: none, on loopback)")
    if server:
        group.add_argument("--grpc-tls-cert", default=None, metavar="PEM",
                           help="this service's server certificate (chain); serve TLS only")
        group.add_argument("--grpc-tls-key", default=None, metavar="PEM",
                           help="the private key of --grpc-tls-cert")
    group.add_argument("--grpc-tls-ca", default=None, metavar="PEM",
                       help="CA bundle verifying peers: clients check servers against it; a "
                            "server given it requires client certificates (mutual TLS)")
    if client:
        group.add_argument("--grpc-tls-client-cert", default=None, metavar="PEM",
                           help="client certificate for servers that require one")
        group.add_argument("--grpc-tls-client-key", default=None, metavar="PEM",
                           help="the private key of --grpc-tls-client-cert")
        group.add_argument("--grpc-tls-server-name", default=None, metavar="NAME",
                           help="name expected in the server certificate when connecting by "
                                "an address it does not list")


def grpc_tls_from_args(args: argparse.Namespace) -> GrpcTlsConfig | None:
    """The validated TLS configuration of parsed flags; None when no TLS flag was given."""
    values = {name: getattr(args, name, None)
              for name in ("grpc_tls_cert", "grpc_tls_key", "grpc_tls_ca", *_CLIENT_FLAGS)}
    if all(value is None for value in values.values()):
        return None
    has_server_flags = hasattr(args, _SERVER_FLAGS[0])
    has_client_flags = hasattr(args, _CLIENT_FLAGS[0])
    if has_server_flags and not has_client_flags and values["grpc_tls_ca"] is not None \
            and values["grpc_tls_cert"] is None:
        # A server-only service (drafter): a CA alone would verify nothing.
        raise ConfigError("--grpc-tls-ca on a server needs --grpc-tls-cert and --grpc-tls-key",
                          param="grpc_tls_cert")
    return GrpcTlsConfig(cert_file=values["grpc_tls_cert"], key_file=values["grpc_tls_key"],
                         ca_file=values["grpc_tls_ca"],
                         client_cert_file=values["grpc_tls_client_cert"],
                         client_key_file=values["grpc_tls_client_key"],
                         server_name=values["grpc_tls_server_name"])


def grpc_tls_flags(tls: GrpcTlsConfig | None, *, server: bool = True,
                   client: bool = True) -> list[str]:
    """The command-line flags that reproduce `tls` for a child service (the launcher)."""
    if tls is None:
        return []
    pairs = []
    if server:
        pairs += [("--grpc-tls-cert", tls.cert_file), ("--grpc-tls-key", tls.key_file)]
    pairs.append(("--grpc-tls-ca", tls.ca_file))
    if client:
        pairs += [("--grpc-tls-client-cert", tls.client_cert_file),
                  ("--grpc-tls-client-key", tls.client_key_file),
                  ("--grpc-tls-server-name", tls.server_name)]
    return [item for flag, value in pairs if value is not None for item in (flag, value)]
