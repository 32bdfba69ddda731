"""The TLS client files (natsfs/auth.py `Connection.ssl_context`): an encrypted key or a certificate
without its key is one sentence, and OpenSSL never prompts for a passphrase on the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from natsfs.auth import Connection
from natsfs.errors import Unavailable


@pytest.fixture()
def client_files(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    cert = ca.issue_cert("natsfs-client")
    paths = {name: str(tmp_path / name) for name in ("ca.pem", "client.pem", "client.key", "client.enc.key")}
    ca.cert_pem.write_to_path(paths["ca.pem"])
    cert.cert_chain_pems[0].write_to_path(paths["client.pem"])
    cert.private_key_pem.write_to_path(paths["client.key"])
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), password=None)
    Path(paths["client.enc.key"]).write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"s3cret")))
    return paths


def test_an_encrypted_key_is_one_sentence_and_never_a_prompt(client_files):
    """(A terminal showed OpenSSL's "Enter PEM pass phrase:" and waited; without one: "[Errno 22]".)"""
    connection = Connection(tls_ca=client_files["ca.pem"], tls_cert=client_files["client.pem"],
                            tls_key=client_files["client.enc.key"])
    with pytest.raises(Unavailable, match=f"the TLS key {client_files['client.enc.key']} is encrypted: natsfs cannot "
                                          "ask for its passphrase"):
        connection.ssl_context()


def test_a_certificate_without_its_key_is_one_sentence(client_files):
    connection = Connection(tls_ca=client_files["ca.pem"], tls_cert=client_files["client.pem"])
    with pytest.raises(Unavailable, match=f"cannot load the TLS client certificate {client_files['client.pem']}: "
                                          "it holds no private key, give it with --tls-key"):
        connection.ssl_context()


def test_plain_key_loads(client_files):
    Connection(tls_ca=client_files["ca.pem"], tls_cert=client_files["client.pem"],
               tls_key=client_files["client.key"]).ssl_context()
