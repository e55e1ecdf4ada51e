"""Collectives between the CPU ranks of one host over Unix sockets, a pair each: gloo's TCP
transport spends about a millisecond of CPU on every rank per all-reduce here (1.6 ms of wall
at two ranks, 7 ms at four on two cores), so CPU tensor parallelism spent most of a step in its
collectives. A collective is one exchange: each rank sends its whole tensor to every peer and
receives theirs; an all-reduce then sums them in rank order, so every rank holds the same bits.
CPU only, and only where every rank is on this host (`LOCAL_WORLD_SIZE == WORLD_SIZE`); GPUs
keep NCCL. A peer that dies closes its sockets (the exchange fails at once); one that freezes
is the watchdog's to catch (`engine.dist`).
"""

from __future__ import annotations

import os
import select
import socket
import struct
from typing import Any

import torch
from torch import Tensor

_HEADER = struct.Struct("<q")  # the payload's bytes, checked on receipt


class Mesh:
    """This rank's sockets to every other rank of a `world`-rank group, set up through `store`
    (a key-value store every rank reaches: torchrun's rendezvous)."""

    def __init__(self, rank: int, world: int, store: Any, timeout_s: float):
        self.rank, self.world, self.timeout_ms = rank, world, int(timeout_s * 1000)
        self.peers: dict[int, socket.socket] = {}
        # NOTE: an abstract address (Linux): nothing on disk to clean up
        name = f"\0kimi-spec-mesh-{os.getpid()}-{id(self)}"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(name)
            server.listen(world)
            store.set(f"mesh{rank}", name)
            for j in range(rank):  # connect to the lower ranks, accept the higher ones
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(store.get(f"mesh{j}").decode())
                s.sendall(_HEADER.pack(rank))
                self.peers[j] = s
            for _ in range(rank + 1, world):
                s, _ = server.accept()
                self.peers[_HEADER.unpack(_recv_exactly(s, _HEADER.size))[0]] = s
        finally:
            server.close()
        self.poll = select.poll()
        self.fds = {s.fileno(): j for j, s in self.peers.items()}
        for s in self.peers.values():
            s.setblocking(False)
            self.poll.register(s, 0)

    def close(self) -> None:
        for s in self.peers.values():
            s.close()
        self.peers.clear()

    def exchange(self, x: Tensor) -> list[Tensor]:
        """Every rank's `x` (same shape and dtype on each), in rank order (this rank's is `x`)."""
        x = x.contiguous()
        data = _bytes(x)
        out = [x if j == self.rank else torch.empty_like(x) for j in range(self.world)]
        want = {j: _bytes(out[j]) for j in self.peers}
        head = _HEADER.pack(len(data))
        send = {j: memoryview(head + bytes(data)) for j in self.peers}
        heads = {j: b"" for j in self.peers}
        got = dict.fromkeys(self.peers, 0)
        for j in self.peers:
            self._send(j, send)
            self._watch(j, True, j in send)
        while send or want:
            events = self.poll.poll(self.timeout_ms)
            if not events:
                raise RuntimeError(f"no peer answered within {self.timeout_ms / 1000:g} s")
            for fd, ev in events:
                j = self.fds[fd]
                if ev & (select.POLLERR | select.POLLNVAL):
                    raise RuntimeError(f"the connection to rank {j} failed")
                if ev & select.POLLOUT and j in send:
                    self._send(j, send)
                if ev & (select.POLLIN | select.POLLHUP) and j in want:
                    heads[j] = self._recv(j, heads[j], want, got, len(data))
                self._watch(j, j in want, j in send)
        return out

    def _watch(self, j: int, recv: bool, send: bool) -> None:
        self.poll.modify(self.peers[j], (select.POLLIN if recv else 0)
                         | (select.POLLOUT if send else 0))

    def _send(self, j: int, todo: dict[int, memoryview]) -> None:
        buf = todo[j]
        try:
            while buf:
                buf = buf[self.peers[j].send(buf):]
        except BlockingIOError:
            pass
        except OSError as e:
            raise RuntimeError(f"sending to rank {j} failed ({e})") from e
        if buf:
            todo[j] = buf
        else:
            del todo[j]

    def _recv(self, j: int, head: bytes, want: dict[int, memoryview], got: dict[int, int],
              nbytes: int) -> bytes:
        """Read what rank `j` has sent of its header, then of its payload; returns the header
        read so far (`want[j]` is dropped once the payload is in)."""
        s = self.peers[j]
        try:
            if len(head) < _HEADER.size:
                part = s.recv(_HEADER.size - len(head))
                if not part:
                    raise RuntimeError(f"rank {j} closed its connection")
                head += part
                if len(head) < _HEADER.size:
                    return head
                if _HEADER.unpack(head)[0] != nbytes:
                    raise RuntimeError(f"rank {j} sent {_HEADER.unpack(head)[0]} bytes where "
                                       f"this rank sent {nbytes}: the ranks diverged")
            while got[j] < nbytes:
                n = s.recv_into(want[j][got[j]:])
                if n == 0:
                    raise RuntimeError(f"rank {j} closed its connection")
                got[j] += n
        except BlockingIOError:
            return head
        except OSError as e:
            raise RuntimeError(f"receiving from rank {j} failed ({e})") from e
        del want[j]
        return head

    def all_reduce(self, x: Tensor) -> None:
        """`x` (contiguous) becomes the sum over ranks, added in rank order."""
        parts = self.exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x.copy_(total)


def _bytes(x: Tensor) -> memoryview:
    """A contiguous tensor's bytes, writable in place."""
    return memoryview(x.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise RuntimeError("a peer closed its connection while the mesh was set up")
        buf += part
    return buf
