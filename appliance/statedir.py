"""The state directory's layout: where each of pdctl's files for one node lives, and the one way to write them.

Every path under `state_dir` is built here, so the planner, the renderers, the service managers and
appliance.node agree on it. Pure apart from `write_atomic`; nothing here knows what a plan is.

    (the directory)      mode 0700: only its owner reads what is deployed
    plan.json            the plan `pdctl up` (or a rebalance step) applied: what is deployed; secret
                         environment values (keys like *TOKEN*, *KEY*) are redacted and kept in secrets.json
    secrets.json         0600: those values, by instance and variable
    admin-token          0600: the proxy's admin API token `pdctl up` generates (unless proxy.admin_token_file)
    proxy.json           the proxy's configuration, derived from plan.json
    layout.json          the shape `pdctl rebalance` / `pdctl mode` left the node in
    manager              the service manager `pdctl up` used (one word)
    env/<unit>.env       0600 environment files of systemd units whose environment holds secrets
    supervisor/          supervisord.conf, its socket, pid file, its own log and the programs' logs/
    models/tiny-qwen3    the embedded tiny model, written before vLLM starts
    kv-store/            the shared-storage connector's KV files (unless connector.shared_storage_path)
    bench/               `pdctl bench --compare`'s per-shape settings files and `plan --suggest`'s profile
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


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
    def bench(self) -> PurePosixPath:
        """`pdctl bench --compare`'s work folder (its bench.json is `plan --suggest`'s default profile)."""
        return self.root / "bench"


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create the directory `path` (and its parents) with mode 0700, or tighten it to 0700 if it exists."""
    Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_atomic(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> bool:
    """Write `text` to `path` via a temporary file and rename (never half-written); False if unchanged.

    The file is fsynced before the rename and its directory after it, so a crash leaves the old file or the
    new one, and a rename that returned is on disk."""
    target = Path(path)
    try:
        if target.read_text() == text and (target.stat().st_mode & 0o777) == mode:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return True
