"""Storages held for backward and let go, one unit at a time, as ``engine/saved.py`` counts them: what
``memory.py``'s walk of a schedule program holds and releases, node by node.

Contract:
    * The bytes are counted in :class:`~ep_overlap_lab.storage_count.Count`, as the engine
      counts a real step.
    * :class:`UnitHolds` holds what one unit's nodes save (the names and bytes its shape gives: ``saved``,
      ``freed_outputs``, ``rebuilt``, ``wgrad_held``), lets it go in their backward, and keeps what a delayed weight
      gradient holds until its ``wgrad`` op; with full recompute, a segment's kept input until its replay.
    * No torch here.
"""

from typing import TYPE_CHECKING

from ep_overlap_lab.storage_count import Count

if TYPE_CHECKING:
    from ep_overlap_lab.planner.memory import ActivationShape
# The experts' backward with delayed wgrad, in autograd's order, as the reference model's experts run it (unsort,
# fc2, the activation, fc1, sort): each step lets go of a saved tensor the node holds ("release"; skipped where the
# node has none of that name), hands one to the wgrad queue ("queue": held on, no new bytes), or holds an output
# gradient for the queue ("grad": new bytes, ``wgrad_held``).
EXPERTS_BWD_DELAYED = (
    ("release", "unsort_index"), ("queue", "expert_act"), ("grad", "dy_fc2"), ("release", "expert_act"),
    ("release", "expert_silu"), ("release", "expert_fc1_out"), ("queue", "expert_x"), ("grad", "dy_fc1"),
    ("release", "expert_x"), ("release", "sort_index"), ("release", "received"),
)  # fmt: skip


class UnitHolds:
    """What one unit of the step holds for backward, node by node, in the step's :class:`Count`."""

    def __init__(self, shape: "ActivationShape", count: Count, unit: int, microbatch: int, sequences: int):
        self.shape, self.count, self.unit, self.microbatch, self.sequences = shape, count, unit, microbatch, sequences
        self.tokens = sequences * shape.seq_length
        self.saved: dict[tuple, list[tuple[tuple, int]]] = {}  # (layer, node) -> the keys it holds
        self.wgrad: dict[tuple, list[tuple]] = {}  # (layer, "experts"/"attention") -> keys a delayed wgrad holds

    def key(self, layer: int | None, name: str) -> tuple:
        """A storage: the token ids and labels are the microbatch's (a half's rows are a view of them)."""
        return ("microbatch", self.microbatch, name) if name in ("tokens", "labels") else (self.unit, layer, name)

    def keep_input(self, layer: int) -> None:
        """A recomputed segment's forward (full recompute) keeps its input, the first layer's ``x``: the same storage
        its replay's attention saves again."""
        T, D, es = self.tokens, self.shape.hidden, self.shape.element_bytes
        self.count.hold(self.key(layer, "x"), T * D * es)

    def drop_input(self, layer: int) -> None:
        self.count.release(self.key(layer, "x"))

    def forward(self, layer: int | None, node: str) -> None:
        held = [(self.key(layer, name), nbytes) for name, nbytes in self.shape.saved(node, layer, self.sequences)]
        self.saved[(layer, node)] = held
        for k, nbytes in held:
            self.count.hold(k, nbytes)
        # An output freed once the next linear ran was held until then: counted on top of all the node keeps, the
        # largest one (they are freed one at a time): an upper bound.
        freed = self.shape.freed_outputs(node, layer, self.sequences)
        if freed:
            name, nbytes = max(freed, key=lambda item: item[1])
            self.count.hold(("freed", self.unit, layer, name), nbytes)
            self.count.release(("freed", self.unit, layer, name))

    def open_backward(self, layer: int | None, node: str) -> dict[str, tuple]:
        """A node's backward begins: what recompute rebuilds is held too. Returns the keys the node now holds, by
        name; the backward lets them go."""
        held = self.saved.pop((layer, node))
        for name, nbytes in self.shape.rebuilt(node, layer, self.sequences):
            held.append((self.key(layer, name), nbytes))
            self.count.hold(*held[-1])
        return {k[-1]: k for k, _ in held}

    def backward(self, layer: int | None, node: str) -> None:
        for k in self.open_backward(layer, node).values():
            self.count.release(k)

    def experts_bwd_delayed(self, layer: int) -> None:
        """Expert backward in autograd's order (:data:`EXPERTS_BWD_DELAYED`); what it queues stays held until the
        ``wgrad`` op."""
        grads = {n: ((self.unit, layer, n), b) for n, b in self.shape.wgrad_held("experts", self.tokens)}
        names = self.open_backward(layer, "experts")
        queued = []
        for action, name in EXPERTS_BWD_DELAYED:
            if action == "grad":
                self.count.hold(*grads[name])
                queued.append(grads[name][0])
            elif name in names and action == "queue":
                self.count.hold(names[name], 0)
                queued.append(names[name])
            elif name in names:
                self.count.release(names[name])
        self.wgrad[(layer, "experts")] = queued

    def pre_dispatch_bwd_delayed(self, layer: int) -> None:
        """The attention's linears keep their inputs (the norm's output, the attention's output) and output
        gradients for the delayed wgrad; everything released before them is larger, so no new peak arises inside
        the node."""
        names = self.open_backward(layer, "pre_dispatch")
        for name, k in names.items():
            if name not in ("ln1_out", "o"):
                self.count.release(k)
        grads = [((self.unit, layer, n), b) for n, b in self.shape.wgrad_held("attention", self.tokens)]
        for k, nbytes in grads:
            self.count.hold(k, nbytes)
        self.wgrad[(layer, "attention")] = [names["ln1_out"], names["o"], *(k for k, _ in grads)]

    def run_wgrad(self, layer: int, which: str) -> None:
        for k in self.wgrad.pop((layer, which)):
            self.count.release(k)
