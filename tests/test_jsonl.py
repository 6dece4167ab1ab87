"""profile/jsonl.py: appended records come back in order; a torn or foreign line is skipped, not fatal."""
from mpitrain.profile.jsonl import append_record, read_records


def test_appended_records_read_back_in_order_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "sub" / "faults.jsonl"  # the folder is created on first append
    assert read_records(path) == []
    append_record(path, {"kind": "hang", "rank": 1})
    append_record(path, {"kind": "kill", "rank": 0}, durable=True)
    with open(path, "a") as f:
        f.write('[1, 2]\n{"kind": "fl')  # not an object, then a line cut by its writer's crash
    assert read_records(path) == [{"kind": "hang", "rank": 1}, {"kind": "kill", "rank": 0}]
    append_record(path, {"kind": "sdc"})  # lands on the torn line: that line is lost, this one too
    append_record(path, {"kind": "nan"})
    assert read_records(path)[-1] == {"kind": "nan"}
