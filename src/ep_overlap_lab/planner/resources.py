"""One rank's two resources as the planner runs them: a compute stream in host order and one FIFO link, which slow
each other while both are busy (pure Python; no torch).

Contract:
    * An all-to-all is queued on the link when it is launched and leaves it ``bytes / bandwidth`` seconds of the link
      alone later; it arrives ``latency`` after it leaves. It starts once the transfers before it are done, and a
      dispatch launched off the host not before its split sizes are back. A split-size exchange is a marker in the same
      queue: its sizes are back one round trip (``meta_s``) after the link has sent what was queued before it.
    * Contention (``Link.comm_stretch``, ``Link.compute_stretch``): while the compute stream runs, a transfer on the
      link progresses at 1 / comm_stretch of its rate alone; while a transfer is on the link, compute progresses at
      1 / compute_stretch. When the host waits, the link runs alone. Both 1 (the default, and what a measured CPU
      step is priced with): the link and the compute never slow each other.
    * Arrival times therefore depend on the compute that follows a launch, so they are settled lazily: a wait runs
      the link alone until its transfer is done.
"""

from collections import defaultdict, deque
from dataclasses import dataclass

from megatron.bridge.training.ep_overlap.program.pipeline import Phase

Key = tuple[str, int, int]  # (all-to-all, layer, unit)


@dataclass
class _Transfer:
    key: object
    work_s: float  # seconds on the link alone (0 for a split-size marker)
    queued_s: float
    exchange: object = None  # the split-size marker this dispatch waits for (off the host)
    marker: bool = False
    not_before: float | None = None
    started_s: float | None = None


class Resources:
    """The compute resource (host order) and the FIFO link of one rank, with their contention."""

    def __init__(self, link, launch_off_host: bool):
        self.link, self.launch_off_host = link, launch_off_host
        self.host = self.link_free = 0.0
        self.queue: deque[_Transfer] = deque()
        self.head_left = 0.0  # the started head transfer's seconds still to send, alone
        self.arrived: dict = {}
        self.exchanges: dict = {}  # (unit, layer): when the split sizes are back
        self.pending: set = set()  # exchanges queued, not back yet
        self.phase = Phase.PLAIN
        self.exposed: dict[str, float] = defaultdict(float)
        self.compute_s = self.comm_s = 0.0
        self.launches: list[Key] = []

    # the link's queue
    def _head_start(self) -> float | None:
        """When the head transfer starts (markers at the head resolved first); None when the queue is empty."""
        while self.queue:
            head = self.queue[0]
            ready = max(head.queued_s, self.link_free)
            if head.marker:
                self.exchanges[head.key] = ready + self.link.meta_s
                self.comm_s += self.link.meta_s
                self.pending.discard(head.key)
                self.queue.popleft()
                continue
            if head.started_s is None:
                if head.exchange is not None and head.not_before is None:
                    head.not_before = self.exchanges.pop(head.exchange, 0.0)
                start = max(ready, head.not_before or 0.0)
                if start > self.host:
                    return start
                head.started_s, self.head_left = start, head.work_s
            return head.started_s
        return None

    def _finish_head(self) -> None:
        head = self.queue.popleft()
        self.link_free = self.host
        self.arrived[head.key] = self.host + self.link.latency_s
        self.comm_s += self.arrived[head.key] - head.started_s

    def _alone_until(self, t: float | None) -> None:
        """The host computes nothing until ``t`` (None: until the head transfer is done); the link runs alone."""
        while True:
            start = self._head_start()
            if start is None or (t is not None and start >= t):
                self.host = max(self.host, t if t is not None else self.host)
                return
            self.host = max(self.host, start)
            self._head_start()  # started now
            done = self.host + self.head_left
            if t is not None and done > t:
                self.head_left -= t - self.host
                self.host = t
                return
            self.host = done
            self._finish_head()
            if t is None:
                return

    # what the runners call
    def compute(self, seconds: float) -> None:
        """``seconds`` of compute (alone); slower while a transfer is on the link."""
        self.compute_s += seconds
        left, slow, stretch = seconds, self.link.compute_stretch, self.link.comm_stretch
        while left > 0:
            start = self._head_start()
            if start is None:
                self.host += left
                return
            if start > self.host:  # the head waits for its split sizes: the link is idle until then
                step = min(left, start - self.host)
                self.host, left = self.host + step, left - step
                continue
            if left * slow < self.head_left * stretch:
                self.host += left * slow
                self.head_left -= left * slow / stretch
                return
            self.host += self.head_left * stretch
            left -= self.head_left * stretch / slow
            self._finish_head()

    def wait(self, t: float) -> None:
        """The host waits until ``t``: exposed time, booked to the phase."""
        if t > self.host:
            self.exposed[self.phase] += t - self.host
            self._alone_until(t)

    def idle_until(self, t: float) -> None:
        """The host waits until ``t`` for something other than an all-to-all (a pipeline receive)."""
        self._alone_until(t)

    def wait_for(self, key) -> None:
        while key not in self.arrived:
            before = self.host
            self._alone_until(None)
            self.exposed[self.phase] += self.host - before
        self.wait(self.arrived[key])

    def wait_exchange(self, key) -> None:
        """Blocks until the split sizes of ``key`` are back (an on-host dispatch)."""
        while key in self.pending:
            before = self.host
            if self._head_start() is not None and key in self.pending:
                self._alone_until(None)
            self.exposed[self.phase] += self.host - before
        self.wait(self.exchanges[key])

    def exchange_start(self, key, nbytes: float) -> None:
        """The split sizes of a dispatch of ``nbytes`` go out (a dense layer exchanges nothing)."""
        if nbytes > 0:
            self.pending.add(key)
            self.queue.append(_Transfer(key, 0.0, self.host, marker=True))
            self._head_start()

    def has_exchange(self, key) -> bool:
        return key in self.pending or key in self.exchanges

    def launch(self, key, nbytes: float, exchange=None) -> None:
        """An all-to-all of ``nbytes``, queued on the link (off the host: not before ``exchange``'s sizes are back)."""
        if nbytes <= 0:  # a dense layer: nothing crosses the link
            self.arrived[key] = self.host
            self.exchanges.pop(exchange, None)
            return
        self.queue.append(_Transfer(key, nbytes / self.link.bandwidth_Bps, self.host, exchange=exchange))
        self.launches.append(key)
        self._head_start()

    def drain(self) -> None:
        """Settles what is still on the link (its time counted in comm), the host's clock left as it is."""
        host = self.host
        while self.queue:
            self._alone_until(None)
        self.host = host
