"""TLS of a shared service's client port: the service's certificate, and the clients' trust.

The operator gives a certificate and key (`--service-cert/--service-key`, e.g. from their
CA or cert-manager); without them the service makes a self-signed one at start (valid for
its host names and addresses) and writes it where users can be handed it: clients trust
exactly that certificate (`--service-ca FILE`), so no public CA is involved. A restarted
service presents the pair it made before while it still covers its names and has more than
a week to run, so the file users were handed stays good.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import socket
import ssl


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceCertificate:
    cert: str  # PEM certificate (chain) the service presents
    key: str  # its PEM private key

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--service-cert {self.cert} and --service-key {self.key} do "
                             f"not load together: {getattr(e, 'reason', None) or e}") from None
        return context


def self_signed(directory: str, names: list[str], days: int = 365) -> ServiceCertificate:
    """A key and a certificate for `names` (host names and IP addresses) in `directory`
    (service-cert.pem, world-readable; service-key.pem, owner only): the pair already there
    when it still serves (`_still_good`), else a fresh one."""
    cert_path = os.path.join(directory, "service-cert.pem")
    key_path = os.path.join(directory, "service-key.pem")
    if _still_good(cert_path, key_path, names):
        return ServiceCertificate(cert_path, key_path)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "isthmus shared service")])
    alternatives: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name.strip("[]"))))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256()))
    os.makedirs(directory, exist_ok=True)
    with open(cert_path, "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return ServiceCertificate(cert_path, key_path)


def _still_good(cert_path: str, key_path: str, names: list[str]) -> bool:
    """The pair at these paths loads together, is valid for more than a week yet, and names
    every one of `names`."""
    from cryptography import x509

    try:
        with open(cert_path, "rb") as f:
            certificate = x509.load_pem_x509_certificate(f.read())
        ServiceCertificate(cert_path, key_path).server_context()
        alternatives = certificate.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    now = datetime.datetime.now(datetime.UTC)
    if certificate.not_valid_after_utc - now < datetime.timedelta(days=7):
        return False
    covered = {str(a) for a in alternatives.get_values_for_type(x509.IPAddress)}
    covered |= set(alternatives.get_values_for_type(x509.DNSName))
    for name in names:
        try:
            name = str(ipaddress.ip_address(name.strip("[]")))
        except ValueError:
            pass
        if name not in covered:
            return False
    return True


def default_names(host: str, advertise: str | None) -> list[str]:
    """What a self-signed certificate is valid for: this machine's names and addresses."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    try:
        names.append(socket.getfqdn())
    except OSError:
        pass
    for extra in (host, advertise):
        if extra and extra not in ("0.0.0.0", "::"):
            names.append(extra)
    return [n for n in names if n]


def client_context(ca: str | None) -> ssl.SSLContext:
    """How a client checks the service: against `ca` (the service's certificate or its
    CA), else the system's trusted CAs."""
    context = ssl.create_default_context(cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
