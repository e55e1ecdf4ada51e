from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.kv_cache import DUMMY_PAGE, BlockAllocator, KVPool, OutOfPages, pages_needed

# ---- BlockAllocator: model-checked against a plain reference count --------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Drives a small pool with random alloc / incref / free sequences. Each entry of `held` is
    one owner's page list (one reference per page), the way requests share prefix pages."""

    @initialize(num_pages=st.integers(2, 9), reserved=st.sampled_from([1, 1, 2]))
    def setup(self, num_pages: int, reserved: int) -> None:
        num_pages = max(num_pages, reserved + 1)
        self.a = BlockAllocator(num_pages, reserved=reserved)
        self.reserved = reserved
        self.initial_free = self.a.num_free
        self.held: list[list[int]] = []
        assert self.initial_free == self.a.capacity == num_pages - reserved

    def _refs(self) -> Counter[int]:
        return Counter(p for pages in self.held for p in pages)

    def _snapshot(self) -> tuple[int, list[int]]:
        return self.a.num_free, [self.a.refcount(p) for p in range(self.a.num_pages)]

    @rule(n=st.integers(0, 10))
    def alloc(self, n: int) -> None:
        before = self._snapshot()
        in_use = set(self._refs())
        if n > self.a.num_free:
            with pytest.raises(OutOfPages):
                self.a.alloc(n)
            assert self._snapshot() == before
            return
        pages = self.a.alloc(n)
        assert len(pages) == n == len(set(pages))
        assert not in_use & set(pages), "handed out a page that is still held"
        assert all(self.reserved <= p < self.a.num_pages for p in pages)
        assert DUMMY_PAGE not in pages
        assert self.a.num_free == before[0] - n
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        pages = data.draw(st.sampled_from(self.held))
        self.a.incref(pages)
        self.held.append(list(pages))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.a.free(self.held.pop(i))

    @rule(data=st.data())
    def free_unheld_raises(self, data: st.DataObject) -> None:
        refs = self._refs()
        unheld = [p for p in range(self.a.num_pages) if not refs[p]]
        if not unheld:
            return
        # Covers double free (a page that was held and returned) and the reserved pages.
        p = data.draw(st.sampled_from(unheld))
        before = self._snapshot()
        with pytest.raises(ValueError):
            self.a.free([p])
        with pytest.raises(ValueError):
            self.a.incref([p])
        assert self._snapshot() == before

    @rule()
    def free_dummy_raises(self) -> None:
        before = self._snapshot()
        with pytest.raises(ValueError):
            self.a.free([DUMMY_PAGE])
        assert self._snapshot() == before

    @rule()
    def free_everything(self) -> None:
        while self.held:
            self.a.free(self.held.pop())
        assert self.a.num_free == self.initial_free

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "a"):
            return
        refs = self._refs()
        assert self.a.num_free + len(refs) == self.a.capacity
        for p in range(self.a.num_pages):
            assert self.a.refcount(p) == refs[p], p
        assert all(self.a.refcount(p) == 0 for p in range(self.reserved))

    def teardown(self) -> None:
        if not hasattr(self, "a"):
            return
        while self.held:
            self.a.free(self.held.pop())
        assert self.a.num_free == self.initial_free


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None)
TestAllocator = AllocatorMachine.TestCase


def test_allocator_hands_out_low_ids_first_and_reuses_freed() -> None:
    a = BlockAllocator(6)
    assert a.alloc(3) == [1, 2, 3]
    a.free([2])
    assert a.alloc(1) == [2]
    assert a.alloc(2) == [4, 5]
    with pytest.raises(OutOfPages, match="need 1 pages, 0 free"):
        a.alloc(1)
    assert a.alloc(0) == []


def test_allocator_bad_arguments() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(1)
    with pytest.raises(ValueError):
        BlockAllocator(3, reserved=3)
    a = BlockAllocator(4)
    with pytest.raises(ValueError, match="-1"):
        a.alloc(-1)
    assert a.num_free == 3


def test_shared_page_returns_only_after_last_free() -> None:
    a = BlockAllocator(3)
    (p,) = a.alloc(1)
    a.incref([p])
    a.free([p])
    assert a.refcount(p) == 1 and a.num_free == 1
    a.free([p])
    assert a.refcount(p) == 0 and a.num_free == 2
    with pytest.raises(ValueError, match=f"page {p}"):
        a.free([p])


# ---- pages_needed -----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,page,expect", [
    (0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3),
    (0, 1, 0), (7, 1, 7), (5, 64, 1),
])
def test_pages_needed_edges(tokens: int, page: int, expect: int) -> None:
    assert pages_needed(tokens, page) == expect


@given(tokens=st.integers(0, 10**6), page=st.integers(1, 512))
def test_pages_needed_is_tight_ceiling(tokens: int, page: int) -> None:
    n = pages_needed(tokens, page)
    assert n * page >= tokens
    assert (n - 1) * page < tokens or n == 0


# ---- KVPool ---------------------------------------------------------------------------------


def test_pages_for_budget() -> None:
    bpt, page = 576 * 2 * 61, 16  # bf16 latent cache of a 61-layer K2 target
    per_page = bpt * page
    assert KVPool.pages_for_budget(10 * per_page, bpt, page) == 10
    assert KVPool.pages_for_budget(10 * per_page + per_page - 1, bpt, page) == 10
    assert KVPool.pages_for_budget(2 * per_page, bpt, page) == 2
    assert isinstance(KVPool.pages_for_budget(2 * per_page, bpt, page), int)


@pytest.mark.parametrize("pages_worth", [0, 1, 1.99])
def test_pages_for_budget_too_small(pages_worth: float) -> None:
    bpt, page = 1152, 16
    with pytest.raises(ValueError, match="need at least 2"):
        KVPool.pages_for_budget(int(pages_worth * bpt * page), bpt, page)


def test_allocate_target_only() -> None:
    pool = KVPool.allocate(page_size=4, num_pages=3, target_layers=2, target_dim=576)
    assert (pool.page_size, pool.num_pages) == (4, 3)
    assert pool.target.shape == (2, 12, 576)
    assert pool.target.dtype == torch.float32
    assert pool.target.device.type == "cpu"
    assert not pool.target.any()
    assert pool.draft is None


def test_allocate_with_draft() -> None:
    pool = KVPool.allocate(page_size=8, num_pages=5, target_layers=3, target_dim=40,
                           draft_layers=2, draft_dim=2 * 4 * 16, dtype=torch.bfloat16)
    assert pool.target.shape == (3, 40, 40)
    assert pool.draft is not None
    assert pool.draft.shape == (2, 40, 128)
    assert pool.target.dtype == pool.draft.dtype == torch.bfloat16
    assert not pool.draft.any()
    # Page p, slot s is flat row p * page_size + s in both caches.
    pool.target[:, 2 * 8 + 3] = 1
    assert pool.target.view(3, 5, 8, 40)[:, 2, 3].eq(1).all()
