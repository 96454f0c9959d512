"""What an emulated cluster is: node names, addresses, link names, rates.

A :class:`ClusterSpec` is pure data (no system calls): ``up`` builds it,
writes it to the state file first (so ``down`` can undo a half-built
cluster), then creates what it names. Names all start with the prefix, so
two clusters with different prefixes and subnets coexist on one host.
"""

from __future__ import annotations

import ipaddress
import json
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError

__all__ = ["ClusterSpec", "parse_rate", "parse_delay", "format_rate", "STATE_ROOT"]

#: Where each cluster keeps its state file, launcher script and Slurm files.
STATE_ROOT = Path("/run/hpcpax-cluster")
#: Interface names are at most 15 characters; the prefix leaves room for "<i>v".
MAX_PREFIX = 8
MAX_NODES = 200

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text) -> int:
    """Link rate in bits per second from tc's notation (``2gbit``, ``500mbit``).

    ``bps`` suffixes are bytes per second, as in tc. Raises ConfigError.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _RATE_UNITS:
        raise ConfigError(f"rate must be a number with a unit such as 2gbit or 500mbit, "
                          f"not {text!r}")
    bits = float(match.group(1)) * _RATE_UNITS[unit]
    if not bits >= 1e6:
        raise ConfigError(f"rate must be at least 1mbit, not {text!r}")
    return int(bits)


def dilate(rate, delay, dilation) -> tuple:
    """``(rate, delay)`` in tc's notation for a cluster slowed ``dilation`` times.

    Time dilation (see ``hpcpax.app.emulation``): links run ``dilation`` times
    slower (the rate divided, the added latency multiplied) while the run
    multiplies its emulated compute by the same factor and reports its times
    divided by it. Raises ConfigError for a dilation not >= 1.
    """
    if isinstance(dilation, bool) or not isinstance(dilation, (int, float)) or dilation < 1:
        raise ConfigError(f"dilation must be a number >= 1, not {dilation!r}")
    bits = parse_rate(rate) / dilation
    if bits < 1e6:
        raise ConfigError(f"rate {rate} / dilation {dilation:g} is below 1mbit")
    seconds = parse_delay(delay) * dilation
    if seconds > 1.0:
        raise ConfigError(f"delay {delay} x dilation {dilation:g} is above 1s")
    return f"{int(round(bits))}bit", f"{seconds * 1e6:.3f}us"


def parse_delay(text) -> float:
    """One-way added latency in seconds from tc's notation (``100us``, ``1ms``, ``0``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = (match.group(2).lower() or "s") if match else None
    if not match or unit not in _DELAY_UNITS:
        raise ConfigError(f"delay must be a number with a unit such as 100us or 1ms, "
                          f"not {text!r}")
    seconds = float(match.group(1)) * _DELAY_UNITS[unit]
    if seconds > 1.0:
        raise ConfigError(f"delay must be at most 1s, not {text!r}")
    return seconds


def format_rate(bits_per_s) -> str:
    """``2000000000`` -> ``"2gbit"`` (exact units only, else plain bits)."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        value = bits_per_s / scale
        if value >= 1 and abs(value - round(value, 3)) < 1e-9:
            return f"{value:g}{unit}"
    return f"{int(bits_per_s)}bit"


def default_subnet(prefix: str) -> str:
    """A /24 in 10.213.0.0/16 picked from the prefix (``hpx`` -> 10.213.0.0/24)."""
    if prefix == "hpx":
        return "10.213.0.0/24"
    return f"10.213.{zlib.crc32(prefix.encode()) % 240 + 10}.0/24"


@dataclass
class ClusterSpec:
    """One emulated cluster.

    Attributes:
        prefix: start of every name (namespaces ``<prefix>1..N`` are the
            nodes and their hostnames; ``<prefix>br`` the bridge; ``<prefix>Iv``
            the host end of node I's veth; ``eth0`` its end in the node).
        nodes: number of nodes.
        rate_bps: link rate of each node, each direction, in bits/s.
        delay_s: added one-way latency between two nodes (half on each link).
        subnet: IPv4 /24 (or larger) of the cluster: ``.1`` is the host's
            address on the bridge, node I has ``.(10 + I)``.
        delay_applied: whether the kernel could add the delay (``netem``).
    """

    prefix: str = "hpx"
    nodes: int = 2
    rate_bps: int = 2_000_000_000
    delay_s: float = 0.0
    subnet: str = ""
    delay_applied: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[a-z][a-z0-9]*", self.prefix) \
                or len(self.prefix) > MAX_PREFIX or self.prefix[-1].isdigit():
            raise ConfigError(f"name prefix must be 1-{MAX_PREFIX} lowercase letters/digits "
                              f"starting with a letter and not ending with a digit, "
                              f"not {self.prefix!r}")
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) \
                or not 1 <= self.nodes <= MAX_NODES:
            raise ConfigError(f"nodes must be an int in 1..{MAX_NODES}, not {self.nodes!r}")
        if not self.subnet:
            self.subnet = default_subnet(self.prefix)
        try:
            network = ipaddress.IPv4Network(self.subnet, strict=True)
        except ValueError as exc:
            raise ConfigError(f"subnet must be an IPv4 network such as 10.213.0.0/24, "
                              f"not {self.subnet!r} ({exc})") from None
        if network.num_addresses < self.nodes + 12:
            raise ConfigError(f"subnet {self.subnet} is too small for {self.nodes} nodes")
        if not network.is_private:
            raise ConfigError(f"subnet must be a private network, not {self.subnet!r}")

    # ------------------------------------------------------------------ names
    @property
    def network(self) -> ipaddress.IPv4Network:
        """The cluster's subnet."""
        return ipaddress.IPv4Network(self.subnet)

    @property
    def node_names(self) -> list:
        """Namespace name = hostname of every node, in order."""
        return [f"{self.prefix}{i}" for i in range(1, self.nodes + 1)]

    @property
    def bridge(self) -> str:
        """Name of the host bridge the nodes' veths join."""
        return f"{self.prefix}br"

    @property
    def host_address(self) -> str:
        """The host's address on the bridge (hydra's and slurmctld's side)."""
        return str(self.network.network_address + 1)

    @property
    def prefix_len(self) -> int:
        """Prefix length of the subnet."""
        return self.network.prefixlen

    def veth(self, node: str) -> str:
        """Host-side end of ``node``'s link."""
        return f"{node}v"

    def address(self, node: str) -> str:
        """IPv4 address of ``node``."""
        index = self.node_names.index(node) + 1
        return str(self.network.network_address + 10 + index)

    @property
    def state_dir(self) -> Path:
        """Where this cluster's state (``state.json``, pid files) lives."""
        return STATE_ROOT / self.prefix

    @property
    def launcher(self) -> Path:
        """The ssh-like script for ``mpirun -launcher ssh -launcher-exec``."""
        return self.state_dir / "launcher"

    def hosts_lines(self) -> list:
        """``/etc/hosts`` lines for the nodes, tagged for removal."""
        return [f"{self.address(n)} {n}  # hpcpax-cluster {self.prefix}" for n in self.node_names]

    # ------------------------------------------------------------------ state
    def to_dict(self) -> dict:
        """The spec as a JSON-able dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data) -> "ClusterSpec":
        """A spec from :meth:`to_dict`'s dict."""
        return cls(**data)

    def save(self) -> None:
        """Write the spec to ``state_dir/state.json`` (atomically)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, prefix: str) -> "ClusterSpec | None":
        """The saved spec of cluster ``prefix``, or None when there is none."""
        path = STATE_ROOT / prefix / "state.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
