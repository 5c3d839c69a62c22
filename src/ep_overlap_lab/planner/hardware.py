"""Hardware profiles the planner prices a cluster with: what one GPU and its links deliver, each figure sourced.

Contract:
    * Facts (datasheet figures, per GPU): dense BF16 peak, SM count, HBM bandwidth, NVLink bandwidth per direction,
      the NVLink domain (GPUs one NVLink hop apart: 8 on HGX/DGX boards, 72 in an NVL72 rack) and the scale-out
      network per GPU per direction.
    * Assumptions (the same for every profile, set before any comparison with a published step time): the share of
      peak a MoE layer's compute reaches, the share of link bandwidth an all-to-all reaches, its latency.
    * ``sources`` names where each figure comes from; a figure marked ``assumption`` is one.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HardwareProfile:
    """What one GPU and its links deliver. Bandwidths are per GPU and per direction."""

    name: str
    peak_flops: float
    sm_count: int
    hbm_Bps: float
    gpus_per_node: int  # the NVLink domain
    nvlink_Bps: float
    network_Bps: float
    compute_efficiency: float = 0.40
    comm_efficiency: float = 0.70
    latency_s: float = 30e-6
    sources: dict[str, str] = field(default_factory=dict)


_ASSUMED = {
    "compute_efficiency": "assumption: 0.40 of peak for a MoE layer (dense GPT layers reach 0.40-0.47 MFU on H100 "
    "in Megatron-Core's published results; grouped expert GEMMs are smaller)",
    "comm_efficiency": "assumption: an all-to-all reaches 0.7 of the link bandwidth",
    "latency_s": "assumption: 30 us per all-to-all (launch and synchronisation)",
}
_HOPPER = _ASSUMED | {
    "peak_flops": "NVIDIA H100/H200 SXM datasheets: 989 TFLOP/s dense BF16 (1,979 with sparsity)",
    "sm_count": "NVIDIA H100 whitepaper: 132 SMs on the SXM5 part",
    "gpus_per_node": "DGX/HGX H100 and H200: 8 GPUs on one NVSwitch domain",
    "nvlink_Bps": "NVIDIA datasheets: NVLink 4, 900 GB/s per GPU both ways together, so 450 GB/s each way",
    "network_Bps": "DGX H100/H200: one ConnectX-7 400 Gb/s InfiniBand NDR adapter per GPU, 50 GB/s each way",
}
_BLACKWELL = _ASSUMED | {
    "sm_count": "148 SMs per B200 (two dies of 74 enabled SMs; NVIDIA Blackwell architecture brief)",
    "nvlink_Bps": "NVLink 5: 1.8 TB/s per GPU both ways together, 900 GB/s each way (DGX B200, GB200/GB300 NVL72)",
    "hbm_Bps": "HBM3e, 8 TB/s per GPU (DGX B200: 64 TB/s for 8 GPUs; GB200/GB300 NVL72: 576 TB/s for 72)",
}

PROFILES: dict[str, HardwareProfile] = {
    "H100": HardwareProfile(
        "H100 SXM", 989e12, 132, 3.35e12, 8, 450e9, 50e9,
        sources=_HOPPER | {"hbm_Bps": "NVIDIA H100 SXM datasheet: HBM3, 3.35 TB/s"},
    ),
    # The H100's compute, SMs and NVLink; larger, faster HBM.
    "H200": HardwareProfile(
        "H200 SXM", 989e12, 132, 4.8e12, 8, 450e9, 50e9,
        sources=_HOPPER | {"hbm_Bps": "NVIDIA H200 SXM datasheet: HBM3e, 4.8 TB/s"},
    ),
    "B200": HardwareProfile(
        "B200 (HGX/DGX, NVLink domain of 8)", 2.25e15, 148, 8e12, 8, 900e9, 50e9,
        sources=_BLACKWELL | {
            "peak_flops": "HGX B200 (1,000 W): 2.25 PFLOP/s dense BF16 (4.5 with sparsity)",
            "gpus_per_node": "DGX/HGX B200: 8 GPUs on two NVSwitch chips",
            "network_Bps": "DGX B200 user guide: 8 ConnectX-7 400 Gb/s adapters, one per GPU, 50 GB/s each way",
        },
    ),
    "B300": HardwareProfile(
        "B300 (HGX/DGX, NVLink domain of 8)", 2.25e15, 160, 8e12, 8, 900e9, 100e9,
        sources=_BLACKWELL | {
            "peak_flops": "HGX B300: 2.25 PFLOP/s dense BF16, as the HGX B200",
            "sm_count": "Blackwell Ultra: 160 SMs per GPU (NVIDIA Blackwell Ultra technical blog)",
            "gpus_per_node": "DGX/HGX B300: 8 GPUs on one NVSwitch domain",
            "network_Bps": "DGX B300: one ConnectX-8 800 Gb/s per GPU, 100 GB/s each way",
        },
    ),
    "GB200": HardwareProfile(
        "GB200 NVL72 (NVLink domain of 72)", 2.5e15, 148, 8e12, 72, 900e9, 50e9,
        sources=_BLACKWELL | {
            "peak_flops": "GB200 NVL72: 180 PFLOP/s dense BF16 for 72 GPUs, 2.5 PFLOP/s each (1,200 W part)",
            "gpus_per_node": "GB200 NVL72: 72 GPUs on one NVLink switch system (130 TB/s)",
            "network_Bps": "GB200 compute tray: 4 ConnectX-7 400 Gb/s adapters for 4 GPUs, 50 GB/s each way",
        },
    ),
    "GB300": HardwareProfile(
        "GB300 NVL72 (NVLink domain of 72)", 2.5e15, 160, 8e12, 72, 900e9, 100e9,
        sources=_BLACKWELL | {
            "peak_flops": "GB300 NVL72: 180 PFLOP/s dense BF16 for 72 GPUs, 2.5 PFLOP/s each",
            "sm_count": "Blackwell Ultra: 160 SMs per GPU (NVIDIA Blackwell Ultra technical blog)",
            "gpus_per_node": "GB300 NVL72: 72 GPUs on one NVLink switch system (130 TB/s)",
            "network_Bps": "GB300 NVL72 enterprise reference architecture: one ConnectX-8 800 Gb/s per GPU, "
            "100 GB/s each way",
        },
    ),
}  # fmt: skip
# An NVL72 rack used as 8-GPU NVLink domains (the NVLink partitioned as an HGX board would be): the same GPU, the
# domain of 8, what recipes written for 8-GPU nodes assume.
for _name in ("GB200", "GB300"):
    _rack = PROFILES[_name]
    PROFILES[f"{_name}-NVL8"] = HardwareProfile(
        _rack.name.replace("NVLink domain of 72", "NVLink domain of 8"), _rack.peak_flops, _rack.sm_count,
        _rack.hbm_Bps, 8, _rack.nvlink_Bps, _rack.network_Bps,
        sources=_rack.sources | {"gpus_per_node": "assumption: the rack's NVLink used as domains of 8 GPUs"},
    )  # fmt: skip
