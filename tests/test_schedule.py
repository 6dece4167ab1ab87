"""Pipeline schedules without communication: validity of every kind, validate() catching planted bugs, simulated
bubbles against the formulas, peak activations, drawing, recording real-run events, and the `schedule` command."""

import sys

import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.errors import MpitrainError
from mpitrain.parallel.schedule import (
    COMPUTE_OPS,
    SCHEDULE_KINDS,
    Event,
    Instruction,
    ScheduleArgumentError,
    ScheduleError,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    placement_of,
    theoretical_bubble,
    zb1p,
)
from mpitrain.parallel.schedule_analysis import bubble_fraction, format_schedule, peak_activations, simulate, validate
from mpitrain.parallel.timeline import Timeline, merge_events, render_png, render_text


def legal_layouts(ps=(1, 2, 3, 4, 8), ms=range(1, 13), vs=(1, 2, 3)):
    for kind in SCHEDULE_KINDS:
        for p in ps:
            for m in ms:
                for v in vs:
                    if kind in ("zbv", "dualpipev"):  # always two chunks in a V; dualpipev needs m >= 2p
                        if v == 2 and (kind == "zbv" or m >= 2 * p):
                            yield kind, p, m, v
                        continue
                    if v > 1 and (kind != "interleaved" or m % p):
                        continue
                    yield kind, p, m, v


def compute_order(program):
    """A rank's compute as compact strings: F3, B3 (full or input-only), W3; chunk 1 in lowercase."""
    letters = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}
    out = []
    for ins in program:
        if ins.op in COMPUTE_OPS:
            letter = letters[ins.op]
            out.append(f"{letter.lower() if ins.chunk else letter}{ins.micro}")
    return out


# ---------------------------------------------------------------- every schedule is valid

def test_every_kind_validates_over_a_grid_of_layouts():
    count = 0
    for kind, p, m, v in legal_layouts():
        schedule = make_schedule(kind, p, m, v)
        assert len(schedule) == p
        validate(schedule, p, m, v, placement_of(kind))
        for program in schedule:
            assert [ins.op for ins in program[-2:]] == ["reduce_grads", "optimizer_step"]
        count += 1
    assert count == 384  # zbv: 5 p x 12 m with two chunks; dualpipev: the 32 with m >= 2p


def test_functions_match_the_dispatcher():
    assert gpipe(3, 5) == make_schedule("gpipe", 3, 5)
    assert one_f_one_b(3, 5) == make_schedule("1f1b", 3, 5)
    assert interleaved(2, 4, 2) == make_schedule("interleaved", 2, 4, 2)
    assert zb1p(3, 5) == make_schedule("zb1p", 3, 5)
    assert interleaved(3, 5, 1) == one_f_one_b(3, 5)  # one chunk per rank is plain 1F1B


def test_one_f_one_b_is_warm_up_steady_cool_down():
    schedule = one_f_one_b(4, 6)
    assert compute_order(schedule[0]) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert compute_order(schedule[3]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]
    rank1 = schedule[1]
    assert rank1[:3] == [Instruction("recv_forward", 0, 0, peer=0), Instruction("forward", 0),
                         Instruction("send_forward", 0, 0, peer=2)]


def test_zb1p_follows_zb_h1_ordering():
    """Step x of rank r: F(x), B(x-(p-1-r)), W(x-(p-1)) (Qi et al. 2024, ZB-H1)."""
    schedule = zb1p(4, 6)
    assert compute_order(schedule[0]) == ["F0", "F1", "F2", "F3", "B0", "W0", "F4", "B1", "W1",
                                          "F5", "B2", "W2", "B3", "W3", "B4", "W4", "B5", "W5"]
    assert compute_order(schedule[1]) == ["F0", "F1", "F2", "B0", "F3", "B1", "W0", "F4", "B2",
                                          "W1", "F5", "B3", "W2", "B4", "W3", "B5", "W4", "W5"]
    assert compute_order(schedule[3]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0",
                                          "F4", "B4", "W1", "F5", "B5", "W2", "W3", "W4", "W5"]
    ops = {ins.op for program in schedule for ins in program}
    assert "backward" not in ops and {"backward_input", "backward_weight"} <= ops


def test_interleaved_places_chunk_c_of_rank_r_at_virtual_stage_c_p_plus_r():
    p, m, v = 2, 4, 2
    schedule = interleaved(p, m, v)
    # rank 1 chunk 0 (stage 1) sends to rank 0 chunk 1 (stage 2); rank 1 chunk 1 is the last stage: no send
    sends = [ins for ins in schedule[1] if ins.op == "send_forward"]
    assert {ins.chunk for ins in sends} == {0} and {ins.peer for ins in sends} == {0}
    recvs = [ins for ins in schedule[0] if ins.op == "recv_forward"]
    assert {ins.chunk for ins in recvs} == {1} and {ins.peer for ins in recvs} == {1}
    # Megatron's order: micro-batches in groups of p, chunk by chunk
    assert compute_order(schedule[0])[:6] == ["F0", "F1", "f0", "f1", "F2", "b0"]  # warm-up 2(p-1) + (v-1)p = 4


def test_single_rank_interleaving_sends_to_itself():
    schedule = interleaved(1, 3, 2)
    validate(schedule, 1, 3, 2)
    assert {ins.peer for ins in schedule[0] if ins.peer is not None} == {0}


# ---------------------------------------------------------------- validate() catches planted bugs

def test_validate_catches_backward_before_its_forward():
    schedule = gpipe(2, 2)
    program = schedule[1]
    f = program.index(Instruction("forward", 0))
    b = program.index(Instruction("backward", 0))
    program[f], program[b] = program[b], program[f]
    with pytest.raises(ScheduleError, match=r"rank 1: backward\(micro=0, chunk=0\) .* before its forward"):
        validate(schedule, 2, 2, 1)


def test_validate_catches_weight_gradient_before_input_gradient():
    schedule = zb1p(2, 2)
    program = schedule[0]
    b = program.index(Instruction("backward_input", 1))
    w = program.index(Instruction("backward_weight", 1))
    program[b], program[w] = program[w], program[b]
    with pytest.raises(ScheduleError, match="backward_weight.*before its backward_input"):
        validate(schedule, 2, 2, 1)


def test_validate_catches_a_dropped_send():
    schedule = one_f_one_b(3, 4)
    schedule[1].remove(Instruction("send_forward", 2, 0, peer=2))
    with pytest.raises(ScheduleError, match=r"rank 1: .* 0 send_forward\(micro=2, chunk=0\), expected 1"):
        validate(schedule, 3, 4, 1)


def test_validate_catches_a_deadlock_from_an_early_receive():
    # rank 0 waits for the gradient of micro-batch 0 before it has sent micro-batch 0 forward: both ranks block
    schedule = gpipe(2, 2)
    recv = Instruction("recv_backward", 0, 0, peer=1)
    schedule[0].remove(recv)
    schedule[0].insert(0, recv)
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at step 0 recv_backward.*rank 1 waits"):
        validate(schedule, 2, 2, 1)


def test_validate_catches_a_deadlock_across_three_ranks():
    # rank 0 waits for a gradient before sending micro-batch 1, which rank 1 needs before it passes the gradient on
    schedule = one_f_one_b(3, 3)
    recv = Instruction("recv_backward", 0, 0, peer=1)
    schedule[0].remove(recv)
    schedule[0].insert(schedule[0].index(Instruction("forward", 1)), recv)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(schedule, 3, 3, 1)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule)


def test_validate_catches_messages_received_out_of_order():
    # rank 1 forwards micro-batch 1 before 0: locally fine, but rank 0 sends 0 first
    schedule = gpipe(2, 2)
    first, second = schedule[1][:2], schedule[1][2:4]
    schedule[1][:4] = second + first
    with pytest.raises(ScheduleError, match="forward messages from rank 0 to rank 1 are out of order"):
        validate(schedule, 2, 2, 1)


def test_validate_catches_wrong_peer_missing_step_and_wrong_rank_count():
    schedule = one_f_one_b(3, 2)
    index = schedule[1].index(Instruction("send_forward", 0, 0, peer=2))
    schedule[1][index] = Instruction("send_forward", 0, 0, peer=0)
    with pytest.raises(ScheduleError, match="should name peer rank 2"):
        validate(schedule, 3, 2, 1)
    schedule = one_f_one_b(3, 2)
    schedule[2].pop()
    with pytest.raises(ScheduleError, match="rank 2: must end with reduce_grads, optimizer_step"):
        validate(schedule, 3, 2, 1)
    with pytest.raises(ScheduleError, match="expected p = 4"):
        validate(one_f_one_b(3, 2), 4, 2, 1)
    with pytest.raises(ScheduleError, match="forwarded once"):
        validate(one_f_one_b(3, 2), 3, 3, 1)  # micro-batch 2 never runs


# ---------------------------------------------------------------- bubbles

def test_simulated_bubble_is_exactly_the_formula_for_gpipe_and_1f1b():
    for kind in ("gpipe", "1f1b"):
        for p in range(1, 9):
            for m in range(1, 13):
                bubble = bubble_fraction(simulate(make_schedule(kind, p, m), t_forward=1.0, t_backward=2.0))
                assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (kind, p, m)
                assert theoretical_bubble(kind, p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_simulated_bubble_matches_theory_for_interleaved_and_zb1p():
    for kind, p, m, v in legal_layouts(ps=(1, 2, 3, 4, 8), ms=range(1, 17), vs=(2, 3, 4)):
        if kind == "interleaved":
            bubble = bubble_fraction(simulate(make_schedule(kind, p, m, v)))
            assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
    for p in range(1, 9):
        for m in range(1, 17):
            bubble = bubble_fraction(simulate(zb1p(p, m)))  # F = B = W = 1
            assert bubble == pytest.approx(theoretical_bubble("zb1p", p, m), abs=1e-12), (p, m)
            if m >= p:
                assert bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


def test_interleaved_and_zb1p_bubbles_are_smaller_than_1f1b():
    for p in (2, 3, 4, 8):
        for m in range(1, 13):
            base = bubble_fraction(simulate(one_f_one_b(p, m)))
            assert bubble_fraction(simulate(zb1p(p, m))) < base, (p, m)
            if m % p == 0:
                for v in (2, 3):
                    assert bubble_fraction(simulate(interleaved(p, m, v))) < base, (p, m, v)


def test_bubble_is_scale_free_and_communication_lengthens_the_step():
    schedule = one_f_one_b(4, 8)
    assert bubble_fraction(simulate(schedule, 0.5, 1.0)) == pytest.approx(bubble_fraction(simulate(schedule)))
    slow = simulate(schedule, t_comm=0.25)
    assert max(e.end for e in slow[0]) > max(e.end for e in simulate(schedule)[0])
    assert bubble_fraction(slow) > bubble_fraction(simulate(schedule))


def test_simulated_timeline_respects_dependencies():
    p, m = 3, 5
    timeline = simulate(zb1p(p, m))
    done = {}
    for rank, events in enumerate(timeline):
        for event in events:
            assert event.end >= event.start
            if event.instruction.op in COMPUTE_OPS:
                done[rank, event.instruction.op, event.instruction.micro] = event
    for micro in range(m):
        for rank in range(1, p):
            assert done[rank, "forward", micro].start >= done[rank - 1, "forward", micro].end
            assert done[rank - 1, "backward_input", micro].start >= done[rank, "backward_input", micro].end
        for rank in range(p):
            assert done[rank, "backward_weight", micro].start >= done[rank, "backward_input", micro].end
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[Instruction("recv_forward", 0, 0, peer=1)], [Instruction("recv_backward", 0, 0, peer=0)]])


# ---------------------------------------------------------------- activations

def test_peak_activations():
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 13):
            assert peak_activations(gpipe(p, m)) == [m] * p
            expected = [min(p - rank, m) for rank in range(p)]
            assert peak_activations(one_f_one_b(p, m)) == expected
            assert peak_activations(zb1p(p, m)) == expected
            assert max(peak_activations(one_f_one_b(p, m))) <= p
    # interleaved counts (micro-batch, chunk) pairs, each 1/v of a stage's activations
    assert peak_activations(interleaved(4, 8, 2)) == [11, 9, 7, 5]


# ---------------------------------------------------------------- argument errors

@pytest.mark.parametrize("args, key", [
    (("pipedream", 4, 8, 1), "parallel.schedule"),
    (("1f1b", 4, 0, 1), "parallel.microbatches"),
    (("1f1b", 0, 4, 1), "parallel.pp"),
    (("gpipe", 4, 8, 2), "parallel.virtual_stages"),
    (("zb1p", 4, 8, 2), "parallel.virtual_stages"),
    (("interleaved", 4, 8, 0), "parallel.virtual_stages"),
    (("interleaved", 4, 6, 2), "parallel.microbatches"),
    (("1f1b", 2.0, 4, 1), "parallel.pp"),
])
def test_invalid_arguments_name_the_key_in_one_line(args, key):
    with pytest.raises(ValueError, match=key) as info:
        make_schedule(*args)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ScheduleArgumentError) and isinstance(info.value, MpitrainError)
    with pytest.raises(ValueError, match=key):
        theoretical_bubble(*args)


def test_interleaved_error_says_what_to_change():
    with pytest.raises(ValueError, match=r"divisible by parallel.pp \(4\); use a multiple of 4, e.g. 8$"):
        interleaved(4, 6, 2)


def test_instruction_rejects_unknown_ops_and_prints_readably():
    with pytest.raises(ValueError, match="unknown pipeline instruction 'fwd'"):
        Instruction("fwd", 0)
    assert str(Instruction("send_forward", 3, 1, peer=2)) == "send_forward(micro=3, chunk=1, to rank 2)"
    assert str(Instruction("recv_backward", 0, 0, peer=1)) == "recv_backward(micro=0, chunk=0, from rank 1)"
    assert str(Instruction("optimizer_step")) == "optimizer_step"
    text = format_schedule(one_f_one_b(2, 2))
    assert "rank 0:" in text and "rank 1:" in text and "optimizer_step" in text


# ---------------------------------------------------------------- drawing and recording

def test_render_text_shows_every_rank_and_the_bubble():
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1)):
        timeline = simulate(make_schedule(kind, 8, 8, v))
        text = render_text(timeline, width=120)
        rows = [line for line in text.splitlines() if line.startswith("rank")]
        assert [row.split("|")[0].strip() for row in rows] == [f"rank {r}" for r in range(8)]
        assert f"bubble fraction {bubble_fraction(timeline):.4f}" in text
        assert "F forward" in text
    text = render_text(simulate(zb1p(4, 8)), width=100)
    assert "F0" in text and "B7" in text and "W7" in text
    assert render_text(simulate(one_f_one_b(1, 1))).startswith("rank 0 |F0")


def test_render_png_writes_a_file(tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib: pip install -e '.[report]'")
    path = tmp_path / "zb1p.png"
    render_png(simulate(zb1p(4, 8)), path, "zb1p p=4 m=8")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_png_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(MpitrainError, match=r"needs matplotlib: pip install 'mpitrain\[plot\]'"):
        render_png(simulate(one_f_one_b(2, 2)), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_recorded_events_merge_and_measure_like_simulated_ones():
    simulated = simulate(one_f_one_b(3, 4))
    gathered = []
    for rank, events in enumerate(simulated):
        timeline = Timeline(rank, clock=lambda: 100.0)  # origin at 100 s; events added at their simulated times
        for event in events:
            ins = event.instruction
            timeline.add(ins.op, ins.micro, ins.chunk, 100.0 + event.start, 100.0 + event.end)
        gathered.append(timeline.to_dicts())
    merged = merge_events(reversed(gathered))  # any grouping and order
    assert len(merged) == 3
    assert bubble_fraction(merged) == pytest.approx(bubble_fraction(simulated))
    assert render_text(merged) == render_text(simulated)


def test_timeline_records_with_its_clock():
    ticks = iter([10.0, 10.5, 11.5, 12.0, 14.0])
    timeline = Timeline(rank=1, clock=lambda: next(ticks))  # origin 10.0
    with timeline.record("recv_forward", 0, 0):
        pass
    with timeline.record("forward", 0, 1):
        pass
    assert timeline.to_dicts() == [
        {"rank": 1, "kind": "recv_forward", "micro": 0, "chunk": 0, "start": 0.5, "end": 1.5},
        {"rank": 1, "kind": "forward", "micro": 0, "chunk": 1, "start": 2.0, "end": 4.0}]
    merged = merge_events([timeline.to_dicts()])
    assert len(merged) == 2 and merged[0] == [] and merged[1][1] == Event(2.0, 4.0, Instruction("forward", 0, 1))
    with pytest.raises(ValueError, match="unknown timeline event kind"):
        timeline.add("compute", 0, 0, 1.0, 2.0)


# ---------------------------------------------------------------- the command

def test_schedule_command_prints_timeline_bubbles_and_activations():
    result = CliRunner().invoke(main, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b"])
    assert result.exit_code == 0, result.output
    for rank in range(4):
        assert f"rank {rank} |" in result.output
    assert "bubble: theoretical 0.2727, simulated 0.2727" in result.output
    assert "peak activations (micro-batches): rank 0 4, rank 1 3, rank 2 2, rank 3 1" in result.output
    result = CliRunner().invoke(main, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
                                       "--virtual-stages", "2", "--instructions"])
    assert result.exit_code == 0, result.output
    assert "bubble: theoretical 0.1579, simulated 0.1579" in result.output
    assert "send_forward(micro=0, chunk=0, to rank 1)" in result.output


def test_schedule_command_errors_are_one_line():
    result = CliRunner().invoke(main, ["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
                                       "--virtual-stages", "2"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        ("Error: interleaved schedule needs parallel.microbatches (6) divisible by parallel.pp (4); "
        "use a multiple of 4, e.g. 8")]


def test_schedule_command_choices_are_the_schedule_kinds():
    command = main.commands["schedule"]
    choice = next(param for param in command.params if param.name == "kind").type
    assert tuple(choice.choices) == SCHEDULE_KINDS


def test_schedule_command_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib: pip install -e '.[report]'")
    path = tmp_path / "zb.png"
    result = CliRunner().invoke(main, ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb1p",
                                       "--png", str(path)])
    assert result.exit_code == 0, result.output
    assert "bubble: theoretical 0.1111, simulated 0.1111" in result.output
    assert path.stat().st_size > 1000
