"""The GPU check's toolchain part: Python, torch, CUDA and the GPU, then every package the engine
and the check import, each found (version, path) or named missing with the wheels to carry.

    python -m bench.gpu_check_env

The engine's run-time dependencies come from pyproject.toml (`[project] dependencies`); the
check adds what it runs on (pytest; triton, whose kernels are the CUDA path) and what it uses
where present (pytest-timeout, nvidia-ml-py, flashinfer-python, which is not carried). Then it
imports the engine's entry points, which finds a dependency's own dependency missing
(tiktoken's regex, pydantic's pydantic-core, jinja2's markupsafe). Exits 1 when CUDA is not
available or something the engine or the check needs is missing. Needs Python 3.11 or newer
(tomllib), as the GPU machine has.
"""

from __future__ import annotations

import importlib
import platform
import re
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
# Beside the engine's dependencies: what the check runs on.
CHECK_NEEDS = ("pytest", "triton")
# Used where present: per-test limits (else bench.pytest_limit), NVML telemetry, flashinfer's
# MLA kernel; what their absence means.
OPTIONAL = {"pytest-timeout": "the check limits each test itself (bench.pytest_limit)",
            "nvidia-ml-py": "no GPU telemetry in the profile",
            "flashinfer-python": "not carried (a 101 MB wheel plus about 55 MB of "
                                 "dependencies): its tests skip, attention takes Triton"}
MODULE_OF = {"nvidia-ml-py": "pynvml", "flashinfer-python": "flashinfer"}
# Importing these imports everything the engine, its profile and the check's pair run with.
ENTRY_POINTS = ("engine.llm", "engine.generate", "graphs.profile", "bench.gpu_check_model")
# The project's own packages: one that does not import is a broken checkout, not a wheel.
PROJECT = ("engine", "ops", "graphs", "bench", "tools")
# How to bring missing wheels (resolved with their dependencies, so pins such as pydantic's on
# pydantic-core hold); bench/gpu_check.sh installs them with --no-deps --no-index.
DOWNLOAD = ("pip download -d WHEELS --only-binary=:all: --python-version 3.12 "
            "--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64")


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The distributions `[project] dependencies` names, without versions or markers."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0] for d in deps]


def module_of(dist: str) -> str:
    return MODULE_OF.get(dist, dist.lower().replace("-", "_"))


def wheel_of(error: Exception, default: str) -> str:
    """The distribution whose absence `error` (an import's) shows: the module Python did not
    find (a dependency's own dependency, say), else `default`."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return default
    top = error.name.split(".")[0]
    return next((d for d, m in MODULE_OF.items() if m == top), top.replace("_", "-"))


def check_packages(needed: list[str]) -> tuple[list[str], list[str]]:
    """Print one line per distribution (needed, then optional) and per entry point; return the
    distributions missing (those a needed one or an entry point does not find) and the entry
    points that fail to import."""
    missing: list[str] = []
    failing: list[str] = []

    def lacks(error: Exception, dist: str) -> None:
        wheel = wheel_of(error, dist)
        if wheel.split(".")[0] not in PROJECT and wheel not in missing:
            missing.append(wheel)

    for dist in [*needed, *OPTIONAL]:
        mod = module_of(dist)
        try:
            m = importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - report and go on
            why = f"{type(e).__name__}: {e}"
            if dist in needed:
                print(f"{dist:<18} MISSING ({why})")
                lacks(e, dist)
            else:
                print(f"{dist:<18} absent, optional: {OPTIONAL[dist]} ({why})")
            continue
        print(f"{dist:<18} {getattr(m, '__version__', '?'):<14} {getattr(m, '__file__', '')}")
    for entry in ENTRY_POINTS:
        try:
            importlib.import_module(entry)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"import {entry}: FAILS ({type(e).__name__}: {e})")
            failing.append(entry)
            lacks(e, entry)
        else:
            print(f"import {entry}: ok")
    return missing, failing


def check_device() -> bool:
    """Print torch, CUDA, the GPU and what flashinfer's MLA planning says of Kimi's widths on
    it; whether CUDA is available."""
    import torch

    print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
          torch.cuda.is_available())
    if not torch.cuda.is_available():
        return False
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}",
          f"{p.multi_processor_count} SMs")
    from ops.attention_gpu import MLADevice, flashinfer_unavailable, mla_backend

    print("flashinfer:", flashinfer_unavailable() or "imports whole")
    dev = MLADevice.of(0)
    for r, rope, dt in ((512, 64, torch.bfloat16), (512, 64, torch.float32)):
        print(f"flashinfer MLA backend for {r}/{rope} {dt}:", mla_backend(r, rope, dt, dev))
    return True


def main() -> int:
    print("python", platform.python_version(), sys.executable)
    missing, failing = check_packages([*requirements(), *CHECK_NEEDS])
    cuda = "torch" not in missing and check_device()
    if missing:
        print(f"missing: {', '.join(missing)}; bring their wheels (docs/gpu.md): "
              f"{DOWNLOAD} {' '.join(missing)}")
    elif failing:
        print(f"{', '.join(failing)} fail to import (see above)")
    else:
        print("every package the engine and the check need imports")
    if not cuda:
        print("CUDA is not available: the check's CUDA tests skip")
    return 1 if missing or failing or not cuda else 0


if __name__ == "__main__":
    sys.exit(main())
