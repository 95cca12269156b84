#!/usr/bin/env bash
# Builds the sdist and wheel of sdk/python with `python -m build`, installs the
# wheel into a fresh virtualenv (its dependencies from PyPI), and imports it
# there, outside the source tree, as a user would install it.
#
#   PYTHON      the interpreter that builds; it needs the `build` package (default: python3)
#   VENV_PYTHON the interpreter of the fresh virtualenv (default: $PYTHON), e.g. a Python 3.10
set -euo pipefail

sdk=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
venv_python=${VENV_PYTHON:-$python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m build --outdir "$work/dist" "$sdk" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
echo "built $(basename "$wheel") and $(basename "$(ls "$work"/dist/*.tar.gz)")"

"$venv_python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "$wheel"
cd "$work"
"$work/venv/bin/python" - <<'EOF'
import importlib.metadata, pathlib, sys
import idem

assert pathlib.Path(idem.__file__).is_relative_to(sys.prefix), idem.__file__
assert (pathlib.Path(idem.__file__).parent / "py.typed").exists()
requires = importlib.metadata.requires("idem-sdk")
assert [r.split(";")[0] for r in requires if "extra ==" not in r] == ["httpx<1,>=0.25"], requires
client = idem.Client("http://127.0.0.1:1", "key")
assert callable(client.submit) and issubclass(idem.IdempotencyConflictError, idem.IdemError)
assert idem.Worker and idem.AsyncClient
print(f"idem {importlib.metadata.version('idem-sdk')} imports on Python {sys.version.split()[0]} from {idem.__file__}")
EOF
