#!/bin/sh
# Writes a C++ source defining kPythonFiles (python_files.h) from the given launcher/python files.
# Usage: embed_python.sh OUT.cc FILE...
set -eu
out=$1
shift
{
  echo '#include "launcher/worker/python_files.h"'
  echo 'namespace elrun {'
  echo 'const EmbeddedFile kPythonFiles[] = {'
  for f in "$@"; do
    if grep -q 'ELRUNPY' "$f"; then
      echo "$f holds the raw string's delimiter" >&2
      exit 1
    fi
    printf '{"%s", R"ELRUNPY(' "${f##*launcher/python/}"
    cat "$f"
    echo ')ELRUNPY"},'
  done
  echo '{nullptr, nullptr}};'
  echo '}  // namespace elrun'
} > "$out"
