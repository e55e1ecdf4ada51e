"""The bundled model's training text: this Python's own standard library sources.

Available offline on every machine that runs the engine, and pinned by the manifest that the
training tools write next to the model (Python version, every file's path, size and SHA-256).
Files are split into train and held-out by a hash of their relative path, so the split does not
depend on which files a given Python ships.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import Any

from engine.held_out import sample_prompts

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Test suites and GUI demos are large, repetitive and unlike the rest; vendored packages are
# not the standard library.
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "turtledemo", "site-packages",
                           "dist-packages", "__pycache__", "lib2to3", "ensurepip"})
HELD_OUT_EVERY = 16  # one file in 16 (by path hash) is never trained on


def _path_hash(rel: str) -> int:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)


def is_held_out(rel: str) -> bool:
    return _path_hash(rel) % HELD_OUT_EVERY == 0


def corpus_files(root: Path = STDLIB) -> list[str]:
    """Relative paths of the corpus's `.py` files, sorted."""
    if not root.is_dir():
        raise FileNotFoundError(f"standard library not found at {root}")
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if not EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            out.append(rel.as_posix())
    return sorted(out)


def read_split(split: str, root: Path = STDLIB) -> list[tuple[str, str]]:
    """`(relative path, text)` for the `train` or `held_out` files."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    want = split == "held_out"
    out = []
    for rel in corpus_files(root):
        if is_held_out(rel) == want:
            out.append((rel, (root / rel).read_text(encoding="utf-8", errors="replace")))
    return out


def manifest(root: Path = STDLIB) -> dict[str, Any]:
    files = []
    for rel in corpus_files(root):
        data = (root / rel).read_bytes()
        files.append({"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                      "split": "held_out" if is_held_out(rel) else "train"})
    return {"source": "python standard library", "python": sys.version.split()[0],
            "root": str(root), "excluded_dirs": sorted(EXCLUDED_DIRS),
            "held_out_rule": f"sha256(path) % {HELD_OUT_EVERY} == 0", "files": files}


def held_out_candidates(root: Path = STDLIB) -> list[str]:
    """Every prompt cut from the held-out files: a `def` line with the lines just above it (so
    the model sees the surrounding style), ending right after the signature. `tools.train_target`
    ships them next to the model (`engine.held_out`)."""
    cands: list[str] = []
    for _, text in read_split("held_out", root):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith("def ") and s.endswith(":") and i >= 3:
                cands.append("\n".join(lines[i - 3:i + 1]) + "\n")
    return cands


def held_out_prompts(n: int, seed: int = 0, root: Path = STDLIB) -> list[str]:
    """`n` of `held_out_candidates`, drawn as `engine.held_out.held_out_prompts` draws them."""
    return sample_prompts(held_out_candidates(root), n, seed)
