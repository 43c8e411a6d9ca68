#!/usr/bin/env bash
# CI: the aarch64 cross compiler (its libgomp comes with it) and qemu-user, for
# tests/kernels/test_cross_targets.py (the NEON kernels, checked under emulation: no ARM64 machine here).
# Idempotent: does nothing when both are already installed. Needs root (CI runs as root).
set -euo pipefail
if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu qemu-user >/dev/null
