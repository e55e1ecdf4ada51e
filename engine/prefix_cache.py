"""The prefix cache: whole KV pages of committed tokens, kept for later requests with the same
prefix (an agent's next turn, a shared system prompt, a request's `n` choices, a preempted
request's resumption), in plain Python (no torch), beside the page allocator.

A page holds, at the same slots, the target's latent rows and the drafter's context rows of its
`page_size` positions (`engine.kv_cache`: one page table serves both caches), so one cached page
restores both. Both are functions of the tokens up to the page's end and nothing after it: a
latent row is the target's cache row of its position; a DFlash context row (`context_kv`) is a
function of the target's features at its own position. So a page can be shared as soon as its
last token is committed and fed to the drafter; unlike an EAGLE drafter (whose row at i depends
on token i + 1, and for which vLLM and SGLang drop or re-key the last page) nothing is dropped.

The pages form a trie, a node per page, keyed by the page's tokens under its parent (the roots
by the requests' `cache_salt`, so tenants with different salts never share a page). Whole
token tuples are compared, so no hash can collide; each edge is exactly one page, so no node is
ever split (SGLang's radix tree splits nodes because its edges are token runs). A trie rather
than vLLM's chained page hashes: the same page-granular matching, with no hash function to choose
and lookups that stop at the first missing page.

Ownership is by the allocator's reference counts: the trie holds one reference on each cached
page, and every request whose page list holds the page holds another. A cached page no request
holds (its count 1) is free for admission (`available`) and is evicted least recently used
first when pages run short (`alloc`), before any request is preempted; a request's pages are
given back last page first, so an answer's tail goes before its prompt's head, as vLLM frees.

What goes in (`insert`) is only what is committed in both caches: whole pages below
`min(cache_len, fed)` (drafts never; rows a plain-decoding step committed but did not feed the
drafter never), so a request that hits gets exactly the rows a cold prefill would write, and
every later write of any request lands at or past its own `min(cache_len, fed)`: in a page only
it holds. `check_writes` asserts that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.kv_cache import BlockAllocator, OutOfPages

# A page's key beyond its tokens, by page index (`PageExtra`): what else its rows depend on.
PageExtra = Callable[[int], tuple[Any, ...]]


def image_keys(images: Sequence[tuple[int, Any]], page_size: int) -> PageExtra | None:
    """The extra key of each page of a prompt with `images` ((first position, image with
    `digest` and `tokens`), `engine.request.Request.images`): `(digest, offset)` of every
    image overlapping the page, its offset the image's start from the page's, so an image's
    placeholder tokens match only where the same image sits at the same place."""
    if not images:
        return None

    def extra(i: int) -> tuple[Any, ...]:
        a, b = i * page_size, (i + 1) * page_size
        return tuple((im.digest, p - a) for p, im in images if p < b and p + im.tokens > a)

    return extra


@dataclass(eq=False)
class Node:
    """One cached page: its id, its tokens' key under `parent` (None: evicted, or a root)."""

    page: int
    key: tuple[Any, ...] = ()
    parent: Node | None = None
    children: dict[tuple[Any, ...], Node] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.parent is not None


class PrefixCache:
    """A trie of cached pages over `alloc` (see the module docstring). Disabled, it matches
    nothing and keeps nothing: the engine runs as without it."""

    def __init__(self, alloc: BlockAllocator, page_size: int, enabled: bool = True):
        self.alloc, self.page_size, self.enabled = alloc, page_size, enabled
        self._roots: dict[str | None, Node] = {}
        self._node: dict[int, Node] = {}  # page -> its node, for every cached page
        # Cached pages no request holds, least recently used first: what `alloc` evicts.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0  # pages evicted, in all

    # ---- the allocator's face ----------------------------------------------------------------

    @property
    def cached(self) -> int:
        """Pages the cache holds (some of them held by requests too)."""
        return len(self._node)

    @property
    def evictable(self) -> int:
        """Cached pages no request holds."""
        return len(self._lru)

    @property
    def available(self) -> int:
        """Pages an allocation can have: the free ones and those it may evict."""
        return self.alloc.num_free + len(self._lru)

    def room_with(self, hit: Sequence[int]) -> int:
        """Pages an allocation can have once a request holds the cached pages `hit`."""
        return self.available - sum(p in self._lru for p in hit)

    def alloc_pages(self, n: int) -> list[int]:
        """`n` fresh pages, evicting least recently used cached pages when too few are free;
        raises OutOfPages (evicting nothing) when even that is not enough."""
        short = n - self.alloc.num_free
        if short > 0:
            if short > len(self._lru):
                raise OutOfPages(f"need {n} pages, {self.alloc.num_free} free and "
                                 f"{len(self._lru)} cached ones evictable")
            self.evict(short)
        return self.alloc.alloc(n)

    def hold(self, pages: Sequence[int]) -> None:
        """A request takes cached `pages` (a match) into its page list."""
        self.alloc.incref(list(pages))
        for p in pages:
            self._lru.pop(p, None)

    def release(self, pages: Sequence[int]) -> None:
        """A request gives its `pages` back (last first): the cached ones it was the last to
        hold become evictable, the others free."""
        for p in reversed(pages):
            self.alloc.free([p])
            if p in self._node and self.alloc.refcount(p) == 1:
                self._lru[p] = None
                self._lru.move_to_end(p)

    def evict(self, n: int) -> int:
        """Evicts least recently used pages no request holds until `n` pages are free again
        (or none is left to evict); returns how many were freed. A page's eviction takes its
        descendants out of the trie too (unreachable once their parent is gone): those no
        request holds are freed with it."""
        freed = 0
        while freed < n and self._lru:
            page, _ = self._lru.popitem(last=False)
            freed += self._drop(self._node[page])
        self.evicted += freed
        return freed

    def _drop(self, node: Node) -> int:
        """`node` and its subtree leave the trie, each page losing the trie's reference;
        returns how many pages that freed."""
        assert node.parent is not None
        del node.parent.children[node.key]
        freed, todo = 0, [node]
        while todo:
            n = todo.pop()
            todo += n.children.values()
            n.children, n.parent = {}, None
            del self._node[n.page]
            self._lru.pop(n.page, None)
            self.alloc.free([n.page])
            freed += self.alloc.refcount(n.page) == 0
        return freed

    def reset(self) -> int:
        """Evicts every page no request holds (`reset_prefix_cache`); returns how many."""
        return self.evict(len(self._lru))

    # ---- matching and inserting --------------------------------------------------------------

    def keys(self, tokens: Sequence[int], n: int, first: int = 0,
             extra: PageExtra | None = None) -> list[tuple[Any, ...]]:
        """The keys of whole pages `first .. n - 1` of `tokens`: each page's tokens, then its
        `extra(i)` when given (`image_keys`)."""
        return [self.key(tokens, i, extra) for i in range(first, n)]

    def key(self, tokens: Sequence[int], i: int, extra: PageExtra | None = None
            ) -> tuple[Any, ...]:
        """Page `i`'s key (`keys`)."""
        s = self.page_size
        return tuple(tokens[i * s:(i + 1) * s]) + (extra(i) if extra else ())

    def match(self, tokens: Sequence[int], salt: str | None, limit: int,
              extra: PageExtra | None = None) -> list[int]:
        """The cached pages of the longest cached prefix of `tokens` in whole pages, at most
        `limit` tokens of it, with the pages' `extra` keys (`keys`); each matched page becomes
        the most recently used. Holds none (`hold` them)."""
        node = self._roots.get(salt) if self.enabled else None
        pages: list[int] = []
        if node is None:
            return pages
        for i in range(min(limit, len(tokens)) // self.page_size):
            node = node.children.get(self.key(tokens, i, extra))
            if node is None:
                break
            pages.append(node.page)
        for p in reversed(pages):  # NOTE: the head most recent: a tail goes before its head
            if p in self._lru:
                self._lru.move_to_end(p)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str | None,
               upto: int, cursor: tuple[Node, int] | None = None,
               extra: PageExtra | None = None) -> tuple[Node, int] | None:
        """Caches the whole pages of `tokens` below position `upto` (their rows committed in
        `pages`, a request's page list), keyed with their `extra` keys (`keys`). A page already
        cached under the same prefix keeps its cached copy (the request's stays private to it,
        freed when released). `cursor` is what the last insert of the same request returned
        (where it stopped), so a request's inserts cost the pages they add; returns the next
        one."""
        if not self.enabled:
            return None
        n = min(upto, len(tokens)) // self.page_size
        node, done = cursor if cursor is not None and cursor[0].live else (None, 0)
        if node is None:
            node = self._roots.get(salt)
            if node is None:
                node = self._roots[salt] = Node(-1, parent=None)
        if done >= n:
            return node, done
        for i, key in enumerate(self.keys(tokens, n, done, extra), done):
            child = node.children.get(key)
            if child is None:
                page = pages[i]
                if page in self._node:  # NOTE: cached elsewhere (never: a page has one prefix)
                    break
                child = node.children[key] = Node(page, key, node)
                self._node[page] = child
                self.alloc.incref([page])
            node = child
        return node, n

    # ---- invariants (tests) --------------------------------------------------------------------

    def check_writes(self, pages: Sequence[int], valid: int) -> None:
        """Asserts that every page of a request's `pages` at or past position `valid` (its
        `min(cache_len, fed)`: where its writes land) is its own: held by nothing else."""
        for p in pages[valid // self.page_size:]:
            if self.alloc.refcount(p) != 1:
                raise AssertionError(f"page {p}, written at positions >= {valid}, is shared "
                                     f"(refcount {self.alloc.refcount(p)})")
