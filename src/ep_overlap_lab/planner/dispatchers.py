"""The token dispatchers as communication models, and what an all-to-all costs the compute beside it.

Contract:
    * :class:`Dispatcher` names a backend as Megatron-Core does (``alltoall``; ``flex`` with ``deepep``, ``hybridep``
      or ``ncclep``), the SMs its kernels hold, and whether its shapes are static. :func:`link_for` turns it, a model
      shape, a layout and a hardware profile into the planner's :class:`~ep_overlap_lab.planner.simulate.Link` for
      one rank, whose bandwidth is expressed against the all-to-all bytes ``cost_model`` books (every routed copy
      that leaves the rank), so one ``Link`` prices every backend.
    * Traffic per token, routing balanced (experts chosen uniformly, ``topk`` distinct of ``E``):
        - ``alltoall`` sends each routed copy to its expert's rank: ``topk x (peers in the NVLink domain) / EP``
          copies over NVLink, ``topk x (peers beyond it) / EP`` over the network.
        - ``deepep``/``hybridep`` send a token once to each rank holding one of its experts, and across the network
          once per remote NVLink domain holding one, which forwards it over NVLink (hierarchical dispatch).
        - ``ncclep`` sends a token once to each rank holding one of its experts, over whichever link reaches it;
          ``static_shape`` (``moe_ncclep_static_shape``) has no split-size exchange and no host sync.
      The all-to-all takes the longer of its NVLink and network parts, each at its bandwidth x ``comm_efficiency``.
    * Contention (``planner/resources.py`` applies it): while a transfer is on the link, compute runs on the SMs
      the communication kernels leave it and shares HBM with the bytes they move
      (:func:`compute_stretch`); while compute runs, a transfer takes :data:`COMM_STRETCH` times its time alone.
"""

import math
from dataclasses import dataclass

from ep_overlap_lab.planner.hardware import HardwareProfile
from ep_overlap_lab.planner.simulate import Link

BYTES_PER_ELEMENT = 2  # bf16 activations on the wire
BACKENDS = ("alltoall", "deepep", "hybridep", "ncclep")
# SMs an all-to-all's kernels hold when the recipe does not say. NCCL runs one CUDA block per channel on its own SM;
# an all-to-all over 8+ peers opens up to NCCL's default channel limit (assumption: 32, MAXCHANNELS on NVSwitch
# systems). DeepEP's default is 20 SMs (Megatron-Core: "historical default 20"); HybridEP and NCCL EP take the same
# when unset (Megatron-Core's moe_hybridep_num_sms: "None uses the default from DeepEP").
DEFAULT_SMS = {"alltoall": 32, "deepep": 20, "hybridep": 20, "ncclep": 20}
# Calibrated, the planner's only one: communication time while it shares the GPU with compute over its time alone.
# Upstream's matched Nsight profile of Qwen3-30B-A3B, 16 x H100, HybridEP (the seed page): the communication kernels'
# interval union grew from 8.25 s per step without the overlap to 10.83 s with it (0.11% and 36.55% of it concurrent
# with GEMM/attention: 9.079 ms and 3,958.997 ms). 10.83 / 8.25 = 1.313.
COMM_STRETCH = (3958.997 / 0.3655) / (9.079 / 0.0011)


@dataclass(frozen=True)
class Dispatcher:
    """A token dispatcher backend as a recipe sets it.

    Attributes:
        backend: ``alltoall``, or the flex backend: ``deepep``, ``hybridep``, ``ncclep``.
        num_sms: SMs its kernels hold (``moe_flex_dispatcher_num_sms``); None: :data:`DEFAULT_SMS`.
        static_shape: ``moe_ncclep_static_shape``: no split-size exchange before a dispatch.
    """

    backend: str = "alltoall"
    num_sms: int | None = None
    static_shape: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"Dispatcher: backend={self.backend!r}; give one of {', '.join(BACKENDS)}")
        if self.num_sms is not None and not (isinstance(self.num_sms, int) and self.num_sms >= 1):
            raise ValueError(f"Dispatcher: num_sms={self.num_sms!r}; give a whole number of SMs, 1 or more")
        if self.static_shape and self.backend != "ncclep":
            raise ValueError("Dispatcher: static_shape applies to the ncclep backend only")

    @property
    def sms(self) -> int:
        return self.num_sms or DEFAULT_SMS[self.backend]


ALLTOALL = Dispatcher()


def _hit(experts: int, held: int, topk: int) -> float:
    """Probability that a token's ``topk`` distinct experts (uniform of ``experts``) include one of ``held``."""
    if held >= experts:
        return 1.0
    return 1.0 - math.comb(experts - held, topk) / math.comb(experts, topk)


def copies_per_token(dispatcher: Dispatcher, experts: int, topk: int, ep: int, domain: int) -> tuple[float, float]:
    """``(NVLink, network)``: hidden-state copies one rank sends per token it routes, in one all-to-all."""
    local = min(ep, domain)  # ranks of the EP group in this rank's NVLink domain
    domains = math.ceil(ep / local)
    per_rank = _hit(experts, experts // ep, topk)
    if dispatcher.backend == "alltoall":
        return topk * (local - 1) / ep, topk * (ep - local) / ep
    if dispatcher.backend == "ncclep":
        return (local - 1) * per_rank, (ep - local) * per_rank
    # DeepEP/HybridEP: once per remote domain across the network; the domain that receives it forwards it to its ranks
    network = (domains - 1) * _hit(experts, experts // domains, topk)
    return domains * (local - 1) * per_rank, network


def all_to_all_seconds(
    dispatcher: Dispatcher, profile: HardwareProfile, experts: int, topk: int, ep: int, tokens: float, hidden: int
) -> float:
    """One all-to-all of ``tokens`` tokens alone on the GPU: the longer of its NVLink and network parts."""
    nvlink, network = copies_per_token(dispatcher, experts, topk, ep, profile.gpus_per_node)
    token_bytes = hidden * BYTES_PER_ELEMENT * tokens
    seconds = max(nvlink * token_bytes / profile.nvlink_Bps, network * token_bytes / profile.network_Bps)
    return seconds / profile.comm_efficiency


def compute_stretch(dispatcher: Dispatcher, profile: HardwareProfile, hbm_Bps_used: float) -> float:
    """How much slower compute runs beside an all-to-all: on the SMs left to it, and with the HBM bandwidth left to
    it (the transfer reads what it sends and writes what it receives at ``hbm_Bps_used``)."""
    sms = min(dispatcher.sms, profile.sm_count - 1)
    hbm_share = min(hbm_Bps_used / profile.hbm_Bps, 0.9)
    return profile.sm_count / (profile.sm_count - sms) / (1.0 - hbm_share)


def link_for(
    dispatcher: Dispatcher,
    profile: HardwareProfile,
    *,
    experts: int,
    topk: int,
    ep: int,
    tokens: float,
    hidden: int,
    booked_bytes: float,
) -> Link:
    """The rank's link for all-to-alls of ``tokens`` tokens, ``booked_bytes`` each in the planner's costs."""
    seconds = all_to_all_seconds(dispatcher, profile, experts, topk, ep, tokens, hidden)
    nvlink, network = copies_per_token(dispatcher, experts, topk, ep, profile.gpus_per_node)
    moved = (nvlink + network) * hidden * BYTES_PER_ELEMENT * tokens
    hbm = 2 * moved / seconds if seconds > 0 else 0.0  # read where it leaves, written where it lands
    meta = 0.0 if dispatcher.static_shape else 2 * profile.latency_s  # the split sizes' round trip
    return Link(
        bandwidth_Bps=booked_bytes / seconds if seconds > 0 else profile.nvlink_Bps,
        latency_s=profile.latency_s,
        meta_s=meta,
        comm_stretch=COMM_STRETCH,
        compute_stretch=compute_stretch(dispatcher, profile, hbm),
    )
