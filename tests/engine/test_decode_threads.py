"""engine.threads.DecodeThreads: the decode step's thread count follows which count is faster on the machine now."""

from __future__ import annotations

from engine.threads import DecodeThreads


def run(threads: DecodeThreads, seconds_on, steps: int) -> list[int]:
    """Feed `steps` decode steps, each taking seconds_on(thread count) seconds; the counts used, step by step."""
    used = []
    for _ in range(steps):
        used.append(threads.use)
        threads.step(seconds_on(threads.use))
    return used


def test_an_idle_machine_keeps_every_thread_and_probes_ever_more_rarely():
    threads = DecodeThreads(2)
    used = run(threads, lambda n: 0.004 if n == 2 else 0.0065, 4000)
    assert used[:64] == [2] * 64  # the first probe comes after 64 steps
    one = used.count(1)
    assert 0 < one <= 4 * 7  # 4 steps now and then: 64, 128, 256, ... steps apart
    assert threads.use == 2 and threads.backoff >= 1024


def test_busy_cores_move_the_step_to_one_thread_and_back_when_they_are_free():
    threads = DecodeThreads(2)
    run(threads, lambda n: 0.004 if n == 2 else 0.0065, 200)  # idle: two threads
    assert threads.use == 2
    used = run(threads, lambda n: 0.045 if n == 2 else 0.008, 200)  # other programs take the cores
    assert used[-100:].count(1) >= 90  # two-thread steps turned 10x slower: one thread within a window or two
    run(threads, lambda n: 0.004 if n == 2 else 0.0065, 2000)  # the cores are free again
    assert threads.use == 2


def test_one_core_never_changes_anything():
    threads = DecodeThreads(1)
    assert set(run(threads, lambda n: 0.01, 100)) == {1}


def test_steps_that_grow_with_the_context_do_not_set_off_a_probe_every_window():
    # from 4 ms to 40 ms a step over 4,000 steps (a reply reaching a long context) on an idle machine
    threads = DecodeThreads(2)
    steps = [0]

    def grows(n):
        steps[0] += 1
        base = 0.004 * (1 + 9 * steps[0] / 4000)
        return base if n == 2 else base * 1.6

    used = run(threads, grows, 4000)
    assert used.count(1) <= 4 * 12 and threads.use == 2
