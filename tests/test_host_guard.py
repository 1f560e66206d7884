"""The host guard is real: a test's own code and the processes it starts cannot touch the host's pdctl paths
unnoticed, and the settings every test starts from are the session's, not /etc/pdctl's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.settings import load_settings
from tests.support.hostguard.sitecustomize import recorded


@pytest.mark.parametrize("path", ["/etc/pdctl/pdctl.toml", "/var/lib/pdctl/layout.json", "/var/lib/pdctl"])
def test_in_process_touches_are_refused_and_recorded(path: str) -> None:
    with pytest.raises(PermissionError, match="host's pdctl state"):
        if path.endswith("pdctl"):
            os.listdir(path)
        else:
            Path(path).read_text()
    touched = recorded()
    assert len(touched) == 1 and path in touched[0], touched


def test_a_child_process_is_guarded_too(tmp_path: Path) -> None:
    # a relative path from a working folder resolves under the host's state dir: still caught
    code = "import os; os.chdir('/var/lib'); open('pdctl/layout.json')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "PermissionError" in done.stderr, done.stderr
    touched = recorded()
    assert len(touched) == 1 and "/var/lib/pdctl/layout.json" in touched[0], touched


def test_settings_come_from_the_session_not_the_host() -> None:
    settings = load_settings()
    assert not settings.state_dir.startswith("/var/lib/pdctl") and not settings.unit_dir.startswith("/etc/")
    assert recorded() == []
