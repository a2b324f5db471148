"""CurveZMQ: key files, loading them safely, and a ZAP authenticator that fails closed.

Layout of a keys folder (``zmqps keygen DIR``)::

    DIR/server.key            0644  the cluster's server public key (every task)
    DIR/server.key_secret     0600  its secret key (chief and PS only)
    DIR/<client>.key          0644  a client's public key (chief, ps, worker, evaluator, status;
    DIR/<client>.key_secret   0600    or one per task: worker0, worker1, ...)
    DIR/allowed/<client>.key  0644  the allow-list: public keys of the clients servers accept

Rules of this module (RELIABILITY.md, "Facts that bite"):

* Fail closed. A CURVE server socket sets ``ZAP_DOMAIN`` (:data:`DOMAIN`) and
  ``ZAP_ENFORCE_DOMAIN=1`` (see :mod:`zmqps.transport.options`), and the
  authenticator is configured for exactly that domain. With a domain but no ZAP
  handler, or a handler for another domain, libzmq would let every key in (or
  skip authentication): :func:`acquire_authenticator` refuses to return unless
  the handler is bound to ``inproc://zeromq.zap.01`` and running.
* Secret keys are written 0600 by :func:`keygen` (never through the umask:
  ``zmq.auth.create_certificates`` writes them 0644), and a secret key file that
  its group or others can read is refused when loaded (:class:`InsecureKeyFile`).
* Every refused client is logged with its peer address, routing id and public
  key (rate-limited per address), and reported to the listeners of the server
  sockets of that context (counted in ``zmqps_auth_failures_total``).
* A server's sealed data connection (:mod:`zmqps.transport.seal`) is a PLAIN
  server with a ZAP domain of its own (:func:`serve_sessions`): the same
  authenticator admits a connection there only if the server's check knows its
  credentials (a live session's key id and credential); a refusal there is
  reported to that server only. No password is ever logged.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.certs import load_certificate, load_certificates
from zmq.utils import z85

from zmqps.logs import LINES_PER_KIND, RateLimitedLog
from zmqps.wire.errors import ConfigError, ZmqpsError

__all__ = [
    "CLIENT_ROLES",
    "DOMAIN",
    "AuthenticatorNotRunning",
    "CurveKeys",
    "InsecureKeyFile",
    "PlainCheck",
    "acquire_authenticator",
    "check_secret_file",
    "keygen",
    "load_keys",
    "release_authenticator",
    "serve_sessions",
    "stop_serving_sessions",
]

log = logging.getLogger("zmqps.security")

#: The ZAP domain of every zmqps server socket and of its authenticator (must match exactly).
DOMAIN = "zmqps"
#: The client pairs ``zmqps keygen`` writes; a PS connects as ``ps`` to the other PS
#: whose states it holds copies of (``--replication``).
CLIENT_ROLES = ("chief", "ps", "worker", "evaluator", "status")
SERVER = "server"
ALLOWED = "allowed"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: Seconds between two log lines about refused clients from one address.
LOG_EVERY_S = 30.0


class InsecureKeyFile(ConfigError):
    """A secret key file is readable by its group or by others."""


class AuthenticatorNotRunning(ZmqpsError):
    """CURVE was asked for but no ZAP handler serves the context: every key would get in."""

    code = "internal"


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys one process uses (z85 bytes). ``server_secret`` and ``allowed_dir``
    only where it serves (chief, PS); ``client_*`` only where it connects."""

    server_public: bytes
    server_secret: bytes | None = field(default=None, repr=False)
    client_public: bytes | None = None
    client_secret: bytes | None = field(default=None, repr=False)
    allowed_dir: str | None = None
    source: str = ""  # the keys folder, for messages

    @property
    def serves(self) -> bool:
        return self.server_secret is not None

    @property
    def connects(self) -> bool:
        return self.client_secret is not None


# ------------------------------------------------------------------ key files

_SECRET_BANNER = (
    "#   ****  Generated on {0} by zmqps keygen  ****\n"
    "#   ZeroMQ CURVE **Secret** Certificate\n"
    "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n"
)
_PUBLIC_BANNER = (
    "#   ****  Generated on {0} by zmqps keygen  ****\n#   ZeroMQ CURVE Public Certificate\n"
)


def _key_text(banner: str, public: bytes, secret: bytes | None) -> str:
    lines = [banner.format(datetime.datetime.now().isoformat(timespec="seconds")), "metadata\n"]
    lines += ["curve\n", f'    public-key = "{public.decode()}"\n']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"\n')
    return "".join(lines)


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    """Create ``path`` with exactly ``mode`` (given at creation and set again with
    fchmod: the umask is never relied on); an old file is replaced only with ``force``."""
    if force:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def keygen(
    directory: str | os.PathLike[str], clients: Iterable[str] = CLIENT_ROLES, force: bool = False
) -> list[Path]:
    """Create the server pair, one pair per client name and the allow-list in
    ``directory``; returns the files written. Raises :class:`ConfigError` when a key
    file exists already (unless ``force``)."""
    root = Path(directory)
    names = [SERVER, *dict.fromkeys(clients)]
    for name in names[1:]:
        if not name or name == SERVER or "/" in name or name.startswith("."):
            raise ConfigError(f"bad client name {name!r}")
    allowed = root / ALLOWED
    targets = [root / f"{n}{ext}" for n in names for ext in (".key", ".key_secret")]
    targets += [allowed / f"{n}.key" for n in names[1:]]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise ConfigError(
            f"{existing[0]} exists (and {len(existing) - 1} more key files);"
            " pass --force to replace them"
        )
    for d in (root, allowed):
        if not d.exists():
            d.mkdir(mode=0o700, parents=True)
            os.chmod(d, 0o700 if d == root else 0o755)
    written: list[Path] = []
    for name in names:
        public, secret = zmq.curve_keypair()
        _write(root / f"{name}.key_secret", _key_text(_SECRET_BANNER, public, secret), 0o600, force)
        pub_text = _key_text(_PUBLIC_BANNER, public, None)
        _write(root / f"{name}.key", pub_text, 0o644, force)
        written += [root / f"{name}.key_secret", root / f"{name}.key"]
        if name != SERVER:
            _write(allowed / f"{name}.key", pub_text, 0o644, force)
            written.append(allowed / f"{name}.key")
    return written


def check_secret_file(path: str | os.PathLike[str]) -> None:
    """Refuse a secret key file its group or others may read (or that is not a file)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"CURVE: secret key file {path} not found") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"CURVE: secret key {path} is not a regular file")
    if st.st_mode & 0o077:
        raise InsecureKeyFile(
            f"CURVE: secret key file {path} is readable by group/others"
            f" (mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
        )


def _public(path: Path) -> bytes:
    if not path.is_file():
        raise ConfigError(f"CURVE: public key file {path} not found (make keys with zmqps keygen)")
    try:
        public, _ = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"CURVE: cannot read {path}: {exc}") from None
    return _checked_key(public, path)


def _pair(path: Path) -> tuple[bytes, bytes]:
    check_secret_file(path)
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"CURVE: cannot read {path}: {exc}") from None
    if secret is None:
        raise ConfigError(f"CURVE: {path} holds no secret key")
    public, secret = _checked_key(public, path), _checked_key(secret, path)
    if zmq.curve_public(secret) != public:
        raise ConfigError(f"CURVE: the public and secret keys in {path} do not match")
    return public, secret


def _checked_key(key: bytes, path: Path) -> bytes:
    if len(key) != 40:
        raise ConfigError(f"CURVE: {path}: a key must be 40 z85 characters, got {len(key)}")
    return key


def _client_file(root: Path, role: str, index: int | None) -> Path:
    """The client pair of one task: ``<role><index>.key_secret`` first, else ``<role>``'s."""
    if index is not None:
        per_task = root / f"{role}{index}.key_secret"
        if per_task.exists():
            return per_task
    return root / f"{role}.key_secret"


def load_keys(
    directory: str | os.PathLike[str],
    role: str,
    index: int | None = None,
    *,
    serve: bool,
    connect: bool,
    connect_if_present: bool = False,
) -> CurveKeys:
    """The keys a task of ``role`` needs from a keys folder: the server pair and the
    allow-list when it ``serve``-s, its client pair when it ``connect``-s (the server
    public key always), or, ``connect_if_present``, when the folder has one (a PS:
    it connects only to hold copies, and a folder made before PS had pairs has
    none). Every problem is one :class:`ConfigError` line."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"CURVE: keys folder {root} not found (make one with zmqps keygen)")
    server_public = _public(root / f"{SERVER}.key")
    server_secret = client_public = client_secret = None
    allowed: str | None = None
    if serve:
        pub, server_secret = _pair(root / f"{SERVER}.key_secret")
        if pub != server_public:
            raise ConfigError(f"CURVE: {root}/server.key does not match server.key_secret")
        allowed_dir = root / ALLOWED
        if not allowed_dir.is_dir():
            raise ConfigError(f"CURVE: no allow-list folder {allowed_dir}")
        if not load_certificates(allowed_dir):
            log.warning("CURVE: the allow-list %s is empty: every client is refused", allowed_dir)
        allowed = str(allowed_dir)
    if connect or (connect_if_present and _client_file(root, role, index).exists()):
        client_public, client_secret = _pair(_client_file(root, role, index))
    return CurveKeys(
        server_public=server_public,
        server_secret=server_secret,
        client_public=client_public,
        client_secret=client_secret,
        allowed_dir=allowed,
        source=str(root),
    )


# ------------------------------------------------------------------ the authenticator

#: Called with (peer address, reason) for each refused client.
DenialListener = Callable[[str, str], None]
#: Given a PLAIN username and password, the user id to admit them as, or None.
PlainCheck = Callable[[bytes, bytes], "str | None"]


class _Authenticator(AsyncioAuthenticator):
    """zmq.auth's asyncio authenticator, with every refusal logged and reported."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        super().__init__(ctx, log=logging.getLogger("zmqps.security.zap"))
        self.listeners: list[DenialListener] = []
        self._request: list[bytes] = []
        # per address (bounded), and at most LINES_PER_KIND lines an interval in all
        self._denials = RateLimitedLog(log, LOG_EVERY_S, lines_per_kind=LINES_PER_KIND)
        #: z85 public key -> its name on the allow-list (the file's, ``ps.key``: ``ps``)
        self.names: dict[bytes, str] = {}
        #: the PLAIN domains of data connections: each server's check and listener
        self.plain: dict[str, tuple[PlainCheck, DenialListener]] = {}
        #: the user id of the PLAIN credentials admitted last (``_authenticate_plain``)
        self._plain_user = ""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        """Admit a data connection whose credentials its server's check knows (never
        logging the password, which zmq.auth's own method does)."""
        served = self.plain.get(domain)
        if served is None:
            return False, b"no sealed sessions in this domain"
        user = served[0](username.encode(), password.encode())
        if user is None:
            return False, b"no live session with these credentials"
        self._plain_user = user
        return True, b"OK"

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The user id of an admitted client: its allow-list name (``chief``, ``ps``,
        ``worker3``), which servers bind the ops only PS and chief send to; its key
        (z85) when no file names it."""
        key = z85.encode(client_public_key)
        return self.names.get(key, key.decode())

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._request = msg
        try:
            await super().handle_zap_message(msg)
        finally:
            self._request = []

    def _send_zap_reply(
        self,
        request_id: bytes,
        status_code: bytes,
        status_text: bytes,
        user_id: str = "anonymous",
    ) -> None:
        if status_code == b"200" and self._plain_user:
            user_id, self._plain_user = self._plain_user, ""
        try:
            super()._send_zap_reply(request_id, status_code, status_text, user_id)
        finally:
            if status_code != b"200":
                self._report_denial(status_text.decode(errors="replace"))

    def _report_denial(self, reason: str) -> None:
        msg = self._request
        domain = msg[2].decode(errors="replace") if len(msg) > 2 else ""
        address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        identity = msg[4].decode(errors="replace") if len(msg) > 4 else "?"
        mechanism = msg[5].decode(errors="replace") if len(msg) > 5 else "?"
        key = ""
        if mechanism == "CURVE" and len(msg) > 6 and len(msg[6]) == 32:
            key = z85.encode(msg[6]).decode()
        elif mechanism == "PLAIN" and len(msg) > 6:  # the username: a key id, public
            key = "session " + msg[6][:64].decode(errors="replace")
        self._denials.warning(
            "refused a %s client from %s%s (key %s): %s",
            mechanism,
            address,
            f" ({identity!r})" if identity else "",
            key or "-",
            reason,
            key=address,
        )
        served = self.plain.get(domain)
        for listener in [served[1]] if served is not None else list(self.listeners):
            listener(address, reason)


@dataclass
class _Entry:
    auth: _Authenticator
    allowed_dir: str
    refs: int = 0


#: One ZAP handler per context (libzmq routes every socket of a context to one endpoint).
_REGISTRY: dict[int, _Entry] = {}


def _start(ctx: zmq.asyncio.Context, allowed_dir: str) -> _Authenticator:
    auth = _Authenticator(ctx)
    auth.start()
    auth.configure_curve(domain=DOMAIN, location=allowed_dir)
    auth.names = allowed_names(allowed_dir)
    return auth


def allowed_names(allowed_dir: str | os.PathLike[str]) -> dict[bytes, str]:
    """Each public key (z85) on the allow-list and its name (the file's, without
    ``.key``); a key in two files keeps the first name in sorted order."""
    names: dict[bytes, str] = {}
    for path in sorted(Path(allowed_dir).glob("*.key")):
        try:
            public, _ = load_certificate(path)
        except (OSError, ValueError):
            continue  # configure_curve skipped it too: no client has that key
        names.setdefault(public, path.stem)
    return names


#: How the authenticator is started; tests replace it to check the daemon refuses to
#: start without one.
start_authenticator: Callable[[zmq.asyncio.Context, str], _Authenticator | None] = _start


def _zap_endpoint_served(ctx: zmq.Context[Any]) -> bool:
    """Whether some socket of ``ctx`` is bound to the ZAP endpoint (we try to bind it)."""
    probe = ctx.socket(zmq.REP, socket_class=zmq.Socket)
    try:
        probe.bind(ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        return exc.errno == zmq.EADDRINUSE
    finally:
        probe.close(linger=0)
    return False


def acquire_authenticator(
    ctx: zmq.asyncio.Context, keys: CurveKeys, listener: DenialListener
) -> None:
    """Make sure a running ZAP authenticator for :data:`DOMAIN` and ``keys.allowed_dir``
    serves ``ctx`` (started on first use; needs a running event loop) and report every
    refusal to ``listener``. Raises :class:`AuthenticatorNotRunning` otherwise."""
    if keys.allowed_dir is None:
        raise ConfigError("CURVE: a server needs the allow-list folder")
    key = int(ctx.underlying)
    entry = _REGISTRY.get(key)
    if entry is None:
        auth = start_authenticator(ctx, keys.allowed_dir)
        if auth is not None:
            entry = _REGISTRY[key] = _Entry(auth, keys.allowed_dir)
    elif entry.allowed_dir != keys.allowed_dir:
        raise ConfigError(
            f"CURVE: one process serves one allow-list ({entry.allowed_dir}),"
            f" not also {keys.allowed_dir}"
        )
    sync_ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)
    if entry is None or entry.auth.zap_socket is None or not _zap_endpoint_served(sync_ctx):
        if entry is not None:
            _REGISTRY.pop(key, None)
            entry.auth.stop()
        raise AuthenticatorNotRunning(
            "CURVE: the ZAP authenticator is not running; refusing to start"
            " (clients would not be authenticated)"
        )
    entry.refs += 1
    entry.auth.listeners.append(listener)


def serve_sessions(
    ctx: zmq.asyncio.Context, domain: str, check: PlainCheck, listener: DenialListener
) -> None:
    """Have the authenticator of ``ctx`` (acquired first: :func:`acquire_authenticator`)
    admit PLAIN connections in ``domain`` whose credentials ``check`` knows, and
    report the others to ``listener`` only."""
    entry = _REGISTRY.get(int(ctx.underlying))
    if entry is None or entry.auth.zap_socket is None:
        raise AuthenticatorNotRunning(
            "sealed data connection: the ZAP authenticator is not running; refusing to bind"
        )
    if domain in entry.auth.plain:
        raise ConfigError(f"ZAP domain {domain!r} is served already")
    entry.auth.plain[domain] = (check, listener)


def stop_serving_sessions(ctx: zmq.asyncio.Context, domain: str) -> None:
    """Undo :func:`serve_sessions`: connections in ``domain`` are refused from now."""
    entry = _REGISTRY.get(int(ctx.underlying))
    if entry is not None:
        entry.auth.plain.pop(domain, None)


def release_authenticator(ctx: zmq.asyncio.Context, listener: DenialListener) -> None:
    """Undo one :func:`acquire_authenticator`; the last one stops the authenticator
    (its socket must be closed before ``ctx.term()``)."""
    key = int(ctx.underlying)
    entry = _REGISTRY.get(key)
    if entry is None:
        return
    if listener in entry.auth.listeners:
        entry.auth.listeners.remove(listener)
    entry.refs -= 1
    if entry.refs <= 0:
        del _REGISTRY[key]
        entry.auth.stop()
