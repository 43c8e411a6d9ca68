#!/usr/bin/env bash
# CI: headless Chromium and its WebDriver (Debian's chromium and chromium-driver, ~1 minute), for
# tests/test_chat_page.py (the chat page driven through Selenium against a real server).
# Idempotent: does nothing when both are already installed. Needs root (CI runs as root).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
