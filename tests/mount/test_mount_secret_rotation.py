"""A password rotated while mounted: the server's and the password file's, then a reconnect.

A private nats-server requires user `u1` with a password (and has a system account to kick clients
with); a background mount authenticates with `--password-file`. The operator then rewrites the file
with a new password, gives the server the new one (config rewritten, reloaded with SIGHUP), and the
mount's connections are dropped (the reload refuses the old password; every connection of the mount is
kicked besides). The mount reconnects with the new password, its upload worker too, and a file written
through it afterwards is read back byte-exact by a fresh client with the new password. The daemon's log
holds neither password and no run of "Authorization Violation" lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import nats
import nats.errors
from helpers import wait_for
from test_auth import NATSFS, _env, _get, mounted

from natsfs.auth import Connection
from natsfs.server import NatsServer

OLD = "rot-old-5e1c0a9d2b"
NEW = "rot-new-8f3b27c6e4"
NATSFS_NAMES = ("natsfs", "natsfs-upload-worker")


def _config(password: str) -> str:
    return (f'accounts {{\n  APP {{ jetstream: enabled, users: [{{user: u1, password: "{password}"}}] }}\n'
            '  SYS { users: [{user: sys, password: sys}] }\n}\nsystem_account: SYS\n')


def _sys(url: str, subject_of: str, payload: dict[str, object]) -> list[dict[str, object]]:
    """The mount's connections the server has (`connz`), kicked first when `subject_of` is "kick"."""

    async def quiet(_error: Exception) -> None:
        pass  # (a connect while the server reloads its config may be reset: tried again below)

    async def connect() -> nats.NATS:
        for attempt in range(50):
            try:
                return await nats.connect(url.replace("nats://", "nats://sys:sys@"), error_cb=quiet,
                                          allow_reconnect=False, connect_timeout=5)
            except (TimeoutError, OSError, nats.errors.Error):
                if attempt == 49:
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def main() -> list[dict[str, object]]:
        nc = await connect()
        try:
            r = await nc.request("$SYS.REQ.SERVER.PING.CONNZ", json.dumps({"limit": 4096, "auth": True}).encode(),
                                 timeout=5)
            info = json.loads(r.data)
            ours = [c for c in info["data"]["connections"] if c.get("name") in NATSFS_NAMES]
            if subject_of == "kick":
                for c in ours:
                    await nc.request(f"$SYS.REQ.SERVER.{info['server']['id']}.KICK",
                                     json.dumps({"cid": c["cid"], **payload}).encode(), timeout=5)
            return ours
        finally:
            await nc.close()

    return asyncio.run(main())


def test_a_rotated_password_file_is_read_again_when_the_mount_reconnects(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(OLD + "\n")
    secret_file.chmod(0o600)
    server = NatsServer(tmp_path / "nats", config=_config(OLD))
    server.start()
    try:
        url = server.url
        options = ["--server", url, "--user", "u1", "--password-file", str(secret_file)]
        made = subprocess.run([NATSFS, "bucket", "create", "b1", *options], capture_output=True, text=True,
                              env=_env(), timeout=60)
        assert made.returncode == 0, made.stderr
        before = os.urandom(300_000)
        after_small = os.urandom(200_000)
        after_big = os.urandom(6 << 20)  # streamed by the upload worker
        with mounted(tmp_path, options, _env()) as mp:
            (mp / "b1" / "before.bin").write_bytes(before)
            assert _get(Connection(servers=(url,), user="u1", password=OLD), "b1", "before.bin") == before
            assert wait_for(lambda: {c["name"] for c in _sys(url, "connz", {})} == set(NATSFS_NAMES), 30)

            # The rotation: the file first, then the server (a reload refuses the old password).
            secret_file.write_text(NEW + "\n")
            (tmp_path / "nats" / "auth.conf").write_text(_config(NEW) + "\n")
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGHUP)
            new = Connection(servers=(url,), user="u1", password=NEW)
            # Every connection of the mount is dropped (those the reload left, if any, are kicked) ...
            _sys(url, "kick", {})
            # ... and comes back, authenticated with the new password (the upload worker's too).
            assert wait_for(lambda: {c["name"] for c in _sys(url, "connz", {})} == set(NATSFS_NAMES), 60), \
                _sys(url, "connz", {})
            assert all(c.get("authorized_user") == "u1" for c in _sys(url, "connz", {}))

            (mp / "b1" / "after.bin").write_bytes(after_small)
            (mp / "b1" / "after-big.bin").write_bytes(after_big)
            assert _get(new, "b1", "after.bin") == after_small
            assert _get(new, "b1", "after-big.bin") == after_big
            assert _get(new, "b1", "before.bin") == before
            assert (mp / "b1" / "after-big.bin").read_bytes() == after_big
            log = next((tmp_path / "data" / "logs").iterdir())
        text = log.read_text()
        assert OLD not in text and NEW not in text
        assert "lost the connection to NATS" in text  # (the reconnect happened)
        violations = [line for line in text.splitlines() if "Authorization Violation" in line]
        assert len(violations) <= 4, violations  # the connections' losses at the reload, not one per retry
        assert " ERROR " not in text, text[-3000:]
    finally:
        server.stop()
