"""Test-only: CUDA's stream semantics on CPU ranks, race-checked by PyTorch's own CUDA sanitizer. Never imported by
product code.

:func:`install` (after :func:`~.mcore_cpu.install_cpu_stubs`, in a forked rank) replaces the stubs' no-op streams and
events with emulated ones whose ids feed ``torch.cuda._sanitizer.EventHandler`` (its per-stream vector clocks):

- streams: ``torch.cuda.Stream``, ``current_stream``, ``torch.cuda.stream(...)``, ``wait_stream``, ``synchronize``;
- events: ``record``, ``wait``/``wait_event``, ``synchronize`` (a host wait), timing or not (counted apart);
- every aten op (a :class:`~torch.utils._python_dispatch.TorchDispatchMode`) is a kernel on the current stream, its
  reads and writes taken from the op's schema by the sanitizer's ``ArgumentHandler`` (CPU tensors accepted here);
  accesses are keyed by storage, so views of one block conflict;
- ``dist.all_to_all_single`` is a kernel on the stream it was issued on (reads its input, writes its output);
- the caching allocator: a block belongs to the stream it was allocated on; ``record_stream`` adds a user;
  ``untyped_storage().resize_(0)`` frees it. A free is reported when a stream other than the block's own used it,
  was not recorded with ``record_stream``, and the block's stream has not waited for that use (the allocator would
  hand the block to the next allocation on its stream at once). Any later access to a freed block is reported;
- a fresh allocation that lands on an address the sanitizer knows is the block reused: the old history is kept
  (and checked) when the allocator would reuse it at once (same stream, no other recorded user), dropped otherwise;
- Megatron-Core's device-to-host copies (``maybe_move_tensor_to_cpu``) are reads on the current stream; a host wait
  (``Event.synchronize``, ``Stream.synchronize``, ``torch.cuda.synchronize``) is logged with its position in the
  issue order (kernels issued so far) and the stream it waits for;
- TE's graphed callables: :meth:`Emulation.static_buffer` hands the same storage on every call (a replay writes into
  it), so a write while a consumer on another stream has not finished is a reported race.

What it finds goes to :attr:`Emulation.errors` (one line each) instead of raising, so a test can assert a clean run
or a planted fault found. Counts (streams, events, timing events, host waits, host collectives) are per
:meth:`Emulation.counting` window.
"""

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.cuda import _sanitizer as san
from torch.utils._python_dispatch import TorchDispatchMode

DEFAULT_STREAM = 0


class _NoStacks:
    """The sanitizer walks the Python stack at every kernel; its reports here are one line without it."""

    class StackSummary:
        @staticmethod
        def extract(*args, **kwargs):
            return []

    @staticmethod
    def walk_stack(*args):
        return None


class _Arguments(san.ArgumentHandler):
    """The sanitizer's argument reader for CPU tensors, keyed by storage (a view's accesses are its block's)."""

    def _handle_argument(self, value, is_write, metadata_only, name=None, is_output=False):
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.is_sparse:
            return
        try:
            storage = value.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr() or id(storage)
        if is_write:
            self.dataptrs_written.add(ptr)
        elif not metadata_only:
            self.dataptrs_read.add(ptr)
        self.tensor_aliases.setdefault(ptr, [])
        if name is not None:
            self.tensor_aliases[ptr].append(name)
        if is_output:
            self.outputs.add(ptr)


@dataclass
class _Block:
    stream: int  # the stream it was allocated on
    users: set = field(default_factory=set)  # streams named by record_stream


@dataclass
class HostWait:
    """One host wait: after ``issued`` kernels, on ``stream`` (``what``: the call). ``beyond``: the labels of the
    default stream's kernels it waits for that were queued after the last forward routing kernel (whose split sizes
    a wait reads): work the host did not need to wait for."""

    issued: int
    stream: int
    what: str
    beyond: tuple = ()


ROUTING_LABELS = ("pre_dispatch", "replay_pre_dispatch", "pre_dispatch_computation forward")  # ours; Megatron-Core's


class Emulation(TorchDispatchMode):
    """The emulated device of one rank; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.handler = san.EventHandler()
        self.errors: list[str] = []
        self.counts: Counter = Counter()
        self.host_waits: list[HostWait] = []
        self.blocks: dict[int, _Block] = {}
        self.kernels = 0
        self._ids = iter(range(1, 1 << 30))
        self._current = [DEFAULT_STREAM]
        self.handler._handle_stream_creation(DEFAULT_STREAM)
        self._static: dict[object, torch.Tensor] = {}
        self.label: str | None = None  # the node the kernels now issued belong to (set by the arms' spies)
        self.launched: list[tuple[int, int, str | None]] = []  # (seq, stream, label) of every kernel
        self.labels: dict[int, str | None] = {}

    # -- streams and events -----------------------------------------------------------------------------------
    def new_id(self) -> int:
        return next(self._ids)

    @property
    def current(self) -> int:
        return self._current[-1]

    def wait_stream(self, waiter: int, other: int) -> None:
        event = self.new_id()
        self.handler._handle_event_creation(event)
        self.handler._handle_event_record(event, other)
        self.handler._handle_event_wait(event, waiter)
        self.handler._handle_event_deletion(event)

    def host_wait(self, stream: int, what: str, event: int | None = None) -> None:
        self.counts["host waits"] += 1
        syncs = self.handler.syncs
        state = syncs.current_sync_states[stream] if event is None else syncs.recorded_sync_states[event]
        last_routing = max((seq for seq, _, label in self.launched if label in ROUTING_LABELS), default=-1)
        reached = state.get(DEFAULT_STREAM, -1)
        beyond = tuple(sorted({str(label) for seq, where, label in self.launched
                               if where == DEFAULT_STREAM and last_routing < seq <= reached}))  # fmt: skip
        self.host_waits.append(HostWait(self.kernels, stream, what, beyond))
        if event is None:
            self.handler._handle_stream_synchronization(stream)
        else:
            self.handler._handle_event_synchronization(event)

    # -- kernels and memory -----------------------------------------------------------------------------------
    def kernel(self, reads: set, writes: set, outputs: set, name: str, aliases: dict) -> None:
        self.kernels += 1
        self.launched.append((self.handler.seq_num + 1, self.current, self.label))
        self.labels[self.handler.seq_num + 1] = self.label
        aliases = {ptr: aliases.get(ptr, []) for ptr in reads | writes}
        for error in self.handler._handle_kernel_launch(self.current, reads - writes, writes, outputs, name, aliases):
            self.errors.append(f"unsynchronized: {error.current_access.operator} ({self.label}) on stream "
                               f"{error.current_access.stream} after {error.previous_access.operator} "
                               f"({self.labels.get(error.previous_access.seq_num)}) on stream "
                               f"{error.previous_access.stream} ({error.current_access.type} after "
                               f"{error.previous_access.type})")  # fmt: skip

    def allocated(self, ptr: int) -> None:
        old = self.blocks.get(ptr)
        reused_at_once = old is not None and old.stream == self.current and not (old.users - {old.stream})
        if not reused_at_once:  # a fresh block, or the allocator would have waited for the other users
            self.handler.tensors_accessed.accesses.pop(ptr, None)
        self.blocks[ptr] = _Block(self.current)

    def record_stream(self, tensor: torch.Tensor, stream: int) -> None:
        block = self.blocks.get(tensor.untyped_storage().data_ptr())
        if block is not None:
            block.users.add(stream)

    def freed(self, storage) -> None:
        ptr = storage.data_ptr()
        block = self.blocks.get(ptr)
        if block is None:
            return
        accesses = self.handler.tensors_accessed.accesses.get(ptr)
        if accesses is not None:
            uses = list(accesses.reads) + ([accesses.write] if accesses.write is not None else [])
            for use in uses:
                if use.stream == block.stream or use.stream in block.users:
                    continue
                if not self.handler.syncs.is_ordered_after(block.stream, use.seq_num, use.stream):
                    self.errors.append(
                        f"early free: a block of stream {block.stream} freed while {use.operator} on stream "
                        f"{use.stream} may still use it (no record_stream, no wait)"
                    )
                    break
        self.handler.tensors_accessed.accesses.pop(ptr, None)
        del self.blocks[ptr]

    def static_buffer(self, key, like: torch.Tensor) -> torch.Tensor:
        """A graph's static output for ``key``: the same storage on every replay (TE's graphed callables)."""
        buffer = self._static.get(key)
        if buffer is None or buffer.shape != like.shape:
            buffer = self._static[key] = torch.empty_like(like)
        elif buffer.untyped_storage().nbytes() == 0:  # CUDA would write into the freed block: report, and go on
            self.errors.append(f"write into a freed graph static buffer ({key})")
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        buffer.copy_(like)
        return buffer.detach()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.record_stream.default:
            return func(*args, **kwargs)
        schema = func._schema
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor) and value.numel() and value.untyped_storage().nbytes() == 0:
                self.errors.append(f"use of a freed block: {schema.name} on stream {self.current}")
        # new_empty/zeros_like read only their input's metadata (the sanitizer matches the name with its namespace)
        is_factory = bool(san.FACTORY_FUNCTION_REGEX.match(schema.name.split("::")[-1]))
        arguments = _Arguments()
        arguments.parse_inputs(schema, args, kwargs, is_factory=is_factory)
        out = func(*args, **kwargs)
        fresh = [r.alias_info is None for r in schema.returns]
        outs = out if isinstance(out, tuple | list) else (out,)
        for is_fresh, value in zip(fresh, outs):
            if is_fresh and isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel():
                self.allocated(value.untyped_storage().data_ptr())
        arguments.parse_outputs(schema, out, is_factory=is_factory)
        self.kernel(arguments.dataptrs_read, arguments.dataptrs_written, arguments.outputs, schema.name,
                    arguments.tensor_aliases)  # fmt: skip
        return out

    @contextlib.contextmanager
    def counting(self):
        """Counts from here (streams, events, timing events, host waits, host collectives)."""
        self.counts = Counter()
        self.host_waits = []
        yield self.counts


def _stream_class(emu: Emulation):
    class Stream:
        def __init__(self, device=None, priority: int = 0, **kwargs):
            self.id, self.priority = emu.new_id(), priority
            emu.handler._handle_stream_creation(self.id)
            emu.counts["streams"] += 1

        @staticmethod
        def priority_range():
            return 0, -1

        @property
        def cuda_stream(self) -> int:
            return self.id

        def wait_stream(self, other) -> None:
            emu.wait_stream(self.id, other.id)

        def wait_event(self, event) -> None:
            event.wait(self)

        def record_event(self, event=None):
            event = event if event is not None else emu.event_class()
            event.record(self)
            return event

        def synchronize(self) -> None:
            emu.host_wait(self.id, "stream.synchronize")

        def query(self) -> bool:
            return True

        def __eq__(self, other):
            return getattr(other, "id", None) == self.id

        def __hash__(self):
            return hash(self.id)

        def __enter__(self):
            emu._current.append(self.id)
            return self

        def __exit__(self, *exc):
            emu._current.pop()

    return Stream


def _event_class(emu: Emulation):
    class Event:
        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
            self.id, self.recorded = emu.new_id(), False
            emu.handler._handle_event_creation(self.id)
            emu.counts["events"] += 1
            emu.counts["timing events"] += bool(enable_timing)

        def record(self, stream=None) -> None:
            stream_id = emu.current if stream is None else stream.id
            emu.handler._handle_event_record(self.id, stream_id)
            self.recorded = True
            emu.counts["event records"] += 1

        def wait(self, stream=None) -> None:
            stream_id = emu.current if stream is None else stream.id
            if self.recorded:  # waiting on an unrecorded event is a no-op in CUDA too
                emu.handler._handle_event_wait(self.id, stream_id)

        def synchronize(self) -> None:
            if self.recorded:
                emu.host_wait(-1, "event.synchronize", self.id)

        def query(self) -> bool:
            return True

        def elapsed_time(self, other) -> float:
            return 0.0

    return Event


def install() -> Emulation:
    """Installs the emulation in this (forked test) process and enters its dispatch mode; returns it."""
    san.traceback = _NoStacks
    emu = Emulation()
    Stream, Event = _stream_class(emu), _event_class(emu)
    emu.event_class = Event
    default = Stream.__new__(Stream)
    default.id, default.priority = DEFAULT_STREAM, 0
    by_id: dict[int, object] = {DEFAULT_STREAM: default}
    original_init = Stream.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        by_id[self.id] = self

    Stream.__init__ = init
    torch.cuda.Stream, torch.cuda.Event = Stream, Event
    torch.cuda.current_stream = lambda *args, **kwargs: by_id[emu.current]
    torch.cuda.default_stream = lambda *args, **kwargs: by_id[DEFAULT_STREAM]

    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield
            return
        with s:
            yield

    torch.cuda.stream = stream
    torch.cuda.synchronize = lambda *args, **kwargs: _device_sync(emu)
    torch.Tensor.record_stream = lambda self, s: emu.record_stream(self, s.id)
    resize = torch.UntypedStorage.resize_

    def resize_(self, size):
        if size == 0 and self.nbytes():
            emu.freed(self)
        return resize(self, size)

    torch.UntypedStorage.resize_ = resize_
    _all_to_all_on_stream(emu)
    _device_to_host_copies(emu)
    _host_collectives(emu)
    emu.__enter__()
    return emu


def _device_sync(emu: Emulation) -> None:
    emu.counts["host waits"] += 1
    emu.host_waits.append(HostWait(emu.kernels, -1, "torch.cuda.synchronize"))
    emu.handler._handle_device_synchronization()


def _all_to_all_on_stream(emu: Emulation) -> None:
    all_to_all_single = dist.all_to_all_single

    @functools.wraps(all_to_all_single)
    def on_stream(output, input, *args, **kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            work = all_to_all_single(output, input, *args, **kwargs)
            ptr_in, ptr_out = input.untyped_storage().data_ptr(), output.untyped_storage().data_ptr()
        emu.kernel({ptr_in}, {ptr_out}, set(), "all_to_all_single", {})
        return work

    dist.all_to_all_single = on_stream


def _device_to_host_copies(emu: Emulation) -> None:
    """Megatron-Core's split sizes' copies: a read on the current stream; the host's wait is the sync after."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if not torch.is_tensor(tensor):
            return tensor
        emu.counts["device-to-host copies"] += 1
        emu.kernel({tensor.untyped_storage().data_ptr()}, set(), set(), "device_to_host", {})
        if record_stream:
            emu.record_stream(tensor, emu.current)
        return tensor.numpy() if as_numpy else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _host_collectives(emu: Emulation) -> None:
    for name in ("all_gather", "all_reduce", "broadcast", "barrier", "all_gather_object"):
        collective = getattr(dist, name)

        def counted(*args, _collective=collective, _name=name, **kwargs):
            emu.counts["host collectives"] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return _collective(*args, **kwargs)

        setattr(dist, name, counted)
