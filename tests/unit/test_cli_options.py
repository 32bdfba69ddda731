"""The command line: mount(8)'s SOURCE form, `-o key=value` for every option, the daemon's arguments,
and the connection settings from options, the environment and NATS CLI contexts (natsfs/cli.py, auth.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from natsfs import auth
from natsfs.cli import (
    build_parser,
    config_from_args,
    daemon_arguments,
    expand_mount_options,
    normalize_argv,
    source_arguments,
)
from natsfs.config import Config, option_fields


def _mount_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["mount"]


def test_source_forms():
    assert source_arguments("nats://h:4222") == ["--server", "nats://h:4222"]
    assert source_arguments("nats://h:4222/b1") == ["--server", "nats://h:4222", "--bucket", "b1"]
    assert source_arguments("nats://a:4222,nats://b:4222/b1") == ["--server", "nats://a:4222,nats://b:4222",
                                                                  "--bucket", "b1"]
    assert source_arguments("tls://h:4222/") == ["--server", "tls://h:4222"]
    assert source_arguments("natsfs") == []


def test_mount_helper_form_becomes_mount():
    argv = normalize_argv(["nats://h:4222/b1", "/mnt/x", "-o", "rw,ro"])
    assert argv == ["mount", "/mnt/x", "--server", "nats://h:4222", "--bucket", "b1", "-o", "rw,ro"]
    assert normalize_argv(["bucket", "ls"]) == ["bucket", "ls"]


def test_every_option_as_o_key_value():
    argv = expand_mount_options(_mount_parser(), ["/mnt", "-o", "cache_dir=/var/cache/natsfs,bucket=b",
                                                  "-oro,allow_other,default_permissions,_netdev,nofail,"
                                                  "x-systemd.automount,uid=1000,gid=100,umask=027,dev,suid,rw,"
                                                  "compression,nosuid", "-o", "creds=/c,tls_ca=/ca"])
    a = _mount_parser().parse_args(argv)
    config = config_from_args(a, auth.Connection())
    assert config.cache_dir == Path("/var/cache/natsfs") and config.bucket == "b"
    assert config.read_only and config.compression
    assert (config.uid, config.gid, config.umask, config.file_mode, config.dir_mode) == (1000, 100, 0o27, 0o640,
                                                                                          0o750)
    assert config.fuse_options == ("allow_other", "default_permissions", "nosuid")
    assert (a.creds_file, a.tls_ca) == ("/c", "/ca")


def test_options_are_generated_from_config():
    """Every `option(...)` field of Config is a mount option with its default and parser."""
    a = _mount_parser().parse_args(["/mnt", "--cache-size", "1GiB", "--entry-timeout", "5m", "--max-bytes", "-1"])
    config = config_from_args(a, auth.Connection())
    assert (config.cache_size, config.entry_timeout, config.attr_timeout, config.max_bytes) == (1 << 30, 300, 300, -1)
    assert config.spool_size == Config(mountpoint=Path("/")).spool_size  # not given: the field's default
    flags = {s for act in _mount_parser()._actions for s in act.option_strings}
    assert {"--" + f.name.replace("_", "-") for f in option_fields()} <= flags
    with pytest.raises(ValueError, match="--cache-size: not a size"):
        config_from_args(_mount_parser().parse_args(["/mnt", "--cache-size", "lots"]), auth.Connection())


@pytest.mark.parametrize("bad, message", [("frobnicate", "unknown mount option: frobnicate"),
                                          ("bucket", "needs a value"), ("read_only=1", "takes no value"),
                                          ("ready_fd=3", "unknown mount option"),
                                          ("password=pw", "use password_file=FILE"),
                                          ("server=nats://u:s3cr3t@h", "or token_file=FILE"),
                                          ("server=nats://t0k3n@b", "or token_file=FILE")])
def test_bad_o_options_are_refused(bad, message, capsys):
    with pytest.raises(SystemExit):
        expand_mount_options(_mount_parser(), ["/mnt", "-o", bad])
    err = capsys.readouterr().err
    assert message in err and "s3cr3t" not in err and "t0k3n" not in err


def test_a_server_url_without_secrets_is_a_mount_option():
    assert expand_mount_options(_mount_parser(), ["/mnt", "-o", "server=nats://h:4222"]) == \
        ["--server", "nats://h:4222", "/mnt"]


@pytest.mark.parametrize("user_option", ["nats_user", "user"])
def test_user_with_a_value_is_the_nats_user_and_the_bare_user_flag_is_dropped(tmp_path, user_option):
    """What the refusals of secrets in mount options advise (`nats_user=NAME` with `password_file=FILE`)
    works from fstab. mount(8) drops `user=NAME` from another user's mount of a `users` line, and passes
    its own bare `user` flag (dropped here); where root mounts, `user=NAME` is the NATS user too."""
    (tmp_path / "pw").write_text("s3cr3t\n")
    argv = expand_mount_options(_mount_parser(), ["/mnt", "-o", f"{user_option}=alice,password_file="
                                                  f"{tmp_path / 'pw'},user,users,_netdev"])
    a = _mount_parser().parse_args(argv)
    connection = auth.resolve({name: getattr(a, name, None) for name in auth.OPTION_DESTS}, environ={})
    assert (connection.user, connection.password) == ("alice", "s3cr3t")


def test_the_secret_refusals_advise_the_user_option_that_survives_a_users_mount(capsys):
    with pytest.raises(SystemExit):
        expand_mount_options(_mount_parser(), ["/mnt", "-o", "password=s3cr3t"])
    with pytest.raises(SystemExit):
        expand_mount_options(_mount_parser(), ["/mnt", "-o", "server=nats://u:s3cr3t@h:4222"])
    err = capsys.readouterr().err
    assert "nats_user=NAME" in err and "s3cr3t" not in err


def test_daemon_gets_the_users_arguments_without_connection_options():
    argv = ["mount", "--bucket", "b", "rel/mnt", "--server", "nats://u:pw@h", "--password=pw", "--token-file",
            "/t", "--log-file", "/l", "--cache-size", "1GiB", "-o", "allow_other", "--read-only"]
    assert daemon_arguments(argv, Path("rel/mnt"), "/abs/rel/mnt") == [
        "mount", "/abs/rel/mnt", "--bucket", "b", "--cache-size", "1GiB", "-o", "allow_other", "--read-only"]
    # An option whose value is optional never takes the next option as its value.
    argv = ["mount", "/m", "--write-back", "--server", "nats://u:pw@h", "--write-back", "5s"]
    assert daemon_arguments(argv, Path("/m"), "/m") == ["mount", "/m", "--write-back", "--write-back", "5s"]
    parsed = config_from_args(_mount_parser().parse_args(expand_mount_options(_mount_parser(), [
        "/m", "-o", "write_back"])), auth.Connection())
    assert parsed.write_back == 0.0


def test_connection_precedence_options_then_environment_then_context(tmp_path):
    ctx = tmp_path / "nats" / "context"
    ctx.mkdir(parents=True)
    (ctx / "prod.json").write_text(json.dumps({"url": "nats://ctx:4222", "user": "cu", "password": "cp",
                                               "creds": "~/x.creds", "ca": "/ca.pem"}))
    (tmp_path / "nats" / "context.txt").write_text("prod")
    env = {"XDG_CONFIG_HOME": str(tmp_path), "NATS_USER": "eu", "NATS_PASSWORD": "ep", "HOME": "/home/h"}
    c = auth.resolve({"user": "ou"}, env)
    assert c.servers == ("nats://ctx:4222",) and (c.user, c.password) == ("ou", "ep")
    assert c.creds_file == "/home/h/x.creds" and c.tls_ca == "/ca.pem"
    assert "ep" not in repr(c) and "password='***'" in repr(c)
    assert auth.Connection.from_json(c.to_json()) == c
    with pytest.raises(auth.Unavailable, match="NATS context 'nope'"):
        auth.resolve({"context": "nope"}, env)
    assert auth.resolve({}, {"HOME": str(tmp_path / "none")}) == auth.Connection()


def test_secret_files_and_variables(tmp_path):
    (tmp_path / "pw").write_text("from-file\n")
    c = auth.resolve({"password_file": str(tmp_path / "pw"), "server": "nats://a,nats://b"},
                     {"HOME": str(tmp_path), "NATS_TOKEN": "tok"})
    assert c.password == "from-file" and c.token == "tok" and c.servers == ("nats://a", "nats://b")
    assert c.connect_options() == {"password": "from-file", "token": "tok"}


@pytest.mark.parametrize("content, message", [(b"\xe8s3cr3t\xff", "is not UTF-8 text"), (b" \n", "is empty")])
@pytest.mark.parametrize("option, what", [("password_file", "password"), ("token_file", "token")])
def test_a_password_or_token_file_that_holds_no_secret_is_one_sentence_naming_it(tmp_path, content, message,
                                                                                 option, what):
    """Not a traceback (UnicodeDecodeError, with a byte of the secret in it), nor a connection refused with
    an Authorization Violation for no stated reason: the file named, nothing of its content shown."""
    path = tmp_path / "secret"
    path.write_bytes(content)
    with pytest.raises(auth.Unavailable) as refused:
        auth.resolve({option: str(path)}, {"HOME": str(tmp_path)})
    assert str(refused.value) == f"the {what} file {path} {message}"


@pytest.mark.parametrize("servers", ["http://alice:s3cr3t@h:4222", "nats://a:4222,HTTPS://h:4222"])
def test_a_server_url_of_no_nats_scheme_is_one_sentence_without_its_secret(servers):
    """nats-py took `http://h:4222` for a host to resolve, and the mount failed with `Name or service not
    known`."""
    with pytest.raises(auth.Unavailable) as refused:
        auth.resolve({"server": servers}, {})
    assert "is no NATS scheme: use nats://, tls://, ws:// or wss://" in str(refused.value)
    assert "s3cr3t" not in str(refused.value)
    assert auth.resolve({"server": "NATS://a:1,tls://b:2,ws://c:3,wss://d:4,e:5"}, {}).servers == (
        "NATS://a:1", "tls://b:2", "ws://c:3", "wss://d:4", "e:5")


@pytest.mark.parametrize("kind", ["creds", "nkey"])
def test_a_damaged_creds_or_nkey_file_is_one_sentence_naming_it(tmp_path, kind):
    """Found before connecting, with the file named and nothing of its content shown."""
    import nkeys

    seed = nkeys.encode_seed(b"\x07" * 32, nkeys.PREFIX_BYTE_USER).decode()
    good = (f"-----BEGIN NATS USER JWT-----\neyJhbGciOi.e30.c2ln\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n") if kind == "creds" \
        else seed + "\n"
    bad = good.replace(seed, "SU" + "X" * 56)
    path = tmp_path / "key"
    field = "creds_file" if kind == "creds" else "nkey_file"
    path.write_text(good)
    auth.Connection(**{field: str(path)}).check_files()
    for damaged in (bad, "garbage\n", ""):
        path.write_text(damaged)
        with pytest.raises(auth.Unavailable) as raised:
            auth.Connection(**{field: str(path)}).check_files()
        message = str(raised.value)
        assert message.startswith(f"{path} (given as --{kind}) is not ") and "SU" not in message


@pytest.mark.parametrize("options", [["-o", "write_back,cache_dir=spool"], ["-owrite_back=30s", "--cache-dir=spool"],
                                     ["--write-back", "--cache-dir", "spool"]])
def test_umount_finds_write_back_however_the_daemon_was_given_it(options):
    """natsfs@.service passes NATSFS_OPTIONS as `-o write_back,cache_dir=...`: `natsfs umount` must still
    wait for the uploads (it reads the daemon's command line with the daemon's own parser)."""
    from natsfs.cli import write_back_progress_file
    from natsfs.compose import spool_root
    from natsfs.core.writeback import PROGRESS_FILE

    argv = ["/usr/bin/python3", "-I", "-m", "natsfs", "mount", "/mnt/x", "--foreground", "--server", "nats://h:4222",
            *options]
    assert write_back_progress_file(argv, "/srv", "/mnt/x") == spool_root(Path("/srv/spool"), Path("/mnt/x")) \
        / PROGRESS_FILE
    assert write_back_progress_file([*argv[:5], "/mnt/x", "--foreground", "-o", "cache_dir=/c"], "/", "/mnt/x") \
        is None


@pytest.mark.parametrize("args, message", [
    (["--uid", "-1"], "--uid: -1 is too small (at least 0)"),
    (["--uid", "4294967296"], "--uid: 4294967296 is too large (at most 4294967294)"),
    (["--gid", "99999999999"], "--gid: 99999999999 is too large"),
    (["--uid", "me"], "--uid: not a whole number: 'me'"),
    (["--chunk-size", "0"], "--chunk-size: 0 is too small (at least 1024)"),
    (["--chunk-size", "1GiB"], "--chunk-size: 1073741824 is too large (at most 67108864)"),
    (["--cache-size", "0"], "--cache-size: 0 is too small"),
    (["--max-meta-bytes", "10"], "--max-meta-bytes: 10 is too small"),
    (["--request-timeout", "0"], "--request-timeout: 0 s is too small"),
    (["--flush-timeout", "0"], "--flush-timeout: 0 s is too small"),
    (["--entry-timeout", "0"], "--entry-timeout: 0 s is too small"),
    (["--shutdown-timeout", "99999999999d"], "--shutdown-timeout: 8.64e+15 s is too large"),
    (["--replicas", "0"], "--replicas: 0 is too small (at least 1)"),
    (["--max-bytes", "0"], "--max-bytes: 0 is too small (at least 1)"),
])
def test_numbers_out_of_range_are_refused_when_parsed(args, message):
    """(A uid beyond 32 bits mounted, then every request failed EIO; a chunk size of 0 every store.)"""
    with pytest.raises(ValueError) as e:
        config_from_args(_mount_parser().parse_args(["/mnt", *args]), auth.Connection())
    assert str(e.value).startswith(message)


def test_numbers_in_range_are_taken():
    config = config_from_args(_mount_parser().parse_args(
        ["/mnt", "--uid", "0", "--gid", "4294967294", "--chunk-size", "1KiB", "--max-bytes", "-1", "--replicas", "5",
         "--shutdown-timeout", "0", "--write-back", "0s"]), auth.Connection())
    assert (config.uid, config.gid, config.chunk_size, config.max_bytes, config.replicas) == (0, 2**32 - 2, 1024,
                                                                                              -1, 5)


@pytest.mark.parametrize("argv, message", [
    (["fsck", "b0", "--grace", "xyz"], "natsfs: argument --grace: not a duration: 'xyz'"),
    (["bucket", "create", "b", "--max-bytes", "12x"], "natsfs: argument --max-bytes: not a size: '12x'"),
    (["bucket", "create", "b", "--ttl", "forever"], "natsfs: argument --ttl: not a duration: 'forever'"),
    (["mount", "/mnt", "-o", "frobnicate"], "natsfs: unknown mount option: frobnicate"),
])
def test_refused_arguments_are_one_sentence(argv, message, capsys):
    """(Were a ValueError traceback at run time, or the usage block before the sentence.)"""
    from natsfs.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_bucket_and_fsck_numbers_are_parsed_with_the_arguments():
    parser = build_parser()
    a = parser.parse_args(["bucket", "create", "b", "--max-bytes", "1MiB", "--ttl", "7d", "--replicas", "3"])
    assert (a.max_bytes, a.ttl, a.replicas) == (1 << 20, 7 * 86400, 3)
    assert parser.parse_args(["bucket", "create", "b"]).max_bytes == -1
    assert parser.parse_args(["fsck", "b"]).grace == 300


def test_local_paths_inside_the_mountpoint_or_under_a_file_are_refused(tmp_path):
    """A log inside the mountpoint deadlocked the daemon (it stats the log path through its own mount);
    a file where a directory must be was a NotADirectoryError traceback."""
    from natsfs.cli import check_local_paths

    mp = tmp_path / "mnt"
    mp.mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "into").symlink_to(mp)

    def problem(*args: str, log: str | None = None) -> str | None:
        config = config_from_args(_mount_parser().parse_args([str(mp), *args]), auth.Connection())
        return check_local_paths(config, Path(log) if log else None)

    ok = ["--cache-dir", str(tmp_path / "c"), "--data-dir", str(tmp_path / "d")]
    assert problem(*ok, log=str(tmp_path / "logs" / "x.log")) is None
    assert problem(*ok, log=str(mp / "self.log")) == (
        f"--log-file {mp / 'self.log'} is inside the mountpoint {mp}: the daemon would wait on its own mount; "
        "choose a path outside it")
    assert "--log-file" in problem(*ok, log=str(tmp_path / "into" / "x.log"))  # through a symlink
    assert problem("--cache-dir", str(mp / "c"), "--data-dir", str(tmp_path / "d")).startswith("--cache-dir")
    assert problem("--cache-dir", str(tmp_path / "c"), "--data-dir", str(mp)).startswith("--data-dir")
    assert problem("--cache-dir", str(tmp_path / "afile"), "--data-dir", str(tmp_path / "d")) == \
        f"--cache-dir {tmp_path / 'afile'} cannot be used: {tmp_path / 'afile'} is not a directory"
    assert problem("--cache-dir", str(tmp_path / "c"), "--data-dir", str(tmp_path / "afile" / "sub")) == \
        f"--data-dir {tmp_path / 'afile' / 'sub'} cannot be used: {tmp_path / 'afile'} is not a directory"
    assert problem(*ok, log=str(tmp_path / "afile" / "sub" / "x.log")) == \
        f"--log-file {tmp_path / 'afile' / 'sub' / 'x.log'} cannot be used: {tmp_path / 'afile'} is not a directory"


def test_output_to_a_reader_that_went_away_ends_quietly(tmp_path):
    """`natsfs bucket ls | head -1`: the reader closes the pipe; the command ended in a BrokenPipeError
    traceback. Now it stops with no output on stderr and the status of a filter killed by SIGPIPE."""
    import subprocess
    import sys

    script = ("import sys\n"
              "from natsfs import cli\n"
              "def many_lines(a):\n"
              "    for i in range(200000):\n"
              "        print(f'bucket{i}\\t0 bytes')\n"
              "    return 0\n"
              "cli.cmd_bucket = many_lines\n"
              "sys.exit(cli.main(['bucket', '--server', 'nats://127.0.0.1:1', 'ls']))\n")
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=tmp_path)
    assert reader.stdout is not None and reader.stderr is not None
    assert reader.stdout.readline() == b"bucket0\t0 bytes\n"
    reader.stdout.close()  # as `head -1` does after its line
    stderr = reader.stderr.read()
    assert reader.wait(60) == 141
    assert stderr == b""
