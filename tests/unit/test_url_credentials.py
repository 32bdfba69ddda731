"""Credentials in server URLs: no part of a password shows in any message whatever characters it holds
(a comma splits server lists: such a list is refused without showing any piece of it), a URL's own
userinfo wins over `$NATS_USER`/`$NATS_PASSWORD`/`$NATS_TOKEN` (as nats.go), percent-decoded, and the
mount(8) SOURCE or `-o` may not carry credentials."""

from __future__ import annotations

import string
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from natsfs import auth
from natsfs.auth import Connection, resolve, split_servers
from natsfs.cli import main
from natsfs.secrecy import redact_url, redact_urls
from natsfs.wire import _connect_options, parse_server

NATSFS = str(Path(sys.executable).parent / "natsfs")
SPECIALS = string.punctuation + " "
INFO = {"auth_required": True}


@pytest.mark.parametrize("char", list(SPECIALS))
def test_no_character_of_a_password_shows_when_redacted(char):
    url = f"nats://alice:Top{char}Secret@h:4222"
    assert redact_url(url) == "nats://alice:***@h:4222"
    token = f"Top{char}Secret@h:4222"  # (a token; with a ':' it is user `Top` and a password)
    assert redact_url(token) == ("Top:***@h:4222" if char == ":" else "***@h:4222")


@pytest.mark.parametrize("char", list(SPECIALS))
def test_a_password_with_any_character_is_refused_or_kept_whole(char):
    """Split at commas as nats.go does: a password that would be cut (`,`) or would end the host part
    (`/`, `?`, `#`) is refused with a sentence naming none of it; any other stays whole in its URL."""
    url = f"nats://alice:Top{char}Secret@h:4222"
    raw = f"nats://other:4222,{url}"
    if char in ",/?#":
        with pytest.raises(auth.Unavailable) as e:
            split_servers(raw)
        assert "Top" not in str(e.value) and "Secret" not in str(e.value) and "percent-encoded" in str(e.value)
    else:
        servers = split_servers(raw)
        assert servers == ("nats://other:4222", url)
        assert "Top" not in redact_urls(servers) and "Secret" not in redact_urls(servers)


@pytest.mark.parametrize("raw", ["nats://alice:TopSecret,tail@h", "alice:TopSecret,tail@h",
                                 "nats://a:4222,nats://alice:TopSecret,tail@h", "tls://TopSecret,tail@h"])
def test_a_comma_in_a_password_is_refused_from_every_source(raw, tmp_path):
    for options, env in [({"server": raw}, {}), ({}, {"NATS_URL": raw})]:
        with pytest.raises(auth.Unavailable) as e:
            resolve(options, {"HOME": str(tmp_path), **env})
        assert "TopSecret" not in str(e.value) and "tail" not in str(e.value)


@pytest.mark.parametrize("command", [["mount", "MNT"], ["fsck", "b0"], ["bucket", "ls"]])
def test_the_commands_say_one_sentence_without_any_of_a_comma_password(command, tmp_path):
    argv = [NATSFS, *[str(tmp_path / "m") if c == "MNT" else c for c in command],
            "--server", "nats://alice:TopSecret,tail@127.0.0.1:1"]
    if command[0] == "mount":
        (tmp_path / "m").mkdir()
        argv += ["--cache-dir", str(tmp_path / "c"), "--data-dir", str(tmp_path / "d")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert "TopSecret" not in proc.stdout + proc.stderr and "tail" not in proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "percent-encoded (%2C)" in proc.stderr


def test_a_percent_encoded_password_is_sent_decoded():
    url = "nats://alice:Top%2CSecret%2F%40@h"
    c = resolve({"server": url}, {}).for_server(url)
    assert (c.user, c.password, c.token) == ("alice", "Top,Secret/@", None)
    assert c.connect_options() == {"user": "alice", "password": "Top,Secret/@"}  # (nats-py: not its URL's)
    sent = _connect_options(INFO, parse_server(url), c, "n")
    assert (sent["user"], sent["pass"]) == ("alice", "Top,Secret/@")


@pytest.mark.parametrize("env", [{"NATS_PASSWORD": "stale"}, {"NATS_USER": "eve", "NATS_PASSWORD": "stale"},
                                 {"NATS_TOKEN": "stale-token"}])
def test_the_urls_userinfo_wins_over_the_environment(env):
    url = "nats://alice:S3cretPW@h:4222"
    c = resolve({"server": url}, env).for_server(url)
    assert (c.user, c.password, c.token) == ("alice", "S3cretPW", None)
    assert c.connect_options() == {"user": "alice", "password": "S3cretPW"}
    sent = _connect_options(INFO, parse_server(url), c, "n")
    assert (sent.get("user"), sent.get("pass"), sent.get("auth_token")) == ("alice", "S3cretPW", None)
    # A URL's token (`token@`) likewise; a URL without userinfo takes the environment's credentials.
    token_url = "nats://tok3n@h"
    assert resolve({"server": token_url}, env).for_server(token_url).connect_options() == {"token": "tok3n"}
    plain = resolve({"server": "nats://h"}, env)
    assert plain.for_server("nats://h") == plain


def test_a_url_userinfo_is_per_server_and_keeps_nkey_and_tls_files():
    c = Connection(servers=("nats://alice:pw@a", "nats://b"), user="bob", password="bobpw", nkey_file="/k",
                   tls_ca="/ca")
    a = c.for_server("nats://alice:pw@a")
    assert (a.user, a.password, a.nkey_file, a.tls_ca) == ("alice", "pw", "/k", "/ca")
    assert c.for_server("nats://b") is c


@pytest.mark.parametrize("source", ["nats://alice:S3cretPW@127.0.0.1:4222/b1", "nats://tok3n@h/b1",
                                    "nats://a:4222,nats://alice:S3cretPW@b:4222"])
def test_a_mount_source_with_credentials_is_refused(source, capsys):
    with pytest.raises(SystemExit) as e:
        main([source, "/mnt/x", "-o", "cache_dir=/tmp/x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "the mount SOURCE cannot carry a user, password or token" in err
    assert "S3cretPW" not in err and "tok3n" not in err


def test_a_password_cut_by_a_comma_in_o_server_never_shows(capsys):
    with pytest.raises(SystemExit):
        main(["natsfs", "/mnt/x", "-o", "server=nats://alice:TopSecret,ta=il@h"])
    with pytest.raises(SystemExit):
        main(["natsfs", "/mnt/x", "-o", "server=nats://alice:TopSecret,tail@h"])
    err = capsys.readouterr().err
    assert "TopSecret" not in err and "tail" not in err and "il@h" not in err


def test_percent_encoding_is_how_such_passwords_are_written():
    assert split_servers(f"nats://alice:{quote('Top,Secret/?#', safe='')}@h,nats://b") == (
        "nats://alice:Top%2CSecret%2F%3F%23@h", "nats://b")
