"""GroupedLinear: delayed wgrad is bitwise equal to the undelayed one; hooks fire once, after the grad is complete."""

import pytest
import torch

from ep_overlap_lab.moe_gpt.grouped_linear import GroupedLinear, grouped_matmul
from ep_overlap_lab.wgrad_store import check_no_pending_wgrads


def make(dtype, groups=3, k=16, n=8, seed=0):
    torch.manual_seed(seed)
    linear = GroupedLinear(groups, k, n, name="experts.fc1").to(dtype)
    with torch.no_grad():
        linear.weight.normal_()
    return linear


def run_backward(linear, x, sizes, grad_out, delay):
    linear.delay_wgrad = delay
    before = None if linear.weight.grad is None else linear.weight.grad.clone()
    x = x.detach().requires_grad_(True)
    linear(x, sizes).backward(grad_out)
    if delay:
        # dgrad only: the weight's gradient is untouched until backward_dw()
        after = linear.weight.grad
        assert (after is None and before is None) or torch.equal(after, before)
        assert linear.pending_wgrads == 1
        linear.backward_dw()
    return x.grad, linear.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [(4, 0, 5), (0, 0, 9), (3, 3, 3)])
@pytest.mark.parametrize("k, n", [(16, 8), (6, 5)])  # aligned: torch._grouped_mm; unaligned: per-group loop
def test_delayed_wgrad_is_bitwise_equal(dtype, sizes, k, n):
    x = torch.randn(sum(sizes), k).to(dtype)
    grad_out = torch.randn(sum(sizes), n).to(dtype)
    dx_a, dw_a = run_backward(make(dtype, k=k, n=n), x, sizes, grad_out, delay=False)
    dx_b, dw_b = run_backward(make(dtype, k=k, n=n), x, sizes, grad_out, delay=True)
    assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)
    empty = [g for g, rows in enumerate(sizes) if rows == 0]
    assert all(dw_a[g].abs().sum() == 0 for g in empty)


def test_matches_a_plain_per_group_matmul():
    linear = make(torch.float32)
    x, sizes = torch.randn(9, 16), (4, 0, 5)
    expected = torch.cat([x[:4] @ linear.weight[0], x[4:] @ linear.weight[2]])
    assert torch.allclose(linear(x, sizes), expected)
    assert torch.equal(grouped_matmul(x, linear.weight.detach(), sizes), linear(x, sizes).detach())


@pytest.mark.parametrize("delay", [False, True])
def test_stride_zero_incoming_grad(delay):
    linear = make(torch.float32)
    x = torch.randn(9, 16, requires_grad=True)
    out = linear(x, (4, 0, 5))
    linear.delay_wgrad = delay
    out.sum().backward()  # the gradient of sum() reaches the function as an expanded (stride-0) tensor
    if delay:
        linear.backward_dw()
    assert torch.equal(x.grad, grouped_matmul(torch.ones(9, 8), linear.weight.detach().transpose(1, 2), (4, 0, 5)))


@pytest.mark.parametrize("delay", [False, True])
def test_grad_ready_hook_fires_once_per_backward_after_grad_is_complete(delay):
    linear = make(torch.float32)
    x, sizes, grad_out = torch.randn(9, 16), (4, 0, 5), torch.randn(9, 8)
    _, expected = run_backward(make(torch.float32), x, sizes, grad_out, delay=False)
    seen = []
    linear.register_grad_ready_hook(lambda p: seen.append(p.grad.clone()))
    for backward in range(2):
        run_backward(linear, x, sizes, grad_out, delay)
        assert len(seen) == backward + 1
        assert torch.equal(seen[-1], expected * (backward + 1))  # complete, accumulated gradient


@pytest.mark.parametrize("delay", [False, True])
def test_main_grad_accumulation(delay):
    linear = make(torch.bfloat16)
    linear.weight.main_grad = torch.zeros_like(linear.weight, dtype=torch.float32)

    def move(param):  # what Megatron's DDP hook does
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None

    linear.register_grad_ready_hook(move)
    x, sizes = torch.randn(9, 16).bfloat16(), (4, 0, 5)
    grad_out = torch.randn(9, 8).bfloat16()
    run_backward(linear, x, sizes, grad_out, delay)
    _, reference = run_backward(make(torch.bfloat16), x, sizes, grad_out, delay=False)
    assert linear.weight.grad is None
    assert torch.equal(linear.weight.main_grad, torch.zeros_like(linear.weight.main_grad).add_(reference))


def test_backward_dw_without_queued_work_names_the_module():
    with pytest.raises(RuntimeError, match="experts.fc1: backward_dw\\(\\) called with no delayed wgrad queued"):
        make(torch.float32).backward_dw()


def test_leftover_wgrad_is_an_error_naming_the_module():
    linear = make(torch.float32)
    linear.delay_wgrad = True
    linear(torch.randn(9, 16, requires_grad=True), (4, 0, 5)).sum().backward()
    with pytest.raises(RuntimeError, match=r"gradients would be lost: experts.fc1 \(1 queued\)"):
        check_no_pending_wgrads([linear])
    linear.backward_dw()
    check_no_pending_wgrads([linear])


def test_forward_queues_nothing():
    linear = make(torch.float32)
    linear.delay_wgrad = True
    with torch.no_grad():
        linear(torch.randn(9, 16), (4, 0, 5))
    linear(torch.randn(9, 16, requires_grad=True), (4, 0, 5))  # forward with grad, no backward
    assert linear.pending_wgrads == 0
