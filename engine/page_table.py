"""The staged page tables of the runner's step buffers: what each padded batch size's staged
table holds from the last step, so that a step writes only the pages it adds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.kv_cache import DUMMY_PAGE


class StagedPageTables:
    """Per padded batch size, each staged row's (page-table id, pages staged). A request's id
    names one list of pages that only grows at its end (`engine.request.Request.table`: a new
    id once its pages are given back), so a row staged under an id needs only the pages added
    since; a prefix cache's shared pages change nothing here (they start a request's list)."""

    def __init__(self, sizes: Sequence[int], max_pages: int):
        self.max_pages = max_pages
        self.held: dict[int, list[tuple[int | None, int]]] = {s: [] for s in sizes}

    def forget(self, size: int) -> None:
        """The staged table of `size` is all padding again."""
        self.held[size] = []

    def stage(self, size: int, pt: np.ndarray, pages: Sequence[Sequence[int]],
              tables: Sequence[int]) -> None:
        """Each row's `pages` into the staged page table `pt [size, W]` (numpy, the staging's
        memory), writing only what changed since the last step of this size (`tables`: the
        rows' ids; empty: every row written whole): a row whose id was staged keeps its pages
        (moved to its new row with the others in one gather when rows shifted) and gets the
        ones added since; any other row is written whole. So the host's work follows the pages a
        step adds, not the contexts' length: all of them land in one indexed write."""
        b = len(pages)
        lens = list(map(len, pages))
        if max(lens) > self.max_pages:
            i = next(i for i, n in enumerate(lens) if n > self.max_pages)
            raise ValueError(f"row {i} holds {lens[i]} pages; the step's page table has "
                             f"{self.max_pages}")
        held = self.held[size]
        ids: Sequence[int | None] = tables or [None] * b
        if tables and [t for t, _ in held[:b]] == list(tables):
            old = [n for _, n in held[:b]]  # every row where it was (most steps)
        else:
            row_of = {t: r for r, (t, _) in enumerate(held) if t is not None}
            src = [row_of.get(t, -1) if t is not None else -1 for t in ids]
            moved = [(i, j) for i, j in enumerate(src) if j not in (-1, i)]
            if moved:
                dst, frm = zip(*moved)
                pt[list(dst)] = pt[list(frm)]  # NOTE: numpy gathers the rows before writing
            old = [held[j][1] if j >= 0 else -1 for j in src]  # -1: not staged
        W = pt.shape[1]
        whole, at, new = [], [], []  # rows written whole; flat positions and their pages
        for i, n, k in [(i, n, k) for i, (n, k) in enumerate(zip(old, lens)) if n != k]:
            if k < n or n < 0:  # not staged, or fewer pages than staged (a list replaced)
                whole.append(i)
                n = 0
            at += range(i * W + n, i * W + k)
            new += pages[i][n:]
        if whole:
            pt[whole] = DUMMY_PAGE
        if at:
            pt.put(at, new)  # at flat positions, in place
        self.held[size] = list(zip(ids, lens))  # rows b.. become padding (`_pad`)
