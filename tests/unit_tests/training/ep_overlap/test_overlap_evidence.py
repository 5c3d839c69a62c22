"""From the engine's records (not wall-clock speed): in every paired layer step, each all-to-all of one
microbatch was in flight while the other microbatch's compute ran, exactly as the timeline says; with edge
pairing, in the warm-up and cool-down steps too."""

import pytest

from .local_ranks import run_local_ranks
from .workers import Case, train_arms

# all-to-all -> the other microbatch's compute node that the layer step issues while it is in flight
TIMELINE = {
    "combine_bwd": "pre_dispatch",  # window 1
    "dispatch": "experts_bwd",  # window 2
    "dispatch_bwd": "experts",  # window 3
    "combine": "pre_dispatch_bwd",  # window 4
}


def ran_in_flight(comm: dict, compute: dict) -> bool:
    return comm["launch_host"] <= compute["start_host"] and compute["end_host"] <= comm["wait_start_host"]


@pytest.fixture(scope="module")
def records():
    """Per arm, the bulk all-to-alls (``comm``) apart from the blocking split-size exchanges (``exchanges``)."""
    case = Case(steps=1, arms=("overlap", "delayed", "plain", "overlap_edges", "delayed_edges"), layer_freq=(1, 0, 1))
    outcomes = run_local_ranks(train_arms, case.world, (case,))
    for outcome in outcomes:
        for arm in outcome.result.values():
            arm["exchanges"] = [c for c in arm["comm"] if c["op"] == "split_exchange"]
            arm["comm"] = [c for c in arm["comm"] if c["op"] != "split_exchange"]
    return case, outcomes


@pytest.mark.parametrize("arm", ["overlap", "delayed_edges", "plain"])
def test_split_size_exchanges_count_as_communication(records, arm):
    # Every MoE layer of every microbatch exchanges its split sizes once, recorded from the moment they go out to
    # the end of the host's wait, in the overlapped arms as in the plain path (so exposed comm is counted alike).
    case, outcomes = records
    for outcome in outcomes:
        exchanges = outcome.result[arm]["exchanges"]
        assert len(exchanges) == sum(case.layer_freq) * case.microbatches
        assert all(c["launch_host"] <= c["wait_start_host"] <= c["wait_end_host"] for c in exchanges)


def test_split_sizes_travel_while_the_delayed_attention_wgrad_computes(records):
    # In a paired layer step after the first, F's split sizes go out as soon as its routing is known, and the
    # host computes B's previous attention wgrad before it waits for them: it never blocks there for a slower peer.
    case, outcomes = records
    for outcome in outcomes:
        compute = outcome.result["delayed"]["compute"]
        later = [c for c in outcome.result["delayed"]["exchanges"] if c["phase"] == "paired" and c["layer"] > 0]
        assert later
        for exchange in later:
            mb = exchange["microbatch"]
            other = [c for c in compute if c["node"] == "attention_wgrad" and c["microbatch"] != mb]
            assert any(ran_in_flight(exchange, c) for c in other), f"layer {exchange['layer']}: nothing hid it"


@pytest.mark.parametrize("arm", ["overlap", "delayed", "overlap_edges", "delayed_edges"])
def test_each_paired_all_to_all_hides_behind_the_other_microbatch(records, arm):
    case, outcomes = records
    for outcome in outcomes:
        comm, compute = outcome.result[arm]["comm"], outcome.result[arm]["compute"]
        paired = [c for c in comm if c["phase"] == "paired"]
        moe_layers = sum(case.layer_freq)
        # With edge pairing the warm-up and cool-down steps take two microbatches each: N - 2 steps are F + B.
        assert len(paired) == 4 * moe_layers * (case.microbatches - (2 if arm.endswith("_edges") else 1))
        for op in paired:
            assert op["wait_start_host"] is not None, f"{op['op']} was never waited on"
            partners = [
                c
                for c in compute
                if c["phase"] == "paired" and c["microbatch"] != op["microbatch"] and ran_in_flight(op, c)
            ]
            assert partners, (
                f"nothing of the other microbatch ran while {op['op']} (layer {op['layer']}) was in flight"
            )
            assert TIMELINE[op["op"]] in {c["node"] for c in partners}


@pytest.mark.parametrize("arm", ["overlap_edges", "delayed_edges"])
def test_edge_pairing_hides_the_warmup_and_cooldown_all_to_alls_too(records, arm):
    case, outcomes = records
    for outcome in outcomes:
        comm, compute = outcome.result[arm]["comm"], outcome.result[arm]["compute"]
        edges = [c for c in comm if c["phase"] in ("warmup", "cooldown")]
        assert len(edges) == 2 * 2 * 2 * sum(case.layer_freq)  # 2 microbatches x 2 all-to-alls x 2 phases
        assert {c["microbatch"] for c in edges if c["phase"] == "warmup"} == {0, 1}
        assert {c["microbatch"] for c in edges if c["phase"] == "cooldown"} == {
            case.microbatches - 2,
            case.microbatches - 1,
        }
        for op in edges:
            partners = [
                c
                for c in compute
                if c["phase"] == op["phase"] and c["microbatch"] != op["microbatch"] and ran_in_flight(op, c)
            ]
            assert partners, (
                f"nothing of the other microbatch ran while {op['op']} (layer {op['layer']}) was in flight"
            )


def test_delayed_expert_wgrad_runs_under_dispatch_backward(records):
    _, outcomes = records
    for outcome in outcomes:
        comm, compute = outcome.result["delayed"]["comm"], outcome.result["delayed"]["compute"]
        dispatch_bwd = [c for c in comm if c["op"] == "dispatch_bwd"]
        assert dispatch_bwd
        for op in dispatch_bwd:
            wgrad = [
                c
                for c in compute
                if c["node"] == "expert_wgrad" and c["microbatch"] == op["microbatch"] and c["layer"] == op["layer"]
            ]
            assert len(wgrad) == 1 and ran_in_flight(op, wgrad[0])


def test_attention_wgrad_follows_its_dgrad_under_an_all_to_all(records):
    _, outcomes = records
    for outcome in outcomes:
        comm, compute = outcome.result["delayed"]["comm"], outcome.result["delayed"]["compute"]
        comm = comm + outcome.result["delayed"]["exchanges"]  # what the wgrad may hide: any transfer in flight
        dgrads = {(c["microbatch"], c["layer"]): c for c in compute if c["node"] == "pre_dispatch_bwd"}
        wgrads = [c for c in compute if c["node"] == "attention_wgrad"]
        assert len(wgrads) == len(dgrads)
        for wgrad in wgrads:
            dgrad = dgrads[(wgrad["microbatch"], wgrad["layer"])]
            assert dgrad["end_host"] <= wgrad["start_host"]  # after its own dgrad
            if wgrad["phase"] == "paired":  # and, in paired steps, while an all-to-all is in flight
                assert any(ran_in_flight(op, wgrad) for op in comm if op["phase"] == "paired")
        assert "attention_wgrad" not in {c["node"] for c in outcome.result["overlap"]["compute"]}


def test_step_stats_are_reported(records):
    _, outcomes = records
    for outcome in outcomes:
        for arm in ("overlap", "plain"):
            stats = outcome.result[arm]["stats"]
            assert stats["comm_s"] > 0
            assert 0 <= stats["exposed_comm_s"] <= stats["comm_s"]
            assert 0.0 <= stats["overlap_fraction"] <= 1.0
        # The plain path blocks on every all-to-all: all of its comm is exposed.
        plain = outcome.result["plain"]["stats"]
        assert plain["exposed_comm_s"] == plain["comm_s"]
