"""Offline batch generation over a prompt file.

    python -m engine.generate --prompts FILE --output OUT.jsonl [--model DIR --draft DIR]
        [--mode tree|chain|ar] [--budget K] [--max-new-tokens N] [--temperature T] ...
    torchrun --nproc-per-node N -m engine.generate --tp N ...   (tensor parallel; rank 0 reads
        the prompts and writes the output)

Prompt files: `.txt` (one prompt per line) or `.jsonl` with one of `prompt` (text),
`prompt_token_ids` (list of ints) or `messages` (chat), plus optional per-line sampling fields.
Every line is checked before anything runs; the output is written to a temporary file and
renamed into place at the end, so a failed run never leaves a half-written output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.config import SamplingParams, add_model_args

SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int,
                   "max_tokens": int, "seed": int, "ignore_eos": bool, "stop": list}
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


class PromptFileError(ValueError):
    pass


def read_prompts(path: str | Path, defaults: SamplingParams
                 ) -> list[tuple[dict[str, Any], SamplingParams]]:
    """Parse and validate a prompt file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    jsonl = path.suffix == ".jsonl"
    for n, line in enumerate(lines, 1):
        where = f"{path}:{n}"
        if not line.strip():
            raise PromptFileError(f"{where}: empty line (remove it, or put a prompt there)")
        if not jsonl:
            out.append(({"prompt": line}, defaults))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: invalid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        given = [k for k in PROMPT_FIELDS if k in obj]
        if len(given) != 1:
            raise PromptFileError(f"{where}: needs exactly one of {', '.join(PROMPT_FIELDS)} "
                                  f"(got {given or 'none'})")
        unknown = set(obj) - set(PROMPT_FIELDS) - set(SAMPLING_FIELDS)
        if unknown:
            raise PromptFileError(f"{where}: unknown field(s) {sorted(unknown)}")
        key = given[0]
        val = obj[key]
        if key == "prompt" and (not isinstance(val, str) or not val):
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
        if key == "prompt_token_ids":
            if not isinstance(val, list) or not val or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in val):
                raise PromptFileError(f"{where}: 'prompt_token_ids' must be a non-empty list of "
                                      f"integers")
        if key == "messages" and (not isinstance(val, list) or not val):
            raise PromptFileError(f"{where}: 'messages' must be a non-empty list")
        kw = asdict(defaults)
        for f, typ in SAMPLING_FIELDS.items():
            if f not in obj:
                continue
            v = obj[f]
            ok = isinstance(v, typ) and not (typ in (int, float) and isinstance(v, bool))
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                ok, v = True, float(v)
            if not ok:
                raise PromptFileError(f"{where}: '{f}' must be {typ.__name__}, got {v!r}")
            kw["max_new_tokens" if f == "max_tokens" else f] = tuple(v) if f == "stop" else v
        try:
            params = SamplingParams(**kw)
        except ValueError as e:
            raise PromptFileError(f"{where}: {e}") from e
        out.append(({key: val}, params))
    if not out:
        raise PromptFileError(f"{path}: no prompts")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.generate",
                                 description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompts", required=True, help=".txt or .jsonl prompt file")
    ap.add_argument("--output", required=True, help="output .jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: run under torchrun --nproc-per-node N")
    ap.add_argument("--tp-timeout", type=float, default=30.0,
                    help="seconds without a heartbeat from a peer rank before exiting")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.tp < 1:
        print(f"error: --tp must be >= 1, got {a.tp}", file=sys.stderr)
        return 2
    # Under tensor parallelism only rank 0 reads prompts and writes output; the other ranks
    # run rank 0's model calls.
    leader = a.tp == 1 or os.environ.get("RANK", "0") == "0"
    items: list[tuple[dict[str, Any], SamplingParams]] = []
    if leader:
        try:
            defaults = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                      max_new_tokens=a.max_new_tokens, seed=a.seed,
                                      ignore_eos=a.ignore_eos)
            items = read_prompts(a.prompts, defaults)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    from engine.llm import LLM

    try:
        llm = LLM(a.model, a.draft, mode=a.mode, budget=a.budget, device=a.device, dtype=a.dtype,
                  max_batch_size=a.max_batch_size, max_model_len=a.max_model_len, tp=a.tp,
                  tp_timeout=a.tp_timeout, budget_policy=a.budget_policy)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if llm.tp is None:
        return _generate(a, llm, items)
    from engine.parallel import PeerLost

    try:
        rc = _generate(a, llm, items) if llm.is_leader else 0
        llm.close()  # followers: run rank 0's calls until it stops
        return rc
    except PeerLost as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        llm.close()


def _generate(a: argparse.Namespace, llm: Any, items: list[tuple[dict[str, Any], SamplingParams]]
              ) -> int:
    try:
        prompts = []
        for n, (p, _) in enumerate(items, 1):
            try:
                prompts.append(llm.encode_prompt(p))
            except ValueError as e:
                raise ValueError(f"{a.prompts}:{n}: {e}") from e
        for n, ids in enumerate(prompts, 1):
            try:
                llm.scheduler.check(llm.make_request(ids, items[n - 1][1]))
            except ValueError as e:
                raise ValueError(f"{a.prompts}:{n}: {e}") from e
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    outs = llm.generate(prompts, [sp for _, sp in items], progress=True)
    out_path = Path(a.output)
    tmp = out_path.with_name(out_path.name + ".partial")
    with tmp.open("w", encoding="utf-8") as f:
        for o in outs:
            f.write(json.dumps({"index": o.index, "text": o.text, "token_ids": o.token_ids,
                                "finish_reason": o.finish_reason, "num_steps": o.num_steps,
                                "accept_lengths": o.accept_lengths}) + "\n")
    os.replace(tmp, out_path)
    s = llm.stats
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in s["phase_seconds"].items())
    print(f"{s['prompts']} prompts, {s['tokens']} tokens in {s['seconds']:.2f}s: "
          f"{s['tokens_per_s']:.1f} tokens/s, mean accepted length {s['mean_accept_len']:.2f} "
          f"per step over {s['steps']} steps\ntime per phase: {phases}\nwrote {out_path}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
