"""Two real processes on 127.0.0.1 (2 CPU devices each, gloo) train like one with 4 devices,
a bfloat16 table among theirs."""

from process_helpers import check_two_processes_match_one


def test_two_processes_match_one_process_with_four_devices(tmp_path):
    check_two_processes_match_one(tmp_path, "mod", "mod", rtol=1e-6, atol=1e-7)
