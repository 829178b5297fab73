"""Run a Ray scenario where only loopback exists: a fresh network namespace, if one works.

Ray's servers listen on every interface; inside ``unshare -n`` (with ``lo`` up)
there is no other. Where unprivileged namespaces are not allowed the prefix is
empty and the scenario falls back to a Ray node address of 127.0.0.1.
"""

from __future__ import annotations

import functools
import shutil
import subprocess


@functools.cache
def netns_prefix() -> tuple[str, ...]:
    """A command prefix that runs in a fresh network namespace with lo up, if one works."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return ()
    prefix = ("unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh")
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else ()
