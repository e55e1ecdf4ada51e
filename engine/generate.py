"""Offline batch generation over a prompt file.

    python -m engine.generate --prompts FILE --output OUT.jsonl [--model DIR --draft DIR]
        [--mode tree|chain|ar] [--budget K] [--max-new-tokens N] [--temperature T] ...
    torchrun --nproc-per-node N -m engine.generate --tp N ...   (tensor parallel; rank 0 reads
        the prompts and writes the output)

Prompt files: `.txt` (one prompt per line) or `.jsonl` with one of `prompt` (text),
`prompt_token_ids` (list of ints) or `messages` (chat), plus optional per-line sampling fields.
Every line is checked, and the output checked writable (its folder is created), before anything
loads. Each result is appended to `OUT.partial` as soon as it finishes, so a run that fails or is
interrupted keeps what it generated; at the end the results are written to `OUT` in input order
and the partial file goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import (
    COMPILE_MIN_TOKENS,
    EngineConfig,
    SamplingParams,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopP,
    add_cli_args,
    error_text,
    parse_cli,
)

if TYPE_CHECKING:
    from engine.llm import GenerationOutput

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


class PromptFileError(ValueError):
    pass


class PromptLine(BaseModel):
    """One line of a `.jsonl` prompt file."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: Annotated[str, Field(min_length=1)] | None = None
    prompt_token_ids: Annotated[list[int], Field(min_length=1)] | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's name for the same
    seed: Seed | None = None
    ignore_eos: bool | None = None
    stop: list[StopString] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> PromptLine:
        given = [k for k in PROMPT_FIELDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"needs exactly one of {', '.join(PROMPT_FIELDS)} "
                             f"(got {', '.join(given) or 'none'})")
        return self

    def prompt_value(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in PROMPT_FIELDS if getattr(self, k) is not None}

    def params(self, defaults: SamplingParams) -> SamplingParams:
        kw = {k: v for k, v in self.model_dump(exclude_none=True).items()
              if k not in PROMPT_FIELDS}
        if "max_tokens" in kw:
            kw["max_new_tokens"] = kw.pop("max_tokens")
        if "stop" in kw:
            kw["stop"] = tuple(kw["stop"])
        return replace(defaults, **kw)


def read_prompts(path: str | Path, defaults: SamplingParams
                 ) -> list[tuple[dict[str, Any], SamplingParams]]:
    """Parse and validate a prompt file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path}:{n}"
        if not line.strip():
            raise PromptFileError(f"{where}: empty line (remove it, or put a prompt there)")
        if path.suffix != ".jsonl":
            out.append(({"prompt": line}, defaults))
            continue
        try:
            p = PromptLine.model_validate_json(line)
            out.append((p.prompt_value(), p.params(defaults)))
        except ValidationError as e:
            raise PromptFileError(f"{where}: {error_text(e)}") from e
    if not out:
        raise PromptFileError(f"{path}: no prompts")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.generate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help=".txt or .jsonl prompt file")
    ap.add_argument("--output", required=True, help="output .jsonl")
    add_cli_args(ap, EngineConfig)
    add_cli_args(ap, SamplingParams, exclude=("stop",))
    return ap


def main(argv: list[str] | None = None) -> int:
    a, cfg, defaults = parse_cli(build_parser(), argv, EngineConfig, SamplingParams)
    from engine.dist import leads

    # Under tensor parallelism only rank 0 reads prompts and writes output; the other ranks
    # run rank 0's model calls.
    leader = leads(cfg.tp)
    items: list[tuple[dict[str, Any], SamplingParams]] = []
    out: Output | None = None
    if leader:
        try:
            items = read_prompts(a.prompts, defaults)
            out = Output(Path(a.output))
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from engine.llm import LLM, compile_auto

    try:
        wanted = sum(p.max_new_tokens for _, p in items)
        llm = LLM(config=compile_auto(cfg, wanted >= COMPILE_MIN_TOKENS))
    except (ValueError, FileNotFoundError) as e:
        if out is not None:
            out.discard()
        print(f"error: {e}", file=sys.stderr)
        return 2
    if llm.tp is None:
        return _generate(a, llm, items, out)
    from engine.dist import PeerLost

    try:
        rc = _generate(a, llm, items, out) if llm.is_leader else 0
        llm.close()  # followers: run rank 0's calls until it stops
        return rc
    except PeerLost as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        llm.close()


class Output:
    """The output file: checked writable at once, results appended to `PATH.partial` as they
    finish, and `PATH` written in input order at the end."""

    def __init__(self, path: Path):
        self.path, self.partial = path, path.with_name(path.name + ".partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file: TextIO = self.partial.open("w", encoding="utf-8")
        except OSError as e:
            raise OSError(f"--output {path}: cannot write there ({e.strerror or e})") from e
        self.count = 0

    @staticmethod
    def line(o: GenerationOutput) -> str:
        return json.dumps({"index": o.index, "text": o.text, "token_ids": o.token_ids,
                           "finish_reason": o.finish_reason, "num_steps": o.num_steps,
                           "accept_lengths": o.accept_lengths,
                           "cached_tokens": o.cached_tokens}) + "\n"

    def add(self, o: GenerationOutput) -> None:
        self.file.write(self.line(o))
        self.file.flush()
        self.count += 1

    def finish(self, outs: list[GenerationOutput]) -> None:
        """`PATH` with `outs` (in input order), then the partial file goes."""
        self.file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(map(self.line, outs)), encoding="utf-8")
        os.replace(tmp, self.path)
        self.partial.unlink()

    def discard(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def _refusals(llm: Any, items: list[tuple[dict[str, Any], SamplingParams]]
              ) -> list[tuple[int, str]]:
    """Every prompt of `items` the engine refuses (too long for --max-model-len or the KV pool,
    ...) with why, so one run names them all; nothing runs."""
    from engine.request import Request

    out = []
    for i, (p, sp) in enumerate(items):
        try:
            llm.scheduler.check(Request(-1, llm.encode_prompt(p), sp))
        except ValueError as e:
            out.append((i, str(e)))
    return out


def _generate(a: argparse.Namespace, llm: Any, items: list[tuple[dict[str, Any], SamplingParams]],
              out: Output | None) -> int:
    from engine.llm import PromptError

    assert out is not None  # the leader opened it
    try:
        outs = llm.generate([p for p, _ in items], [sp for _, sp in items], progress=True,
                            on_output=out.add)
    except PromptError as e:  # raised before anything ran
        out.discard()
        for i, why in _refusals(llm, items) or [(e.index, e.message)]:
            print(f"error: {a.prompts}:{i + 1}: {why}", file=sys.stderr)
        return 2
    except BaseException:
        out.file.close()
        print(f"{out.count} of {len(items)} results were written to {out.partial} before the "
              f"run stopped", file=sys.stderr)
        raise
    out.finish(outs)
    s = llm.stats
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in s["phase_seconds"].items())
    print(f"{s['prompts']} prompts, {s['tokens']} tokens in {s['seconds']:.2f}s: "
          f"{s['tokens_per_s']:.1f} tokens/s, mean accepted length {s['mean_accept_len']:.2f} "
          f"per step over {s['steps']} steps; {s['cached_tokens']} prompt tokens from the "
          f"prefix cache, {s['prefill_tokens']} prefilled\ntime per phase: {phases}\n"
          f"wrote {out.path}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
