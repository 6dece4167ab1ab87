"""MPITRAIN_FAULT: parsing, which rank and step a fault strikes, and striking once per run (recorded on disk)."""
import pytest

from mpitrain.errors import ConfigError
from mpitrain.resilience.faults import RECORD_FILE, Fault, FaultPlan, parse_faults


def test_parse_faults_reads_every_kind_and_field():
    assert parse_faults("kill:rank=1:step=7; slow:rank=0:factor=3,nan:step=2") == [
        Fault("kill", 1, 7), Fault("slow", 0, None, 3.0), Fault("nan", None, 2)]


@pytest.mark.parametrize("text, named", [("boom:step=1", "unknown fault 'boom'"), ("kill:rank=1", "needs step=N"),
                                         ("kill:step=x", "must be a number"), ("kill:when=3", "'when=3'"),
                                         ("slow:factor=0.5", "at least 1")])
def test_bad_fault_specs_are_named(text, named):
    with pytest.raises(ConfigError, match="MPITRAIN_FAULT") as error:
        parse_faults(text)
    assert named in str(error.value)


def test_a_fault_strikes_its_rank_at_its_step_only():
    plan = FaultPlan(parse_faults("kill:rank=1:step=7;slow:rank=1:step=3:factor=2"), rank=1)
    assert plan.due("kill", 6) is None and plan.due("kill", 7) == Fault("kill", 1, 7)
    assert plan.due("slow", 2) is None and plan.due("slow", 3) and plan.due("slow", 9)  # slow lasts
    assert not FaultPlan(parse_faults("kill:rank=1:step=7"), rank=0)


def test_one_shot_faults_strike_once_per_run_even_across_restarts(tmp_path):
    environ = {"MPITRAIN_FAULT": "nan:step=4;kill:rank=1:step=5"}
    first = FaultPlan.from_environment(1, tmp_path, environ)
    assert first.due("nan", 4) and first.due("nan", 4) is None  # used up in this process
    # a restart that died before step 5 (an MPI start-up failure, say) still sees the kill strike ...
    second = FaultPlan.from_environment(1, tmp_path, environ)
    assert second.due("nan", 4) is None and second.due("kill", 5)
    # ... and the one after it does not; other ranks keep their own record
    assert not FaultPlan.from_environment(1, tmp_path, environ)
    assert FaultPlan.from_environment(0, tmp_path, environ).due("nan", 4)
    (tmp_path / RECORD_FILE).write_text((tmp_path / RECORD_FILE).read_text() + '{"kind": "ki')  # torn by a kill
    assert not FaultPlan.from_environment(1, tmp_path, environ)
