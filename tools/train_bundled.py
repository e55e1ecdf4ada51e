"""Train the bundled pair end to end: the target, then its DFlash drafter in four stages.

    python -m tools.train_bundled [--out models] [--work DIR] [--dry-run]

One command, fixed seeds, about 2 h 10 min on 2 cores. It runs `tools.train_target`
(`OUT/kimi-mini`), then `tools.train_draft` four times, each stage starting from the
previous one: two on the target's greedy continuations, two with half of them sampled at
T = 0.8 (the last writes `OUT/kimi-mini-dflash`); then it writes `OUT/SHA256SUMS`. Each step
writes its own `training.json`; a drafter's nests the stages before it. `--dry-run` prints the
commands instead.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

TARGET_ARGS = ["--layers", "16", "--hidden", "128", "--steps", "1500"]
DRAFT_ARGS = ["--layers", "2", "--block-size", "16", "--target-layers", "1", "5", "9", "14",
              "--prompts", "3072", "--seqs-per-step", "12"]
SAMPLED = ["--sampled", "0.5", "--temperature", "0.8"]
STAGES = [
    ["--steps", "8000"],
    ["--steps", "8000", "--lr", "1.5e-3", "--seed", "1"],
    [*SAMPLED, "--steps", "4000", "--lr", "1e-3", "--seed", "2"],
    [*SAMPLED, "--steps", "4000", "--lr", "7e-4", "--seed", "3"],
]


def commands(out: Path, work: Path) -> list[tuple[str, list[str]]]:
    """`(tool module, its argv)` in order."""
    target = out / "kimi-mini"
    cmds = [("tools.train_target", ["--out", str(target), *TARGET_ARGS])]
    prev: Path | None = None
    for i, stage in enumerate(STAGES, 1):
        dst = out / "kimi-mini-dflash" if i == len(STAGES) else work / f"draft{i}"
        init = ["--init", str(prev)] if prev else []
        cmds.append(("tools.train_draft",
                      ["--target", str(target), *DRAFT_ARGS, "--out", str(dst), *init, *stage]))
        prev = dst
    return cmds


def write_sums(out: Path) -> None:
    from tools.train_draft import sha256_of

    files = sorted(p for d in ("kimi-mini", "kimi-mini-dflash") for p in (out / d).iterdir()
                   if p.is_file())
    lines = [f"{sha256_of(p)}  {p.relative_to(out).as_posix()}" for p in files]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.train_bundled",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--work", type=Path, help="where the first three drafter stages go "
                    "(default: a temporary directory)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    if a.dry_run:
        for mod, args in commands(a.out, a.work or Path("WORK")):
            print(shlex.join([sys.executable, "-m", mod, *args]))
        return
    from tools import train_draft, train_target

    mains = {"tools.train_target": train_target.main,
             "tools.train_draft": train_draft.main}
    with tempfile.TemporaryDirectory(prefix="kimi-mini-stages-") as tmp:
        cmds = commands(a.out, a.work or Path(tmp))
        for i, (mod, args) in enumerate(cmds, 1):
            print(f"[{i}/{len(cmds)}] python -m {shlex.join([mod, *args])}", flush=True)
            mains[mod](args)
    write_sums(a.out)
    print(f"wrote {a.out}/SHA256SUMS")


if __name__ == "__main__":
    main()
