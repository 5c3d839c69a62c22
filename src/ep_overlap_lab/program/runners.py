"""What a runner of the program's ops implements (no torch): the runner protocols, generated from the payload's op
table (:data:`~megatron.bridge.training.ep_overlap.program.ops.OPS`, each op's ``at``), which a test checks every
runner against; and :class:`NoComm` / :class:`NoPipeline`, the communication and P2P ops of a runner that prices or
counts a program instead of running it (the planner's)."""

from typing import Any, Protocol, runtime_checkable

from megatron.bridge.training.ep_overlap.program.ops import ENDS, LAYER, OPS, WHOLE

LAYER_OPS = frozenset(op for op, spec in OPS.items() if spec.at == LAYER)
CHUNK_END_OPS = frozenset(op for op, spec in OPS.items() if spec.at == ENDS)
PLAIN_OPS = frozenset(op for op, spec in OPS.items() if spec.at == WHOLE)


def runner_protocol(name: str, ops) -> type:
    """A runtime-checkable protocol with the method of each op of ``ops`` (:attr:`OpSpec.method`)."""

    def method(self, *args: Any) -> Any: ...

    namespace = {OPS[op].method: method for op in sorted(ops)}
    return runtime_checkable(type(name, (Protocol,), namespace))


LayerRunner = runner_protocol("LayerRunner", LAYER_OPS)
ChunkRunner = runner_protocol("ChunkRunner", CHUNK_END_OPS)
PlainRunner = runner_protocol("PlainRunner", PLAIN_OPS)


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
