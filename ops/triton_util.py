"""Launch helpers shared by the Triton kernels (`ops.attention_triton`, `ops.moe_triton`,
`ops.quant_triton`), and the interpreter limits that shape those kernels.

Interpreter: on CPU tensors the kernels always run under Triton's interpreter (`kernel_for`
re-wraps the jitted function's Python body in `InterpretedFunction`), whether or not
`TRITON_INTERPRET=1` was set when the kernel modules were imported (triton 3.9.0 reads the
variable when `@triton.jit` decorates, not at `import triton`); so tests need no environment
setup and a whole test session may mix CPU and CUDA runs. The interpreter's limits:

- `tl.dot` on bf16 tiles is wrong in the interpreter (bf16 is held as uint16 and multiplied as
  integers), so on the CPU dot operands are widened to fp32 (`ieee_dots`); on a GPU bf16/fp16
  tiles go to the tensor cores as they are, and fp32 inputs use `input_precision="ieee"` (no
  TF32), so fp32 runs match the torch twins tightly everywhere.
- Rounding fp32 to bf16 with `.to(tl.bfloat16)` truncates in the interpreter (numpy has no
  bf16; even `fp_downcast_rounding="rtne"` misrounds half the values there), while a GPU rounds
  to nearest even as torch does. Where `rne_bf16` says so (bf16 targets on the CPU) a kernel
  rounds by integer arithmetic on the fp32 bits first (`(u + 0x7FFF + ((u >> 16) & 1)) &
  0xFFFF0000`, exact for finite values), so the cast that follows is exact and matches torch.
- Under the interpreter a kernel can call another `@triton.jit` function only if that one was
  decorated under `TRITON_INTERPRET=1` (then it is an `InterpretedFunction`); `kernel_for`
  re-wraps only the kernel it is given. So the kernels call no jitted helper of their own and
  nothing of `triton.language.standard` (`tl.zeros`, `tl.sum`, `tl.max`, `tl.cdiv`,
  `tl.sigmoid`, decorated when triton is imported): they use builtins (`tl.full`, `tl.exp`,
  `tl.reduce`), and code two launches share lives in one kernel behind constexpr switches.
"""

from __future__ import annotations

from typing import Any

import torch

_INTERPRETED: dict[Any, Any] = {}


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """The compiled kernel on an accelerator; on the CPU the interpreter's version of it,
    whatever `TRITON_INTERPRET` was when the kernel was decorated."""
    if device.type != "cpu":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if kernel not in _INTERPRETED:
        _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[kernel]


def ieee_dots(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a kernel's dots over `dtype` tiles on `device` must take fp32 operands with
    `input_precision="ieee"`: on the CPU (the interpreter) and for fp32 (no TF32)."""
    return torch.device(device).type == "cpu" or dtype == torch.float32


def rne_bf16(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a kernel rounding fp32 to `dtype` on `device` must round to nearest even by hand
    (bf16 on the interpreter)."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16


