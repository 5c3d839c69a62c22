"""Test-only, no torch: the host events the engine issues for a program, derived from the program alone.

The engine runs a program's ops in the order its lane issues them (``program/interpreter.py``: program order on a
host lane; ``order=IssueOrder.DEVICE`` gives the device lane's); each op on the host is at most a few events of
``launch_order.py``'s vocabulary (one line each):

    ``compute <node> L<layer> m<unit> <phase>``  a compute op; a delayed wgrad is ``compute expert_wgrad`` /
                                                 ``compute attention_wgrad``. ``L`` is the global layer number, -1
                                                 for the embedding, the chunk's layer count for the head
    ``record split_exchange ...``                an MoE layer's split sizes going out (``launch split``)
    ``launch <op> ...`` / ``wait <op> L<layer> m<unit>``  an MoE layer's all-to-all (a dense layer's move nothing)
    ``record <op> ... plain``                    overlap off: each blocking all-to-all of the plain path
    ``p2p post|take|send <kind>m<mb>c<chunk>r<peer>``, ``wait p2p ...``, ``p2p finish``, then one
    ``record p2p_send_<kind> L-1 m<mb> <phase>`` per send, in the order they went out

:class:`EventRunner` is the interpreter's runner that writes them; :func:`program_events` drives it over a rank's
steps as the engine's driver does (receives posted one step ahead, taken when their step starts), and
:func:`driver_call_events` over one call of Megatron-Core's driver into the plan (the hook). Every event sequence
of the old recorded golden file (1,160 engine sequences, 416 driver calls) is reproduced by them exactly.
"""

import itertools
from dataclasses import replace

from megatron.bridge.training.ep_overlap.options import EPOverlapOptions
from megatron.bridge.training.ep_overlap.program.interpreter import IssueOrder, run_ops
from megatron.bridge.training.ep_overlap.program.pipeline import BACKWARD, FORWARD
from megatron.bridge.training.ep_overlap.program.steps import ChunkShape, windows_of

_WGRAD_NODE = {"experts": "expert_wgrad", "attention": "attention_wgrad"}


def transfer_name(t) -> str:
    return f"{t.kind}m{t.microbatch}c{t.chunk}r{t.peer}"


class _Log:
    """The events of one rank's step, and what its P2P has posted and sent."""

    def __init__(self, dispatched: int, plain_records: bool):
        self.dispatched, self.plain_records = dispatched, plain_records
        self.events: list[str] = []
        self.phase = ""
        self.posted: set = set()
        self.sent: list = []


class _LayerEvents:
    def __init__(self, log: _Log, unit: int, number: int, moe: bool):
        self.log, self.unit, self.number, self.moe = log, unit, number, moe
        self.sent = log.dispatched  # tensors a dispatch moves (each waited for on its own)

    def _compute(self, node: str) -> None:
        self.log.events.append(f"compute {node} L{self.number} m{self.unit} {self.log.phase}")

    def _launch(self, op: str) -> None:
        if self.moe:  # the gradients of what a dispatch moved go back one launch each
            times = self.sent if op == "dispatch_bwd" else 1
            self.log.events += [f"launch {op} L{self.number} m{self.unit} {self.log.phase}"] * times

    def _wait(self, op: str) -> None:
        if self.moe:
            times = self.sent if op in ("dispatch", "dispatch_bwd") else 1
            self.log.events += [f"wait {op} L{self.number} m{self.unit}"] * times

    def compute_pre_dispatch(self, x) -> None:
        self._compute("pre_dispatch")

    def launch_split(self) -> None:
        if self.moe:
            self.log.events.append(f"record split_exchange L{self.number} m{self.unit} {self.log.phase}")

    def wait_split(self) -> None: ...

    def compute_experts(self) -> None:
        self._compute("experts")

    def compute_combine(self) -> None:
        self._compute("combine")

    def compute_combine_bwd(self, g) -> None:
        self._compute("combine_bwd")

    def compute_experts_bwd(self) -> None:
        self._compute("experts_bwd")

    def compute_pre_dispatch_bwd(self) -> None:
        self._compute("pre_dispatch_bwd")

    def wgrad_experts(self) -> None:
        self._compute(_WGRAD_NODE["experts"])

    def wgrad_attention(self) -> None:
        self._compute(_WGRAD_NODE["attention"])


for _op in ("dispatch", "combine", "combine_bwd", "dispatch_bwd"):
    setattr(_LayerEvents, f"launch_{_op}", lambda self, op=_op: self._launch(op))
    setattr(_LayerEvents, f"wait_{_op}", lambda self, op=_op: self._wait(op))


class EventRunner:
    """One unit on its chunk (``numbers``: the chunk's global layer numbers, ``moe``: which are MoE layers)."""

    def __init__(self, log: _Log, unit: int, microbatch: int, numbers: list[int], moe: tuple[bool, ...]):
        self.log, self.unit, self.microbatch, self.numbers, self.moe = log, unit, microbatch, numbers, moe
        self.layers = [_LayerEvents(log, unit, n, m) for n, m in zip(numbers, moe)]
        self.recv: dict[str, object] = {}  # role -> the transfer this unit receives in this step
        self.send: dict[str, object] = {}

    def _compute(self, node: str, layer: int) -> None:
        self.log.events.append(f"compute {node} L{layer} m{self.unit} {self.log.phase}")

    def compute_embedding(self) -> None:
        self._compute("embedding", -1)

    def compute_head(self, x) -> None:
        self._compute("head", len(self.numbers))

    def compute_head_bwd(self) -> None:
        self._compute("head_bwd", len(self.numbers))

    def compute_embedding_bwd(self, g) -> None:
        self._compute("embedding_bwd", -1)

    # Under Megatron-Core's driver its own P2P moves the tensors: the unit then has no transfer, and no event.
    def _wait_recv(self, role: str) -> None:
        if role in self.recv:
            self.log.events.append(f"wait p2p {transfer_name(self.recv[role])}")

    def _send(self, role: str) -> None:
        if role in self.send:
            t = self.send[role]
            self.log.events.append(f"p2p send {transfer_name(t)}")
            self.log.sent.append(t)

    def wait_recv_activation(self) -> None:
        self._wait_recv(FORWARD)

    def wait_recv_grad(self) -> None:
        self._wait_recv(BACKWARD)

    def launch_send_activation(self, x) -> None:
        self._send(FORWARD)

    def launch_send_grad(self, g) -> None:
        self._send(BACKWARD)

    def _plain(self, order, ops: tuple[str, ...]) -> None:
        if not self.log.plain_records:
            return
        for number, moe in order:
            if moe:
                self.log.events += [f"record {op} L{number} m{self.unit} plain" for op in ops]

    # A plain run takes its input from the pipeline (where it has one), and sends its output on, itself.
    def plain_forward(self) -> None:
        self._wait_recv(FORWARD)
        self._plain(zip(self.numbers, self.moe), ("split_exchange", "dispatch", "combine"))
        self._send(FORWARD)

    def plain_backward(self) -> None:
        self._wait_recv(BACKWARD)
        self._plain(reversed(list(zip(self.numbers, self.moe))), ("combine_bwd", "dispatch_bwd"))
        self._send(BACKWARD)


def program_events(
    steps,
    numbers: list[list[int]],
    moe: list[tuple[bool, ...]],
    *,
    dispatched: int = 1,
    plain_records: bool = True,
    order: IssueOrder = IssueOrder.HOST,
) -> list[str]:
    """The host events of a rank's ``steps`` over its chunks (global layer ``numbers`` and ``moe`` per chunk), for
    a model whose dispatch moves ``dispatched`` tensors (the reference model's tokens; Megatron-Core's tokens and
    probabilities) and whose plain path records its blocking all-to-alls (``plain_records``: the reference
    model's does; a Megatron-Core model's plain path is its own forward and backward), issued as a lane of kind
    ``order`` issues them."""
    log = _Log(dispatched, plain_records)

    def post(transfers) -> None:
        for t in transfers:
            if t not in log.posted:
                log.posted.add(t)
                log.events.append(f"p2p post {transfer_name(t)}")

    pipelined = any(step.recv or step.send for step in steps)
    runners: dict[tuple[int, int], EventRunner] = {}
    if pipelined and steps:
        post(steps[0].recv)
    for i, step in enumerate(steps):
        if pipelined and i + 1 < len(steps):
            post(steps[i + 1].recv)
        log.phase = step.phase
        bound = {}
        for m in step.units:
            key = (m.unit, m.virtual)
            if key not in runners:
                runners[key] = EventRunner(log, m.unit, m.microbatch, numbers[m.virtual], moe[m.virtual])
            bound[m.unit] = runners[key]
        for t in step.recv:
            log.events.append(f"p2p take {transfer_name(t)}")
            bound[step.unit_for(t).unit].recv[t.kind] = t
        for t in step.send:
            bound[step.unit_for(t).unit].send[t.kind] = t
        run_ops(step.ops, bound, order)
        for m in step.units:
            if m.done:
                del runners[(m.unit, m.virtual)]
    if pipelined:
        log.events.append("p2p finish")
        log.events += [f"record p2p_send_{t.kind} L-1 m{t.microbatch} {log.phase}" for t in log.sent]
    return log.events


def driver_call_events(
    forward,
    backward,
    shapes: list,
    numbers: list[list[int]],
    *,
    delay_wgrad: bool,
    window: int,
    dispatched: int = 2,
    order: IssueOrder = IssueOrder.HOST,
) -> list[str]:
    """The host events of one call of Megatron-Core's driver into the plan (the hook): ``forward`` / ``backward``
    are (virtual stage, microbatch) or None, ``shapes`` and ``numbers`` the rank's chunks by virtual stage; the call
    runs the program's step for them (``windows_of``), its units named by their microbatches, issued as a lane of
    kind ``order`` issues them."""
    kind = "paired" if forward and backward else "forward" if forward else "backward"
    log = _Log(dispatched, plain_records=False)
    log.phase = {"paired": "paired", "forward": "warmup", "backward": "cooldown"}[kind]
    runners, sides = {}, []
    for unit, side in ((0, forward), (1, backward)):
        if side is not None:
            vp, mb = side
            runners[unit] = EventRunner(log, mb, mb, numbers[vp], shapes[vp].moe)
        sides.append([unit] if side is not None else [])
    fs = shapes[forward[0]] if forward else None
    bs = shapes[backward[0]] if backward else None
    windows = windows_of(kind, sides[0], sides[1], fs, bs, delay_wgrad=delay_wgrad, window=window)
    run_ops([op for w in windows for op in w.ops], runners, order)
    return log.events


def rank_chunks(
    layer_freq: list[int], pipeline_size: int, pipeline_rank: int, virtual: int | None = None
) -> tuple[list, list[list[int]]]:
    """The shapes and global layer numbers of a pipeline rank's chunks (``virtual`` stages; default 2 with pipeline
    stages)."""
    virtual = virtual or (2 if pipeline_size > 1 else 1)
    per_chunk, left = divmod(len(layer_freq), pipeline_size * virtual)  # Megatron-Core's even split, chunk v * P + r
    assert not left, f"{len(layer_freq)} layers do not split evenly over {pipeline_size} x {virtual} chunks"
    layers = [range(c * per_chunk, (c + 1) * per_chunk) for c in range(pipeline_size * virtual)]
    mine = list(range(pipeline_rank, len(layers), pipeline_size))
    last = len(layers) - 1
    shapes = [ChunkShape(c == 0, c == last, tuple(bool(layer_freq[n]) for n in layers[c])) for c in mine]
    return shapes, [layers[c] for c in mine]


def engine_step_events(
    options: dict,
    layer_freq: list[int],
    num_microbatches: int,
    *,
    pipeline_size: int = 1,
    pipeline_rank: int = 0,
    dispatched: int = 1,
    plain_records: bool = True,
    order: IssueOrder = IssueOrder.HOST,
) -> list[str]:
    """The host events of one engine step with ``options`` (``EPOverlapEngine``'s keywords, plus ``forward_only``),
    as ``launch_order.run_engine`` records it: with the auto attention-wgrad window, its first (plain) step; issued
    as a lane of kind ``order`` issues them."""
    from ep_overlap_lab.program.steps import program

    options = dict(options)
    forward_only = options.pop("forward_only")
    chosen = EPOverlapOptions(**options)
    if chosen.attention_wgrad_window is None:  # EPOverlapEngine: plain first, unless nothing is delayed
        auto_first = chosen.overlap and chosen.delay_wgrad and not forward_only
        chosen = replace(chosen, overlap=False) if auto_first else replace(chosen, attention_wgrad_window=1)
    shapes, numbers = rank_chunks(layer_freq, pipeline_size, pipeline_rank)
    steps = list(
        program(chosen, shapes, num_microbatches, pipeline_size=pipeline_size, rank=pipeline_rank,
                forward_only=forward_only)
    )  # fmt: skip
    return program_events(
        steps, numbers, [s.moe for s in shapes], dispatched=dispatched, plain_records=plain_records, order=order
    )


# ---- the option combinations the rules allow -------------------------------------------------------------------

ENDS = {"alone": {}, "edges": {"edge_pairing": True}, "chunks": {"moe_ep_overlap_chunks": 2}}


def engine_options(pp: int, *, off_host: bool = True, chunks: bool = True) -> list[dict]:
    """Every engine option set the rules allow at pipeline size ``pp`` (``off_host``: the model allows launching
    off the host; ``chunks``: try chunking, PP 1 only)."""
    launch = [None, False, True] if off_host else [None, False]
    combos = [dict(overlap=False, launch_off_host=lo, forward_only=fo) for lo in launch[:2] for fo in (False, True)]
    windows = [1, 2, None] if pp == 1 else [1, 2]
    ends = [e for e in ENDS if e != "chunks" or (chunks and pp == 1)]
    for delay, window, end, lo, fo in itertools.product((False, True), windows, ends, launch, (False, True)):
        combos.append(
            dict(overlap=True, delay_wgrad=delay, attention_wgrad_window=window, launch_off_host=lo, forward_only=fo)
            | ENDS[end]
        )
    return combos


def key(options: dict) -> str:
    return ",".join(f"{k}={options[k]}" for k in sorted(options))
