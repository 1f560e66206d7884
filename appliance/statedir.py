"""The state directory's layout: where each of pdctl's files for one node lives, and the one way to write them.

Every path under `state_dir` is built here, so the planner, the renderers, the service managers and
appliance.node agree on it. Pure apart from the writing and reading at the end; nothing here knows what a plan is.

A state update is all or nothing: `transaction()` writes every new file beside its target first (fsynced), then
renames them all, and puts the previous files back if a rename or anything after it in the block fails. A
failure to write (read-only, full, not ours, a symbolic link) is one StateWriteError naming the path and the fix.

    (the directory)      mode 0700: only its owner reads what is deployed
    plan.json            the plan `pdctl up` (or a rebalance step) applied: what is deployed; secret
                         environment values (keys like *TOKEN*, *KEY*) are redacted and kept in secrets.json
    secrets.json         0600: those values, by instance and variable
    admin-token          0600: the proxy's admin API token `pdctl up` generates (unless proxy.admin_token_file)
    proxy.json           the proxy's configuration, derived from plan.json
    layout.json          the shape `pdctl rebalance` / `pdctl mode` left the node in
    lock                 who holds the node lock (appliance.nodelock): the command and its pid
    manager              the service manager `pdctl up` used (one word)
    env/<unit>.env       0600 environment files of systemd units whose environment holds secrets
    supervisor/          supervisord.conf, its socket, pid file, its own log and the programs' logs/
    models/tiny-qwen3    the embedded tiny model, written before vLLM starts
    kv-store/            the shared-storage connector's KV files (unless connector.shared_storage_path)
    kv-events/           0700: the ipc:// sockets DP-1 vLLM engines publish their KV cache events on (<instance>.sock)
    bench/               `pdctl bench --compare`'s per-shape settings files and `plan --suggest`'s profile
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from appliance.errors import PdctlError


@dataclass(frozen=True)
class StateDir:
    """The paths of one state directory (pure: PurePosixPath, so planning and rendering touch no disk)."""

    root: PurePosixPath

    @classmethod
    def at(cls, state_dir: str | os.PathLike[str]) -> StateDir:
        """The layout of the state directory `state_dir`."""
        return cls(PurePosixPath(state_dir))

    @property
    def plan(self) -> PurePosixPath:
        """The deployed plan."""
        return self.root / "plan.json"

    @property
    def secrets(self) -> PurePosixPath:
        """The engines' secret environment values that plan.json leaves out (mode 0600)."""
        return self.root / "secrets.json"

    @property
    def admin_token(self) -> PurePosixPath:
        """The proxy's admin API token that `pdctl up` generates when proxy.admin_token_file is not set (0600)."""
        return self.root / "admin-token"

    @property
    def proxy_config(self) -> PurePosixPath:
        """The proxy's configuration (`python -m appliance.proxy --config` reads it)."""
        return self.root / "proxy.json"

    @property
    def layout(self) -> PurePosixPath:
        """What `pdctl rebalance` (the roles' shapes) and `pdctl mode` (the mode) recorded."""
        return self.root / "layout.json"

    @property
    def lock(self) -> PurePosixPath:
        """The mutating command that holds (or last held) the node lock, and its pid."""
        return self.root / "lock"

    @property
    def manager(self) -> PurePosixPath:
        """The name of the service manager `pdctl up` used."""
        return self.root / "manager"

    @property
    def env_dir(self) -> PurePosixPath:
        """The systemd units' secret environment files."""
        return self.root / "env"

    def env_file(self, unit: str) -> PurePosixPath:
        """The secret environment file of one systemd unit."""
        return self.env_dir / f"{unit}.env"

    @property
    def supervisor(self) -> PurePosixPath:
        """supervisord's folder: config, socket, pid file and logs."""
        return self.root / "supervisor"

    @property
    def supervisor_logs(self) -> PurePosixPath:
        """The supervised programs' log files."""
        return self.supervisor / "logs"

    @property
    def tiny_model(self) -> PurePosixPath:
        """Where the embedded tiny model is written."""
        return self.root / "models" / "tiny-qwen3"

    @property
    def kv_store(self) -> PurePosixPath:
        """The shared-storage connector's default KV folder."""
        return self.root / "kv-store"

    @property
    def kv_events(self) -> PurePosixPath:
        """The private folder of the engines' KV cache events sockets (they carry prompts' token ids)."""
        return self.root / "kv-events"

    def kv_events_socket(self, instance: str) -> PurePosixPath:
        """The ipc:// socket the engine of `instance` binds for its KV cache events, the proxy connecting to it."""
        return self.kv_events / f"{instance}.sock"

    @property
    def bench(self) -> PurePosixPath:
        """`pdctl bench --compare`'s work folder (its bench.json is `plan --suggest`'s default profile)."""
        return self.root / "bench"


class StateWriteError(PdctlError):
    """A state file cannot be written or read; the previous state is whole and still in force."""


def _fix(exc: OSError, path: Path, where: Path) -> str:
    if exc.errno == errno.EROFS:
        return f"{where} is on a read-only file system: remount it read-write, or set state_dir to a writable folder"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the file system of {where} (df -h {where}), or set state_dir elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"run pdctl as the user that owns {where} (root for /var/lib/pdctl), or set state_dir to a folder of yours"
    if exc.errno == errno.ELOOP:
        return f"remove the symbolic link {path}; pdctl writes its state files itself"
    return f"check {where}"


def state_error(exc: OSError, path: str | os.PathLike[str], doing: str = "write", *,
                directory: bool = False) -> StateWriteError:
    """One line for an OSError on the state file (or `directory`) `path`: what failed and the fix, by errno."""
    target = Path(path)
    where = target if directory else target.parent
    return StateWriteError(f"cannot {doing} {target}: {exc.strerror or exc}", fix=_fix(exc, target, where))


def read_state(path: str | os.PathLike[str]) -> str:
    """A state file's text; never through a symbolic link (FileNotFoundError when there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateWriteError(f"{path} is a symbolic link, not a file pdctl wrote",
                                  fix=f"remove it; `pdctl up` writes {Path(path).name} again") from None
        raise state_error(exc, path, "read") from None
    with os.fdopen(fd) as handle:
        return handle.read()


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create the directory `path` (and its parents) with mode 0700, or tighten it to 0700 if it exists; one
    that another user owns is refused (its owner could open it again and read or plant what pdctl keeps there)."""
    try:
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(path)
        if info.st_uid != os.geteuid():
            raise StateWriteError(f"{path} belongs to uid {info.st_uid}, not to the user pdctl runs as ({os.geteuid()})",
                                  fix=f"remove it (pdctl makes it again), or chown it to uid {os.geteuid()}")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.chmod(path, 0o700)
    except OSError as exc:
        raise state_error(exc, path, "make or tighten", directory=True) from None


def _unchanged(target: Path, text: str, mode: int) -> bool:
    try:
        st = os.lstat(target)
        return stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode and read_state(target) == text
    except (OSError, UnicodeDecodeError, PdctlError):
        return False


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Transaction:
    """The files of one state update: staged beside their targets, then all renamed into place, or none."""

    staged: list[tuple[Path, Path]] = field(default_factory=list)  # (target, its new text's temporary file)
    kept: list[tuple[Path, Path | None]] = field(default_factory=list)  # (target, the previous file's link)

    def write(self, path: str | os.PathLike[str], text: str, mode: int = 0o644) -> bool:
        """Stage `text` for `path` (written and fsynced now, in place at commit); False when it is unchanged."""
        target = Path(path)
        if _unchanged(target, text, mode):
            return False
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        except OSError as exc:
            raise state_error(exc, target) from None
        self.staged.append((target, Path(tmp)))
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise state_error(exc, target) from None
        return True

    def commit(self) -> None:
        """Rename every staged file into place, keeping the previous ones until the transaction ends."""
        try:
            for target, _ in self.staged:
                # a hard link keeps the previous file, so a failure below puts it back whole
                previous = None
                if os.path.lexists(target):
                    previous = target.with_name(f".{target.name}.previous")
                    previous.unlink(missing_ok=True)
                    os.link(target, previous, follow_symlinks=False)
                self.kept.append((target, previous))
            for target, tmp in self.staged:
                os.replace(tmp, target)
            for directory in {target.parent for target, _ in self.staged}:
                _fsync_dir(directory)
        except OSError as exc:
            self.roll_back()
            failed = next((t for t, tmp in self.staged if exc.filename in (str(t), str(tmp))), self.staged[0][0])
            raise state_error(exc, failed) from None
        finally:
            self.staged = [(t, tmp) for t, tmp in self.staged if tmp.exists()]

    def roll_back(self) -> None:
        """Put the previous files back (a file that was new goes) and drop what is still staged."""
        for target, previous in reversed(self.kept):
            if previous is None:
                target.unlink(missing_ok=True)
            else:
                os.replace(previous, target)
        self.kept = []
        self.discard()

    def discard(self) -> None:
        """Drop the staged files and the kept previous ones."""
        for _, tmp in self.staged:
            tmp.unlink(missing_ok=True)
        for _, previous in self.kept:
            if previous is not None:
                previous.unlink(missing_ok=True)
        self.staged, self.kept = [], []


@contextmanager
def transaction() -> Iterator[Transaction]:
    """A state update: stage files with `write`, and `commit` where they must be in place (else at the end);
    an exception in the block rolls every file back to its previous content."""
    tx = Transaction()
    try:
        yield tx
        if tx.staged:
            tx.commit()
    except BaseException:
        tx.roll_back()
        raise
    tx.discard()


def write_atomic(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> bool:
    """Write `text` to `path` via a temporary file and rename (never half-written); False if unchanged.

    The file is fsynced before the rename and its directory after it, so a crash leaves the old file or the
    new one, and a rename that returned is on disk; a failure is one StateWriteError."""
    with transaction() as tx:
        return tx.write(path, text, mode)
