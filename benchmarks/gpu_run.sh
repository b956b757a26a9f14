#!/usr/bin/env bash
# The GPU check with the packages the device image lacks (outlines-core and interegular
# for the grammar masks' device path, gguf for GGUF checkpoints), carried as wheels.
#
# Here, before a GPU session:   bash benchmarks/gpu_run.sh --fetch   (fills .whl/)
# On the GPU machine (the device tool's `run`, carry [".whl"]):
#                               bash benchmarks/gpu_run.sh [gpu_check.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(outlines_core interegular gguf)

if [[ "${1:-}" == "--fetch" ]]; then
    python=.venv/bin/python
    [[ -x $python ]] || python=python3
    rm -rf .whl && mkdir .whl
    for name in "${WHEELS[@]}"; do
        # (the version this checkout's tests run with: one version of each)
        version=$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$name==$version"
    done
    ls -l .whl
    exit 0
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    # (a wheel that does not fit the machine's Python must not cost the run: without them
    # the regex requests and GGUF models are skipped, as with no wheels)
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "the .whl/ wheels did not install: the regex requests and GGUF models are skipped" >&2
    fi
else
    echo "no .whl/ wheels: the regex requests and GGUF models are skipped" >&2
fi
export PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu_check.py --isolate "$@"
