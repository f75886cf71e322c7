#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (jax 0.11 needs it): $PYTHON if set, python3.12 / python3.13
# on the PATH, a pyenv-installed 3.12/3.13, or python3 if it is new enough. Fails with a clear
# message otherwise.
set -euo pipefail
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
candidates+=(python3.12 python3.13)
if command -v pyenv >/dev/null 2>&1; then
  root="$(pyenv root)"
  for p in "$root"/versions/3.12*/bin/python "$root"/versions/3.13*/bin/python; do
    [ -x "$p" ] && candidates+=("$p")
  done
fi
for p in "$HOME"/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12 /usr/local/bin/python3.12; do
  [ -x "$p" ] && candidates+=("$p")
done
candidates+=(python3)
for p in "${candidates[@]}"; do
  if command -v "$p" >/dev/null 2>&1 && ok "$p"; then command -v "$p"; exit 0; fi
done
echo "error: Pallasite needs Python 3.12 or newer (jax 0.11.2 requires it) and none was found;" \
     "install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
