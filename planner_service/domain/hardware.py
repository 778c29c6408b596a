"""GPU catalog and node defaults, copied from ``shared/data/gpus.json`` with the sources it cites.

FLOP/s are dense (no 2:4 sparsity). ``h2d_bytes_per_s`` / ``d2h_bytes_per_s`` are measured pinned
(cudaHostAlloc) copy-engine rates with ~1 GiB buffers, not the PCIe marketing figure; very large single
copies can run slower (A100 SXM4: 25.1 GB/s at 1 GiB, 16.5 GB/s at 20 GiB, nvbandwidth #42).
Where gpus.json gives a range for a card with no single measurement, the low end is taken: the planner
should not promise a transfer faster than the hardware was seen to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

_GIB = 2**30
_GB = 10**9
_TFLOP = 10**12


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    hbm_bytes: int  # usable device memory as nvidia-smi reports it, before CUDA context and safety margins
    hbm_bytes_per_s: float
    bf16_flops: float  # dense, per second
    h2d_bytes_per_s: float  # measured pinned host -> device
    d2h_bytes_per_s: float  # measured pinned device -> host
    # GPU -> GPU rate, one direction, of the link a tensor-parallel all-reduce crosses between two cards of a
    # node: PCIe peer-to-peer, through host DRAM where the driver has no peer access, or NVLink
    peer_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not value > 0:
                raise ValueError(f"{self.name}: {f.name} must be positive, got {value}")


_GPUS = (
    GpuSpec(
        name="RTX 3090",
        hbm_bytes=int(24.0 * _GIB),
        hbm_bytes_per_s=936 * _GB,
        bf16_flops=71 * _TFLOP,  # FP32-accumulate rate, the one PyTorch/vLLM GEMMs use
        h2d_bytes_per_s=24 * _GB,
        d2h_bytes_per_s=24 * _GB,
        peer_bytes_per_s=11 * _GB,  # no peer access: through host, both directions at once (see source)
        source="gpus.json: NVIDIA Ampere GA102 whitepaper Appendix A (bf16 71 TFLOPS w/ FP32 acc); 936 GB/s "
        "(holynerdvana spec page, xiaozheyao/triteia specs.py); H2D '~24-26 GB/s, use 4090/A100 measurements "
        "as proxy' -> low end 24 GB/s; no D2H measurement, H2D figure used; peer: p2p over PCIe 'driver-dependent', "
        "so through host at the RTX 4090's bidirectional low end (11 GB/s), the proxy gpus.json names",
    ),
    GpuSpec(
        name="RTX 4090",
        hbm_bytes=int(23.99 * _GIB),
        hbm_bytes_per_s=1008 * _GB,
        bf16_flops=165.2 * _TFLOP,  # FP32-accumulate rate
        h2d_bytes_per_s=23.9 * _GB,
        d2h_bytes_per_s=26.3 * _GB,
        peer_bytes_per_s=11 * _GB,  # no peer access: through host, both directions at once (see source)
        source="gpus.json: waredb.com / gigagpu.com (bf16 165.2 TFLOPS FP32-acc, 1008 GB/s); nvbandwidth "
        "issue #15, 8x RTX 4090 box: H2D 23.9-26.4, D2H 26.3-27.1 GB/s -> low ends; usable 23.99 GiB is a "
        "typical nvidia-smi total, not from a retrieved source; peer: p2p over PCIe 'disabled in stock driver', so an "
        "all-reduce goes through host with both directions of each card's link busy: 'bidirectional collapses to "
        "11-16' GB/s (nvbandwidth #15) -> low end 11 GB/s",
    ),
    GpuSpec(
        name="A100 40GB PCIe",
        hbm_bytes=int(40.0 * _GIB),
        hbm_bytes_per_s=1555 * _GB,
        bf16_flops=312 * _TFLOP,
        h2d_bytes_per_s=25 * _GB,
        d2h_bytes_per_s=25 * _GB,
        peer_bytes_per_s=21.8 * _GB,  # GPU<->GPU over PCIe4 without NVLink, low end (nvbandwidth #50)
        source="gpus.json: cli99/llm-analysis a100-pcie-40gb.json (1555 GB/s, 312 TFLOPS); "
        "winston-zhang-orz/gpu-specs (bf16 312 dense); H2D ~25 GB/s (A100-SXM4-40GB 25.13 GB/s at 1 GiB, "
        "nvbandwidth #42, same Gen4 x16 link); no D2H measurement, H2D figure used; peer: GPU<->GPU over PCIe4 without "
        "NVLink 21.8-26.35 GB/s (6x RTX A6000, nvbandwidth #50) -> low end; the optional NVLink bridge is not assumed",
    ),
    GpuSpec(
        name="A100 80GB PCIe",
        hbm_bytes=int(80.0 * _GIB),
        hbm_bytes_per_s=1935 * _GB,
        bf16_flops=312 * _TFLOP,
        h2d_bytes_per_s=25 * _GB,
        d2h_bytes_per_s=25 * _GB,
        peer_bytes_per_s=21.8 * _GB,  # GPU<->GPU over PCIe4 without NVLink, low end (nvbandwidth #50)
        source="gpus.json: ai-dynamo/aiconfigurator systems/a100_pcie.yaml @095f58a5 (1.935 TB/s, 80 GiB, "
        "bf16 312 TFLOPS); H2D ~25 GB/s as gpus.json gives it; no D2H measurement, H2D figure used; peer: PCIe4 "
        "GPU<->GPU low end 21.8 GB/s (nvbandwidth #50); the optional NVLink bridge is not assumed",
    ),
    GpuSpec(
        name="L40",
        hbm_bytes=int(45.0 * _GIB),
        hbm_bytes_per_s=864 * _GB,
        bf16_flops=181.05 * _TFLOP,
        h2d_bytes_per_s=24 * _GB,
        d2h_bytes_per_s=24 * _GB,
        peer_bytes_per_s=21.8 * _GB,  # GPU<->GPU over PCIe4 without NVLink, low end (nvbandwidth #50)
        source="gpus.json: NVIDIA L40/L40S datasheet table (mullet.se product 355414: bf16 181.05 dense, "
        "864 GB/s); usable 45.0 GiB from aiconfigurator l40s.yaml (46068 MiB); H2D '~24-26 (Gen4)' -> low "
        "end 24 GB/s; no D2H measurement, H2D figure used; no NVLink: peer is PCIe4 GPU<->GPU, low end 21.8 GB/s "
        "(nvbandwidth #50)",
    ),
    GpuSpec(
        name="L40S",
        hbm_bytes=int(44.99 * _GIB),
        hbm_bytes_per_s=864 * _GB,
        bf16_flops=362.05 * _TFLOP,
        h2d_bytes_per_s=24 * _GB,
        d2h_bytes_per_s=24 * _GB,
        peer_bytes_per_s=21.8 * _GB,  # GPU<->GPU over PCIe4 without NVLink, low end (nvbandwidth #50)
        source="gpus.json: ai-dynamo/aiconfigurator systems/l40s.yaml @095f58a5 (864 GB/s, 46068 MiB, "
        "bf16 362.05 TFLOPS); H2D '~24-26 (Gen4)' -> low end 24 GB/s; no D2H measurement, H2D figure used; no NVLink: "
        "peer is PCIe4 GPU<->GPU, low end 21.8 GB/s (nvbandwidth #50)",
    ),
    GpuSpec(
        name="H100 PCIe (80GB)",
        hbm_bytes=int(79.6 * _GIB),
        hbm_bytes_per_s=2000 * _GB,
        bf16_flops=756.5 * _TFLOP,
        h2d_bytes_per_s=55.63 * _GB,
        d2h_bytes_per_s=55.63 * _GB,
        peer_bytes_per_s=55.63 * _GB,  # no GPU<->GPU measurement on PCIe5: its H2D figure stands in (see source)
        source="gpus.json: ai-dynamo/aiconfigurator systems/h100_pcie.yaml @095f58a5 (2 TB/s, bf16 756.5 "
        "dense); H2D 55.63 GB/s = the H100 nvbandwidth host_to_device_memcpy_ce example it cites "
        "(dev.smart-guide.co.kr tutorial), Gen5 host; no copy-engine D2H measurement, H2D figure used; "
        "usable 79.6 GiB is a typical nvidia-smi total, not from a retrieved source; peer: gpus.json has no PCIe5 "
        "GPU<->GPU measurement, so the H2D figure stands in (on PCIe4 the peer figure, 21.8-26.35, is about the H2D "
        "one); the optional NVLink bridge is not assumed",
    ),
    GpuSpec(
        name="H200 SXM (141GB)",
        hbm_bytes=int(140.4 * _GIB),
        hbm_bytes_per_s=4800 * _GB,
        bf16_flops=989 * _TFLOP,
        h2d_bytes_per_s=50 * _GB,
        d2h_bytes_per_s=50 * _GB,
        peer_bytes_per_s=450 * _GB,  # NVLink 4 through NVSwitch, per direction (see source)
        source="gpus.json: ai-dynamo/aiconfigurator systems/h200_sxm.yaml @095f58a5 (4800 GB/s, bf16 989 "
        "dense); alibaba/InferSim hardware/gpu.py; H2D '~50-56 (Gen5)' -> low end 50 GB/s; no D2H "
        "measurement, H2D figure used; usable 140.4 GiB is a typical nvidia-smi total, not from a "
        "retrieved source; peer: NVLink 4 '900 GB/s bidirectional' (gpus.json) -> 450 GB/s per direction, a spec figure",
    ),
)

GPU_PRESETS: Mapping[str, GpuSpec] = MappingProxyType(
    dict(
        zip(
            ("rtx-3090", "rtx-4090", "a100-40gb-pcie", "a100-80gb-pcie", "l40", "l40s", "h100-pcie", "h200"),
            _GPUS,
            strict=True,
        )
    )
)


def gpu_preset(name: str) -> GpuSpec:
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown GPU preset {name!r}; known: {', '.join(GPU_PRESETS)}") from None


# --- node defaults ------------------------------------------------------------------------------------

# Project default for a GPU server's DRAM (a sizing choice, not a measured fact).
DEFAULT_HOST_DRAM_BYTES = 512 * _GIB
# Project default local NVMe capacity: 8 TB, decimal as drives are sold.
DEFAULT_NVME_BYTES = 8 * 10**12
# gpus.json host_storage, PCIe 4.0 x4 NVMe sequential read 7.0-7.45 GB/s (Samsung 980 Pro 7.0, 990 Pro
# 7.45; gamebastion.com, velocitymicro.com): low end. Datasheet QD-deep reads; a single-threaded
# safetensors load reaches only ~1-4 GB/s, which is the loader's limit, not the drive's.
DEFAULT_NVME_READ_BYTES_PER_S = 7.0 * _GB
# gpus.json has no write figure, so the read figure is reused: optimistic, as sequential writes on these
# drives are usually somewhat slower than reads.
DEFAULT_NVME_WRITE_BYTES_PER_S = DEFAULT_NVME_READ_BYTES_PER_S
