"""Device profiles for the step-time model (``grpo_mega.plan.step_time``): what a data sheet says a device does.

A profile holds peak figures only; what a GRPO step really gets out of them is the job of the named efficiency
factors (``grpo_mega.plan.step_time.Efficiency``), fitted on measured steps, never set per config.

Sources (NVIDIA data sheets, dense, i.e. without 2:4 sparsity; bandwidths per GPU and per direction):

========  ==============  =============  ==========================  =====================  ========
device    bf16 TFLOP/s    HBM TB/s       NVLink GB/s per direction   network GB/s per GPU   memory
========  ==============  =============  ==========================  =====================  ========
H100      989 (SXM5)      3.35 (HBM3)    450 (NVLink 4: 900 both)    50 (400 Gb/s NIC)      80 GB
H200      989             4.8 (HBM3e)    450                         50                     141 GB
H20       148             4.0 (HBM3)     450                         50                     96 GB
A100      312 (SXM4)      2.04 (80 GB)   300 (NVLink 3: 600 both)    25 (200 Gb/s HDR)      80 GB
B200      2250 (HGX)      8.0 (HBM3e)    900 (NVLink 5: 1800 both)   50 (400 Gb/s NIC)      180 GB
========  ==============  =============  ==========================  =====================  ========

The network column assumes one 400 Gb/s (A100: 200 Gb/s) NIC per GPU, the common HGX build; clusters with fewer
NICs get less. ``storage_gb_s`` (a checkpoint's write rate per node) is an assumption of 2 GB/s for a shared
file system, not a data-sheet figure. The CPU profile is this project's 2-core test machine: fp32 matmul peak as
``bench/matmul_peak.py`` measures it, memory bandwidth as ``bench/matmul_peak.py --bandwidth`` measures it, gloo
between processes assumed; use ``cpu_profile`` with your own measurements for another machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from grpo_mega.config import ConfigError


@dataclass(frozen=True)
class DeviceProfile:
    """Peak figures of one device (per device; bytes and FLOP per second)."""

    name: str
    peak_flops: float
    """Dense matmul FLOP/s in the training dtype (bf16 on GPUs, fp32 on the CPU)."""
    memory_bandwidth: float
    """Device memory (HBM) bytes/s: what bounds decoding."""
    intra_node_bandwidth: float
    """Bytes/s per device and direction to a device of the same node (NVLink): TP and in-node DP traffic."""
    inter_node_bandwidth: float
    """Bytes/s per device and direction to another node (InfiniBand / RoCE): DP across nodes, async weight sync."""
    memory_gib: float
    storage_bandwidth: float = 2e9
    """Bytes/s a node writes a checkpoint at (an assumption: a shared file system)."""
    host_overlap: bool = False
    """The host queues work ahead of the device (a GPU's asynchronous kernel launches): a pass takes the longer of
    its device time and its host-side fixed costs, not their sum (the CPU runs both in turn)."""


TERA = 1e12
GB = 1e9

PROFILES: dict[str, DeviceProfile] = {
    "H100": DeviceProfile("H100", 989e12, 3.35e12, 450 * GB, 50 * GB, 79.6, host_overlap=True),
    "H200": DeviceProfile("H200", 989e12, 4.8e12, 450 * GB, 50 * GB, 139.8, host_overlap=True),
    "H20": DeviceProfile("H20", 148e12, 4.0e12, 450 * GB, 50 * GB, 95.6, host_overlap=True),
    "A100": DeviceProfile("A100", 312e12, 2.039e12, 300 * GB, 25 * GB, 79.3, host_overlap=True),
    "B200": DeviceProfile("B200", 2250e12, 8.0e12, 900 * GB, 50 * GB, 178.4, host_overlap=True),
    # 2-core Intel Xeon of this project's CI, 2 threads: fp32 matmul 394-438 GFLOP/s idle (bench/matmul_peak.py,
    # docs/performance.md); memory 6.5 GB/s (bench/matmul_peak.py --bandwidth, 1 thread, 2026-11-28 at load average
    # 13: a lower bound); gloo between processes and the disk: 2 and 0.5 GB/s, assumed, not measured.
    "CPU": DeviceProfile("CPU", 400e9, 6.5e9, 2e9, 2e9, 8.0, storage_bandwidth=0.5e9),
}


def device_profile(name: str) -> DeviceProfile:
    """The shipped profile called ``name`` (case-insensitive; "H100 80GB HBM3" -> H100, the first known name the
    device string contains); ConfigError naming the choices otherwise."""
    text = name.strip().upper()
    if text in PROFILES:
        return PROFILES[text]
    tokens = text.replace("-", " ").replace("_", " ").split()
    for key in PROFILES:
        if key != "CPU" and key in tokens:
            return PROFILES[key]
    raise ConfigError(f"--device {name!r}: no profile; expected one of {sorted(PROFILES)}")


def cpu_profile(peak_flops: float, memory_bandwidth: float, interconnect_bandwidth: float = 2e9) -> DeviceProfile:
    """A CPU profile from measured figures (``bench/matmul_peak.py``): fp32 peak FLOP/s, memory bytes/s, and the
    process-to-process (gloo) bytes/s for TP / DP traffic."""
    if not (peak_flops > 0 and memory_bandwidth > 0 and interconnect_bandwidth > 0):
        raise ConfigError("cpu_profile: peak_flops, memory_bandwidth and interconnect_bandwidth must be > 0")
    return replace(PROFILES["CPU"], peak_flops=peak_flops, memory_bandwidth=memory_bandwidth,
                   intra_node_bandwidth=interconnect_bandwidth, inter_node_bandwidth=interconnect_bandwidth)
