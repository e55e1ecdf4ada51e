"""Compile every Triton kernel configuration the engine launches, for a GPU this machine need not
have, and report what the compiler made of each.

    python -m graphs.kernels --model configs/kimi-k2.5-text --draft configs/kimi-k2.5-dflash \\
        --tp 8 --arch sm_90a --json kernels.json

The launches are the engine's own: each launcher (`ops.moe_triton`'s expert GEMMs,
`ops.attention_triton`'s paged MLA prefix and drafter attention, `ops.prefill_triton`'s MHA prefill
when present, `ops.norm_triton`'s RMSNorm at each norm's width and with the residual add,
`ops.rope_triton`'s rotary tails of the queries and keys) runs on meta tensors of one rank's
shapes, steps and prefill chunks, with its `kernel_for` swapped for a recorder, so the constexprs,
warps and stages recorded are the ones a CUDA run passes. Each distinct configuration is then
specialized as Triton's launcher would (its binder: 16-byte-aligned pointers, integer hints) and
compiled with Triton's own compiler for the target (`GPUTarget("cuda", 90, 32)` for sm_90a) and
`ptxas -v` on the PTX. Each row: `{"name", "use", "config", "mma", "registers", "spills",
"shared_bytes"}` where `use` is "step" or "prefill" and "attention" or "experts" (or "norm" and
"rope": one configuration a shape serves steps and prefill alike), and `mma` is "wgmma"
(Hopper's warpgroup MMA in the PTX), "mma.sync" or "none". Needs Triton's NVIDIA backend (its
bundled ptxas), no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import DraftConfig, ModelConfig
from engine.memory import PREFILL_CHUNK

ARCHS = {"sm_90a": 90, "sm_90": 90, "sm_100a": 100, "sm_80": 80}
# Step batches and target rows a step request carries (plain decoding: 1; a tree of the default
# budget: 17) whose launches are recorded (configurations are deduplicated).
STEP_BATCHES = (1, 8, 64)
STEP_ROWS = (1, 17)


@dataclass
class Launch:
    """One recorded launch: the kernel, its arguments and keyword arguments (constexprs and
    launch options), and what the engine launched it for."""

    kernel: Any
    args: tuple
    kwargs: dict[str, Any]
    use: str = ""
    shapes: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """Stands in for `ops.triton_util.kernel_for`: `recorder(kernel, device)[grid](*args, **kw)`
    records the launch instead of running it."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __call__(self, kernel: Any, device: torch.device) -> Any:
        rec = self

        class _Grid:
            def __getitem__(self, grid: Any) -> Callable[..., None]:
                def launch(*args: Any, **kwargs: Any) -> None:
                    rec.launches.append(Launch(kernel, args, kwargs))
                return launch

        return _Grid()


@contextlib.contextmanager
def recording() -> Iterator[_Recorder]:
    """Swap the Triton launchers' `kernel_for` for a recorder while the block runs."""
    import ops.attention_triton as at
    import ops.moe_triton as mt
    import ops.norm_triton as nt
    import ops.quant_triton as qt
    import ops.rope_triton as rt

    rec = _Recorder()
    patched = [(qt, "kernel_for"), (at, "_kernel_for"), (nt, "kernel_for"), (mt, "kernel_for"),
               (rt, "kernel_for")]
    try:
        import ops.prefill_triton as pt
        patched.append((pt, "kernel_for"))
    except ImportError:
        pass
    saved = [(m, n, getattr(m, n)) for m, n in patched]
    try:
        for m, n in patched:
            setattr(m, n, rec)
        yield rec
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def recorded(use: str, run: Callable[[], Any], **shapes: Any) -> list[Launch]:
    """The launches `run()` makes (`recording`), each marked with its `use` and `shapes`."""
    with recording() as rec:
        run()
    for la in rec.launches:
        la.use, la.shapes = use, shapes
    return rec.launches


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def expert_launches(cfg: ModelConfig, tp: int, tokens: dict[str, list[int]]) -> list[Launch]:
    """The routed expert bank's GEMM launches on one rank, for each `use` in `tokens` ("step
    experts": the tokens of a step; "prefill experts": a chunk's)."""
    from ops.moe_triton import (
        moe_experts_fp8_triton,
        moe_experts_triton,
        moe_experts_w4a16_triton,
    )

    E, H, k = cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok
    inter = cfg.moe_intermediate_size // tp
    q = cfg.quantization

    def bank(T: int) -> None:
        x, idx = _meta(T, H), torch.empty(T, k, dtype=torch.int64, device="meta")
        w = torch.empty(T, k, dtype=torch.float32, device="meta")
        # the shared experts' rows, which the reduction adds (`MoE.forward`)
        add = _meta(T, H) if cfg.n_shared_experts else None
        if q is not None and q.method == "int4":
            g = q.group_size
            moe_experts_w4a16_triton(
                x, idx, w, _meta(E, 2 * inter, -(-H // 8), dtype=torch.int32),
                _meta(E, 2 * inter, -(-H // g)), _meta(E, H, -(-inter // 8), dtype=torch.int32),
                _meta(E, H, -(-inter // g)), g, add=add)
        elif q is not None and q.method == "fp8":
            b0, b1 = q.block_size
            f8 = torch.float8_e4m3fn
            moe_experts_fp8_triton(
                x, idx, w, _meta(E, 2 * inter, H, dtype=f8),
                _meta(E, -(-2 * inter // b0), -(-H // b1), dtype=torch.float32),
                _meta(E, H, inter, dtype=f8),
                _meta(E, -(-H // b0), -(-inter // b1), dtype=torch.float32), (b0, b1), add=add)
        else:
            moe_experts_triton(x, idx, w, _meta(E, 2 * inter, H), _meta(E, H, inter), add=add)

    return [la for use, counts in tokens.items() for T in counts
            for la in recorded(use, lambda T=T: bank(T), tokens=T)]


def attention_launches(cfg: ModelConfig, draft: DraftConfig | None, tp: int, chunk: int,
                       page_size: int, context: int) -> list[Launch]:
    """The attention kernels' launches on one rank: the paged MLA prefix attention of steps
    (each batch's target rows, `STEP_ROWS`), the drafter's context attention of steps, and the
    MHA prefill kernel's causal and prefix passes of a prefill chunk over its cached prefix
    (every prefill chunk takes the MHA form) when `ops.prefill_triton` is present."""
    import ops.attention_triton as at

    heads = cfg.num_attention_heads // tp
    R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    pages = -(-context // page_size)
    out: list[Launch] = []

    def record(use: str, run: Callable[[], Any], **shapes: Any) -> None:
        out.extend(recorded(use, run, **shapes))

    def mla(bs: int, rows: int) -> Callable[[], Any]:
        table = torch.empty(bs, pages, dtype=torch.int32, device="meta")
        ctx = torch.empty(bs, dtype=torch.int32, device="meta")
        return lambda: at.mla_prefix_attention(
            _meta(bs, rows, heads, R), _meta(bs, rows, heads, P),
            _meta(bs * pages * page_size, R + P), table, ctx, page_size, 1.0)

    for bs in STEP_BATCHES:
        for rows in STEP_ROWS:
            record("step attention", mla(bs, rows), batch=bs, rows=rows)
    if draft is not None:
        nh = draft.num_attention_heads // tp
        kvh = max(1, draft.num_key_value_heads // tp)
        hd = draft.head_dim
        for bs in STEP_BATCHES:
            table = torch.empty(bs, pages, dtype=torch.int32, device="meta")
            ctx = torch.empty(bs, dtype=torch.int32, device="meta")

            def drafter(bs: int = bs, table: torch.Tensor = table,
                        ctx: torch.Tensor = ctx) -> Any:
                return at.draft_context_attention(
                    _meta(bs, draft.block_size, nh, hd),
                    _meta(bs * pages * page_size, 2 * kvh * hd), table, ctx, page_size, 1.0)

            record("step attention", drafter, batch=bs, rows=draft.block_size)
    try:
        from ops.prefill_triton import mha_prefill_triton
    except ImportError:
        return out
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim

    def mha(keys: int, causal: bool, prev: bool) -> Callable[[], Any]:
        o, lse = _meta(1, chunk, heads, dv, dtype=torch.float32), _meta(
            1, chunk, heads, dtype=torch.float32)
        return lambda: mha_prefill_triton(
            _meta(1, chunk, heads, dn + P), _meta(1, keys, heads, dn), _meta(1, keys, P),
            _meta(1, keys, heads, dv), 1.0, causal, o if prev else None,
            lse if prev else None)

    record("prefill attention", mha(chunk, True, False), rows=chunk, keys=chunk)
    record("prefill attention", mha(chunk, False, True), rows=chunk, keys=chunk)
    return out


def norm_launches(cfg: ModelConfig, draft: DraftConfig | None) -> list[Launch]:
    """The RMSNorm kernel's launches: one a width the engine normalizes (the hidden states, the
    query and latent projections, the drafter's heads), and the hidden states' with the
    residual add (`add_rms_norm`)."""
    from ops.norm_triton import add_rms_norm_triton, rms_norm_triton

    widths = {cfg.hidden_size, cfg.kv_lora_rank, *([cfg.q_lora_rank] if cfg.q_lora_rank else []),
              *([draft.head_dim] if draft is not None else [])}
    out: list[Launch] = []
    for H in sorted(widths):
        out += recorded("norm", lambda H=H: rms_norm_triton(_meta(4, H), _meta(H), 1e-6),
                        width=H)
    H = cfg.hidden_size
    return out + recorded("norm", lambda: add_rms_norm_triton(_meta(4, H), _meta(4, H),
                                                              _meta(H), 1e-6), width=H)


def rope_launches(cfg: ModelConfig, tp: int) -> list[Launch]:
    """The rotary kernel's launches: the queries' heads of one rank (their rotary tail after
    `qk_nope_head_dim` channels) and the keys' single rotary head."""
    from ops.rope_triton import rope_tail_triton

    heads, P = cfg.num_attention_heads // tp, cfg.qk_rope_head_dim
    angles = _meta(4, P // 2, dtype=torch.float32)
    out: list[Launch] = []
    for h, nope in ((heads, cfg.qk_nope_head_dim), (1, 0)):
        out += recorded("rope", lambda h=h, nope=nope: rope_tail_triton(
            _meta(4, h, nope + P), angles, angles, nope), heads=h, nope=nope)
    return out


def _type_name(v: Any) -> str:
    return getattr(v, "name", None) or str(v)


def config_of(la: Launch) -> dict[str, Any]:
    """A launch's configuration: its constexprs (by name) and launch options, as JSON values."""
    names = la.kernel.arg_names
    const = {p.name for p in la.kernel.params if p.is_constexpr}
    cfg: dict[str, Any] = {}
    for i, v in enumerate(la.args):
        if names[i] in const:
            cfg[names[i]] = v
    for key, v in la.kwargs.items():
        cfg[key] = v
    cfg.setdefault("num_warps", 4)
    cfg.setdefault("num_stages", 3)
    return {key: (v if isinstance(v, (bool, int, float, str)) else _type_name(v))
            for key, v in cfg.items()}


def ptxas_path(arch: int) -> str:
    """Triton's bundled ptxas for `arch` (what its own compiler runs)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def _compilable(fn: Any) -> Any:
    """`fn`, a jitted kernel with a compiled form (one decorated under `TRITON_INTERPRET=1` has
    none)."""
    if not hasattr(fn, "params"):
        raise RuntimeError(f"{fn} was decorated under TRITON_INTERPRET=1: it has no compiled "
                           "form")
    return fn


def compile_launch(la: Launch, arch: str = "sm_90a") -> dict[str, Any]:
    """Compile one recorded launch for `arch` as Triton's launcher would specialize it, then
    read `ptxas -v`: `{"mma", "registers", "spills", "shared_bytes"}`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _compilable(la.kernel)
    backend = make_backend(GPUTarget("cuda", ARCHS[arch], 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(la.kwargs, debug=False)
    bound, spec, options = binder(*la.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    return compile_source(fn, signature, constexprs, attrs, options.__dict__, arch)


def compile_source(fn: Any, signature: dict[str, str], constexprs: dict[Any, Any],
                   attrs: dict[Any, Any], options: dict[str, Any], arch: str = "sm_90a"
                   ) -> dict[str, Any]:
    """The jitted `fn` compiled for `arch` at this signature (`{arg: "*bf16" | "i32" |
    "constexpr" ...}`), constexprs, attributes (divisibility hints) and options (`num_warps`,
    ...), its PTX assembled by `ptxas -v`: `{"mma", "registers", "spills" (stored and loaded
    bytes), "shared_bytes"}`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    cc = ARCHS[arch]
    kernel = compile(ASTSource(_compilable(fn), signature, constexprs, attrs),
                     target=GPUTarget("cuda", cc, 32), options=options)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas_path(cc), "-v", f"-arch={arch}", str(src), "-o",
                              str(Path(d) / "k.o")], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed on {fn.__name__}: {res.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    mma = ("wgmma" if re.search(r"\bwgmma\.", ptx)
           else "mma.sync" if re.search(r"\bmma\.sync\b", ptx) else "none")
    return {"mma": mma, "registers": int(regs.group(1)) if regs else 0,
            "spills": int(spills.group(1)) + int(spills.group(2)) if spills else 0,
            "shared_bytes": int(kernel.metadata.shared)}


def audit(cfg: ModelConfig, draft: DraftConfig | None, tp: int, *, arch: str = "sm_90a",
          chunk: int = PREFILL_CHUNK["cuda"], page_size: int = 16, context: int = 32768,
          only: str | None = None) -> list[dict[str, Any]]:
    """Every distinct Triton kernel configuration the engine launches on one rank of `tp`
    (steps and `chunk`-token prefill chunks over `context` cached tokens), compiled for
    `arch`, one row each (see the module docstring); `only` keeps the rows whose `use` holds
    it ("experts", "attention", "step", "prefill", "norm", "rope")."""
    launches: list[Launch] = []
    if only is None or "attention" not in only:
        steps = sorted({bs * rows for bs in STEP_BATCHES for rows in STEP_ROWS})
        launches += expert_launches(cfg, tp, {"step experts": steps, "prefill experts": [chunk]})
    if only is None or "experts" not in only:
        launches += attention_launches(cfg, draft, tp, chunk, page_size, context)
    if only is None or "norm" in only:
        launches += norm_launches(cfg, draft)
    if only is None or "rope" in only:
        launches += rope_launches(cfg, tp)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for la in launches:
        if only is not None and only not in la.use:
            continue
        conf = config_of(la)
        key = json.dumps([la.kernel.__name__, la.use, conf], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        rows.append({"name": la.kernel.__name__, "use": la.use, "config": conf, **la.shapes,
                     **compile_launch(la, arch)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphs.kernels", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/kimi-k2.5-text", help="target config directory")
    ap.add_argument("--draft", default="configs/kimi-k2.5-dflash",
                    help="drafter config directory ('' for none)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks")
    ap.add_argument("--arch", default="sm_90a", choices=sorted(ARCHS))
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK["cuda"],
                    help="prefill chunk tokens")
    ap.add_argument("--only", default=None, help="keep rows whose use holds this word")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dir(args.model)
    draft = DraftConfig.from_dir(args.draft) if args.draft else None
    rows = audit(cfg, draft, args.tp, arch=args.arch, chunk=args.chunk, only=args.only)
    for r in rows:
        c = r["config"]
        tiles = "x".join(str(c[t]) for t in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK")
                         if t in c)
        shape = " ".join(f"{t}={c[t]}" for t in ("N", "K", "DV", "G") if t in c)
        print(f"{r['name']:<22} {r['use']:<18} {shape:<14} {tiles:<11} warps "
              f"{c['num_warps']} stages {c['num_stages']}  {r['mma']:<8} regs "
              f"{r['registers']:<3} spills {r['spills']:<5} shared {r['shared_bytes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
