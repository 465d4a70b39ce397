"""`make bench-peak`'s FMA ceiling: the float32 lanes it counts follow the core's FMA units, not the flags alone."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_bench.py"


@pytest.fixture(scope="module")
def peak_bench():
    spec = importlib.util.spec_from_file_location("peak_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peak_bench"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("peak_bench", None)


def cpu(peak_bench, flags: str, vendor: str = "AuthenticAMD", family: int = 0, model: int = 0):
    return peak_bench.Cpu(model="x", arch="x86_64", cores=2, cpus=2, flags=frozenset(flags.split()), mhz=2600.0,
                          clock_source="test", vendor=vendor, family=family, model_number=model)


@pytest.mark.parametrize("family, model, design, lanes", [
    (0x1A, 0x02, "Zen 5", 16),  # 512-bit units
    (0x19, 0x11, "Zen 4", 8),  # Genoa: AVX-512 in two 256-bit halves
    (0x19, 0x61, "Zen 4", 8),  # Raphael
    (0x19, 0x01, "Zen 3", 8),  # no AVX-512 flag on Zen 3: AVX2's 8 lanes
    (0x17, 0x31, "Zen 2", 8),  # Rome: 256-bit units
    (0x17, 0x01, "Zen or Zen+", 4),  # Naples: AVX2 in two 128-bit halves
    (0x17, 0x08, "Zen or Zen+", 4),  # Pinnacle Ridge (Zen+)
])
def test_amd_core_design_sets_the_lanes(peak_bench, family, model, design, lanes):
    flags = "fma avx avx2" + (" avx512f" if design in ("Zen 4", "Zen 5") else "")
    c = cpu(peak_bench, flags, family=family, model=model)
    assert c.core_design == design
    assert c.lanes == lanes
    assert c.fma_ceiling() == pytest.approx(2 * 2.6e9 * 2 * lanes * 2)


def test_intel_avx512_counts_sixteen_lanes(peak_bench):
    c = cpu(peak_bench, "fma avx avx2 avx512f", vendor="GenuineIntel", family=6, model=0x8F)
    assert c.core_design == "" and c.lanes == 16
