"""Offline API: `LLM(model, draft).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig, SamplingParams
from engine.kv_cache import KVPool, pages_needed
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.request import Request
from engine.scheduler import Scheduler
from engine.spec import Models, StepShape
from engine.tokenizer import Tokenizer
from graphs.runner import PhaseTimer, StepGraphRunner

if TYPE_CHECKING:
    from engine.parallel import TensorParallel

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "kimi-mini"
DEFAULT_DRAFT = REPO / "models" / "kimi-mini-dflash"


def model_pair(model: str | Path | None, draft: str | Path | None) -> tuple[Path, Path | None]:
    """The target and drafter directories to use: the bundled pair when no model is given
    (a given drafter still wins), else the given ones (no drafter unless given)."""
    if model is None:
        return DEFAULT_MODEL, Path(draft) if draft else DEFAULT_DRAFT
    return Path(model), Path(draft) if draft else None

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

Prompt = str | Sequence[int] | dict[str, Any]


@dataclass
class GenerationOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_steps: int
    accept_lengths: list[int] = field(default_factory=list)


@dataclass
class EngineConfig:
    mode: str = "tree"
    budget: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 8
    page_size: int = 16
    max_model_len: int | None = None
    kv_pages: int | None = None
    use_graphs: bool | None = None
    capture_sizes: tuple[int, ...] | None = None
    # Tensor parallelism: ranks (each a process started by torchrun) and the seconds a rank may
    # go without a heartbeat from a peer before it exits naming that peer.
    tp: int = 1
    tp_timeout: float = 30.0
    # A tree-budget table {batch size: budget} (TOML, `graphs.policy`); None: `budget` for all.
    budget_policy: str | None = None
    # Prefix attention: "auto" (flashinfer's MLA kernel on CUDA when installed) or "torch".
    attention: str = "auto"


class LLM:
    def __init__(self, model: str | Path | None = None, draft: str | Path | None = None,
                 *, progress: bool = True, **engine: Any):
        self.config = cfg = EngineConfig(**engine)
        if cfg.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
        if cfg.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {cfg.max_batch_size}")
        model, draft = model_pair(model, draft)
        self.model_dir = Path(model)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.model_dir}: no model here (config.json missing). Pass --model DIR, or "
                f"write a small random one with `python -m engine.tools.make_tiny --out DIR`.")
        device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
        self.tp: TensorParallel | None = None
        self._following = True  # followers: until the leader says "stop"
        self._closed = False
        if cfg.tp != 1:
            from engine.parallel import TensorParallel

            self.tp = TensorParallel.init(cfg.tp, device, heartbeat_timeout_s=cfg.tp_timeout)
            device = self.tp.device
            progress = progress and self.tp.rank == 0
        self.tokenizer = (Tokenizer.from_dir(self.model_dir)
                          if (self.model_dir / "tiktoken.model").is_file() else None)
        target = KimiForCausalLM.from_dir(self.model_dir, device, dtype, progress=progress,
                                          tp=self.tp)
        drafter = None
        if cfg.mode != "ar":
            if draft is None:
                raise ValueError(f"mode {cfg.mode!r} needs a drafter (--draft DIR)")
            drafter = DFlashDrafter.from_dir(draft, target.cfg.hidden_size, device, dtype,
                                             tp=self.tp)
        self.models = Models(target, drafter, tp=self.tp)
        mc: ModelConfig = target.cfg
        block = drafter.c.block_size if drafter else 2
        shape = StepShape(cfg.mode, cfg.budget, block, sample=False)
        budgets = None
        if cfg.budget_policy and cfg.mode == "tree":
            from graphs.policy import load_budgets

            budgets = load_budgets(cfg.budget_policy)
        # NOTE: the page table must cover the step that can emit the most, whatever its size.
        widest = StepShape(cfg.mode, max([cfg.budget, *(budgets or {}).values()]), block, False)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        max_pages = pages_needed(self.max_model_len + widest.max_emit, cfg.page_size)
        num_pages = cfg.kv_pages or (1 + cfg.max_batch_size * max_pages)
        self.pool = KVPool.allocate(
            page_size=cfg.page_size, num_pages=num_pages, target_layers=mc.num_hidden_layers,
            target_dim=mc.kv_cache_dim, draft_layers=drafter.c.num_hidden_layers if drafter else 0,
            draft_dim=drafter.c.kv_dim if drafter else 0, dtype=dtype, device=device)
        self.timer = PhaseTimer()
        self.runner = StepGraphRunner(self.models, self.pool, shape,
                                      max_batch_size=cfg.max_batch_size, max_pages=max_pages,
                                      capture_sizes=cfg.capture_sizes,
                                      use_graphs=cfg.use_graphs, timer=self.timer,
                                      budgets=budgets)
        self._attach_prefix_kernels(max_pages)
        self.runner.capture(progress=progress)
        # Without graphs nothing needs fixed shapes: route tokens only through their experts.
        self.models.sparse_moe = not self.runner.use_graphs
        stop_ids = self.tokenizer.stop_ids if self.tokenizer else frozenset(
            [mc.eos_token_id] if mc.eos_token_id is not None else [])
        sched_kw: dict[str, Any] = dict(
            max_batch_size=cfg.max_batch_size, max_model_len=self.max_model_len,
            stop_ids=stop_ids, detok=self.decode if self.tokenizer else None)
        if self.tp is not None and self.tp.rank == 0:
            from engine.parallel import LeaderScheduler

            self.scheduler: Scheduler = LeaderScheduler(self.tp, self.models, self.pool,
                                                        self.runner, **sched_kw)
        else:
            self.scheduler = Scheduler(self.models, self.pool, self.runner, **sched_kw)
        self.stats: dict[str, Any] = {}
        self._next_id = 0

    def _attach_prefix_kernels(self, max_pages: int) -> None:
        """On CUDA with flashinfer installed, one planned MLA prefix kernel per captured batch
        size (the runner plans it before each step, outside the graph)."""
        if self.config.attention not in ("auto", "torch"):
            raise ValueError(f"attention must be 'auto' or 'torch', got "
                             f"{self.config.attention!r}")
        if self.config.attention == "torch" or self.pool.target.device.type != "cuda":
            return
        from ops.attention_gpu import FlashInferMLAPrefix, flashinfer_available, prefix_planner

        if not flashinfer_available():
            return
        mc = self.models.target.cfg
        heads = self.models.target.model.layers[0].self_attn.cfg.num_attention_heads  # per rank
        backends = {bs: FlashInferMLAPrefix(
            bs, self.runner.shapes[(bs, False)].num_nodes, max_pages, self.pool.page_size,
            heads, mc.kv_lora_rank, mc.qk_rope_head_dim, mc.softmax_scale, self.pool.target.dtype,
            self.pool.target.device) for bs in self.runner.capture_sizes}
        self.models.prefix = dict(backends)
        self.runner.planner = prefix_planner(backends)

    # ---- prompts -----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "messages" in prompt:
                return self._tok().apply_chat_template(prompt["messages"])
            if "prompt" in prompt:
                return self._tok().encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages'")
        if isinstance(prompt, str):
            return self._tok().encode(prompt)
        return [int(t) for t in prompt]

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer (tiktoken.model); pass token ids")
        return self.tokenizer

    def decode(self, ids: list[int]) -> str:
        """Output text: special tokens (`<|im_end|>`, reserved ids) leave no text."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        req = Request(self._next_id, list(prompt_ids), params)
        self._next_id += 1
        return req

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt. Under tensor parallelism every rank calls this: rank 0
        (the leader) runs the requests; the others run rank 0's model calls until it is done
        and return an empty list (their `prompts` are ignored)."""
        from tqdm import tqdm

        if not self.is_leader:
            self.follow()
            return []
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        reqs = [self.make_request(self.encode_prompt(p), sp) for p, sp in zip(prompts, params)]
        for i, r in enumerate(reqs):
            try:
                self.scheduler.check(r)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        for r in reqs:
            self.scheduler.add(r)
        self.timer.totals.clear()
        if self.tp is not None:
            self.tp.comm.reset()
        t0 = time.perf_counter()
        bar = tqdm(total=len(reqs), desc="generating", unit="prompt", disable=not progress)
        while self.scheduler.has_work:
            t_step = time.perf_counter()
            events = self.scheduler.step()
            bar.update(sum(1 for e in events if e.finished))
            self.timer.totals["engine"] += time.perf_counter() - t_step
        bar.close()
        if self.tp is not None:
            self.tp.send(("end",))
        elapsed = time.perf_counter() - t0
        outs = [self._output(i, r) for i, r in enumerate(reqs)]
        n_tok = sum(len(o.token_ids) for o in outs)
        acc = [a for r in reqs for a in r.accept_lengths]
        phases = dict(self.timer.totals)
        engine_t = phases.pop("engine", elapsed)
        phases["prefill+sched"] = max(engine_t - sum(phases.values()), 0.0)
        self.stats = {
            "prompts": len(reqs), "tokens": n_tok, "seconds": elapsed,
            "tokens_per_s": n_tok / elapsed if elapsed else 0.0,
            "steps": sum(r.num_steps for r in reqs),
            "mean_accept_len": sum(acc) / len(acc) if acc else 0.0,
            "phase_seconds": phases, "preemptions": self.scheduler.num_preemptions,
        }
        if self.tp is not None:
            # Rank 0's collectives during this call: calls and bytes per kind, and wall seconds
            # when `self.tp.timed` was set (eager steps only).
            c = self.tp.comm
            self.stats["collectives"] = {op: {"calls": c.calls[op], "bytes": c.bytes[op],
                                              "seconds": c.seconds.get(op, 0.0)}
                                         for op in c.calls}
        return outs

    def _output(self, i: int, r: Request) -> GenerationOutput:
        text = self.decode(r.output_ids)
        if r.text_end is not None:
            text = text[: r.text_end]
        return GenerationOutput(i, r.prompt_ids, list(r.output_ids), text, r.finish_reason or "",
                                r.num_steps, list(r.accept_lengths))

    # ---- tensor parallelism ------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True in a single process and on tensor-parallel rank 0 (which reads prompts, runs
        the scheduler, writes output and serves HTTP)."""
        return self.tp is None or self.tp.rank == 0

    def follow(self) -> bool:
        """A tensor-parallel follower (rank > 0): run the leader's model calls until it ends a
        `generate` (returns True) or shuts down (returns False)."""
        if self.is_leader:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        if not self._following:
            return False
        from engine.parallel import follow

        self._following = follow(self.tp, self.models, self.pool, self.runner) == "end"
        return self._following

    def close(self) -> None:
        """Under tensor parallelism, every rank calls this once at the end: the leader tells
        the followers to stop, the followers run the leader's calls until then, and each rank
        leaves the group. Nothing to do in a single process."""
        tp = self.tp
        if tp is None or self._closed:
            return
        self._closed = True
        try:
            if not tp.broken:
                if tp.rank == 0:
                    tp.send(("stop",))
                else:
                    while self.follow():
                        pass
        finally:
            # NOTE: graphs holding collectives go before the process group they use.
            self.runner.graphs.clear()
            tp.close()
