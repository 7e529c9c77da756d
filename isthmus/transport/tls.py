"""Mutual TLS between the members of a fleet (`--tls-cert/--tls-key/--tls-ca`).

Every member (the controller and each worker) has a certificate signed by the fleet's own
CA, with the subject alternative name `DNS:isthmus-fleet`: being signed by that CA is what
makes a process a member, whatever host it runs on, so peers check the CA and that fixed
name instead of host names. TLS then covers the workers' control streams (both ends verify
each other) and the peer data servers (worker to worker). It does not cover the stock
client's port (the client speaks plain gRPC), the pulse and endpoint RPCs on that port, nor
jax's coordination service and gloo's collective traffic inside a group, which jaxlib runs
without TLS: keep the fleet on a private network all the same.
"""

from __future__ import annotations

import dataclasses
import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

FLEET_NAME = "isthmus-fleet"  # the name every member's certificate carries


@dataclasses.dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str  # PEM certificate chain of this member
    key: str  # its PEM private key
    ca: str  # the fleet CA's PEM certificate

    def __post_init__(self) -> None:
        for option, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                             ("--tls-ca", self.ca)):
            try:
                with open(path, "rb") as f:
                    if b"-----BEGIN" not in f.read():
                        raise ValueError(f"{option} {path} is not a PEM file")
            except OSError as e:
                raise ValueError(f"{option} {path}: {e.strerror or e}") from None
        try:  # a key that does not match its certificate fails here, not at the first peer
            self.server_context()
        except ssl.SSLError as e:
            raise ValueError(f"--tls-cert/--tls-key/--tls-ca do not load together: "
                             f"{e.reason or e}") from None

    def _read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.load_verify_locations(self.ca)
        context.verify_mode = ssl.CERT_REQUIRED  # a worker must show a fleet certificate
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.load_verify_locations(self.ca)
        context.check_hostname = True  # against FLEET_NAME, passed as server_hostname
        return context

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca), require_client_auth=True)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))


# What a TLS channel to a peer needs beside its credentials: peers are checked by the name
# every member's certificate carries, not by the address dialled.
GRPC_NAME_OPTION = (("grpc.ssl_target_name_override", FLEET_NAME),)


def from_options(cert: str | None, key: str | None, ca: str | None) -> TlsConfig | None:
    """The TLS setting of the command line: all three files or none (ValueError)."""
    given = [x for x in (cert, key, ca) if x]
    if not given:
        return None
    if len(given) != 3:
        raise ValueError("mutual TLS needs all three of --tls-cert, --tls-key and --tls-ca")
    return TlsConfig(cert, key, ca)  # type: ignore[arg-type]
