"""Authentication the NATS way (issue 13): each method mounts a server that requires it.

For user/password, token, NKey, creds (operator mode, JWTs signed in the test with `nkeys`), TLS with
client certificates (made with `trustme`) and a NATS CLI context, a private nats-server requires that
method; `natsfs bucket create` (options after the subcommand) makes a bucket, a background mount
writes a file large enough to go through the upload worker, and a fresh nats-py client with the same
credentials reads the bytes back. The secret (password, token, seed) is in no /proc/*/cmdline, no
environment of the mount's processes, no log and no output.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nkeys
import pytest
import trustme
from helpers import wait_for

from natsfs.auth import Connection, resolve
from natsfs.server import NatsServer

NATSFS = str(Path(sys.executable).parent / "natsfs")
SECRET = "s3cr3t-4d1e9b77c0"  # unique: found anywhere means leaked


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _mount_processes(mountpoint: Path) -> list[int]:
    daemons = {pid for pid in _pids() if str(mountpoint).encode() in _read(f"/proc/{pid}/cmdline")}
    children = set()
    for pid in _pids():
        line = _read(f"/proc/{pid}/stat").decode(errors="replace")
        if line and int(line.rsplit(")", 1)[1].split()[1]) in daemons:
            children.add(pid)
    return sorted(daemons | children)


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("NATS_")} | extra


@contextlib.contextmanager
def mounted(tmp_path: Path, args: list[str], env: dict[str, str]) -> Iterator[Path]:
    mp = tmp_path / "mnt"
    mp.mkdir(exist_ok=True)
    proc = subprocess.run([NATSFS, "mount", str(mp), "--data-dir", str(tmp_path / "data"), "--cache-dir",
                           str(tmp_path / "cache"), "--log-level", "debug", *args],
                          capture_output=True, text=True, env=env, timeout=60)
    try:
        assert proc.returncode == 0, proc.stderr
        assert SECRET not in proc.stdout + proc.stderr
        yield mp
    finally:
        with open("/proc/mounts") as f:
            if any(line.split()[1] == str(mp) for line in f):
                subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True)
        assert wait_for(lambda: not _mount_processes(mp), 20), "the daemon did not exit"


def _get(connection: Connection, bucket: str, name: str) -> bytes:
    async def run() -> bytes:
        nc = await nats.connect(servers=list(connection.servers), **connection.connect_options())
        try:
            obs = await nc.jetstream().object_store(bucket)
            return bytes((await asyncio.wait_for(obs.get(name), 60)).data)
        finally:
            await nc.close()

    return asyncio.run(run())


def _assert_secret_nowhere(mp: Path, texts: list[str], secret: str) -> None:
    leaks = [_read(f"/proc/{pid}/cmdline") for pid in _pids() if secret.encode() in _read(f"/proc/{pid}/cmdline")]
    assert leaks == []
    processes = _mount_processes(mp)
    assert len(processes) == 3  # daemon, upload worker, kernel notifier
    for pid in processes:
        assert secret.encode() not in _read(f"/proc/{pid}/environ")
    for text in texts:
        assert secret not in text


# ---------------------------------------------------------------- server setups, one per method
def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _keypair(prefix: int) -> tuple[bytes, str]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def _jwt(signer_seed: bytes, subject: str, nats_claims: dict[str, Any], name: str) -> str:
    signer = nkeys.from_seed(bytearray(signer_seed))
    claims = {"jti": _b64(os.urandom(16)), "iat": int(time.time()), "iss": signer.public_key.decode(),
              "name": name, "sub": subject, "nats": nats_claims | {"version": 2}}
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "." + _b64(json.dumps(claims).encode())
    return head + "." + _b64(signer.sign(head.encode()))


def _creds_setup(tmp_path: Path) -> tuple[str, list[str], str]:
    """Operator mode: an operator, a system account, an account with JetStream, and a user's creds file."""
    op_seed, op_pub = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    _sys_seed, sys_pub = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    acc_seed, acc_pub = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed, user_pub = _keypair(nkeys.PREFIX_BYTE_USER)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                 "conn": -1, "leaf": -1}
    op_jwt = _jwt(op_seed, op_pub, {"type": "operator", "system_account": sys_pub}, "op")
    sys_jwt = _jwt(op_seed, sys_pub, {"type": "account", "limits": unlimited}, "SYS")
    acc_jwt = _jwt(op_seed, acc_pub, {"type": "account", "limits": unlimited | {
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}}, "A")
    user_jwt = _jwt(acc_seed, user_pub, {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1,
                                         "payload": -1}, "u")
    creds = tmp_path / "user.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n")
    creds.chmod(0o600)
    config = (f"operator: {op_jwt}\nsystem_account: {sys_pub}\nresolver: MEMORY\n"
              f"resolver_preload: {{ {sys_pub}: {sys_jwt}, {acc_pub}: {acc_jwt} }}\n")
    return config, ["--creds", str(creds)], user_seed.decode()


def _setup(method: str, tmp_path: Path) -> tuple[str, list[str], dict[str, str], str, str]:
    """(server config, mount/bucket options, extra environment, URL scheme, the secret)."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    if method == "password-file":
        return (f'authorization {{ user: "u1", password: "{SECRET}" }}', ["--user", "u1", "--password-file",
                str(secret_file)], {}, "nats", SECRET)
    if method == "password-env":
        return (f'authorization {{ user: "u1", password: "{SECRET}" }}', [], {"NATS_USER": "u1",
                "NATS_PASSWORD": SECRET}, "nats", SECRET)
    if method == "token-file":
        return f'authorization {{ token: "{SECRET}" }}', ["--token-file", str(secret_file)], {}, "nats", SECRET
    if method == "token-env":
        return f'authorization {{ token: "{SECRET}" }}', [], {"NATS_TOKEN": SECRET}, "nats", SECRET
    if method == "nkey":
        seed, public = _keypair(nkeys.PREFIX_BYTE_USER)
        seed_file = tmp_path / "user.nk"
        seed_file.write_bytes(seed + b"\n")
        seed_file.chmod(0o600)
        return f'authorization {{ users: [ {{ nkey: "{public}" }} ] }}', ["--nkey", str(seed_file)], {}, "nats", \
            seed.decode()
    if method == "creds":
        config, options, seed = _creds_setup(tmp_path)
        return config, options, {}, "nats", seed
    if method == "tls":
        ca = trustme.CA()
        server_cert = ca.issue_cert("127.0.0.1")
        client_cert = ca.issue_cert("natsfs-client")
        paths = {}
        for name, blob in [("ca.pem", ca.cert_pem), ("server.pem", server_cert.cert_chain_pems[0]),
                           ("server.key", server_cert.private_key_pem), ("client.pem", client_cert.cert_chain_pems[0]),
                           ("client.key", client_cert.private_key_pem)]:
            path = tmp_path / name
            blob.write_to_path(str(path))
            paths[name] = str(path)
        config = (f'tls {{ cert_file: "{paths["server.pem"]}", key_file: "{paths["server.key"]}", '
                  f'ca_file: "{paths["ca.pem"]}", verify: true }}')
        client_key = Path(paths["client.key"]).read_text().splitlines()[1]
        return config, ["--tls-ca", paths["ca.pem"], "--tls-cert", paths["client.pem"], "--tls-key",
                        paths["client.key"]], {}, "tls", client_key
    if method == "context":
        context_dir = tmp_path / "config" / "nats" / "context"
        context_dir.mkdir(parents=True)
        (tmp_path / "config" / "nats" / "context.txt").write_text("prod\n")
        return f'authorization {{ token: "{SECRET}" }}', [], {"XDG_CONFIG_HOME": str(tmp_path / "config")}, "nats", \
            SECRET
    raise AssertionError(method)


METHODS = ["password-file", "password-env", "token-file", "token-env", "nkey", "creds", "tls", "context"]


@pytest.mark.parametrize("method", METHODS)
def test_each_method_mounts_a_server_that_requires_it(tmp_path, method):
    config, options, extra_env, scheme, secret = _setup(method, tmp_path)
    server = NatsServer(tmp_path / "nats", config=config)
    server.start()
    try:
        url = f"{scheme}://{server.host}:{server.port}"
        env = _env(**extra_env)
        if method == "context":  # the selected context names the server and the token
            (tmp_path / "config" / "nats" / "context" / "prod.json").write_text(
                json.dumps({"url": url, "token": SECRET}))
            server_args = []
        else:
            server_args = ["--server", url]
        # Without the credentials the server refuses us, and says nothing secret.
        refused = subprocess.run([NATSFS, "bucket", "ls", "--server", url], capture_output=True, text=True,
                                 env=_env(), timeout=60)
        assert refused.returncode == 1 and "cannot connect to NATS" in refused.stderr, refused.stderr
        made = subprocess.run([NATSFS, "bucket", "create", "b1", *server_args, *options], capture_output=True,
                              text=True, env=env, timeout=60)
        assert made.returncode == 0, made.stderr
        data = os.urandom(6 << 20)  # streamed by the upload worker
        with mounted(tmp_path, [*server_args, *options], env) as mp:
            (mp / "b1" / "big.bin").write_bytes(data)
            assert (mp / "b1" / "big.bin").stat().st_size == len(data)
            log = next((tmp_path / "data" / "logs").iterdir())
            _assert_secret_nowhere(mp, [made.stdout, made.stderr, log.read_text()], secret)
        text = log.read_text()
        assert secret not in text and " ERROR " not in text, text[-3000:]
        connection = resolve({"server": None if method == "context" else url, **_options_dict(options)},
                             _env(**extra_env))
        assert _get(connection, "b1", "big.bin") == data
    finally:
        server.stop()


def _options_dict(options: list[str]) -> dict[str, str]:
    names = {"--user": "user", "--password-file": "password_file", "--token-file": "token_file", "--nkey": "nkey_file",
             "--creds": "creds_file", "--tls-ca": "tls_ca", "--tls-cert": "tls_cert", "--tls-key": "tls_key"}
    return {names[options[i]]: options[i + 1] for i in range(0, len(options), 2)}


def test_a_missing_credentials_file_is_one_sentence(tmp_path):
    missing = tmp_path / "nope.creds"
    proc = subprocess.run([NATSFS, "bucket", "ls", "--server", "nats://127.0.0.1:1", "--creds", str(missing)],
                          capture_output=True, text=True, env=_env(), timeout=30)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"natsfs: cannot read {missing} (given as --creds)"


class _RecordingProxy:
    """A TCP proxy to `port` that records every byte the clients send (what a sniffer on the way sees)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.sent = bytearray()
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            self.connections += 1
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if record:
                    self.sent.extend(data)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            s.close()


def _tls_files(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    paths = {}
    for name, blob in [("ca.pem", ca.cert_pem), ("server.pem", server_cert.cert_chain_pems[0]),
                       ("server.key", server_cert.private_key_pem)]:
        path = tmp_path / name
        blob.write_to_path(str(path))
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("asked", [["--server", "tls://alice:{pw}@127.0.0.1:{port}"],
                                   ["--server", "nats://alice:{pw}@127.0.0.1:{port}", "--tls-ca", "{ca}"]],
                         ids=["tls-url", "tls-ca"])
def test_tls_asked_of_a_server_without_tls_fails_before_any_credential_is_sent(tmp_path, asked):
    """A sniffer between natsfs and a plaintext server sees not a byte: the mount and the bucket and fsck
    commands fail with one sentence before any connection sends its CONNECT."""
    paths = _tls_files(tmp_path)
    server = NatsServer(tmp_path / "nats", config=f'authorization {{ user: alice, password: "{SECRET}" }}')
    server.start()
    proxy = _RecordingProxy(server.port)
    try:
        args = [a.format(pw=SECRET, port=proxy.port, ca=paths["ca.pem"]) for a in asked]
        mp = tmp_path / "mnt"
        mp.mkdir()
        for command in (["mount", str(mp), "--data-dir", str(tmp_path / "data"), "--cache-dir",
                         str(tmp_path / "cache")], ["bucket", "ls"], ["fsck", "b1"]):
            proc = subprocess.run([NATSFS, *command, *args], capture_output=True, text=True, env=_env(), timeout=60)
            assert proc.returncode != 0
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].endswith("does not offer TLS, which a tls:// URL or a TLS option "
                                                         "(--tls-ca, --tls-cert, --tls-key) asks for: refusing to "
                                                         "send credentials in clear"), proc.stderr
            assert SECRET not in proc.stderr
        with open("/proc/mounts") as f:
            assert not any(line.split()[1] == str(mp) for line in f)
        assert proxy.connections >= 3 and bytes(proxy.sent) == b""
    finally:
        proxy.close()
        server.stop()


def test_a_server_asking_for_a_client_certificate_not_given_is_one_sentence_saying_so(tmp_path):
    """`verify: true` and no --tls-cert: the server drops the connection with a TLS alert, which reached
    the mount as `Connection lost` (or the alert's OpenSSL text, by timing); its INFO said why."""
    paths = _tls_files(tmp_path)
    server = NatsServer(tmp_path / "nats", config=(f'tls {{ cert_file: "{paths["server.pem"]}", key_file: '
                                                   f'"{paths["server.key"]}", ca_file: "{paths["ca.pem"]}", '
                                                   f'verify: true }}\nauthorization {{ user: alice, password: '
                                                   f'"{SECRET}" }}'))
    server.start()
    try:
        args = ["--server", f"tls://alice:{SECRET}@127.0.0.1:{server.port}", "--tls-ca", paths["ca.pem"]]
        mp = tmp_path / "mnt"
        mp.mkdir()
        for command in (["mount", str(mp), "--data-dir", str(tmp_path / "data"), "--cache-dir",
                         str(tmp_path / "cache")], ["bucket", "ls"]):
            proc = subprocess.run([NATSFS, *command, *args], capture_output=True, text=True, env=_env(), timeout=60)
            assert proc.returncode != 0
            assert proc.stderr.strip().splitlines() == [
                f"natsfs: cannot connect to NATS at tls://alice:***@127.0.0.1:{server.port}: the server asks for a "
                "TLS client certificate, and none was given (--tls-cert and --tls-key, or $NATS_CERT and "
                "$NATS_KEY)"], proc.stderr
        with open("/proc/mounts") as f:
            assert not any(line.split()[1] == str(mp) for line in f)
    finally:
        server.stop()


def test_commands_over_tls_print_nothing_but_their_answer(tmp_path):
    """nats-py's TLS connections end with an asyncio WARNING (`returning true from eof_received() has no
    effect when using ssl`): it was printed on stderr by every `natsfs bucket` command over TLS."""
    config, options, _env_extra, scheme, _secret = _setup("tls", tmp_path)
    server = NatsServer(tmp_path / "nats", config=config)
    server.start()
    try:
        url = f"{scheme}://127.0.0.1:{server.port}"
        for command in (["bucket", "create", "b1"], ["bucket", "ls"]):
            proc = subprocess.run([NATSFS, *command, "--server", url, *options], capture_output=True, text=True,
                                  env=_env(), timeout=60)
            assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
        assert proc.stdout.startswith("b1\t")
    finally:
        server.stop()


def test_a_server_that_offers_tls_without_requiring_it_is_mounted_over_tls(tmp_path):
    """`allow_non_tls`: the server's INFO says `tls_available`; TLS asked, every connection of the mount
    (main, lean reads, upload worker) goes TLS: the sniffer sees no CONNECT and no secret."""
    paths = _tls_files(tmp_path)
    config = (f'tls {{ cert_file: "{paths["server.pem"]}", key_file: "{paths["server.key"]}" }}\n'
              f'allow_non_tls: true\nauthorization {{ user: alice, password: "{SECRET}" }}')
    server = NatsServer(tmp_path / "nats", config=config)
    server.start()
    proxy = _RecordingProxy(server.port)
    try:
        args = ["--server", f"tls://alice:{SECRET}@127.0.0.1:{proxy.port}", "--tls-ca", paths["ca.pem"]]
        made = subprocess.run([NATSFS, "bucket", "create", "b1", *args], capture_output=True, text=True,
                              env=_env(), timeout=60)
        assert made.returncode == 0, made.stderr
        data = os.urandom(6 << 20)  # streamed by the upload worker
        with mounted(tmp_path, args, _env()) as mp:
            (mp / "b1" / "big.bin").write_bytes(data)
            assert (mp / "b1" / "big.bin").read_bytes() == data
        assert proxy.connections >= 3
        assert b"CONNECT" not in proxy.sent and SECRET.encode() not in proxy.sent
    finally:
        proxy.close()
        server.stop()
