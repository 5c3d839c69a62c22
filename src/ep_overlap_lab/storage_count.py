"""One count of the bytes held for backward, shared by the engine (a real step) and the planner (a program's walk).

Contract:
    * :class:`Count` counts each storage once however many hold it, from its first holder until its last lets go,
      leaves out what its owner freed for now, and keeps the peak.
    * No torch here: the planner runs where torch cannot be imported.
"""


class Count:
    """Storages and their holders: each storage counts once however many hold it, from its first holder until its
    last lets go, except while its owner freed it for now (``discard``/``restore``); the peak is kept. The one
    count of bytes held: ``engine/saved.py`` counts a real step with it, ``memory.py`` walks a program with it."""

    def __init__(self):
        self.holders: dict[tuple, int] = {}
        self.sizes: dict[tuple, int] = {}
        self.discarded: set[tuple] = set()  # held storages freed for now (their bytes not counted)
        self.current = self.peak = 0

    def hold(self, key: tuple, nbytes: int) -> None:
        if not self.holders.get(key):
            self.sizes[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self.holders[key] = self.holders.get(key, 0) + 1

    def release(self, key: tuple, missing_ok: bool = False) -> None:
        if missing_ok and key not in self.holders:
            return
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            size = self.sizes.pop(key)
            if key in self.discarded:  # its bytes were already taken off
                self.discarded.remove(key)
            else:
                self.current -= size

    def discard(self, key: tuple) -> bool:
        """The storage's data is freed for now: its bytes stop counting. False when it is not held, or already."""
        if not self.holders.get(key) or key in self.discarded:
            return False
        self.discarded.add(key)
        self.current -= self.sizes[key]
        return True

    def restore(self, key: tuple) -> None:
        """The storage holds data again (after :meth:`discard`)."""
        if key in self.discarded:
            self.discarded.remove(key)
            self.current += self.sizes[key]
            self.peak = max(self.peak, self.current)
