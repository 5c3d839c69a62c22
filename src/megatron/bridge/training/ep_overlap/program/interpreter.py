"""One loop over a program's ops for its three consumers: the engine's nodes, the planner's simulator and memory count.

Contract:
    * :func:`run_ops` calls each op, in order, on a runner: op ``(kind, name)`` of unit ``u`` is the method
      ``<kind>_<name>`` (:attr:`~megatron.bridge.training.ep_overlap.program.ops.Op.method`) of ``runners[u]`` for
      an op at the chunk's ends, of ``runners[u].layers[j]`` for one at layer j. What an op writes (``OPS``: ``x``
      the unit's activation, ``g`` its gradient) is handed to the next op of that unit that reads it.
    * The runners differ, the loop does not: the engine's ``MicrobatchNodes`` (and, overlap off, ``PlainRun``) run
      the model; ``planner/simulate.py`` charges each op a time on one rank's compute and link; ``planner/memory.py``
      holds and lets go of what each node saves for backward. A runner has one method per op it can be given
      (:class:`NoComm` gives those that move nothing for a runner that counts no communication).
    * No torch here.
"""

from megatron.bridge.training.ep_overlap.program.ops import OPS, Op


def run_ops(ops, runners) -> None:
    """Runs ``ops`` in order on ``runners`` (unit -> the unit's runner, whose ``layers`` run its layer ops)."""
    values = {}
    for op in ops:
        target = runners[op.unit] if op.layer is None else runners[op.unit].layers[op.layer]
        reads, writes = OPS[(op.kind, op.name)]
        method = getattr(target, op.method)
        out = method(values.pop((op.unit, reads))) if reads else method()
        if writes:
            values[(op.unit, writes)] = out


class NoComm:
    """A layer runner's communication ops as nothing: for a runner that counts only what nodes compute and save."""

    def launch_split(self) -> None: ...

    def wait_split(self) -> None: ...

    def launch_dispatch(self) -> None: ...

    def wait_dispatch(self) -> None: ...

    def launch_combine(self) -> None: ...

    def wait_combine(self) -> None: ...

    def launch_combine_bwd(self) -> None: ...

    def wait_combine_bwd(self) -> None: ...

    def launch_dispatch_bwd(self) -> None: ...

    def wait_dispatch_bwd(self) -> None: ...

    def launch_replay_dispatch(self) -> None: ...

    def wait_replay_dispatch(self) -> None: ...

    def launch_replay_combine(self) -> None: ...

    def wait_replay_combine(self) -> None: ...


class NoPipeline:
    """A chunk runner's P2P ops refused: for a runner of a PP = 1 program (the planner's)."""

    def _refuse(self, *args) -> None:
        raise ValueError("a pipeline transfer in the program: the planner prices PP = 1 programs only")

    wait_recv_activation = launch_send_activation = wait_recv_grad = launch_send_grad = _refuse


__all__ = ["NoComm", "NoPipeline", "Op", "run_ops"]
