"""Tree budget per captured batch size and sampling mode: a small TOML file, read with `tomllib`.

Small batches are draft-bound and afford big trees; large ones are verify-bound and want small
ones, down to 0: plain decoding through the same step at AR's cost (a request drafts again when
the batch shrinks, its drafter cache caught up first). Sampled steps accept fewer drafts than greedy
ones, so they have their own table. Every graph of one (size, mode) has one budget, so its shapes
stay fixed. `python -m graphs.profile --tune` measures and writes it:

    [greedy]       # captured batch size = tree budget (nodes besides the root; 0: plain)
    1 = 16
    16 = 4
    [sampled]      # optional: the greedy table when absent
    1 = 8

Each captured size takes the entry of the largest listed size not above it (sizes below every
entry take the smallest entry). One table ships per device and execution path, measured on the
bundled pair: `configs/budgets-cpu.toml` (the eager CPU step), `configs/budgets-cpu-compiled.toml`
(the compiled CPU step, `engine.cpu`) and `configs/budgets-cuda.toml` (estimated at Kimi's size
by `graphs.plan --cost --tune` until `graphs.profile --tune` measures one there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TABLES = {False: "greedy", True: "sampled"}
Policy = dict[bool, dict[int, int]]  # sampling? -> {batch size: budget}


class PolicyError(ValueError):
    pass


def policy_path(device_type: str, compiled: bool = False) -> Path:
    """Where the policy of a device type's execution path ships (the compiled CPU step's
    apart from the eager one's: their costs differ); `graphs.profile --tune` writes it there."""
    kind = "-compiled" if compiled and device_type == "cpu" else ""
    return CONFIGS / f"budgets-{device_type}{kind}.toml"


def default_policy(device_type: str, compiled: bool = False) -> Path | None:
    """The shipped policy of a device type's execution path, if one ships."""
    p = policy_path(device_type, compiled)
    return p if p.is_file() else None


def _table(p: Path, name: str, table: Any) -> dict[int, int]:
    if not isinstance(table, dict) or not table:
        raise PolicyError(f"{p}: [{name}] must be a non-empty table (batch size = budget)")
    out: dict[int, int] = {}
    for k, v in table.items():
        try:
            bs = int(k)
        except ValueError as e:
            raise PolicyError(f"{p}: key {k!r} in [{name}] is not a batch size") from e
        if bs < 1 or not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PolicyError(f"{p}: [{name}] {k} = {v!r}: batch sizes must be integers >= 1 "
                              f"and budgets integers >= 0")
        out[bs] = v
    return dict(sorted(out.items()))


def load_budgets(path: str | Path) -> Policy:
    """`{sampling: {batch size: budget}}` from the `[greedy]` (and `[sampled]`) tables."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise PolicyError(f"{p}: budget policy not found") from e
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{p}: not valid TOML ({e})") from e
    unknown = set(data) - set(TABLES.values())
    if unknown:
        raise PolicyError(f"{p}: unknown tables {sorted(unknown)} (expected [greedy], "
                          f"[sampled])")
    greedy = _table(p, "greedy", data.get("greedy"))
    return {False: greedy,
            True: _table(p, "sampled", data["sampled"]) if "sampled" in data else greedy}


def budgets_for_sizes(policy: Mapping[int, int], sizes: Sequence[int]) -> dict[int, int]:
    """Spread one table over capture sizes: each size takes the entry of the largest listed
    size not above it, or the smallest listed size's entry below them all."""
    keys = sorted(policy)
    out = {}
    for s in sizes:
        below = [k for k in keys if k <= s]
        out[s] = policy[below[-1] if below else keys[0]]
    return out


# A tree must beat plain decoding (budget 0) by this much to be chosen: prompts differ in how
# well they draft, and a tune's near-tie can be another prompt mix's clear loss.
MARGIN = 0.10


def best_budgets(rows: Sequence[Mapping[str, Any]], margin: float = MARGIN) -> Policy:
    """The budget of the most tokens per second at each (sampling, batch size), from rows with
    `sample`, `batch_size`, `budget` and `tokens_per_s`; budget 0 unless a tree beats it by
    `margin`."""
    best: dict[tuple[bool, int], Mapping[str, Any]] = {}
    plain: dict[tuple[bool, int], float] = {}
    for m in rows:
        k = (m["sample"], m["batch_size"])
        if m["budget"] == 0:
            plain[k] = m["tokens_per_s"]
        if k not in best or m["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = m
    pick = {k: 0 if k in plain and m["tokens_per_s"] <= (1 + margin) * plain[k] else m["budget"]
            for k, m in best.items()}
    return {s: {bs: b for (s2, bs), b in sorted(pick.items()) if s2 == s} for s in (False, True)}


def write_tuned(path: str | Path, rows: Sequence[Mapping[str, Any]], note: str,
                source: str = "measured") -> dict[str, Any]:
    """Choose (`best_budgets`) and write the policy of a tune's `rows`; returns the record of
    both for a JSON report: `{"tune": rows, "policy": {"path": ..., "budgets": ...}}`."""
    policy = best_budgets(rows)
    p = write_budgets(path, policy, rows, note=note, source=source)
    return {"tune": list(rows), "policy": {"path": str(p), "budgets": {
        TABLES[k]: v for k, v in policy.items()}}}


def write_budgets(path: str | Path, policy: Mapping[bool, Mapping[int, int]],
                  measured: Sequence[Mapping[str, Any]] = (), note: str = "",
                  source: str = "measured") -> Path:
    """Write the tables (and, as comments, the rows they came from: `source` says whether those
    were measured or estimated)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Tree budget per captured batch size and sampling mode (0: plain decoding through",
             "# the same step), read by engine.policy. Written by `python -m graphs.profile "
             "--tune`",
             "# (measured) or `python -m graphs.plan --cost --tune` (estimated)."]
    lines += [f"# {line}" for line in note.splitlines()]
    if measured:
        lines.append(f"# {source}: mode, batch size, budget, tokens per row-step, step ms, "
                     f"tokens/s")
        lines += [f"#   {TABLES[m['sample']]:>7} {m['batch_size']:>4} {m['budget']:>4} "
                  f"{m['accept']:7.3f} {m['step_ms']:9.3f} {m['tokens_per_s']:10.1f}"
                  for m in measured]
    for sample, name in TABLES.items():
        if sample in policy:
            lines += ["", f"[{name}]", *(f"{int(bs)} = {int(b)}"
                                         for bs, b in sorted(policy[sample].items()))]
    p.write_text("\n".join(lines) + "\n")
    load_budgets(p)  # what we write must read back
    return p
