import pytest

from planner_service.domain.hardware import (
    DEFAULT_HOST_DRAM_BYTES,
    DEFAULT_NVME_BYTES,
    DEFAULT_NVME_READ_BYTES_PER_S,
    DEFAULT_NVME_WRITE_BYTES_PER_S,
    GPU_PRESETS,
    GpuSpec,
    gpu_preset,
)

EXPECTED_GPUS = ("rtx-3090", "rtx-4090", "a100-40gb-pcie", "a100-80gb-pcie", "l40", "l40s", "h100-pcie", "h200")


def test_every_preset_present() -> None:
    assert tuple(GPU_PRESETS) == EXPECTED_GPUS


@pytest.mark.parametrize("name", EXPECTED_GPUS)
def test_preset_numbers_positive_and_sourced(name: str) -> None:
    gpu = gpu_preset(name)
    assert isinstance(gpu.hbm_bytes, int)
    assert gpu.hbm_bytes > 0
    assert gpu.hbm_bytes_per_s > 0
    assert gpu.bf16_flops > 0
    assert gpu.h2d_bytes_per_s > 0
    assert gpu.d2h_bytes_per_s > 0
    assert gpu.peer_bytes_per_s > 0
    assert gpu.source
    # Measured host links sit below the PCIe per-direction peak (gpus.json: Gen5 x16 = 63 GB/s).
    assert gpu.h2d_bytes_per_s < 63e9


def test_h200_matches_gpus_json() -> None:
    # gpus.json "H200 SXM (141GB)": hbm_GiB_usable 140.4, 4800 GB/s, bf16 989 dense TFLOPS.
    h200 = gpu_preset("h200")
    assert h200.hbm_bytes == int(140.4 * 2**30)
    assert h200.hbm_bytes_per_s == 4800e9
    assert h200.bf16_flops == 989e12


def test_unknown_gpu_lists_names() -> None:
    with pytest.raises(KeyError) as info:
        gpu_preset("nope")
    for name in EXPECTED_GPUS:
        assert name in str(info.value)


def test_gpu_spec_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="hbm_bytes"):
        GpuSpec("bad", 0, 1.0, 1.0, 1.0, 1.0, 1.0, "test")


def test_presets_are_read_only() -> None:
    with pytest.raises(TypeError):
        GPU_PRESETS["x"] = gpu_preset("h200")  # type: ignore[index]  # the write this test expects to fail


def test_node_defaults() -> None:
    assert DEFAULT_HOST_DRAM_BYTES == 512 * 2**30
    assert DEFAULT_NVME_BYTES == 8 * 10**12
    # gpus.json host_storage: PCIe 4.0 x4 NVMe reads 7.0-7.45 GB/s.
    assert 7.0e9 <= DEFAULT_NVME_READ_BYTES_PER_S <= 7.45e9
    assert 0 < DEFAULT_NVME_WRITE_BYTES_PER_S <= DEFAULT_NVME_READ_BYTES_PER_S
