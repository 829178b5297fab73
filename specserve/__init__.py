"""specserve: speculative decoding served as draft, target and orchestrator services.

Importing the package turns gRPC's fork support off for this process and its children
(``GRPC_ENABLE_FORK_SUPPORT=false`` unless set): specserve starts children with a
``preexec_fn`` (the parent-death signal), which makes :class:`subprocess.Popen` fork
rather than vfork, and with fork support on, gRPC restarts its poller in the forked
child, whose ``epoll_wait`` then fails on the descriptor ``close_fds`` closed and
aborts the child before it execs (grpc/grpc#43055: 13 of 300 children died under four
busy gRPC threads; none with the setting). The setting must precede gRPC's import,
hence here; specserve forks no process that goes on using gRPC without an exec.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
