"""config.parse_size / parse_duration: the units users type on the command line."""

from __future__ import annotations

import pytest

from natsfs.config import parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("0", 0),
        (4096, 4096),
        ("512k", 512 * 1024),
        ("512K", 512 * 1024),
        ("512KiB", 512 * 1024),
        ("10M", 10 * 2**20),
        ("10m", 10 * 2**20),
        ("64MiB", 64 * 2**20),
        ("10MB", 10 * 10**6),
        ("10kB", 10_000),
        ("1GiB", 2**30),
        ("1G", 2**30),
        ("2GB", 2 * 10**9),
        ("1TiB", 2**40),
        ("1PiB", 2**50),
        ("1.5GiB", 3 * 2**29),
        ("0.5k", 512),
        (" 8 MiB ", 8 * 2**20),
        ("100B", 100),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1", "1.5", "ten", "10XB", "1e6", "10 M B x", "0x10"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match=r"size|bytes"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", 30.0),
        ("30", 30.0),
        ("0", 0.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("7d", 7 * 86400.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
        (" 10 s ", 10.0),
        (12, 12.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "s", "-5s", "5 minutes", "1w", "5M", "1h30m", "abc"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--server", "nats://a:4222"], 10.0),
        (["--server", "nats://a:4222,nats://b:4222,nats://c:4222"], 30.0),
        (["--server", "nats://a:4222,nats://b:4222", "--flush-timeout", "5s"], 5.0),
    ],
)
def test_flush_timeout_waits_out_a_cluster_election_when_several_servers_are_given(args, expected):
    from natsfs.cli import build_parser, config_from_args, connection_from_args

    a = build_parser().parse_args(["mount", "/mnt/x", *args])
    config = config_from_args(a, connection_from_args(a))
    assert config.flush_timeout == expected


def test_a_cluster_whose_port_was_taken_at_start_picks_its_ports_again(tmp_path, monkeypatch):
    """`free_port` can only pick a port, not hold it: another process may bind it first."""
    from natsfs.errors import Unavailable
    from natsfs.server import NatsCluster, NatsServer

    starts: list[int | None] = []

    def start(self: NatsServer, timeout: float = 15.0) -> str:
        starts.append(self.port)
        if len(starts) == 2:
            raise Unavailable('nats-server exited at start: listen tcp: bind: address already in use')
        return self.url

    monkeypatch.setattr(NatsServer, "start", start)
    monkeypatch.setattr(NatsServer, "stop", lambda self, timeout=10.0: None)
    monkeypatch.setattr(NatsCluster, "wait_healthy", lambda self, nodes=None, timeout=30.0: None)
    cluster = NatsCluster(tmp_path, size=3)
    first = list(cluster.client_ports)
    assert cluster.start() == cluster.urls
    assert len(starts) == 5 and cluster.client_ports != first  # 2 tries of the first, then all 3 again
