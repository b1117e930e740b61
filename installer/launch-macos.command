#!/bin/bash
# DS-V4.1 Chat launcher for macOS: double-click it in Finder (it opens in Terminal), or use the
# ~/Applications/DS-V4.1 Chat.app that 'python3 installer/bootstrap.py install-shortcut' makes.
#
# The first start sets the app up: a window lists each step and its progress (Tk), or Terminal
# shows it where Tk is missing. Later starts open the app straight away. The repository is found
# from this file's own location (links followed), so it works from any folder.
#
# Environment: DSV41_PYTHON  the Python (3.10+) to run the installer with
#              DSV41_HOME    data folder (default ~/Library/Application Support/ds-v41-chat)
set -u
APP="DS-V4.1 Chat"

# Finder and app bundles start programs with a minimal PATH: add where Python usually lives
# (Homebrew, python.org), before the system's /usr/bin/python3 (3.9, too old).
PATH="/opt/homebrew/bin:/usr/local/bin:/Library/Frameworks/Python.framework/Versions/Current/bin:$HOME/.pyenv/shims:$PATH"
export PATH

# This file's real location, following symlinks.
self=$0
while [ -L "$self" ]; do
    target=$(readlink "$self")
    case $target in
        /*) self=$target ;;
        *) self=$(dirname "$self")/$target ;;
    esac
done
HERE=$(cd "$(dirname "$self")" && pwd -P) || exit 1
self="$HERE/$(basename "$self")"
BOOT="$HERE/bootstrap.py"

# Arguments: drop the ones macOS and our app bundle add.
from_app=""
args=()
for a in "$@"; do
    case $a in
        --from-app) from_app=1 ;;
        -psn_*) ;;
        *) args+=("$a") ;;
    esac
done

alert() {
    printf '%s\n' "$1" >&2
    if [ -n "$from_app" ] && command -v osascript >/dev/null 2>&1; then
        osascript -e "display alert \"$APP\" message \"${1//\"/\\\"}\" as critical" >/dev/null 2>&1
    fi
}

find_python() {
    for py in ${DSV41_PYTHON:+"$DSV41_PYTHON"} python3 python3.14 python3.13 python3.12 python3.11 python3.10; do
        command -v "$py" >/dev/null 2>&1 || continue
        if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

if [ ! -f "$BOOT" ]; then
    alert "The installer is missing ($BOOT). Keep this launcher inside the $APP folder (installer/)."
    exit 1
fi

PY=$(find_python) || {
    alert "$APP needs Python 3.10 or newer, and none was found. Install it from https://www.python.org/downloads/ (or 'brew install python python-tk'), then start $APP again."
    exit 1
}

DATA=${DSV41_HOME:-$HOME/Library/Application Support/ds-v41-chat}

if [ -n "$from_app" ]; then
    # Started from the app bundle (no Terminal): keep the output in a log file.
    mkdir -p "$DATA/logs" 2>/dev/null && {
        log="$DATA/logs/launcher.log"
        if [ -f "$log" ] && [ "$(wc -c <"$log")" -gt 1000000 ]; then mv -f "$log" "$log.old"; fi
        exec >>"$log" 2>&1
        echo "--- $(date '+%Y-%m-%d %H:%M:%S') $self ${args[*]-}"
    }
    # A setup is due and Tk cannot show it: let Terminal run this file, so the steps are seen.
    if ! "$PY" "$BOOT" status >/dev/null 2>&1 && ! "$PY" -c 'import tkinter' >/dev/null 2>&1; then
        if command -v open >/dev/null 2>&1 && open -a Terminal "$self"; then
            exit 0
        fi
    fi
    cd "$HERE/.." || exit 1
    exec "$PY" "$BOOT" run ${args[@]+"${args[@]}"}
fi

cd "$HERE/.." || exit 1
"$PY" "$BOOT" run ${args[@]+"${args[@]}"}
rc=$?
if [ "$rc" -ne 0 ]; then
    printf '\n%s stopped (exit code %s); the messages above say why. Press Enter to close.' "$APP" "$rc"
    read -r _ || true
fi
exit "$rc"
