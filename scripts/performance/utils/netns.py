"""An emulated network between local ranks: one network namespace per rank, wire-bound links.

Each rank gets namespace ``<prefix>-r<k>`` with interface ``ep0`` (address 169.254.213.<k+1>). A hub namespace
holds a bridge that joins the ranks' veth links. Both ends of every link are shaped with
``tc qdisc ... tbf rate <G>gbit`` (netem is not available here), so a rank sends and receives at most G Gbit/s,
as over a NIC between nodes. gloo is bound to ``ep0`` through GLOO_SOCKET_IFNAME.

The namespaces are removed on every exit path: normal exit, exceptions (``with`` and atexit), SIGINT and
SIGTERM. Namespaces left by a process that was killed outright are removed by the next run.
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable

PREFIX = "epov"
SUBNET = "169.254.213"
IFNAME = "ep0"


class LinkUnavailable(RuntimeError):
    """The emulated link cannot be set up on this host (not root, or iproute2 missing)."""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Deletes namespaces of earlier runs whose process no longer exists; returns their names."""
    removed = []
    for name in _netns_names():
        match = re.fullmatch(rf"{PREFIX}(\d+)-(hub|r\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def check_available() -> None:
    """Raises LinkUnavailable saying why, when namespaces and tc cannot be used here."""
    if os.geteuid() != 0:
        raise LinkUnavailable(
            "--link_gbps needs root (it creates network namespaces and tc qdiscs); run as root or drop --link_gbps"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(
            f"--link_gbps needs iproute2 ({', '.join(missing)} not found); install iproute2 or drop --link_gbps"
        )


class EmulatedLink:
    """Namespaces and shaped links for ``nranks`` local ranks; use as a context manager."""

    def __init__(self, nranks: int, rate_gbps: float):
        if rate_gbps <= 0:
            raise ValueError(f"link rate must be positive, got {rate_gbps} Gbit/s")
        self.nranks, self.rate_gbps = nranks, rate_gbps
        self.owner = os.getpid()
        self.hub = f"{PREFIX}{self.owner}-hub"
        self.namespaces = [f"{PREFIX}{self.owner}-r{k}" for k in range(nranks)]
        self._previous_handlers: dict[int, object] = {}
        self._up = False
        self.removed_stale: list[str] = []  # namespaces of killed runs that entering this link removed

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def master_addr(self) -> str:
        return self.address(0)

    def _shape(self, namespace: str, device: str) -> None:
        rate = f"{self.rate_gbps * 1000:g}mbit"
        tc = ("tc", "-n", namespace, "qdisc", "add", "dev", device, "root")
        _run(*tc, "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")

    def __enter__(self) -> "EmulatedLink":
        check_available()
        self.removed_stale = remove_stale_namespaces()
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        self._up = True
        try:
            _run("ip", "netns", "add", self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for rank, namespace in enumerate(self.namespaces):
                _run("ip", "netns", "add", namespace)
                _run("ip", "-n", namespace, "link", "set", "lo", "up")
                port = f"r{rank}"
                _run(
                    "ip",
                    "-n",
                    namespace,
                    "link",
                    "add",
                    IFNAME,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.hub,
                )
                _run("ip", "-n", namespace, "addr", "add", f"{self.address(rank)}/24", "dev", IFNAME)
                _run("ip", "-n", namespace, "link", "set", IFNAME, "up")
                _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", port, "up")
                self._shape(namespace, IFNAME)  # what this rank sends
                self._shape(self.hub, port)  # what this rank receives
        except subprocess.CalledProcessError as exc:
            self.close()
            raise LinkUnavailable(
                f"could not set up the emulated link: {' '.join(exc.cmd)}: {exc.stderr.strip()}"
            ) from exc
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Removes every namespace of this link (idempotent; only the creating process acts)."""
        if not self._up or os.getpid() != self.owner:
            return
        self._up = False
        for namespace in [*self.namespaces, self.hub]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        atexit.unregister(self.close)

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self.owner:  # a forked rank: leave cleanup to the parent
            raise KeyboardInterrupt
        self.close()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def rank_setup(self) -> Callable[[int], None]:
        """A function that moves a forked rank into its namespace and binds gloo to its link."""
        namespaces = list(self.namespaces)

        def enter(rank: int) -> None:
            fd = os.open(f"/var/run/netns/{namespaces[rank]}", os.O_RDONLY)
            try:
                os.setns(fd, os.CLONE_NEWNET)
            finally:
                os.close(fd)
            os.environ["GLOO_SOCKET_IFNAME"] = IFNAME

        return enter
