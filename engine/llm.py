"""Offline API: `LLM(model, draft).generate(prompts, SamplingParams(...))` and
`LLM.chat(messages, SamplingParams(...), tools=...)`, in vLLM's names and shapes: a vLLM offline
script ports by changing its import (`from engine import LLM, SamplingParams`). vLLM's keyword
arguments are taken (`tensor_parallel_size`, `max_num_seqs`, `max_tokens`, `n`, ...:
`engine.config.ENGINE_NAMES`, `SAMPLING_NAMES`), unknown ones refused with a TypeError naming
them; each output has vLLM's `.outputs[i].text`, `.token_ids`, `.finish_reason` and
`.prompt_token_ids`."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.attention import prefill_score_bytes, select_backend
from engine.config import (
    DEFAULT_BUDGET,
    ENGINE_NAMES,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    choice_seed,
)
from engine.cpu import gemm_layout
from engine.dist import Group
from engine.grammar import Grammars
from engine.kv_cache import pages_needed
from engine.leader import AnnouncingRunner, End, Stop, follow
from engine.media import (
    MediaConfig,
    MediaError,
    expand_placeholders,
    load_image_source,
    message_images,
)
from engine.memory import (
    CPU_MEMORY_SHARE,
    KVMemoryError,
    PoolSize,
    activation_reserve,
    checkpoint_bytes,
    default_cpu_budget,
    default_prefill_chunk,
    engine_pool,
    gb,
    parse_size,
    size_kv_pool,
)
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.models.vision import (
    KimiVision,
    VisionConfig,
    has_vision_weights,
    vision_weight_bytes,
)
from engine.policy import Policy, default_policy, load_budgets
from engine.request import Request
from engine.runner import Logprob, PhaseTimer, StepGraphRunner
from engine.scheduler import Scheduler
from engine.spec import Models, StepShape
from engine.tokenizer import IncrementalDecoder, Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "kimi-mini"
DEFAULT_DRAFT = REPO / "models" / "kimi-mini-dflash"

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

Prompt = str | Sequence[int] | dict[str, Any]
Message = dict[str, Any]


def model_pair(model: str | Path | None, draft: str | Path | None) -> tuple[Path, Path | None]:
    """The target and drafter directories to use: the bundled pair when no model is given
    (a given drafter still wins), else the given ones (no drafter unless given)."""
    if model is None:
        return DEFAULT_MODEL, Path(draft) if draft else DEFAULT_DRAFT
    return Path(model), Path(draft) if draft else None


def resolve_device(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """`auto` device: CUDA when present, else the CPU; `auto` dtype: bfloat16 on CUDA, float32
    on the CPU."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    return torch.device("cuda" if cuda else "cpu"), DTYPES[dtype]


def compiles(cfg: EngineConfig, device: torch.device) -> bool:
    """Whether `cfg` compiles the step (`--compile on`; the CLIs settle `auto` first with
    `compile_auto`). Refuses where it cannot: CUDA captures graphs, and it runs in one process."""
    if cfg.compile == "on" and (device.type != "cpu" or cfg.tp != 1):
        raise ValueError("--compile on compiles the CPU's step in a single process; CUDA "
                         "captures graphs (use --compile auto or off)")
    return cfg.compile == "on"


def compile_auto(cfg: EngineConfig, pays_back: bool) -> EngineConfig:
    """`cfg` with `--compile auto` settled: on where the step compiles (the CPU, one process,
    a C++ compiler) and the caller expects the compile to pay back."""
    if cfg.compile != "auto":
        return cfg
    cxx = shutil.which(os.environ.get("CXX") or "g++")  # what inductor compiles its kernels with
    on = pays_back and cxx is not None and cfg.tp == 1 and resolve_device(cfg)[0].type == "cpu"
    return replace(cfg, compile="on" if on else "off")


def load_models(cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                tp: Group | None = None, progress: bool = True) -> tuple[Models, Path]:
    """The target (and, unless `mode` is ar, the drafter) of `cfg`, this rank's shard of each,
    their weights in the layout the step of `cfg` runs fastest from; also returns the target's
    directory."""
    model, draft = model_pair(cfg.model, cfg.draft)
    if not (model / "config.json").is_file():
        raise FileNotFoundError(
            f"{model}: no model here (config.json missing). Pass --model DIR, or write a small "
            f"random one with `python -m tools.make_tiny --out DIR`.")
    if cfg.mode != "ar" and (draft is None or not (draft / "config.json").is_file()):
        raise FileNotFoundError(
            f"mode {cfg.mode!r} needs a drafter: {draft or '(none given)'} has no config.json. "
            f"Pass --draft DIR (`python -m tools.make_draft --target DIR --out DIR`) or "
            f"use --mode ar.")
    target = KimiForCausalLM.from_dir(model, device, dtype, progress=progress, tp=tp)
    # NOTE: every rank holds the whole tower and encodes the images of its prefills itself.
    vision = (KimiVision.from_dir(model, device, dtype)
              if has_vision_weights(model) else None)
    drafter = (DFlashDrafter.from_dir(draft, target.cfg.hidden_size, device, dtype, tp=tp,
                                      rope_amplitude=cfg.draft_rope_amplitude)
               if cfg.mode != "ar" else None)
    if device.type == "cpu" and not compiles(cfg, device):
        # NOTE: only the eager step's layout: the compiled step's budget table was measured
        # with the weights as stored.
        for m in (target, drafter):
            if m is not None:
                gemm_layout(m)
    return Models(target, drafter, tp=tp, vision=vision), model


def step_shapes(mode: str, budget: int | None, block: int, policy: str | Path | None
                ) -> tuple[StepShape, Policy | None, StepShape]:
    """The runner's step shape, its budget policy (read from `policy`, if any, in tree mode
    without a fixed `budget`) and the widest step any batch size may take: the page tables
    must cover what it can emit, whatever the size."""
    shape = StepShape(mode, DEFAULT_BUDGET if budget is None else budget, block, sample=False)
    budgets = load_budgets(policy) if policy and budget is None and mode == "tree" else None
    most = max(b for t in budgets.values() for b in t.values()) if budgets else shape.budget
    return shape, budgets, StepShape(mode, most, block, False)


def prefill_chunk(cfg: EngineConfig, device: torch.device) -> int:
    """The most prompt tokens one engine step prefills: `--prefill-chunk`, else the device's
    default (`engine.memory.PREFILL_CHUNK`)."""
    return cfg.prefill_chunk or default_prefill_chunk(device.type)


def memory_budget(cfg: EngineConfig, device: torch.device) -> tuple[int | None, int, str]:
    """The memory the engine may take on `device` (`engine.memory`'s budget; None: unknown),
    the bytes in use there now (on CUDA, as `mem_get_info` says: weights, context, other
    processes; 0 on the CPU, whose caller counts the weights) and where the budget came from."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        u = cfg.gpu_memory_utilization
        return int(total * u), total - free, f"--gpu-memory-utilization {u} of {gb(total)}"
    if cfg.cpu_memory_budget is not None:
        return (parse_size(cfg.cpu_memory_budget), 0,
                f"--cpu-memory-budget {cfg.cpu_memory_budget}")
    b = default_cpu_budget()
    return b, 0, f"--cpu-memory-budget default, {CPU_MEMORY_SHARE} x MemAvailable"


def check_fits(cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
               budget: tuple[int | None, int, str]) -> None:
    """Before loading anything: raise `engine.memory.KVMemoryError` when not even one full
    context fits beside the weights (as stored, split over the ranks: a lower bound) in
    `budget` (`memory_budget`'s). Nothing to check with --kv-pages or an unknown budget."""
    model, draft = model_pair(cfg.model, cfg.draft)
    if cfg.kv_pages is not None or budget[0] is None or not (model / "config.json").is_file():
        return
    mc = ModelConfig.from_dir(model)
    max_len = cfg.max_model_len or mc.max_position_embeddings
    nbytes = torch.finfo(dtype).bits // 8
    # NOTE: every rank holds the vision tower whole
    vision = VisionConfig.from_dir(model) if has_vision_weights(model) else None
    tower = vision_weight_bytes(model) if vision is not None else 0
    weights = (checkpoint_bytes(model) - tower + (checkpoint_bytes(draft) if cfg.mode != "ar"
                                                  else 0)) // cfg.tp + tower
    reserve = activation_reserve(mc, tp=cfg.tp, max_batch_size=cfg.max_batch_size, step_rows=1,
                                 prefill_tokens=prefill_chunk(cfg, device), dtype_bytes=nbytes,
                                 cuda=device.type == "cuda",
                                 prefill_score_bytes=prefill_score_bytes(cfg.attention, device),
                                 vision=vision,
                                 image_patches=MediaConfig.from_dir(model).max_patches)
    size_kv_pool(budget_bytes=budget[0], used_bytes=budget[1] + weights,
                 reserve_bytes=reserve.total,
                 bytes_per_token=mc.num_hidden_layers * mc.kv_cache_dim * nbytes,
                 page_size=cfg.page_size, max_model_len=max_len,
                 pages_per_context=pages_needed(max_len, cfg.page_size),
                 max_batch_size=cfg.max_batch_size, budget_flag=budget[2], tp=cfg.tp)


def one_or_many(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """`generate`'s prompts as a list: a lone prompt (a string, a dict, a list of token ids) is
    one prompt, as in vLLM, not a sequence of them (a string's characters)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]
    return items


class PromptError(ValueError):
    """Prompt `index` of a `generate` call cannot run (nothing ran)."""

    def __init__(self, index: int, message: str):
        super().__init__(f"prompt {index}: {message}")
        self.index, self.message = index, message


@dataclass
class GenerationOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_steps: int
    accept_lengths: list[int] = field(default_factory=list)
    # When the sampling params ask (`logprobs`, `prompt_logprobs`): per output token, and per
    # prompt token (None for the first).
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not prefilled again)
    # The prompt's other choices (`SamplingParams.n`), in order: choice 0 is the fields above.
    more: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None  # the prompt's text, when it was given as text

    # ---- vLLM's RequestOutput --------------------------------------------------------------

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every choice (one unless `n`), as vLLM's `RequestOutput.outputs`."""
        first = CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                                 self.logprobs, self.num_steps, self.accept_lengths)
        return [first, *self.more]

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def finished(self) -> bool:
        return True


@dataclass
class CompletionOutput:
    """One choice of a prompt, as vLLM's `CompletionOutput`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[Logprob] | None = None
    num_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)


class LLM:
    """The offline engine: `LLM(model, draft, **engine knobs)` (see `EngineConfig`), or
    `LLM(config=EngineConfig(...))`. `warm_up=False` leaves capturing (or compiling) the step
    graphs to the caller, `runner.capture()` from the thread that will run the steps: a compiled
    step's kernels keep the torch threads they were compiled with (followers still capture).
    `threads`: the torch threads that thread runs with, when not this one's; on the CPU they
    run the steps, and compiled steps over more token rows than a few run on all of them
    (`engine.cpu.CompiledCPUSteps.threads_for`). vLLM's names of the engine knobs are taken
    (`tensor_parallel_size`, `max_num_seqs`, ...: `engine.config.ENGINE_NAMES`); an unknown
    keyword raises a TypeError naming it."""

    def __init__(self, model: str | Path | None = None, draft: str | Path | None = None,
                 *, progress: bool = True, config: EngineConfig | None = None,
                 warm_up: bool = True, threads: int | None = None, **engine: Any):
        engine = ENGINE_NAMES.canonical(
            engine, EngineConfig.__pydantic_fields__,
            others=("model", "draft", "progress", "config", "warm_up", "threads"), owner="LLM")
        paths = {k: str(v) for k, v in (("model", model), ("draft", draft)) if v is not None}
        if config is None:
            config = EngineConfig(**paths, **engine)
        elif paths or engine:
            config = replace(config, **paths, **engine)
        self.config = cfg = config
        device, dtype = resolve_device(cfg)
        compiled = compiles(cfg, device)  # "auto" is off here: the CLIs settle it
        self.tp: Group | None = None
        self._following = True  # followers: until the leader says "stop"
        self._closed = False
        if cfg.tp != 1:
            self.tp = Group.init(cfg.tp, device, heartbeat_timeout_s=cfg.tp_timeout)
            device = self.tp.device
            progress = progress and self.tp.rank == 0
        budget = memory_budget(cfg, device) if cfg.kv_pages is None else (None, 0, "")
        check_fits(cfg, device, dtype, budget)
        self.models, self.model_dir = load_models(cfg, device, dtype, self.tp, progress)
        self.tokenizer = Tokenizer.of_model(self.model_dir)
        self.media_config = MediaConfig.from_dir(self.model_dir)
        target, drafter = self.models.target, self.models.drafter
        mc = target.cfg
        block = drafter.c.block_size if drafter else 2
        shape, budgets, widest = step_shapes(
            cfg.mode, cfg.budget, block, cfg.budget_policy or default_policy(device.type, compiled))
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        max_pages = pages_needed(self.max_model_len + widest.max_emit, cfg.page_size)
        self.kv_size = self._size_pool(budget, device, dtype, max_pages,
                                       widest.num_nodes + block)
        num_pages = self.kv_size.num_pages
        if progress:
            print(self.kv_size.describe(), file=sys.stderr)
        self.pool = self.models.kv_pool(cfg.page_size, num_pages, dtype, device)
        self.timer = PhaseTimer()
        self.runner = StepGraphRunner(self.models, self.pool, shape,
                                      max_batch_size=cfg.max_batch_size, max_pages=max_pages,
                                      capture_sizes=cfg.capture_sizes,
                                      use_graphs=cfg.use_graphs, timer=self.timer,
                                      budgets=budgets, compile=compiled, threads=threads)
        self._attach_attention(max_pages)
        if warm_up or not self.is_leader:
            self.runner.capture(progress=progress)
        stop_ids = self.tokenizer.stop_ids if self.tokenizer else frozenset(
            [mc.eos_token_id] if mc.eos_token_id is not None else [])
        runner: Any = self.runner
        if self.tp is not None and self.tp.is_leader:
            runner = AnnouncingRunner(self.runner, self.tp)
        self.scheduler = Scheduler(
            runner, num_pages=num_pages, page_size=cfg.page_size, vocab_size=mc.vocab_size,
            prefill_chunk=prefill_chunk(cfg, device),
            max_batch_size=cfg.max_batch_size, max_model_len=self.max_model_len,
            stop_ids=stop_ids, decoder=self._text_decoder if self.tokenizer else None,
            grammars=Grammars(self.tokenizer, mc.vocab_size) if self.tokenizer else None,
            prefix_caching=cfg.enable_prefix_caching)
        self.stats: dict[str, Any] = {}
        self._next_id = 0

    def _size_pool(self, budget: tuple[int | None, int, str], device: torch.device,
                   dtype: torch.dtype, max_pages: int, step_rows: int) -> PoolSize:
        """The KV pool's pages (`engine.memory.engine_pool`): --kv-pages, else sized over
        `budget` (read before the weights loaded) and what is in use now; every rank takes the
        smallest of the ranks' sizes, since rank 0 hands out pages for all."""
        cfg = self.config
        used = 0  # nothing to size from without a budget (--kv-pages, or memory unknown)
        if budget[0] is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # loading's temporaries, cached but free
            used = memory_budget(cfg, device)[1]
        elif budget[0] is not None:
            used = sum(t.numel() * t.element_size()
                       for m in (self.models.target, self.models.drafter, self.models.vision)
                       if m is not None for t in (*m.parameters(), *m.buffers()))
        _, size, err = engine_pool(
            self.models.target.cfg, kv_pages=cfg.kv_pages, budget_bytes=budget[0],
            used_bytes=used, budget_flag=budget[2], tp=cfg.tp,
            max_batch_size=cfg.max_batch_size, step_rows=step_rows,
            prefill_tokens=prefill_chunk(cfg, device), dtype_bytes=torch.finfo(dtype).bits // 8,
            cuda=device.type == "cuda",
            prefill_score_bytes=prefill_score_bytes(cfg.attention, device),
            bytes_per_token=self.models.kv_bytes_per_token(dtype),
            page_size=cfg.page_size, max_model_len=self.max_model_len,
            pages_per_context=max_pages,
            vision=self.models.vision.cfg if self.models.vision is not None else None,
            image_patches=self.media_config.max_patches,
            # NOTE: on the CPU the default budget is a guess (a share of the RAM free at start,
            # which the OS and other processes share): there the cache takes the whole budget
            # only when --cpu-memory-budget gives one, else it lives in what the batch leaves
            prefix_caching=cfg.enable_prefix_caching and (
                device.type == "cuda" or cfg.cpu_memory_budget is not None))
        if self.tp is not None and self.tp.control is not None:
            # NOTE: every rank joins, even one without room, so none waits on a failed peer
            import torch.distributed as dist

            n = torch.tensor([size.num_pages if size is not None else 0])
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.tp.control)
            if size is not None and int(n.item()) > 0:
                return replace(size, num_pages=int(n.item()))
            raise err or KVMemoryError(
                "another tensor-parallel rank has no room for one full context (see its "
                "error): lower --max-model-len, raise --tp or --gpu-memory-utilization")
        if err is not None:
            raise err
        assert size is not None
        return size

    def _attach_attention(self, max_pages: int) -> None:
        """How attention reads the paged caches (`--attention`, `engine.attention`): a backend
        built for every (batch size, tree nodes) the runner steps; the runner lets it plan
        before each step, outside the graph."""
        r = self.runner
        steps = [(bs, s.num_nodes) for bs in r.capture_sizes for s in r.shapes_of(bs)]
        self.models.attention = select_backend(self.config.attention, self.models.target,
                                               self.pool, steps, max_pages)

    # ---- prompts -----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text, token ids, or a dict of one of `prompt`,
        `prompt_token_ids` (vLLM's TextPrompt, TokensPrompt) or `messages` (a conversation, with
        `tools`, `chat_template_kwargs` and `add_generation_prompt` for the chat template).
        Each image's placeholder is expanded to its tokens (`encode_with_images`)."""
        return self.encode_with_images(prompt)[0]

    def encode_with_images(self, prompt: Prompt) -> tuple[list[int], list[tuple[int, Any]]]:
        """A prompt's token ids and its images (`Request.images`): the images of a dict's
        `multi_modal_data` (`{"image": one or a list}`, vLLM's form: a PIL image, bytes, a
        data URL or a file path, each matching one `<|media_pad|>` of the prompt in order) or
        of its `messages`' image parts (`image_url` with a data URL or a file path); each
        image's placeholder becomes the image's tokens."""
        sources: list[tuple[str, Any]] = []
        if isinstance(prompt, dict):
            mm = (prompt.get("multi_modal_data") or {}).get("image")
            if mm is not None:
                mm = mm if isinstance(mm, list | tuple) else [mm]
                sources = [(f"multi_modal_data.image[{i}]", s) for i, s in enumerate(mm)]
            elif "messages" in prompt and "prompt_token_ids" not in prompt:
                sources = message_images(prompt["messages"])
        ids = self._encode_ids(prompt)
        if not sources:
            return ids, []
        vision = self.models.vision
        if vision is None:
            raise MediaError(f"{sources[0][0]}: {self.model_dir} has no vision tower: it takes "
                             f"no images")
        images = [load_image_source(s, self.media_config, name, local_files=True)
                  for name, s in sources]
        return expand_placeholders(ids, images, vision.cfg.placeholder_id)

    def _encode_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "messages" in prompt:
                return self._tok().apply_chat_template(
                    prompt["messages"], prompt.get("add_generation_prompt", True),
                    prompt.get("tools"), **(prompt.get("chat_template_kwargs") or {}))
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

    def _text_decoder(self) -> IncrementalDecoder:
        assert self.tokenizer is not None
        return self.tokenizer.stream_decoder(skip_special_tokens=True)

    def reset_prefix_cache(self) -> int:
        """Evicts every cached page no request holds (vLLM's name); returns how many."""
        return self.scheduler.cache.reset()

    def decode(self, ids: list[int]) -> str:
        """Output text: special tokens (`<|im_end|>`, reserved ids) leave no text."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def make_request(self, prompt_ids: list[int], params: SamplingParams,
                     images: list[tuple[int, Any]] | None = None) -> Request:
        req = Request(self._next_id, list(prompt_ids), params, images=list(images or ()))
        self._next_id += 1
        return req

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False,
                 on_output: Callable[[GenerationOutput], None] | None = None,
                 *, use_tqdm: bool | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (a lone prompt, text, token ids or a dict, is one prompt);
        `on_output` sees each result as soon as it is finished (in finishing order; a prompt's
        once all its `n` choices are). `use_tqdm`: vLLM's name of `progress`. Under tensor
        parallelism every rank calls this: rank 0 (the leader) runs the requests; the others
        run rank 0's model calls until it is done and return an empty list (their `prompts`
        are ignored)."""
        if not self.is_leader:
            self.follow()
            return []
        if use_tqdm is not None:
            progress = use_tqdm
        steps = self.generate_stepwise(prompts, params, progress, on_output)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             progress: bool = False, *, use_tqdm: bool | None = None,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True,
             on_output: Callable[[GenerationOutput], None] | None = None
             ) -> list[GenerationOutput]:
        """vLLM's `LLM.chat`: generate for one conversation (a list of messages) or for each of
        a list of them, each rendered by the model's chat template as the server renders a
        chat request (`Tokenizer.apply_chat_template`, with `tools` and `chat_template_kwargs`,
        e.g. `{"thinking": False}`). The outputs hold the raw answers (reasoning and tool-call
        markup are not parsed here: `engine.toolcalls.parse_output` reads them)."""
        convs = [messages] if not messages or isinstance(messages[0], dict) else messages
        prompts = [{"messages": list(c), "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "chat_template_kwargs": chat_template_kwargs} for c in convs]
        return self.generate(prompts, params, progress, on_output, use_tqdm=use_tqdm)

    def generate_stepwise(self, prompts: Prompt | Sequence[Prompt],
                          params: SamplingParams | Sequence[SamplingParams] | None = None,
                          progress: bool = False,
                          on_output: Callable[[GenerationOutput], None] | None = None
                          ) -> Generator[int, None, list[GenerationOutput]]:
        """`generate` one engine step at a time (a single process, or the leader): it yields
        the tokens each step added and returns the outputs. The time it spends suspended is
        left out of its stats, so a benchmark can interleave engines a few tokens each in turn
        and time each on the same machine at the same moment. One at a time per engine: they
        share its scheduler."""
        from tqdm import tqdm

        if not self.is_leader:
            raise RuntimeError("generate_stepwise is the leader's; other ranks call generate")
        prompts = one_or_many(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        reqs: list[Request] = []
        owner: list[int] = []  # each request's prompt (a prompt has n of them, in order)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:  # every prompt is checked before any runs
                ids, images = self.encode_with_images(p)
                for k in range(sp.n):
                    # NOTE: choice k samples with seed + k, as the server's n choices do
                    reqs.append(self.make_request(ids, sp if k == 0 or sp.seed is None else
                                                  replace(sp, seed=choice_seed(sp.seed, k)),
                                                  images))
                    owner.append(i)
                    self.scheduler.add(reqs[-1])
            except ValueError as e:
                for r in reqs:
                    self.scheduler.abort(r)
                raise PromptError(i, str(e)) from e
        self.timer.totals.clear()
        if self.tp is not None:
            self.tp.comm.reset()
        t0, suspended = time.perf_counter(), 0.0
        bar = tqdm(total=len(reqs), desc="generating", unit="prompt", disable=not progress)
        index = {r.rid: k for k, r in enumerate(reqs)}
        left = [0] * len(prompts)  # choices of each prompt still running
        for i in owner:
            left[i] += 1
        done: dict[int, GenerationOutput] = {}
        while self.scheduler.has_work:
            t_step = time.perf_counter()
            events = self.scheduler.step()
            self.timer.totals["engine"] += time.perf_counter() - t_step
            for e in events:
                if e.finished:
                    bar.update(1)
                    i = owner[index[e.req.rid]]
                    left[i] -= 1
                    if left[i] == 0:
                        o = done[i] = self._prompt_output(i, prompts[i], reqs, owner)
                        if on_output is not None:
                            on_output(o)
            t_yield = time.perf_counter()
            yield sum(len(e.new_ids) for e in events)
            suspended += time.perf_counter() - t_yield
        bar.close()
        if self.tp is not None:
            self.tp.send(End())
        elapsed = time.perf_counter() - t0 - suspended
        outs = [done.get(i) or self._prompt_output(i, p, reqs, owner)
                for i, p in enumerate(prompts)]
        n_tok = sum(len(r.output_ids) for r in reqs)
        acc = [a for r in reqs for a in r.accept_lengths]
        phases = dict(self.timer.totals)
        engine_t = phases.pop("engine", elapsed)
        phases["prefill+sched"] = max(engine_t - sum(phases.values()), 0.0)
        self.stats = {
            "prompts": len(prompts), "tokens": n_tok, "seconds": elapsed,
            "tokens_per_s": n_tok / elapsed if elapsed else 0.0,
            "steps": sum(r.num_steps for r in reqs),
            "mean_accept_len": sum(acc) / len(acc) if acc else 0.0,
            "phase_seconds": phases, "preemptions": self.scheduler.num_preemptions,
            "cached_tokens": sum(r.cached_tokens for r in reqs),
            "prefill_tokens": sum(len(r.prompt_ids) - r.cached_tokens for r in reqs),
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
        # NOTE: the text the scheduler decoded as the tokens came (with what a split character
        # left), each token decoded once
        text = r.decoded if r.text_decoder is not None else self.decode(r.output_ids)
        if r.text_end is not None:
            text = text[: r.text_end]
        return GenerationOutput(i, r.prompt_ids, list(r.output_ids), text, r.finish_reason or "",
                                r.num_steps, list(r.accept_lengths), r.logprobs,
                                r.prompt_logprobs, r.cached_tokens)

    def _prompt_output(self, i: int, prompt: Prompt, reqs: list[Request], owner: list[int]
                       ) -> GenerationOutput:
        """Prompt i's output: its first choice, with the others in `more`."""
        first, *others = [self._output(i, r) for r, o in zip(reqs, owner) if o == i]
        more = [CompletionOutput(k, o.text, o.token_ids, o.finish_reason, o.logprobs,
                                 o.num_steps, o.accept_lengths) for k, o in enumerate(others, 1)]
        return replace(first, more=more,
                       prompt=prompt if isinstance(prompt, str) else prompt.get("prompt")
                       if isinstance(prompt, dict) else None)

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
        self._following = isinstance(follow(self.tp, self.runner), End)
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
                    tp.send(Stop())
                else:
                    while self.follow():
                        pass
        finally:
            # NOTE: graphs holding collectives go before the process group they use.
            self.runner.graphs.clear()
            tp.close()
