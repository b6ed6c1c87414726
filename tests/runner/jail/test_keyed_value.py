"""``keyed_value``: one key of a flat-keyed cgroup file, as the kernel writes them."""

from __future__ import annotations

from sandcell_runner.jail.cgroups import keyed_value

OOM_CONTROL = "oom_kill_disable 1\nunder_oom 0\noom_kill 7\n"


def test_a_key_is_found_by_its_whole_name_at_a_line_start() -> None:
    assert keyed_value(OOM_CONTROL, "oom_kill") == 7  # not oom_kill_disable's 1
    assert keyed_value(OOM_CONTROL, "oom_kill_disable") == 1
    assert keyed_value(OOM_CONTROL, "under_oom") == 0
    assert keyed_value("max 3", "max") == 3  # no newline at the end
    assert keyed_value("xmax 5\nmax 2\n", "max") == 2


def test_a_missing_key_or_a_value_that_is_no_number_is_zero() -> None:
    assert keyed_value(OOM_CONTROL, "oom") == 0
    assert keyed_value("", "max") == 0
    assert keyed_value("xmax 5\n", "max") == 0
    assert keyed_value("max many\n", "max") == 0
