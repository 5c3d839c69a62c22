"""Test-only: torch stand-ins for Megatron-Core's two paged-stash Triton kernels, so paged stash runs on CPU ranks.

Megatron-Core 0.19.2 (``transformer/moe/ops/paged_stash.py``) launches them as ``kernel[grid](...)`` with the
arguments below; these take the same ones and write the same tensors in place. A buffer's pages are handed out from
a ring of free page ids: ``head``/``tail`` (device vectors ``[device, host]``) count pages taken and given back and
only grow; a ring index is a count modulo ``capacity``. ``overflow`` is one flag shared by every buffer.

    copy[grid](src, device_dst, host_dst, num_tokens, free_list_device, free_list_host, head, tail, capacity,
               page_record, overflow, host_spill, spilled_to_host, new_head, PAGE_SIZE=, HIDDEN_SIZE=,
               BLOCK_SIZE=, HAS_HOST_BUFFER=)
        With ``overflow`` set: nothing but ``new_head = head``. Else the ``ceil(n / PAGE)`` pages the first ``n``
        rows of ``src`` need come from the device ring when it has that many free, else from the host ring (if
        ``HAS_HOST_BUFFER``; then ``host_spill = 1``), else ``overflow = 1`` and nothing is copied.
        ``spilled_to_host``: 1 on the host ring or on overflow, else 0. Page ``s`` is the ring's entry
        ``(head + s) % capacity``; ``page_record[s]`` is set to it and token ``t`` goes to row
        ``page * PAGE + t % PAGE`` of that buffer. ``new_head`` advances the ring used by the pages taken.
    pop[grid](device_src, host_src, dst, num_tokens, page_record, spilled_to_host, overflow, free_list_device,
              free_list_host, tail, capacity, new_tail, PAGE_SIZE=, HIDDEN_SIZE=, BLOCK_SIZE=)
        With ``overflow`` set, or a host-spilled tensor and no host ring: nothing but ``new_tail = tail``. Else
        row ``t < n`` of ``dst`` is read back from where ``page_record`` says, each page goes back to its ring at
        ``(tail + s) % capacity`` in the order it is popped, and ``new_tail`` advances that ring. Rows ``>= n`` of
        ``dst`` are left as they were.

``n`` is the device scalar ``num_tokens``. As the kernels, these never read a device value on the host: every choice
above is a mask (``torch.where``) and every write an index copy whose rows not taken go to a spare row that is then
cut, so each launch issues the same operations whatever the counts. A grid of no programs writes nothing, as a
launch of no programs. :func:`install_paged_stash_kernels` puts them into Megatron-Core's paged-stash module (where
``offload_to_stash``/``reload_from_stash`` look them up); ``LAUNCHES`` counts the launches of programs.
"""

from collections import Counter

import torch

LAUNCHES: Counter = Counter()  # "copy"/"pop": launches in this process


class _Launcher:
    """``kernel[grid](*args, **constants)``, as a Triton kernel is launched."""

    def __init__(self, run):
        self.run = run

    def __getitem__(self, grid):
        def launch(*args, **constants):
            programs = grid[0] if isinstance(grid, tuple) else grid
            if programs:  # no program, no write
                self.run(*args, **constants)

        return launch


def _with_spare(table: torch.Tensor) -> torch.Tensor:
    """``table`` with one more (zero) entry or row at the end: where reads and writes not taken go."""
    return torch.cat([table, table.new_zeros((1, *table.shape[1:]))])


def _ring_entry(ring: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """The ring's entries ``(start + slot) % capacity`` (the spare zero where the ring is empty)."""
    index = (start + slots) % capacity.clamp(min=1)
    return _with_spare(ring)[torch.where(capacity > 0, index, ring.numel())]


def _write(table: torch.Tensor, index: torch.Tensor, values: torch.Tensor, take: torch.Tensor) -> None:
    """``table[index[i]] = values[i]`` where ``take[i]``, in place (each taken index distinct); the rest untouched."""
    padded = _with_spare(table)
    padded.index_copy_(0, torch.where(take, index, table.shape[0]), values)
    table.copy_(padded[: table.shape[0]])


def _read(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]``, the spare zero row where an index is past the end (a read not taken)."""
    return _with_spare(table)[index.clamp(max=table.shape[0])]


def _pages_for(num_tokens: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = num_tokens.reshape(-1)[0].to(torch.int64)
    return n, (n + page - 1) // page


def _copy(
    src, device_dst, host_dst, num_tokens, free_list_device, free_list_host, head, tail, capacity, page_record,
    overflow, host_spill, spilled_to_host, new_head, *, PAGE_SIZE, HIDDEN_SIZE, BLOCK_SIZE, HAS_HOST_BUFFER,
):  # fmt: skip
    n, pages = _pages_for(num_tokens, PAGE_SIZE)
    stopped = overflow.reshape(-1)[0] == 1
    on_device = tail[0] - head[0] >= pages
    on_host = ~on_device & (tail[1] - head[1] >= pages) & bool(HAS_HOST_BUFFER)
    full = ~on_device & ~on_host
    copies = ~stopped & ~full
    overflow.copy_(torch.where(~stopped & full, 1, overflow))
    spilled_to_host.copy_(torch.where(stopped, spilled_to_host, (full | on_host).to(spilled_to_host.dtype)))
    host_spill.copy_(torch.where(copies & on_host, 1, host_spill))
    taken = torch.stack([pages * (copies & ~on_host), pages * (copies & on_host)])
    new_head.copy_(head + taken)
    slots_S = torch.arange(page_record.numel(), device=src.device)
    page_S = torch.where(
        on_host,
        _ring_entry(free_list_host, head[1], slots_S, capacity[1]),
        _ring_entry(free_list_device, head[0], slots_S, capacity[0]),
    )
    page_record.copy_(torch.where(copies & (slots_S * PAGE_SIZE < n), page_S, page_record))
    src_TH = src.view(-1, HIDDEN_SIZE)
    tokens_T = torch.arange(src_TH.shape[0], device=src.device)
    rows_T = page_S[tokens_T // PAGE_SIZE] * PAGE_SIZE + tokens_T % PAGE_SIZE
    moved_T = copies & (tokens_T < n)
    _write(device_dst.view(-1, HIDDEN_SIZE), rows_T, src_TH, moved_T & ~on_host)
    _write(host_dst.view(-1, HIDDEN_SIZE), rows_T, src_TH, moved_T & on_host)
    LAUNCHES["copy"] += 1


def _pop(
    device_src, host_src, dst, num_tokens, page_record, spilled_to_host, overflow, free_list_device, free_list_host,
    tail, capacity, new_tail, *, PAGE_SIZE, HIDDEN_SIZE, BLOCK_SIZE,
):  # fmt: skip
    n, pages = _pages_for(num_tokens, PAGE_SIZE)
    spilled = spilled_to_host.reshape(-1)[0] == 1
    pops = (overflow.reshape(-1)[0] != 1) & ~(spilled & (capacity[1] == 0))
    new_tail.copy_(tail + torch.stack([pages * (pops & ~spilled), pages * (pops & spilled)]))
    dst_TH = dst.view(-1, HIDDEN_SIZE)
    tokens_T = torch.arange(dst_TH.shape[0], device=dst.device)
    rows_T = page_record[tokens_T // PAGE_SIZE] * PAGE_SIZE + tokens_T % PAGE_SIZE
    stored_TH = torch.where(
        spilled, _read(host_src.view(-1, HIDDEN_SIZE), rows_T), _read(device_src.view(-1, HIDDEN_SIZE), rows_T)
    )
    dst_TH.copy_(torch.where((pops & (tokens_T < n))[:, None], stored_TH, dst_TH))
    # each page back to its ring, in the order popped
    slots_S = torch.arange(page_record.numel(), device=dst.device)
    freed_S = pops & (slots_S * PAGE_SIZE < n)
    _write(free_list_device, (tail[0] + slots_S) % capacity[0].clamp(min=1), page_record, freed_S & ~spilled)
    _write(free_list_host, (tail[1] + slots_S) % capacity[1].clamp(min=1), page_record, freed_S & spilled)
    LAUNCHES["pop"] += 1


copy_kernel = _Launcher(_copy)
pop_kernel = _Launcher(_pop)


def install_paged_stash_kernels() -> None:
    """Megatron-Core's paged stash launches the stand-ins from now on, in this process."""
    from megatron.core.transformer.moe import paged_stash

    paged_stash.paged_stash_copy_kernel = copy_kernel
    paged_stash.paged_stash_pop_kernel = pop_kernel
