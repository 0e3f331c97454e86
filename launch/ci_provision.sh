#!/usr/bin/env bash
# Provision the tools the two-host test (tests/test_multinode.py) needs: an sshd and pdsh; and
# libaio's headers, which DeepSpeed's async_io op (NVMe offload, tests/integration/test_nvme_offload.py)
# is built against. Idempotent: installs the Debian packages openssh-server, pdsh and libaio-dev only
# when a binary (or libaio.h) is missing.
# Needs root (or passwordless sudo) and apt; prints what it did. It starts no daemon: the test runs
# an sshd of its own on port 2222 and stops it by PID.
set -euo pipefail

need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
[ -e /usr/include/libaio.h ] || need+=(libaio-dev)

if [ ${#need[@]} -eq 0 ]; then
    echo "ci_provision: sshd, ssh, pdsh and libaio-dev already installed"
else
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
            echo "ci_provision: need root to install: ${need[*]}" >&2; exit 1; fi
    fi
    # de-duplicate (openssh-client may be listed twice)
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    echo "ci_provision: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # The package's postinst may try to start sshd through systemd/invoke-rc.d; refuse it (no init here).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
        $SUDO chmod +x /usr/sbin/policy-rc.d
        trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    $SUDO apt-get update -qq || true
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# sshd refuses to start without its privilege-separation directory.
if [ "$(id -u)" -eq 0 ]; then mkdir -p /run/sshd; chmod 0755 /run/sshd; fi
echo "ci_provision: $(command -v pdsh) $( (/usr/sbin/sshd -V 2>&1 || true) | head -1)"
