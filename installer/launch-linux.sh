#!/bin/sh
# DS-V4.1 Chat launcher for Linux: double-click it (or the menu entry that
# 'python3 installer/bootstrap.py install-shortcut' makes) to start the app.
#
# The first start sets the app up: a window lists each step and its progress (Tk), or, where Tk is
# missing, a terminal shows it. Later starts open the app straight away. The repository is found
# from this file's own location (links followed), so it works from any folder.
#
# Environment: DSV41_PYTHON  the Python (3.10+) to run the installer with
#              DSV41_HOME    data folder (default ~/.local/share/ds-v41-chat)
set -u
APP="DS-V4.1 Chat"

# This file's real location, following symlinks (no GNU 'readlink -f' needed).
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

on_terminal() { [ -t 1 ] || [ -t 2 ]; }

# Tell the user something, also when nobody watches a terminal (double-click).
alert() {
    printf '%s\n' "$1" >&2
    on_terminal && return 0
    if command -v zenity >/dev/null 2>&1; then zenity --error --title="$APP" --text="$1"
    elif command -v kdialog >/dev/null 2>&1; then kdialog --title "$APP" --error "$1"
    elif command -v xmessage >/dev/null 2>&1; then xmessage -center "$APP: $1"
    elif command -v notify-send >/dev/null 2>&1; then notify-send "$APP" "$1"
    fi
}

# A Python 3.10 or newer: $DSV41_PYTHON, python3, then python3.X.
find_python() {
    for py in ${DSV41_PYTHON:+"$DSV41_PYTHON"} python3 python3.14 python3.13 python3.12 python3.11 python3.10 python; do
        command -v "$py" >/dev/null 2>&1 || continue
        if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

# Run "$@" in a terminal window; false when there is no terminal program.
in_terminal() {
    for term in x-terminal-emulator gnome-terminal konsole xfce4-terminal mate-terminal kitty alacritty xterm; do
        command -v "$term" >/dev/null 2>&1 || continue
        case $term in
            gnome-terminal) "$term" --wait -- "$@" ;;
            xfce4-terminal|mate-terminal) "$term" -x "$@" ;;
            kitty) "$term" "$@" ;;
            *) "$term" -e "$@" ;;
        esac
        return 0
    done
    return 1
}

if [ ! -f "$BOOT" ]; then
    alert "The installer is missing ($BOOT). Keep this launcher inside the $APP folder (installer/)."
    exit 1
fi

PY=$(find_python) || {
    alert "$APP needs Python 3.10 or newer, and none was found. Install it (e.g. 'sudo apt install python3 python3-venv python3-tk'), then start $APP again."
    exit 1
}

DATA=${DSV41_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/ds-v41-chat}

if ! on_terminal && [ -z "${DSV41_IN_TERMINAL:-}" ]; then
    # Started from the desktop: keep the output in a log file (the app's error window points to it).
    mkdir -p "$DATA/logs" 2>/dev/null && {
        log="$DATA/logs/launcher.log"
        if [ -f "$log" ] && [ "$(wc -c <"$log")" -gt 1000000 ]; then mv -f "$log" "$log.old"; fi
        exec >>"$log" 2>&1
        echo "--- $(date '+%Y-%m-%d %H:%M:%S') $self $*"
    }
    # A setup is due and no window can show it (no Tk, or no X display): show it in a terminal.
    if ! "$PY" "$BOOT" status >/dev/null 2>&1; then
        if [ -z "${DISPLAY:-}" ] || ! "$PY" -c 'import tkinter' >/dev/null 2>&1; then
            if in_terminal env DSV41_IN_TERMINAL=1 "$self" "$@"; then
                exit 0
            fi
        fi
    fi
fi

cd "$HERE/.." || exit 1
if [ -n "${DSV41_IN_TERMINAL:-}" ]; then
    "$PY" "$BOOT" run "$@"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        printf '\n%s stopped (exit code %s); the messages above say why. Press Enter to close.' "$APP" "$rc"
        read -r _ || true
    fi
    exit "$rc"
fi
exec "$PY" "$BOOT" run "$@"
