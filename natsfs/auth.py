"""How natsfs authenticates to NATS: the connection settings, where they come from, and their options.

`Connection` holds the server URLs and every credential NATS knows (user/password, token, NKey seed
file, creds file, TLS CA/cert/key). `resolve` builds it the way the NATS CLI does, first match wins:
command-line options (a password or token also from `--password-file`/`--token-file`), then the
`NATS_URL`/`NATS_USER`/`NATS_PASSWORD`/`NATS_TOKEN`/`NATS_CREDS`/`NATS_NKEY`/`NATS_CA`/`NATS_CERT`/
`NATS_KEY` environment variables, then a NATS CLI context (`--context NAME`, `$NATS_CONTEXT`, or the
one selected in `~/.config/nats/context.txt`), read from `~/.config/nats/context/NAME.json`.

Secrets (the password, the token, a password in a URL) travel to child processes as JSON through a
pipe (`to_json`/`from_json`), never in argv or the environment; `repr` and every message redact them.
The bridge turns a `Connection` into nats-py connect options with `connect_options`.

A password or token taken from `--password-file`/`--token-file` keeps the file's (absolute) path beside
it (`password_file`, `token_file`, which travel with it), and `refreshed` reads the file again: every
connection is made with `refreshed()` settings, so a secret rotated by rewriting its file is used from
the next connect on (a reconnect after the server dropped the connection, or a new upload worker),
without remounting. A file that cannot be read then, or holds nothing, keeps the secret read before,
said once at WARNING naming the file (never its content) until it is readable again. (A creds or NKey
file is read anew at every connect anyway.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import ssl
import stat
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import nkeys  # type: ignore[import-untyped]

from .errors import Unavailable
from .secrecy import REDACTED, redact_urls

log = logging.getLogger(__name__)

# Environment variables that carry connection settings; children never inherit them (they get a pipe).
ENV_VARS = {"servers": "NATS_URL", "user": "NATS_USER", "password": "NATS_PASSWORD", "token": "NATS_TOKEN",
            "creds_file": "NATS_CREDS", "nkey_file": "NATS_NKEY", "tls_ca": "NATS_CA", "tls_cert": "NATS_CERT",
            "tls_key": "NATS_KEY"}
# NATS CLI context JSON keys for our fields.
_CONTEXT_KEYS = {"servers": "url", "user": "user", "password": "password", "token": "token",
                 "creds_file": "creds", "nkey_file": "nkey", "tls_ca": "ca", "tls_cert": "cert", "tls_key": "key"}
SECRET_FIELDS = ("password", "token")
# The command-line options (dest → help); --server, --context and the *-file variants are added too.
OPTION_HELP = {
    "user": "user name (default: $NATS_USER)",
    "password": "password; visible to `ps`: prefer --password-file or $NATS_PASSWORD",
    "token": "authentication token; visible to `ps`: prefer --token-file or $NATS_TOKEN",
    "creds_file": "user JWT + NKey seed file (.creds) (default: $NATS_CREDS)",
    "nkey_file": "NKey seed file (default: $NATS_NKEY)",
    "tls_ca": "CA certificate(s) that sign the server's certificate (default: $NATS_CA)",
    "tls_cert": "client certificate for TLS (default: $NATS_CERT)",
    "tls_key": "client certificate's private key (default: $NATS_KEY)",
}
OPTION_FLAGS = {"creds_file": "--creds", "nkey_file": "--nkey"}


@dataclass(frozen=True)
class Connection:
    servers: tuple[str, ...] = ()
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkey_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # The files `password` and `token` were read from (`--password-file`, `--token-file`): read again
    # before each connect (`refreshed`). Paths, not secrets.
    password_file: str | None = None
    token_file: str | None = None

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}
        for name in SECRET_FIELDS:
            if name in shown:
                shown[name] = REDACTED
        if "servers" in shown:
            shown["servers"] = redact_urls(self.servers)
        return f"Connection({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    __str__ = __repr__

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes | bytearray) -> Connection:
        doc = json.loads(text)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        values["servers"] = tuple(values.get("servers") or ())
        return cls(**values)

    def for_server(self, server: str) -> Connection:
        """The credentials for a connection to `server`. A URL's own userinfo (`user:password@`, or a
        token as `token@`) wins over every other user, password and token (options, environment,
        context), as in nats.go, which sends a URL's userinfo whenever it has one; it is taken
        percent-decoded, as nats.go does (nats-py would send `%2C` as it is), and passed on as explicit
        credentials (which nats-py and `wire` send before a URL's). NKey and creds files stay: nats.go
        sends them too."""
        if not has_userinfo(server):
            return self
        userinfo = (server.partition("://")[2] if "://" in server else server).rpartition("@")[0]
        user, colon, password = userinfo.partition(":")
        if colon:
            return replace(self, user=unquote(user), password=unquote(password), token=None, password_file=None,
                           token_file=None)
        return replace(self, user=None, password=None, token=unquote(user), password_file=None, token_file=None)

    def refreshed(self, level: int = logging.WARNING) -> Connection:
        """These settings with the password and token read again from the files they came from
        (`password_file`, `token_file`): what a connection about to authenticate uses, so that a secret
        rotated by rewriting its file is sent from the next connect on. A file that cannot be read now,
        or is empty or not UTF-8, keeps the secret held here (the last one read), said at `level` once
        per file (and process) until it is readable again, naming the file and never its content."""
        changes: dict[str, Any] = {}
        for name in SECRET_FIELDS:
            path = getattr(self, f"{name}_file")
            if not path:
                continue
            try:
                secret = _read_secret_file(path, name)
            except Unavailable as e:
                _SECRET_FILES.failed(path, f"{e}; keeping the {name} read before", level)
                continue
            _SECRET_FILES.read(path, name, secret, changed=secret != getattr(self, name))
            if secret != getattr(self, name):
                changes[name] = secret
        return replace(self, **changes) if changes else self

    def connect_options(self) -> dict[str, Any]:
        """nats-py `connect()` keyword arguments for these credentials (not the servers)."""
        options: dict[str, Any] = {}
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.nkey_file:
            options["nkeys_seed"] = self.nkey_file
        if self.user:
            options["user"] = self.user
        if self.password:
            options["password"] = self.password
        if self.token:
            options["token"] = self.token
        if self.tls_ca or self.tls_cert:
            options["tls"] = self.ssl_context()
        return options

    def ssl_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                # OpenSSL asks for the passphrase of an encrypted key on the terminal (or fails with EINVAL
                # without one): never prompt, say what it is.
                context.load_cert_chain(self.tls_cert, self.tls_key, password=_no_passphrase)
        except _EncryptedKey:
            raise Unavailable(f"the TLS key {self.tls_key or self.tls_cert} is encrypted: natsfs cannot ask for its "
                              "passphrase (decrypt it, e.g. `openssl pkey -in KEY -out KEY.plain`, and keep that "
                              "file readable by you only)") from None
        except ssl.SSLError as e:
            if self.tls_cert and not self.tls_key:
                raise Unavailable(f"cannot load the TLS client certificate {self.tls_cert}: it holds no private "
                                  "key, give it with --tls-key") from None
            raise Unavailable(f"cannot load the TLS files: {e}") from None
        except OSError as e:
            raise Unavailable(f"cannot load the TLS files: {e}") from None
        return context

    def check_files(self) -> None:
        """Each named file is readable: a typo is one clear sentence, not a failed handshake later."""
        for name in ("creds_file", "nkey_file", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                flag = OPTION_FLAGS.get(name, "--" + name.replace("_", "-"))
                raise Unavailable(f"cannot read {path} (given as {flag})")
        if self.creds_file:
            _check_seed(self.creds_file, "--creds", "a NATS credentials file (a user JWT and an NKey seed)",
                        creds=True)
        if self.nkey_file:
            _check_seed(self.nkey_file, "--nkey", "an NKey seed file", creds=False)


class _EncryptedKey(Exception):
    """OpenSSL asked for the passphrase of the TLS key."""


def _no_passphrase() -> str:
    raise _EncryptedKey


def _creds_block(title: str) -> bytes:
    """The pattern of a creds file block (`-----BEGIN <title>-----`, its one line, `------END...`)."""
    return rb"-{3,}[^\n]*BEGIN " + title.encode() + rb"[^\n]*\n\s*(\S+)\s*\n"


def _check_seed(path: str, flag: str, what: str, *, creds: bool) -> None:
    """The file holds what nats-py will sign with (and, for creds, a user JWT): a damaged file is one
    sentence naming it now, not an unexplained failure at connect. Nothing of its content is shown."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise Unavailable(f"cannot read {path} (given as {flag}): {e.strerror}") from None
    if creds:
        jwt = re.search(_creds_block("NATS USER JWT"), data)
        found = re.search(_creds_block("USER NKEY SEED"), data)
        seed = found.group(1) if found is not None and jwt is not None else b""
    else:
        seed = data.strip()
    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except Exception:  # nkeys raises its own error classes, and others on odd input
        raise Unavailable(f"{path} (given as {flag}) is not {what}") from None


def nats_config_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(environ.get("HOME") or str(Path.home()), ".config")
    return Path(base) / "nats"


def _context(name: str | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """The NATS CLI context `name` (or the selected one); {} when none is selected."""
    directory = nats_config_dir(environ)
    explicit = bool(name)
    if not name:
        name = environ.get("NATS_CONTEXT")
        explicit = bool(name)
    if not name:
        try:
            name = (directory / "context.txt").read_text().strip()
        except OSError:
            return {}
        if not name:
            return {}
    path = directory / "context" / f"{name}.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        if explicit:
            raise Unavailable(f"cannot read NATS context {name!r} ({path}): {e.strerror}") from None
        return {}
    except ValueError:
        raise Unavailable(f"NATS context {name!r} ({path}) is not valid JSON") from None
    return doc if isinstance(doc, dict) else {}


def _read_secret_file(path: str, what: str) -> str:
    """The secret in `path`, stripped. A file that is not UTF-8 text, or holds nothing, is one sentence
    naming the file (never a byte of its content), not a traceback or a connection refused for no
    stated reason."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Unavailable(f"cannot read the {what} file {path}: {e.strerror}") from None
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise Unavailable(f"the {what} file {path} is not UTF-8 text") from None
    if not secret:
        raise Unavailable(f"the {what} file {path} is empty")
    return secret


def _rereadable(path: str) -> str | None:
    """The absolute path to read the secret file `path` again at (`Connection.refreshed`), None when it
    cannot be: not a regular file (the pipe of `--password-file <(...)`, a device), or named through a
    process's descriptors (`/dev/fd/N`, `/dev/stdin`, `/proc/self/fd/N`): in the daemon and the upload
    worker that number is another descriptor (a spool file, a pipe), whose bytes would go to the server
    as the secret, or whose read would block."""
    absolute = os.path.abspath(path)
    try:
        if not stat.S_ISREG(os.stat(absolute).st_mode):
            return None
        hop = absolute
        for _ in range(40):  # (each symbolic link on the way, as the kernel follows them)
            directory = os.path.realpath(os.path.dirname(hop))
            if directory == "/proc" or directory.startswith("/proc/"):
                return None
            hop = os.path.join(directory, os.path.basename(hop))
            if not os.path.islink(hop):
                return absolute
            hop = os.path.join(directory, os.readlink(hop))
    except OSError:
        pass
    return None


class _SecretFiles:
    """What the process last found in each secret file it read again: whether the file failed (said
    once until it is readable again) and a digest of its secret (a change is said once, whichever of
    the process's connections reads it first). A process's connections run in two threads (asyncio
    and trio)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[str, int] = {}  # path -> the level its failure was said at
        self._digests: dict[str, bytes] = {}

    def failed(self, path: str, message: str, level: int) -> None:
        with self._lock:
            if self._failing.get(path, -1) >= level:  # (said already: by a quiet connection, said again louder)
                return
            self._failing[path] = level
        log.log(level, "%s", message)

    def read(self, path: str, what: str, secret: str, *, changed: bool) -> None:
        """`path` was read (`secret`); `changed`: not the secret the reading connection held."""
        digest = hashlib.sha256(secret.encode()).digest()  # (only to tell a change: the secret is not kept)
        with self._lock:
            again = self._failing.pop(path, None) is not None
            before = self._digests.get(path)
            self._digests[path] = digest
        if again:
            log.info("the %s file %s is readable again", what, path)
        if before != digest and (before is not None or changed):
            log.info("the %s in %s changed: new connections use the new one", what, path)


_SECRET_FILES = _SecretFiles()


# The URL schemes nats-py connects with.
SCHEMES = ("nats", "tls", "ws", "wss")


def split_servers(raw: str | None) -> tuple[str, ...]:
    """A comma list of server URLs as its URLs, as nats.go splits it (at every comma).

    A comma, `/`, `?` or `#` inside a URL's password or token would cut that secret in two, and a piece
    of it would then show as a URL of its own (or a host) in messages: such a list is refused with one
    sentence that shows none of it. A comma belongs to a password when a piece after it carries an `@`
    but no scheme (`nats://u:pa,ss@h` gives `nats://u:pa` and `ss@h`); so in a list, each URL with
    credentials needs its scheme."""
    pieces = [s.strip() for s in (raw or "").split(",")]
    servers = tuple(s for s in pieces if s)
    if len(pieces) > 1 and any("@" in s and "://" not in s for s in pieces):
        raise Unavailable("a server URL's password or token holds a comma, which separates servers: write it "
                          "percent-encoded (%2C), and give each server of a list its scheme (nats://user:pw@host)")
    for server in servers:
        scheme = server.partition("://")[0] if "://" in server else "nats"
        if scheme.lower() not in SCHEMES:
            # (nats-py took http:// for a host name to resolve: "Name or service not known")
            raise Unavailable(f"a server URL starts with {scheme}://, which is no NATS scheme: use nats://, tls://, "
                              "ws:// or wss://")
        userinfo = server.partition("://")[2] if "://" in server else server
        if "@" in userinfo and any(c in userinfo.rpartition("@")[0] for c in "/?#"):
            raise Unavailable("a server URL's password or token holds '/', '?' or '#', which end the host part of "
                              "a URL: write them percent-encoded (%2F, %3F, %23)")
    return servers


def has_userinfo(server: str) -> bool:
    """Whether a server URL carries credentials (`user:password@` or `token@`)."""
    return "@" in (server.partition("://")[2] if "://" in server else server)


def tls_wanted(server: str, auth: Connection | None) -> bool:
    """Whether a connection to `server` must be TLS, as nats.go decides `Secure`: a `tls://` URL (any in
    the server list: nats.go turns TLS on for its whole pool), or a TLS CA, client certificate or key.
    Such a connection to a server that does not offer TLS is refused before anything (credentials) is
    sent."""
    if server.partition("://")[0].lower() == "tls":
        return True
    if auth is None:
        return False
    return bool(auth.tls_ca or auth.tls_cert or auth.tls_key) or any(
        s.partition("://")[0].lower() == "tls" for s in auth.servers)


NO_TLS = ("the server does not offer TLS, which a tls:// URL or a TLS option (--tls-ca, --tls-cert, --tls-key) asks "
          "for: refusing to send credentials in clear")
CLIENT_CERT_WANTED = ("the server asks for a TLS client certificate, and none was given (--tls-cert and --tls-key, "
                      "or $NATS_CERT and $NATS_KEY)")


def client_cert_missing(info: Mapping[str, Any], auth: Connection | None) -> bool:
    """Whether a failed connection is explained by the server's INFO asking for a client certificate
    (`tls_verify`) that was not given: the server then drops the connection with a TLS alert that, by
    timing, reaches the client as `Connection lost` or a broken pipe rather than as the alert."""
    return bool(info.get("tls_verify")) and not (auth is not None and auth.tls_cert)


def resolve(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Connection:
    """Connection settings from parsed options (`server`, `context`, `password_file`, `token_file` and
    the `OPTION_HELP` names; missing or None = not given), the environment, and the NATS CLI context."""
    env = os.environ if environ is None else environ
    given = dict(options)
    files: dict[str, Any] = {}
    for name in SECRET_FIELDS:
        path = given.get(f"{name}_file")
        if path and not given.get(name):
            given[name] = _read_secret_file(path, name)
            again = _rereadable(path)
            if again is not None:
                files[f"{name}_file"] = again  # (read again at each connect: `refreshed`)
    context = _context(given.get("context"), env)
    values: dict[str, Any] = {}
    for name, var in ENV_VARS.items():
        value = given.get("server" if name == "servers" else name) or env.get(var) or context.get(_CONTEXT_KEYS[name])
        if value:
            values[name] = split_servers(value) if name == "servers" else str(value)
    if "servers" not in values:
        values["servers"] = ()
    home = env.get("HOME") or str(Path.home())
    for name in ("creds_file", "nkey_file", "tls_ca", "tls_cert", "tls_key"):
        if name in values and values[name].startswith("~/"):  # as the NATS CLI writes contexts
            values[name] = os.path.join(home, values[name][2:])
    return Connection(**values, **files)


def add_options(parser: Any, *, suppress: bool = False) -> None:
    """Add the connection options to an argparse parser (`suppress`: absent options leave no attribute,
    for options repeated on nested subcommands)."""
    import argparse

    extra: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    parser.add_argument("--server", help="NATS URL(s), comma separated; nats:// or tls:// "
                        "(default: $NATS_URL, then the NATS context)", **extra)
    parser.add_argument("--context", help="NATS CLI context to read (default: $NATS_CONTEXT or the selected one)",
                        **extra)
    for name, text in OPTION_HELP.items():
        flag = OPTION_FLAGS.get(name, "--" + name.replace("_", "-"))
        parser.add_argument(flag, dest=name, help=text, **extra)
    parser.add_argument("--password-file", help="read the password from this file", **extra)
    parser.add_argument("--token-file", help="read the token from this file", **extra)


OPTION_DESTS = ("server", "context", *OPTION_HELP, "password_file", "token_file")
