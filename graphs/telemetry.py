"""GPU telemetry from NVML (`pynvml`, from the optional `gpu` extra), for profiling only.

Every metric is read on its own: a VM or a driver that lacks one (`NVMLError_NotSupported`)
loses that metric, not the rest. Without NVML or a driver, `available` is False and the report
says "no GPU telemetry". Sampling runs on a background thread (>= 100 ms period), never on the
step's path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

NO_TELEMETRY = "no GPU telemetry"


def _read(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # NVMLError_* (not supported, no permission, ...): drop this metric only
        return None


def pci_bus_id(index: int) -> str | None:
    """The PCI address (`"0000:3b:00.0"`) of CUDA device `index`, from torch's device properties
    (`pci_domain_id`, `pci_bus_id`, `pci_device_id`); None when this torch does not expose them."""
    import torch

    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(not isinstance(i, int) for i in ids):
        return None
    return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"


def nvml_handle(nvml: Any, index: int) -> tuple[Any, str]:
    """NVML's handle for CUDA device `index`, and how it was found.

    NVML numbers devices in PCI order while CUDA's ordinals follow CUDA_DEVICE_ORDER (fastest
    first by default) and CUDA_VISIBLE_DEVICES, so the device is looked up by its PCI bus id
    (`nvmlDeviceGetHandleByPciBusId`, which calls NVML's `..._v2`); only when that fails is NVML
    asked for the same index, and the returned note says so."""
    try:
        pci = pci_bus_id(index)
    except Exception as e:  # no CUDA in this torch, a bad ordinal
        pci, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "torch exposes no PCI bus id"
    if pci is not None:
        by_pci = getattr(nvml, "nvmlDeviceGetHandleByPciBusId_v2", None) or getattr(
            nvml, "nvmlDeviceGetHandleByPciBusId", None)
        if by_pci is None:
            why = "this pynvml has no nvmlDeviceGetHandleByPciBusId"
        else:
            try:
                return by_pci(pci), f"PCI bus id {pci}"
            except Exception as e:  # NVMLError_NotFound, NVMLError_InvalidArgument
                why = f"PCI bus id {pci} not found ({type(e).__name__}: {e})"
    return (nvml.nvmlDeviceGetHandleByIndex(index),
            f"NVML index {index} ({why}; NVML and CUDA may order devices differently)")


class Telemetry:
    """NVML telemetry for CUDA device `index` (the ordinal torch uses), found by PCI bus id."""

    def __init__(self, index: int = 0, enabled: bool = True):
        self.available = False
        self.reason = f"{NO_TELEMETRY} (no CUDA device)"
        self.lookup: str | None = None
        self.nvml: Any = None
        self.handle: Any = None
        if not enabled:
            return
        try:
            import pynvml  # lazy: the CPU install does not have it

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle, self.lookup = nvml_handle(pynvml, index)
            self.available = True
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded
            self.reason = f"{NO_TELEMETRY} ({type(e).__name__}: {e})"
            if self.nvml is not None:  # initialised, but no handle for this device
                _read(self.nvml.nvmlShutdown)

    def close(self) -> None:
        if self.available:
            _read(self.nvml.nvmlShutdown)
            self.available = False

    # ---- one-off reads ---------------------------------------------------------------------------

    def static(self) -> dict[str, Any]:
        """Name, memory, link state: what the numbers depend on."""
        if not self.available:
            return {"telemetry": self.reason}
        n, h = self.nvml, self.handle
        mem = _read(lambda: n.nvmlDeviceGetMemoryInfo(h))
        name = _read(lambda: n.nvmlDeviceGetName(h))
        out: dict[str, Any] = {
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_total_bytes": getattr(mem, "total", None),
            "memory_used_bytes": getattr(mem, "used", None),
            "sm_clock_mhz": _read(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            "sm_clock_max_mhz": _read(lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)),
            "power_w": _watts(_read(lambda: n.nvmlDeviceGetPowerUsage(h))),
            "power_limit_w": _watts(_read(lambda: n.nvmlDeviceGetEnforcedPowerLimit(h))),
            "pcie_gen": _read(lambda: n.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            "pcie_width": _read(lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h)),
            "nvlink_active_links": self._nvlinks(),
            "gpu_count": _read(n.nvmlDeviceGetCount),
            "nvml_device": self.lookup,
        }
        return out

    def _nvlinks(self) -> int | None:
        n, h = self.nvml, self.handle
        links = getattr(n, "NVML_NVLINK_MAX_LINKS", 18)
        states = [_read(lambda i=i: n.nvmlDeviceGetNvLinkState(h, i)) for i in range(links)]
        known = [s for s in states if s is not None]
        return sum(1 for s in known if s) if known else None

    def energy_mj(self) -> int | None:
        if not self.available:
            return None
        return _read(lambda: self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    # ---- background sampling ---------------------------------------------------------------------

    def sampler(self, period_s: float = 0.1) -> Sampler:
        return Sampler(self, max(period_s, 0.1))


def _watts(mw: int | None) -> float | None:
    return None if mw is None else mw / 1000.0


class Sampler:
    """`with telemetry.sampler() as s: ...` then `s.summary()`: mean power and SM clock over the
    block, and the energy it used (from the energy counter when the GPU has one)."""

    def __init__(self, tel: Telemetry, period_s: float):
        self.tel, self.period = tel, period_s
        self.power: list[float] = []
        self.clock: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._e0: int | None = None
        self._e1: int | None = None

    def _loop(self) -> None:
        n, h = self.tel.nvml, self.tel.handle
        while not self._stop.wait(self.period):
            p = _read(lambda: n.nvmlDeviceGetPowerUsage(h))
            c = _read(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
            if p is not None:
                self.power.append(p / 1000.0)
            if c is not None:
                self.clock.append(float(c))

    def __enter__(self) -> Sampler:
        if self.tel.available:
            self._e0 = self.tel.energy_mj()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._e1 = self.tel.energy_mj()

    def summary(self, seconds: float, tokens: int) -> dict[str, Any]:
        if not self.tel.available:
            return {}
        mean = lambda xs: sum(xs) / len(xs) if xs else None
        power = mean(self.power)
        joules = None
        if self._e0 is not None and self._e1 is not None:
            joules = (self._e1 - self._e0) / 1000.0
        elif power is not None:
            joules = power * seconds
        return {"power_w": power, "sm_clock_mhz": mean(self.clock), "joules": joules,
                "joules_per_token": joules / tokens if joules is not None and tokens else None}
