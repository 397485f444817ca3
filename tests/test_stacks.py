import threading

from scorer.server.stacks import StackSampler


def waiting_leaf(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()


def test_each_thread_s_stack_is_counted_under_its_name_and_written_most_frequent_first(tmp_path):
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=waiting_leaf, args=(started, release), name="worker-x")
    worker.start()
    started.wait()
    try:
        sampler = StackSampler(str(tmp_path / "stacks.txt"))
        for _ in range(3):  # driven directly: no timing decides the counts
            sampler.sample()
    finally:
        release.set()
        worker.join()
    sampler.stop()  # never started: writes the counts
    lines = (tmp_path / "stacks.txt").read_text().splitlines()
    worker_lines = [line for line in lines if line.startswith("worker-x;")]
    assert len(worker_lines) == 1
    stack, count = worker_lines[0].rsplit(" ", 1)
    assert int(count) == 3
    assert "test_stacks.py:waiting_leaf;" in stack and stack.endswith("threading.py:wait")
    assert sampler.samples == 3
    assert not any(line.startswith("stack-sampler;") for line in lines)
    counts = [int(line.rsplit(" ", 1)[1]) for line in lines]
    assert counts == sorted(counts, reverse=True)
