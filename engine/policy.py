"""Tree budget per captured batch size: a small TOML table (`configs/budgets.toml`).

Large batches are verify-bound, so they want smaller trees than a lone request does; every
graph of one batch size shares one budget so its shapes stay fixed. The table is written by
`python -m graphs.profile --tune` and read with `tomllib`:

    [budgets]      # captured batch size = tree budget (nodes besides the root)
    1 = 64
    8 = 32
    32 = 8

A runner built with `budgets=load_budgets(path)` uses, for each captured size, the entry for
the largest listed size not above it (sizes below every entry use the smallest entry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "configs" / "budgets.toml"


class PolicyError(ValueError):
    pass


def load_budgets(path: str | Path = DEFAULT_POLICY) -> dict[int, int]:
    """`{batch size: budget}` from the `[budgets]` table of a TOML file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise PolicyError(f"{p}: budget policy not found") from e
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{p}: not valid TOML ({e})") from e
    table = data.get("budgets")
    if not isinstance(table, dict) or not table:
        raise PolicyError(f"{p}: needs a non-empty [budgets] table (batch size = budget)")
    out: dict[int, int] = {}
    for k, v in table.items():
        try:
            bs = int(k)
        except ValueError as e:
            raise PolicyError(f"{p}: key {k!r} in [budgets] is not a batch size") from e
        if bs < 1 or not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PolicyError(f"{p}: [budgets] {k} = {v!r}: batch size and budget must be "
                              f"integers >= 1")
        out[bs] = v
    return dict(sorted(out.items()))


def budgets_for_sizes(policy: Mapping[int, int], sizes: Sequence[int]) -> dict[int, int]:
    """Spread a policy over capture sizes: each size takes the entry of the largest listed
    size not above it, or the smallest listed size's entry below them all."""
    keys = sorted(policy)
    out = {}
    for s in sizes:
        below = [k for k in keys if k <= s]
        out[s] = policy[below[-1] if below else keys[0]]
    return out


def write_budgets(path: str | Path, budgets: Mapping[int, int],
                  measured: Sequence[Mapping[str, Any]] = (), note: str = "") -> Path:
    """Write the `[budgets]` table (and, as comments, the measurements it came from)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Tree budget per captured batch size (tree mode), read by engine.policy.",
             "# Written by `python -m graphs.profile --tune`."]
    if note:
        lines += [f"# {line}" for line in note.splitlines()]
    if measured:
        lines.append("# measured: batch size, budget, accepted tokens per step, step ms, "
                     "tokens/s")
        for m in measured:
            lines.append(f"#   {m['batch_size']:>4} {m['budget']:>4} {m['accept']:7.3f} "
                         f"{m['step_ms']:9.3f} {m['tokens_per_s']:10.1f}")
    lines.append("")
    lines.append("[budgets]")
    lines += [f"{int(bs)} = {int(b)}" for bs, b in sorted(budgets.items())]
    p.write_text("\n".join(lines) + "\n")
    load_budgets(p)  # what we write must read back
    return p
