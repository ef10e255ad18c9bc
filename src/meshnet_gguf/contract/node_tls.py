"""TLS bound to a node's Ed25519 identity: the certificate a node serves through a relay, and the
client context a tracker uses to reach it.

The relay in between is untrusted, so the tracker speaks TLS 1.3 end to end
with the node. The node's certificate is self-signed with the node key itself
and names the node id; the tracker takes it from the node's signed
registration, checks that its key *is* the registered node key, and trusts
that one certificate only. A relay (or anyone else) without the node key
cannot complete the handshake, and cannot read or alter the bytes after it.

Shared contract (floor 1): the node builds the certificate, the reference
tracker pins it. No I/O.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from meshnet_gguf.contract.signing import node_id_for

# The certificate is a pure function of the key (Ed25519 signatures are deterministic and the
# dates are fixed), so a node announces the same certificate across restarts. Its validity
# carries no meaning: trust comes from the pinned key, and the key's lifetime is the node's.
_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)  # RFC 5280: no expiry
TLS_MINIMUM_VERSION = ssl.TLSVersion.TLSv1_3


class NodeCertificateError(ValueError):
    """A certificate that does not bind the node's key and id; the tracker must not trust it."""


def node_certificate(key: Ed25519PrivateKey) -> bytes:
    """DER of the node's self-signed certificate: its own Ed25519 key, subject and SAN = node id."""
    public = key.public_key()
    node_id = node_id_for(public)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    serial = int.from_bytes(hashlib.sha256(raw).digest()[:16], "big") >> 1  # positive, < 2**127
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, None)
    )
    return certificate.public_bytes(serialization.Encoding.DER)


def certificate_pem(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


def certificate_text(der: bytes) -> str:
    """base64url without padding, like public keys on the wire."""
    return base64.urlsafe_b64encode(der).rstrip(b"=").decode("ascii")


def certificate_from_text(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise NodeCertificateError(f"tls_certificate is not base64url: {exc}") from None


def check_node_certificate(der: bytes, public_key: Ed25519PublicKey) -> str:
    """The node id the certificate is valid for, or `NodeCertificateError` when it does not bind `public_key`."""
    try:
        certificate = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise NodeCertificateError(f"tls_certificate is not an X.509 certificate: {exc}") from None
    cert_key = certificate.public_key()
    if not isinstance(cert_key, Ed25519PublicKey):
        raise NodeCertificateError("tls_certificate does not carry an Ed25519 key")
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    if cert_key.public_bytes(*raw) != public_key.public_bytes(*raw):
        raise NodeCertificateError("tls_certificate is not for the node's registered key")
    node_id = node_id_for(public_key)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise NodeCertificateError("tls_certificate has no subjectAltName") from None
    if node_id not in names.get_values_for_type(x509.DNSName):
        raise NodeCertificateError(f"tls_certificate does not name {node_id}")
    try:
        public_key.verify(certificate.signature, certificate.tbs_certificate_bytes)
    except Exception:
        raise NodeCertificateError("tls_certificate is not self-signed by the node key") from None
    return node_id


def pinned_client_context(der: bytes, public_key: Ed25519PublicKey) -> ssl.SSLContext:
    """A TLS 1.3 client context that trusts exactly this node's certificate (and checks the node id as host name)."""
    check_node_certificate(der, public_key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = TLS_MINIMUM_VERSION
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=der)
    return context


def server_context(cert_pem_path: str, key_pem_path: str) -> ssl.SSLContext:
    """The node's TLS 1.3 server context from its certificate and its identity key (PEM files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_MINIMUM_VERSION
    context.load_cert_chain(cert_pem_path, key_pem_path)
    return context


__all__ = [
    "NodeCertificateError",
    "certificate_from_text",
    "certificate_pem",
    "certificate_text",
    "check_node_certificate",
    "node_certificate",
    "pinned_client_context",
    "server_context",
]
