#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the project with the given extras.
# Finds python3.12 on PATH, or a 3.12 version managed by pyenv; fails naming what is missing.
set -euo pipefail
extras="${1:-test}"
venv=.venv
stamp="$venv/.installed-$extras"

if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi

find_python() {
    local candidate
    for candidate in python3.12 python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        local version
        version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
        if [ -n "$version" ] && [ -x "$(pyenv root)/versions/$version/bin/python3.12" ]; then
            echo "$(pyenv root)/versions/$version/bin/python3.12"
            return 0
        fi
    fi
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    if ! py=$(find_python); then
        echo "error: Python 3.12 not found. Megatron-Core needs Python >= 3.12 and this project pins 3.12." >&2
        echo "       Looked for python3.12/python3/python on PATH and for a 3.12.x version under pyenv." >&2
        echo "       Install one (e.g. 'pyenv install 3.12' or your OS package python3.12) and rerun." >&2
        exit 1
    fi
    echo "creating $venv with $py"
    "$py" -m venv "$venv"
fi
echo "installing project with extras [$extras] (first run downloads torch, ~2 min)"
# pip's and setuptools' notices are kept in a log, shown only when the install fails.
log="$venv/install.log"
if ! { "$venv/bin/python" -m pip install -q --upgrade pip && "$venv/bin/python" -m pip install -q -e ".[$extras]"; } \
    >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "error: installing the project failed; the whole pip log is in $log" >&2
    exit 1
fi
rm -f "$venv"/.installed-*
touch "$stamp"
