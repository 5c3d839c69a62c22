"""The plain path: one unit through one chunk by ordinary autograd, the reference every schedule is bitwise equal to.

Its all-to-alls block (the model's own differentiable all-to-all). :class:`PlainTimeline` records them as the
overlapped path is recorded, so both arms of an A/B draw and compare alike.
"""

import time

from megatron.bridge.training.ep_overlap.program.pipeline import Phase
from megatron.bridge.training.ep_overlap.runtime.nodes import UnitInput
from megatron.bridge.training.ep_overlap.runtime.records import CommRecord, ComputeRecord


class PlainTimeline:
    """Records the plain path as the overlapped path is recorded, so both arms of an A/B draw and compare alike:
    every all-to-all, and the compute between them as one segment each, named ``plain <next>`` after the
    boundary that ends it (``plain dispatch`` of layer j is everything computed since the previous all-to-all up
    to layer j's dispatch; ``plain forward_end``/``plain backward_end`` close a chunk's forward and backward)."""

    def __init__(self, lane):
        self.lane = lane
        self.open_ops: dict[str, CommRecord] = {}
        self.segment: ComputeRecord | None = None

    def start(self, microbatch: int) -> None:
        clock = self.lane.recorder.clock
        self.segment = ComputeRecord("plain", -1, microbatch, Phase.PLAIN, clock.mark(), time.perf_counter())

    def end(self, next_boundary: str, layer: int) -> None:
        record = self.segment
        record.node, record.layer = f"plain {next_boundary}", layer
        record.end, record.end_host = self.lane.recorder.clock.mark(), time.perf_counter()
        self.lane.recorder.compute.append(record)

    def observe(self, op: str, event: str, sent: int, received: int, layer: int, microbatch: int) -> None:
        # Blocking all-to-alls: launched and waited for at once.
        if event == "start":
            self.end(op, layer)
            record = self.lane.record_comm(op, layer, microbatch, exchanged=(sent, received))
            record.wait_start_host = record.launch_host
            self.open_ops[op] = record
        else:
            record = self.open_ops.pop(op)
            record.done, record.wait_end_host = self.lane.recorder.clock.mark(), time.perf_counter()
            self.start(microbatch)

    def attach(self, chunk, microbatch: int) -> None:
        for number, layer in zip(chunk.layer_numbers, chunk.layers):
            if hasattr(layer, "comm_observer"):
                layer.comm_observer = lambda op, event, sent, got, j=number: self.observe(
                    op, event, sent, got, j, microbatch
                )

    def detach(self, chunks) -> None:
        for chunk in chunks:
            for layer in chunk.layers:
                if hasattr(layer, "comm_observer"):
                    layer.comm_observer = None


class PlainRun:
    """One microbatch through one chunk by ordinary autograd; the all-to-alls block (the reference path).

    A whole model runs its own plain ``__call__``; a pipeline chunk runs embedding or received input, its layers'
    ``forward``, then head and loss or a send. ``plain_forward``/``plain_backward`` are the program's ``plain`` ops.
    """

    def __init__(self, unit: UnitInput, io, timeline):
        chunk = unit.chunk
        self.chunk, self.mb, self.io, self.timeline = chunk, unit.unit, io, timeline
        self.tokens, self.labels, self.normalizer = unit.tokens, unit.labels, unit.normalizer
        self.first, self.last = chunk.pre_process, chunk.post_process
        self.loss = None

    def plain_forward(self) -> None:
        received = None if self.first else self.io.input.wait()  # before the segment: waiting is not compute
        self.timeline.attach(self.chunk, self.mb)
        self.timeline.start(self.mb)
        if self.first and self.last:
            self.loss = self.chunk(self.tokens, self.labels, self.normalizer)
        else:
            x = self.chunk.embed(self.tokens) if self.first else received.requires_grad_(True)
            self.input = x
            x = self.chunk.run_layers(x)
            if self.last:
                self.loss = self.chunk.head_loss(x, self.labels, self.normalizer, self.tokens)
            else:
                self.output = x
                self.io.send_output(x)
        self.timeline.end("forward_end", -1)

    def plain_backward(self) -> None:
        grad = None if self.last else self.io.grad.wait()
        self.timeline.attach(self.chunk, self.mb)
        self.timeline.start(self.mb)
        if self.last:
            self.loss.backward()
        else:
            self.output.backward(grad)
        if not self.first:
            self.io.send_grad(self.input.grad)
        self.input = self.output = None
        self.timeline.end("backward_end", -1)
