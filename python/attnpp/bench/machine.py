"""The machine a run measures: its CPU (model, instruction-set flags), the CPU level and threads of each library,
the versions, the memory available, and the share of the CPUs' time that other processes took meanwhile."""
from __future__ import annotations

import functools
import os
import platform
import time

import numpy as np
import torch

import attnpp

from .config import CAPABILITY_VARS, OPENBLAS_LEVEL_CORE


def _cpuinfo(field):
    """The value of ``field`` in /proc/cpuinfo's first processor, or None (no such file or field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model():
    """The CPU's model name (/proc/cpuinfo; else what the platform module says)."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


def simd_flags():
    """The CPU's vector instruction-set flags (SSE, AVX, AVX-512, FMA, AMX and kin), sorted; [] if unknown."""
    flags = (_cpuinfo("flags") or "").split()
    return sorted(f for f in flags if f.startswith(("sse", "ssse", "avx", "fma", "amx", "f16c", "bmi")))


@functools.cache  # (NumPy's build does not change; gemm_products asks once per table row)
def numpy_openblas():
    """Whether NumPy's BLAS is OpenBLAS (NumPy's wheels), which takes OPENBLAS_CORETYPE."""
    try:
        return "openblas" in np.__config__.CONFIG["Build Dependencies"]["blas"]["name"].lower()
    except (AttributeError, KeyError, TypeError):  # (a NumPy before 1.26 has no CONFIG)
        return False


def numpy_level_core():
    """The OpenBLAS core type of attnpp's CPU level (config.OPENBLAS_LEVEL_CORE), at which NumPy's sgemm is
    measured; None where NumPy's BLAS is not OpenBLAS or the machine not x86-64 (OpenBLAS picks its own there)."""
    if not numpy_openblas() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return OPENBLAS_LEVEL_CORE.get(attnpp.cpu_capability())


def available_memory():
    """Bytes of memory available to a new allocation without swapping (/proc/meminfo's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_seconds():
    """(CPU seconds used by the whole machine, by this process and its ended children (the fine-tune cases' and
    --capability's runs), wall clock), or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    own = os.times()
    mine = own.user + own.system + own.children_user + own.children_system
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), mine, time.perf_counter()


def background_load(before):
    """Share of all CPUs' time that other processes (or the hypervisor) used since ``before``: OpenMP threads
    that lose their core wait for it at every barrier, so a busy machine slows both libraries unevenly."""
    after = cpu_seconds()
    if before is None or after is None:
        return None
    machine, own, wall = (b - a for a, b in zip(before, after))
    return max(0.0, machine - own) / (wall * (os.cpu_count() or 1))


def describe(load, note=None):
    """The machine as the results file records it: CPU, flags, each library's level (and the variables that forced
    it), threads, versions, the other processes' load (``load``, background_load's) and the run's ``note``."""
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "simd_flags": simd_flags(),
        "level": {"attnpp": attnpp.cpu_capability(), "torch": torch.backends.cpu.get_cpu_capability()},
        "forced": {var: os.environ[var] for var in CAPABILITY_VARS if var in os.environ},
        "threads": {"attnpp": attnpp.get_num_threads(), "torch": torch.get_num_threads()},
        "versions": {"attnpp": attnpp.__version__, "torch": torch.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "other_processes_load": load,
        "note": note,
    }
