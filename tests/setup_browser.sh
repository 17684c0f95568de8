#!/bin/sh
# Headless Chromium and its WebDriver for the browser tests (tests/api/rest/test_console_browser.py).
# Idempotent: does nothing when both are on PATH. Otherwise installs Debian's `chromium` and
# `chromium-driver` with apt-get (as root, or through sudo when it works without a password).
# Never fails the caller: without a browser the browser tests skip and say why.
set -u
have() { command -v "$1" >/dev/null 2>&1; }
if have chromium && have chromedriver; then
    exit 0
fi
if ! have apt-get; then
    echo "setup_browser: no apt-get here; install chromium and chromedriver yourself (the browser tests skip)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "setup_browser: not root and no password-less sudo; the browser tests skip" >&2
        exit 0
    fi
fi
echo "setup_browser: installing chromium and chromium-driver (apt-get)" >&2
# DPkg::Lock::Timeout: wait for another apt-get on the machine rather than fail at once
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq >&2 &&
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    chromium chromium-driver >&2 ||
    echo "setup_browser: apt-get failed; the browser tests skip" >&2
exit 0
