"""Facts about the device: peak FLOP/s for MFU and memory statistics (CUDA or CPU RSS)."""

import dataclasses
import resource

import torch

# Dense bf16 tensor-core peak per device, from vendor data sheets (no sparsity).
_PEAK_BF16_FLOPS = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of one device, or ``None`` when unknown (CPUs, unlisted GPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Peak memory since the last reset, in GiB (``pct`` of the device's capacity)."""

    peak_active_gib: float
    peak_active_pct: float | None
    peak_reserved_gib: float | None
    peak_reserved_pct: float | None
    alloc_retries: int | None
    ooms: int | None

    def summary(self) -> str:
        if self.peak_reserved_gib is None:
            return f"{self.peak_active_gib:.2f}GiB rss"
        return f"{self.peak_active_gib:.2f}GiB({self.peak_active_pct:.1f}%)"


class MemoryMonitor:
    """CUDA allocator peaks on GPU; the process's peak resident set size on CPU."""

    _GIB = 1024**3

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.reset_peak_memory_stats(device)

    def stats(self) -> MemoryStats:
        if self.device.type != "cuda":
            # ru_maxrss is in KiB on Linux; it never resets, so it is the run's peak.
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return MemoryStats(rss / self._GIB, None, None, None, None, None)
        s = torch.cuda.memory_stats(self.device)
        active = s.get("active_bytes.all.peak", 0)
        reserved = s.get("reserved_bytes.all.peak", 0)
        return MemoryStats(
            peak_active_gib=active / self._GIB,
            peak_active_pct=100 * active / self.capacity,
            peak_reserved_gib=reserved / self._GIB,
            peak_reserved_pct=100 * reserved / self.capacity,
            alloc_retries=s.get("num_alloc_retries", 0),
            ooms=s.get("num_ooms", 0),
        )

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
